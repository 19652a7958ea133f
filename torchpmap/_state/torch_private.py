"""The one door to private torch: every private PyTorch API torchpmap uses, and nothing else.

Each entry is a small function or constant. Its docstring says what torchpmap needs it
for, which public API would replace it (or that none exists yet, and what would be
needed), and on which torch versions it was checked (:data:`CHECKED`). :data:`ENTRIES`
maps every entry to a probe that verifies, on the running torch, that the private API
still exists and behaves as torchpmap expects; :func:`check` runs the probes and raises
:class:`TorchPrivateError` naming each entry that failed (``tests/test_torch_private.py``
runs it once per entry). ``docs/torch-internals.md`` lists the entries for readers.

Rules for this module:

* Nothing else in torchpmap reaches into ``torch._C``, ``torch._functorch``,
  ``torch._subclasses``, ``torch.utils._pytree``, private keyword arguments or private
  names of ops: it goes through an entry here.
* Importing this module imports no private torch module that ``import torch`` has not
  already loaded. Entries on the hot path are bound once, at import (an attribute lookup
  in a module torch has loaded); the others look their API up when first called.
* Nothing degrades silently. A private API that is missing makes its entry raise
  :class:`TorchPrivateError` (naming the entry) when torchpmap needs it, not at
  ``import torchpmap`` (except :data:`pytree`, which the front end needs there). Where
  torchpmap can go on without it, it warns with :class:`TorchPrivateWarning` (naming the
  entry) and says what it turned off.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import inspect
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import torch

#: The torch versions on which every entry below was checked (``check()`` passes).
CHECKED = ("2.11.0", "2.13.0", "2.14.1")

_DOCS = "docs/torch-internals.md"


class TorchPrivateError(RuntimeError):
    """A private torch API behind entry ``entry`` of this module is missing or has changed."""

    def __init__(self, entry: str, problem: str):
        self.entry = entry
        super().__init__(
            f"torchpmap: the private torch API behind torchpmap._state.torch_private.{entry} {problem} (torch "
            f"{torch.__version__}; torchpmap was checked on torch {', '.join(CHECKED)}). This torch release "
            f"changed an internal that torchpmap relies on; see {_DOCS} (entry {entry!r}) and please report it."
        )


class TorchPrivateWarning(RuntimeWarning):
    """torchpmap turned a feature off because a private torch API is missing or changed."""


def _bind(entry: str, getter: Callable[[], Any]) -> Any:
    """``getter()`` (an attribute of a module torch has already loaded), or, when the
    attribute is missing, a stand-in that raises :class:`TorchPrivateError` for ``entry``
    when called: a missing internal breaks the feature that needs it, not the import."""
    try:
        return getter()
    except (AttributeError, ImportError) as error:
        problem = f"is missing ({type(error).__name__}: {error})"

        def missing(*args: Any, **kwargs: Any) -> Any:
            raise TorchPrivateError(entry, problem)

        return missing


def _module(name: str) -> Any:
    return importlib.import_module(name)


# ======================================================================= torch.func's vmap levels
# torchpmap's vectorized engine is torch.func.vmap without its pytree handling, inlined:
# the front end has flattened and checked the arguments already. Measured on the dispatch
# row (``pmap(lambda v: v + 1)`` over 8): ``torch.func.vmap`` itself costs about 95 us more
# per call than these five calls, on both 2.13.0 and 2.14.1 (its wrapper, not the batching).

current_vmap_level = _bind("current_vmap_level", lambda: torch._C._functorch.maybe_current_level)
"""``current_vmap_level() -> int | None``: the level of the innermost torch.func transform
(vmap, grad, jvp, ...) active in this thread, None outside every transform.

For: finding whether a collective runs directly under the vmap level of its axis
(:mod:`torchpmap._collectives.binding`), refusing transforms that cannot follow a call into device
threads, and choosing between a compiled program and the eager engine.
Public replacement: none; torch.func has no "which transform am I in" query (what we'd
need: ``torch.func.current_level()`` or an interpreter-stack view).
Checked: torch 2.11.0, 2.13.0, 2.14.1 (``torch._C._functorch.maybe_current_level``)."""

vmap_level_of = _bind("vmap_level_of", lambda: torch._C._functorch.maybe_get_level)
"""``vmap_level_of(tensor) -> int``: the torch.func level a tensor is wrapped at (-1 for a
plain tensor).

For: telling whether an axis token, or an output, is batched at this map's own level
(``out_axes=None`` and the collectives' fast path).
Public replacement: none (a public ``torch.func`` query of a tensor's batching level).
Checked: torch 2.11.0, 2.13.0, 2.14.1 (``torch._C._functorch.maybe_get_level``)."""

unwrap_batched = _bind("unwrap_batched", lambda: torch._C._functorch._unwrap_batched)
"""``unwrap_batched(tensor, level) -> (value, batch dim or None)``: the physical tensor
behind a tensor batched at ``level``.

For: a collective directly under its axis' level sees every instance's value at once
without going through an ``autograd.Function`` (:func:`torchpmap._collectives.binding.bind_many`);
the value behind a mapped value's batching, whose ``requires_grad`` an instance would see
(:mod:`torchpmap._engines.autograd_metadata`).
Public replacement: the ``vmap`` staticmethod of ``torch.autograd.Function`` receives the
same (value, in_dim) pairs; torchpmap uses it (``_Bind``) wherever a transform sits
between the collective and its axis, but it costs about 150 us per collective.
Checked: torch 2.11.0, 2.13.0, 2.14.1 (``torch._C._functorch._unwrap_batched``)."""

_get_unwrapped = _bind("functorch_value", lambda: torch._C._functorch.get_unwrapped)
_is_wrapped = _bind("functorch_value", lambda: torch._C._functorch.is_functorch_wrapped_tensor)
_is_batched = _bind("functorch_value", lambda: torch._C._functorch.is_batchedtensor)


def functorch_value(t: torch.Tensor, vmap_level: int | None = None) -> tuple[torch.Tensor, int | None]:
    """``(value, dim)``: the plain tensor behind ``t``, under its grad wrappers and, when
    ``vmap_level`` is given, the batching of that vmap level (``dim`` its batch dim, None
    when ``t`` is not batched there). Not differentiable: the value is outside the
    transforms.

    For: a gradient bucket's all-reduce starts inside the backward of ``torch.func.grad``
    (:mod:`torchpmap._collectives.gradient_mean`), where the gradients are wrapped at the grad level
    (and batched at the pmap's own level) and a collective needs their storage.
    Public replacement: none inside ``torch.func``; plain autograd's tensor hooks (what
    DDP uses) see plain tensors.
    Checked: torch 2.11.0, 2.13.0, 2.14.1 (``torch._C._functorch.get_unwrapped``,
    ``is_functorch_wrapped_tensor``, ``is_batchedtensor``, with :data:`unwrap_batched`)."""
    while _is_wrapped(t) and not _is_batched(t):
        t = _get_unwrapped(t)
    dim = None
    if vmap_level is not None and _is_batched(t):
        t, dim = unwrap_batched(t, vmap_level)
    if _is_wrapped(t):
        raise TorchPrivateError("functorch_value", f"found a tensor wrapped at another level than {vmap_level}")
    return t, dim


def functorch_levels(t: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(batched, tracked)``: the vmap levels at which ``t`` is batched, and the levels
    of the other torch.func wrappers around it (grad, jvp), outermost first.

    For: shard_map's implicit ``pvary`` (:mod:`torchpmap._frontend.implicit_pvary`): an
    op that mixes a differentiated value the same on every position of a mesh axis with
    one that varies along it (JAX inserts ``pvary`` there; its transpose is ``psum``).
    The mesh axis' vmap level says which values vary; the grad level, which are
    differentiated inside the map.
    Public replacement: none (``torch.func`` does not say at which levels a tensor is
    wrapped). Checked: torch 2.11.0, 2.13.0, 2.14.1 (the pieces of :func:`functorch_value`
    and :data:`vmap_level_of`)."""
    batched: list[int] = []
    tracked: list[int] = []
    while _is_wrapped(t):
        (batched if _is_batched(t) else tracked).append(vmap_level_of(t))
        t = _get_unwrapped(t)
    return tuple(batched), tuple(tracked)


def functorch_base(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor under every torch.func wrapper of ``t`` (batched, grad-tracking),
    at any level; ``t`` itself when it is plain. Its version counter moves with an in-place
    write through any of the wrappers (theirs do not).

    For: a nested pmap refuses a write into an argument its instances share (an enclosing
    map's value, batched there: :mod:`torchpmap._frontend.aliasing`).
    Public replacement: none. Checked: torch 2.11.0, 2.13.0, 2.14.1 (``get_unwrapped`` of a
    batched and of a grad-tracking tensor, ``is_functorch_wrapped_tensor``)."""
    while _is_wrapped(t):
        t = _get_unwrapped(t)
    return t


def is_functorch_wrapped(t: torch.Tensor) -> bool:
    """Whether ``t`` is a torch.func wrapper (batched or grad-tracking): a tensor with no
    storage of its own, whose ``data_ptr()`` raises.

    For: an RNN module on CUDA whose weights are such wrappers runs without cuDNN, which
    needs their storage (:mod:`torchpmap._engines.rnn_weights`); a mapped value's autograd
    metadata, read behind its batching (:mod:`torchpmap._engines.autograd_metadata`).
    Public replacement: none (``torch.func`` does not say whether a tensor is its wrapper).
    Checked: torch 2.11.0, 2.13.0, 2.14.1 (``is_functorch_wrapped_tensor``)."""
    return bool(_is_wrapped(t))


add_batch_dim = _bind("add_batch_dim", lambda: torch._C._functorch._add_batch_dim)
"""``add_batch_dim(tensor, dim, level) -> tensor``: wraps ``tensor`` as batched along
``dim`` at ``level`` (what torch.func.vmap does to each input).

For: the inlined vmap of the vectorized engine, and re-wrapping a collective's results.
Public replacement: ``torch.func.vmap`` (about 95 us more per call, see above) or an
``autograd.Function.vmap`` rule (about 150 us per collective).
Checked: torch 2.11.0, 2.13.0, 2.14.1 (``torch._C._functorch._add_batch_dim``)."""

remove_batch_dim = _bind("remove_batch_dim", lambda: torch._C._functorch._remove_batch_dim)
"""``remove_batch_dim(tensor, level, size, out_dim) -> tensor``: the physical result of a
tensor batched at ``level`` with the batch moved to ``out_dim`` (a tensor unbatched at
that level is expanded to ``size``).

For: the outputs of the inlined vmap. Public replacement: ``torch.func.vmap``.
Checked: torch 2.11.0, 2.13.0, 2.14.1 (``torch._C._functorch._remove_batch_dim``)."""

vmap_increment_nesting = _bind("vmap_increment_nesting", lambda: torch._C._functorch._vmap_increment_nesting)
"""``vmap_increment_nesting(size, randomness) -> level``: opens a vmap level of ``size``
(randomness "error", "same" or "different"); must be closed by
:data:`vmap_decrement_nesting`.

For: the inlined vmap. Public replacement: ``torch.func.vmap``.
Checked: torch 2.11.0, 2.13.0, 2.14.1 (``torch._C._functorch._vmap_increment_nesting``)."""

vmap_decrement_nesting = _bind("vmap_decrement_nesting", lambda: torch._C._functorch._vmap_decrement_nesting)
"""``vmap_decrement_nesting()``: closes the innermost vmap level.

For: the inlined vmap. Public replacement: ``torch.func.vmap``.
Checked: torch 2.11.0, 2.13.0, 2.14.1 (``torch._C._functorch._vmap_decrement_nesting``)."""

pop_interpreter = _bind(
    "pop_interpreter", lambda: _module("torch._functorch.pyfunctorch").temporarily_pop_interpreter_stack
)
"""``with pop_interpreter(): ...`` runs the block one torch.func level down, as a
batching rule runs.

For: computing a collective on the unwrapped values of its level (exchanges across
devices use ``autograd.Function``, which must not see that level).
Public replacement: the same state an ``autograd.Function.vmap`` rule runs in (``_Bind``,
about 150 us per collective); no public context manager.
Checked: torch 2.11.0, 2.13.0, 2.14.1 (``torch._functorch.pyfunctorch.temporarily_pop_interpreter_stack``,
a module ``import torch`` loads)."""

_decompositions_loaded = False


@functools.cache
def cpu_flash_attention() -> tuple[Any, Any] | None:
    """The (forward, backward) ops of the CPU flash attention that
    ``F.scaled_dot_product_attention`` runs on CPU, None when this torch has none.

    For: torchpmap's batching rule for them (vmap has none, and loops over the instances).
    Public replacement: none (private aten ops; a batching rule in torch would retire the
    need). Checked: torch 2.11.0, 2.13.0, 2.14.1
    (``torch.ops.aten._scaled_dot_product_flash_attention_for_cpu`` and ``_backward``)."""
    try:
        return (
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
        )
    except AttributeError:
        return None


#: The backward ops of the CUDA kernels behind ``F.scaled_dot_product_attention``.
_CUDA_ATTENTION_BACKWARDS = (
    "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_cudnn_attention_backward",
)
#: The arguments of those ops that hold the attention's batch first (folded by torchpmap's rule).
CUDA_ATTENTION_BATCH_FIRST = frozenset({"grad_out", "grad_out_", "query", "key", "value", "out", "logsumexp"})


def cuda_attention_backwards() -> tuple[Any, ...]:
    """The backward ops of the CUDA attention kernels (memory-efficient, flash, cuDNN) that
    this torch has.

    For: torchpmap's batching rule for them. vmap has rules for their forwards (one call,
    the instances folded into the batch) but none for the backwards, which its fallback
    runs once per instance, on slices of the folded forward's log-sum-exp (and, with
    dropout, with the folded call's random state, which regenerates other masks than
    the forward drew).
    Public replacement: none (private aten ops). Checked: torch 2.11.0, 2.13.0, 2.14.1
    (the schemas; the kernels ran on an H100 with 2.11.0)."""
    return _aten_defaults(_CUDA_ATTENTION_BACKWARDS)


#: The forwards of the CUDA kernels that compute the log-sum-exp only when asked to.
_CUDA_ATTENTION_FORWARDS = (
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
)


def cuda_attention_forwards() -> tuple[Any, ...]:
    """The forward ops of the CUDA attention kernels that take ``compute_log_sumexp``
    (memory-efficient, cuDNN) that this torch has.

    For: torchpmap's batching rule for them, which replaces vmap's. Under vmap,
    ``F.scaled_dot_product_attention`` decides ``compute_log_sumexp`` from the batched
    wrappers' ``requires_grad``, which is False when the gradient is taken outside the
    vmap (``.backward()`` on a pmap result): the forward then skips the log-sum-exp its
    backward needs. Seen with torch 2.11.0 on an H200: the memory-efficient backward fails
    ("LSE is not correctly aligned (strideH)"), in bfloat16 the default kernel returned wrong gradients, silently.
    Public replacement: none (private aten ops; a fix in torch's rule would retire it).
    Checked: torch 2.11.0, 2.13.0, 2.14.1 (the schemas; the kernels ran on an H200 with 2.11.0)."""
    return _aten_defaults(_CUDA_ATTENTION_FORWARDS)


def _aten_defaults(names: tuple[str, ...]) -> tuple[Any, ...]:
    """The default overloads of the ``torch.ops.aten`` ops of these names that this torch has."""
    packets = (getattr(torch.ops.aten, name, None) for name in names)
    return tuple(packet.default for packet in packets if packet is not None)


#: The recurrent ops behind ``nn.RNN``/``nn.LSTM``/``nn.GRU`` on padded (not packed) input.
_RECURRENT = ("gru", "lstm", "rnn_tanh", "rnn_relu")


def recurrent_ops() -> tuple[Any, ...]:
    """The ``.input`` overloads of ``aten::gru``, ``lstm``, ``rnn_tanh`` and ``rnn_relu``
    (what ``nn.GRU``, ``nn.LSTM`` and ``nn.RNN`` call through ``torch._VF``): ``(input,
    hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first)``,
    ``hx`` a list for the LSTM.

    For: torchpmap's batching rule for them (vmap has none, and cannot loop over them:
    "Batching rule not implemented for aten::gru.input. We could not generate a
    fallback"). They are composite ops: under ``torch.func.grad`` inside the map they are
    decomposed before vmap sees them, and this rule plays no part there.
    Public replacement: none (a batching rule in torch).
    Checked: torch 2.11.0, 2.13.0, 2.14.1 (the ops and their schemas)."""
    return tuple(getattr(torch.ops.aten, name).input for name in _RECURRENT)


#: The ops that read a tensor's value into Python (``bool(t)``, ``t.item()``, ``int(t)``,
#: ``float(t)``), which vmap refuses for a batched tensor.
_VALUE_READS = ("is_nonzero", "item", "_local_scalar_dense")


def vmap_value_reads() -> tuple[Any, ...]:
    """The ops behind ``bool(t)``, ``t.item()`` and ``int(t)``/``float(t)``
    (``aten::is_nonzero``, ``aten::item``, ``aten::_local_scalar_dense``).

    For: torchpmap's batching rule for them, which replaces vmap's (vmap refuses them for
    a batched tensor, "It looks like you're calling .item()"): when every instance holds
    the same value, that value is read once, as each instance would read it run alone, so
    a Python branch that goes the same way for every instance (Hugging Face's
    ``padding_mask.all()``) no longer sends the whole function to one instance at a time.
    Public replacement: none (a vmap option for "uniform" control flow).
    Checked: torch 2.11.0, 2.13.0, 2.14.1 (the ops and their schemas; vmap has a rule for
    each, which raises)."""
    return tuple(getattr(torch.ops.aten, name).default for name in _VALUE_READS)


def vmap_randomness() -> str | None:
    """The ``randomness`` ("error", "same" or "different") of the innermost transform in
    force when it is a vmap, else None.

    For: torchpmap's batching rules of random ops (attention with dropout) refuse or draw
    as vmap's own rules do. Public replacement: none (``torch._functorch.pyfunctorch``'s
    ``VmapInterpreter.randomness`` is private too). Checked: torch 2.11.0, 2.13.0, 2.14.1
    (``torch._C._functorch.peek_interpreter_stack``, ``CVmapInterpreterPtr.randomness``,
    ``RandomnessType``)."""
    f = torch._C._functorch
    top = f.peek_interpreter_stack()
    if top is None or top.key() != f.TransformType.Vmap:
        return None
    kind = f.CVmapInterpreterPtr(top).randomness()
    names = {f.RandomnessType.Error: "error", f.RandomnessType.Same: "same", f.RandomnessType.Different: "different"}
    return names[kind]


def batching_excluded() -> contextlib.AbstractContextManager:
    """``with batching_excluded(): ...`` runs ops as a batching rule's body runs: below the
    innermost vmap level (the ``FuncTorchBatched`` dispatch key excluded), with the levels
    beneath still batching.

    For: torchpmap's own batching rules (:mod:`torchpmap._engines.batching_rules`), which
    call the op once on the unwrapped, folded values, as torch's C++ rules do.
    Public replacement: ``torch.library.register_vmap``, for custom ops only (what we'd
    need: the same for an aten op without a rule).
    Checked: torch 2.11.0, 2.13.0, 2.14.1 (``torch._C._ExcludeDispatchKeyGuard``, ``DispatchKeySet``,
    ``DispatchKey.FuncTorchBatched``)."""
    try:
        keys = torch._C.DispatchKeySet(torch._C.DispatchKey.FuncTorchBatched)
        return torch._C._ExcludeDispatchKeyGuard(keys)
    except AttributeError as error:
        raise TorchPrivateError("batching_excluded", f"is missing ({error})") from error


def ensure_vmap_decompositions() -> None:
    """Installs the batching decompositions torch.func.vmap installs on its first call.

    For: the inlined vmap, so that ops such as ``mse_loss_backward`` batch as under
    ``torch.func.vmap`` (without them they fall back to a slow loop, with a warning).
    Public replacement: none direct. Calling ``torch.func.vmap`` once does it, but would
    show an extra op to the caller's torch function/dispatch modes and tracers; so that is
    only the fallback, with a :class:`TorchPrivateWarning`, when the private loader moves.
    Checked: torch 2.11.0, 2.13.0, 2.14.1 (``torch._functorch.vmap.lazy_load_decompositions``).
    """
    global _decompositions_loaded
    if _decompositions_loaded:
        return
    try:
        loader = _module("torch._functorch.vmap").lazy_load_decompositions
    except (AttributeError, ImportError) as error:
        warnings.warn(
            f"{TorchPrivateError('ensure_vmap_decompositions', f'is missing ({error})')} torchpmap loads them "
            "by calling torch.func.vmap once instead.",
            TorchPrivateWarning,
            stacklevel=2,
        )
        torch.func.vmap(torch.neg)(torch.zeros(1))
    else:
        loader()
    _decompositions_loaded = True


# ======================================================================= saved tensor hooks
# A vmap must refuse saved-tensor hooks (as torch.func.vmap does). The public context
# manager ``torch.autograd.graph.disable_saved_tensors_hooks(message)`` makes exactly these
# three calls, but as a generator-based context manager it costs 1.17 us more per pmap call
# (measured: 0.21 us for the three calls, 1.38 us for the context manager, on both 2.13.0
# and 2.14.1), over the budget of 0.5 us on the dispatch row: kept private.

saved_tensors_hooks_disabled_message = _bind(
    "saved_tensors_hooks_disabled_message",
    lambda: torch._C._autograd._saved_tensors_hooks_get_disabled_error_message,
)
"""``saved_tensors_hooks_disabled_message() -> str | None``: the error message of the
current "saved tensor hooks disabled" state, None when they are enabled.

For: restoring the caller's state after a pmap. Public replacement:
``torch.autograd.graph.disable_saved_tensors_hooks`` (1.17 us more per call, see above).
Checked: torch 2.11.0, 2.13.0, 2.14.1 (``torch._C._autograd._saved_tensors_hooks_get_disabled_error_message``)."""

disable_saved_tensors_hooks = _bind(
    "disable_saved_tensors_hooks", lambda: torch._C._autograd._saved_tensors_hooks_disable
)
"""``disable_saved_tensors_hooks(message)``: from now on, setting saved tensor hooks
raises ``RuntimeError(message)``; raises it at once (after disabling) if hooks are set.

For: refusing ``save_on_cpu`` and friends inside a pmap, as torch.func.vmap does.
Public replacement: ``torch.autograd.graph.disable_saved_tensors_hooks`` (1.17 us more).
Checked: torch 2.11.0, 2.13.0, 2.14.1 (``torch._C._autograd._saved_tensors_hooks_disable``)."""

enable_saved_tensors_hooks = _bind("enable_saved_tensors_hooks", lambda: torch._C._autograd._saved_tensors_hooks_enable)
"""``enable_saved_tensors_hooks()``: allows saved tensor hooks again.

For: restoring the caller's state. Public replacement: the context manager above.
Checked: torch 2.11.0, 2.13.0, 2.14.1 (``torch._C._autograd._saved_tensors_hooks_enable``)."""


# ======================================================================= pytrees

def _pytree_module() -> Any:
    try:  # needed at import: the front end builds its leaf spec then
        return _module("torch.utils._pytree")
    except ImportError as error:
        raise TorchPrivateError("pytree", f"is missing ({error})") from error


pytree = _pytree_module()
"""torch's pytree module, ``torch.utils._pytree``: torchpmap uses only its non-underscore
functions (``tree_flatten``, ``tree_unflatten``, ``tree_map``, ``tree_map_with_path``,
``tree_leaves``, ``tree_leaves_with_path``, ``tree_flatten_with_path``, ``tree_is_leaf``,
``keystr``, ``TreeSpec`` with ``.type`` and ``.context``, ``KeyPath``).

For: arguments, outputs and collectives over pytrees, with the same registered node
types as torch.func (so a user's ``register_pytree_node`` works in a pmap).
Public replacement: none on torch 2.13/2.14 (no ``torch.utils.pytree``); a public pytree
module with these functions would replace it one for one. ``_get_node_type`` and
``SUPPORTED_NODES``, used before, are no longer needed (a one-level ``tree_flatten``
with ``is_leaf`` gives a node's type, context and children).
Checked: torch 2.11.0, 2.13.0, 2.14.1 (loaded by ``import torch``)."""


# ======================================================================= jit=True: tracing


_device_guard_set = False


def ensure_cuda_device_guard() -> None:
    """Registers, once, the no-op CUDA device guard that torch's fake-tensor tracing
    registers on a machine without a usable GPU, from the calling thread (call it from the
    thread that imports torchpmap).

    For: torch 2.11 (a CUDA build with no GPU) registers that guard the first time a
    fake-tensor trace (``pmap(jit=True)``) enters ``FakeTensorMode``, from the tracing
    thread, and once that thread has exited the next trace crashes the process (a
    segmentation fault). A first compiled call, or a probe, in a worker thread was enough.
    Registered from the importing thread, which outlives the others, the guard stays
    valid. Without a GPU on 2.13 and 2.14 it changes nothing (the traces register it
    anyway); with a usable GPU it is not called, as in torch.
    Public replacement: none; the fix belongs in torch (``FakeTensorMode.__enter__``
    calls ``torch._C._ensureCUDADeviceGuardSet`` on every trace).
    Checked: torch 2.11.0, 2.13.0, 2.14.1 (``torch._C._ensureCUDADeviceGuardSet``; the crash
    reproduced on 2.11.0 only)."""
    global _device_guard_set
    if _device_guard_set:
        return
    _device_guard_set = True
    if torch.cuda.is_available():
        return
    try:
        ensure = torch._C._ensureCUDADeviceGuardSet
    except AttributeError as error:
        raise TorchPrivateError("ensure_cuda_device_guard", f"is missing ({error})") from error
    ensure()


def make_fx_real_inputs(fn: Callable[..., Any], **options: Any) -> Callable[..., Any]:
    """``make_fx(fn, tracing_mode="fake", **options)`` that accepts real tensors the
    function closes over (they become constants of the graph, which torchpmap then lifts
    into inputs). ``options`` are make_fx's public keywords (e.g. ``decomposition_table``).

    For: ``pmap(jit=True)``, which traces the vectorized program before ``torch.compile``.
    Public replacement: none. The private keyword ``_allow_non_fake_inputs`` is the only
    way; what we'd need: a public make_fx option, or a public way to fake-ify the tensors a
    function closes over.
    Checked: torch 2.11.0, 2.13.0, 2.14.1 (``torch.fx.experimental.proxy_tensor.make_fx(...,
    _allow_non_fake_inputs=True)``).
    """
    from torch.fx.experimental.proxy_tensor import make_fx

    if "_allow_non_fake_inputs" not in inspect.signature(make_fx).parameters:
        raise TorchPrivateError("make_fx_real_inputs", "has lost make_fx's keyword _allow_non_fake_inputs")
    return make_fx(fn, tracing_mode="fake", _allow_non_fake_inputs=True, **options)


def compile_graph(
    graph: torch.fx.GraphModule, example_inputs: Sequence[torch.Tensor], config: dict[str, Any]
) -> Callable[..., Any]:
    """Inductor's compilation of an aten-level graph, without TorchDynamo: a callable that
    takes the graph's inputs and returns its outputs (differentiable: AOTAutograd is
    inside). ``config`` patches ``torch._inductor.config`` for this compilation.

    For: ``pmap(jit=True)``. Its cache already keys each program on everything the program
    bakes in (:class:`torchpmap._engines.compiled.Signature`), so Dynamo's re-trace of the
    graph and its guards at every call (12 µs for a one-op graph, 36 µs for the benchmark
    MLP's step on the 2-core CPU box) buy nothing.
    Public replacement: ``torch.compile(graph.forward)``, which is what torchpmap uses when
    the caller passes other ``torch.compile`` options, or when the graph writes into an
    input (Dynamo then guards on the inputs' aliasing). What we'd need: a public
    "compile this FX graph" (``torch._inductor.compile`` documents itself as that, but
    lives in a private package).
    Checked: torch 2.11.0, 2.13.0, 2.14.1 (``torch._inductor.compile(gm, example_inputs, options)``).
    """
    try:
        compile_fx_graph = _module("torch._inductor").compile
    except (AttributeError, ImportError) as error:
        raise TorchPrivateError("compile_graph", f"is missing ({error})") from error
    return compile_fx_graph(graph, list(example_inputs), options=dict(config))


def eager_rounding_options() -> dict[str, Any]:
    """Inductor options under which a compiled program rounds to a low-precision dtype
    where eager PyTorch does: ``{"emulate_precision_casts": True}``.

    For: ``pmap(jit=True)``. By default inductor computes a ``bfloat16``/``float16``
    value in float32 inside a fused kernel and skips the roundings in between (a
    ``t.to(torch.bfloat16).float()`` can come back unrounded), so the numbers depend on
    how the program was cut and fused: one device's program (every instance) and 4
    devices' (one slice each) disagreed by a bfloat16 ulp or two, and both with eager.
    With the option, every placement gives eager's roundings at each cast (torch 2.13;
    torch 2.11's inductor still folds a round trip such as ``t.to(torch.bfloat16).float()``
    away before the option applies, so there such a program can still differ).
    Public replacement: none; the key is documented in ``torch._inductor.config`` only
    (what we'd need: a public "numerics like eager" switch for ``torch.compile``).
    A torch without the key gets ``{}``: compiled programs then round as inductor does.
    Checked: torch 2.11.0, 2.13.0, 2.14.1 (the key exists and compiles; whether a round
    trip is rounded: :func:`rounds_round_trips`).
    """
    try:
        known = hasattr(_module("torch._inductor.config"), "emulate_precision_casts")
    except ImportError:
        known = False
    return {"emulate_precision_casts": True} if known else {}


def is_fake_tensor(t: torch.Tensor) -> bool:
    """Whether ``t`` is a fake tensor of a trace (metadata, no memory).

    For: the journal of closed-over writes (:mod:`torchpmap._engines.closure_writes`)
    skips a trace's fake tensors, whose storage has no address (asking for it warns).
    Public replacement: none (``torch._subclasses.fake_tensor.FakeTensor``; what we'd
    need: a public test for a tensor without memory).
    Checked: torch 2.11.0, 2.13.0, 2.14.1.
    """
    return isinstance(t, _module("torch._subclasses.fake_tensor").FakeTensor)


_value_dependent: tuple[type[BaseException], ...] | None = None


def value_dependent_errors() -> tuple[type[BaseException], ...]:
    """The exceptions a fake-tensor trace raises when the program depends on tensor values
    (``torch.equal``, ``bool(t)``, data-dependent shapes).

    For: the fallback warning of ``pmap(jit=True)``, which then tells the user to compute
    such a branch with ``torch.where``. Missing classes only make that message generic,
    so a missing one warns (:class:`TorchPrivateWarning`) instead of raising.
    Public replacement: ``GuardOnDataDependentSymNode`` is in
    ``torch.fx.experimental.symbolic_shapes``; the two others only in the private
    ``torch._subclasses.fake_tensor`` (what we'd need: a public base class for "depends on
    data" trace errors).
    Checked: torch 2.11.0, 2.13.0, 2.14.1.
    """
    global _value_dependent
    if _value_dependent is None:
        found, missing = [], []
        for module, name in (
            ("torch._subclasses.fake_tensor", "DataDependentOutputException"),
            ("torch._subclasses.fake_tensor", "DynamicOutputShapeException"),
            ("torch.fx.experimental.symbolic_shapes", "GuardOnDataDependentSymNode"),
        ):
            try:
                found.append(getattr(_module(module), name))
            except (AttributeError, ImportError):
                missing.append(f"{module}.{name}")
        if missing:
            warnings.warn(
                str(TorchPrivateError("value_dependent_errors", f"is missing {', '.join(missing)}"))
                + " pmap(jit=True) fallbacks caused by value-dependent code get a generic message.",
                TorchPrivateWarning,
                stacklevel=2,
            )
        _value_dependent = tuple(found)
    return _value_dependent


# ======================================================================= torch.distributed


def default_store() -> Any:
    """The ``torch.distributed.Store`` of the default process group.

    For: adopting a process group someone else initialized: torchpmap's fault watching
    (heartbeats, failure reports naming the rank) lives in that store, under its own prefix.
    Raises :class:`TorchPrivateError` when the API is gone or fails; the caller
    (:mod:`torchpmap._state.process_group`) then warns with :class:`TorchPrivateWarning` that
    fault watching is off, never silently.
    Public replacement: none (``init_process_group(store=...)`` takes a store but there is
    no public getter; what we'd need: ``torch.distributed.get_default_store()``).
    Checked: torch 2.11.0, 2.13.0, 2.14.1 (``torch.distributed.distributed_c10d._get_default_store``).
    """
    try:
        getter = _module("torch.distributed.distributed_c10d")._get_default_store
    except (AttributeError, ImportError) as error:
        raise TorchPrivateError("default_store", f"is missing ({error})") from error
    try:
        return getter()
    except Exception as error:
        raise TorchPrivateError("default_store", f"failed: {type(error).__name__}: {error}") from error


# ======================================================================= torch's state, carried into device threads
# A pmap over several devices runs one thread per device; each must see its caller's
# torch state (see :mod:`torchpmap._state.context`). PyTorch keeps that state per thread and
# offers no public way to read it out of one thread and into another.


def forward_grad_enabled() -> bool:
    """Whether forward-mode AD is on in this thread (``torch.func.jvp`` turns it on).

    For: carrying the caller's forward-grad mode into device threads.
    Public replacement: none (what we'd need: a public getter in ``torch.autograd.forward_ad``).
    Checked: torch 2.11.0, 2.13.0, 2.14.1 (``torch._C._is_fwd_grad_enabled``).
    """
    return torch._C._is_fwd_grad_enabled()


def global_backward_hooks() -> bool:
    """Whether a module backward hook is registered for every module
    (``torch.nn.modules.module.register_module_full_backward_hook`` and its pre-hook).

    For: the data-parallel step's refusal of backward hooks, which its torch.func transforms
    ignore (one device) or refuse (several).
    Public replacement: none (the register functions return handles; nothing lists them).
    Checked: torch 2.11.0, 2.13.0, 2.14.1 (``torch.nn.modules.module._global_backward_hooks``,
    ``_global_backward_pre_hooks``).
    """
    module = torch.nn.modules.module
    return bool(module._global_backward_hooks) or bool(module._global_backward_pre_hooks)


def forward_grad_set(enabled: bool) -> contextlib.AbstractContextManager:
    """Sets forward-mode AD on or off in this thread for a block.

    For: entering the caller's forward-grad mode in a device thread.
    Public replacement: none. Checked: torch 2.11.0, 2.13.0, 2.14.1
    (``torch.autograd.forward_ad._set_fwd_grad_enabled``).
    """
    return torch.autograd.forward_ad._set_fwd_grad_enabled(enabled)


def forward_ad_level() -> int:
    """The process' open forward-AD level (``torch.autograd.forward_ad.dual_level``), or -1
    when none is open. ``torch.func.jvp`` opens it at its outermost nesting; a user may
    open it directly, to make dual tensors.

    For: device threads share the open level instead of opening a second one (torch
    refuses nested forward-AD levels); a collective with no derivative refuses a value
    that carries a tangent under ``no_grad`` (forward AD ignores grad mode).
    Public replacement: none (``forward_ad`` has no getter of its level).
    Checked: torch 2.11.0, 2.13.0, 2.14.1 (``torch.autograd.forward_ad._current_level``).
    """
    return torch.autograd.forward_ad._current_level


def function_mode_stack() -> list[Any]:
    """The torch function modes in force in this thread, outermost first.

    For: device threads see the caller's ``with torch.device(...)``,
    ``torch.set_default_device`` and other function modes.
    Public replacement: none (``torch.overrides`` has only the private
    ``_get_current_function_mode_stack``). Checked: torch 2.11.0, 2.13.0, 2.14.1.
    """
    from torch.overrides import _get_current_function_mode_stack

    return list(_get_current_function_mode_stack())


@contextlib.contextmanager
def function_mode_pushed(mode: Any) -> Iterator[None]:
    """Pushes an already-entered torch function mode of another thread onto this thread's
    stack for a block (entering it again would re-run its ``__enter__``).

    For: the same. Public replacement: none (``torch.overrides._push_mode``/``_pop_mode``).
    Checked: torch 2.11.0, 2.13.0, 2.14.1.
    """
    from torch.overrides import _pop_mode, _push_mode

    _push_mode(mode)
    try:
        yield
    finally:
        _pop_mode()


def _layer_stack() -> tuple[Callable[[], Any], Callable[[], Any], Callable[[Any], Any]]:
    f = torch._C._functorch
    return f.peek_interpreter_stack, f.pop_dynamic_layer_stack, f.push_dynamic_layer_stack


def functorch_layers() -> list[Any]:
    """The torch.func interpreter stack of this thread, innermost first, left in place.

    For: torch.func transforms around a multi-device pmap enclose its device threads too.
    Public replacement: none (torch's own loop is the private
    ``torch._functorch.pyfunctorch.temporarily_clear_interpreter_stack``).
    Checked: torch 2.11.0, 2.13.0, 2.14.1 (``torch._C._functorch.peek_interpreter_stack``,
    ``pop_dynamic_layer_stack``, ``push_dynamic_layer_stack``).
    """
    peek, pop, push = _layer_stack()
    layers = []
    while peek() is not None:
        layers.append(pop())
    for layer in reversed(layers):
        push(layer)
    return layers


@contextlib.contextmanager
def functorch_layers_restored(layers: Sequence[Any]) -> Iterator[None]:
    """Pushes ``layers`` (from :func:`functorch_layers` of another thread) onto this
    thread's interpreter stack for a block: the caller's transforms enclose the block.

    For: the same. Public replacement: none. Checked: torch 2.11.0, 2.13.0, 2.14.1 (the same calls).
    """
    _, pop, push = _layer_stack()
    pushed = 0
    try:
        for layer in reversed(layers):
            push(layer)
            pushed += 1
        yield
    finally:
        for _ in range(pushed):
            pop()


@contextlib.contextmanager
def functorch_layers_cleared() -> Iterator[None]:
    """No torch.func transform in force for a block (put back after).

    For: torchpmap's own random draw (one per call) must not be batched, or refused, by an
    enclosing vmap. Public replacement: none (torch has the private
    ``temporarily_clear_interpreter_stack``). Checked: torch 2.11.0, 2.13.0, 2.14.1 (the same calls).
    """
    peek, pop, push = _layer_stack()
    layers = []
    while peek() is not None:
        layers.append(pop())
    try:
        yield
    finally:
        for layer in reversed(layers):
            push(layer)


def innermost_vmap_level() -> int | None:
    """The level of the innermost vmap among the torch.func transforms in force (grad and
    jvp levels above it are skipped), or None.

    For: ``randomness="per_instance"`` draws one stream per instance of *its* vmap level,
    and must refuse a random op inside a vmap nested in the instance (whose instances
    would all get the same numbers). Public replacement: none (``maybe_current_level``
    gives the innermost level of any kind). Checked: torch 2.11.0, 2.13.0, 2.14.1
    (``torch._C._functorch.peek_interpreter_stack``, ``TransformType``, and the pop/push
    of :func:`functorch_layers`).
    """
    f = torch._C._functorch
    peek, pop, push = _layer_stack()
    popped, found = [], None
    try:
        while (top := peek()) is not None:
            if top.key() == f.TransformType.Vmap:
                found = top.level()
                break
            popped.append(pop())
    finally:
        for layer in reversed(popped):
            push(layer)
    return found


def jvp_nesting() -> int:
    """How many ``torch.func.jvp`` calls are open in this process (torch.func opens the
    process' forward-AD level only at nesting 1).

    For: device threads share one forward-AD level per call.
    Public replacement: none (what we'd need: per-thread forward-AD levels, or a public
    way to hold one open). Checked: torch 2.11.0, 2.13.0, 2.14.1
    (``torch._functorch.eager_transforms.JVP_NESTING``).
    """
    from torch._functorch import eager_transforms

    return eager_transforms.JVP_NESTING


@contextlib.contextmanager
def jvp_nesting_raised() -> Iterator[None]:
    """Counts one more open jvp for a block, so that a jvp inside it neither opens nor
    closes the process' forward-AD level (the caller holds it open).

    For: the same. Public replacement: none. Checked: torch 2.11.0, 2.13.0, 2.14.1 (the same global).
    """
    from torch._functorch import eager_transforms

    eager_transforms.JVP_NESTING += 1
    try:
        yield
    finally:
        eager_transforms.JVP_NESTING -= 1


def release_compiled(fn: Any) -> None:
    """Drops what torch.compile keeps for ``fn`` (a function, or a bound method of a traced
    graph module).

    For: the jit cache frees an evicted program. Dynamo's cache entries on its code object
    hold, through a clean-up hook, the graph module itself (about 0.1 MiB per
    recompilation otherwise).
    Public replacement: none (``torch.compiler.reset()`` drops every program of the
    process; ``torch._dynamo.reset_code`` is exported but undocumented).
    Checked: torch 2.11.0, 2.13.0, 2.14.1 (``torch._dynamo.reset_code``).
    """
    code = getattr(getattr(fn, "__func__", fn), "__code__", None)
    if code is None:
        return
    try:
        reset_code = _module("torch._dynamo").reset_code
    except (AttributeError, ImportError) as error:
        raise TorchPrivateError("release_compiled", f"is missing ({error})") from error
    reset_code(code)


# ======================================================================= jit=True: auditing the trace


def _dispatch_mode_class() -> type:
    try:
        return _module("torch.utils._python_dispatch").TorchDispatchMode
    except (AttributeError, ImportError) as error:
        problem = f"is missing ({type(error).__name__}: {error})"

        class Missing:  # subclassing still works at import; using the mode raises
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                raise TorchPrivateError("TorchDispatchMode", problem)

        return Missing


TorchDispatchMode: Any = _dispatch_mode_class()  # a class (Any: subclasses of it type-check)
"""The base class of a torch dispatch mode (``__torch_dispatch__``), which sees every aten
op below autograd. If torch moves it, subclasses still define, and creating one raises
:class:`TorchPrivateError`.

For: ``pmap(jit=True)`` watches its trace to write the stops of the gradient (``detach``,
``no_grad``) into the graph.
Public replacement: none; ``torch.overrides.TorchFunctionMode`` is public but sees torch
functions above autograd (what we'd need: a public ``TorchDispatchMode``).
Checked: torch 2.11.0, 2.13.0, 2.14.1 (``torch.utils._python_dispatch.TorchDispatchMode``, loaded by
``import torch``)."""


modes_disabled = _bind(
    "modes_disabled", lambda: _module("torch.utils._python_dispatch")._disable_current_modes
)
"""``with modes_disabled(): ...`` runs ops with every torch dispatch mode set aside (a
fake-tensor trace's own modes included), so that they compute on real tensors.

For: ``pmap(jit=True)``'s trace runs each elementwise op once more on one-element real
tensors of the op's dtypes, and runs eagerly where eager's kernel refuses them: fake
tensors do not check (``torch.hypot`` of integers, a float product written into an
integer tensor by ``mul_``), and the compiled program computed what eager refuses.
Public replacement: none (what we'd need: fake tensors that check kernel dtype
support, or a public way to step outside the active modes).
Checked: torch 2.11.0, 2.13.0, 2.14.1 (``torch.utils._python_dispatch._disable_current_modes``)."""


has_kernel_for_dispatch_key = _bind(
    "has_kernel_for_dispatch_key", lambda: torch._C._dispatch_has_kernel_for_dispatch_key
)
"""``has_kernel_for_dispatch_key(op_name, key) -> bool``: whether the operator
``op_name`` (e.g. ``"aten::add.Tensor"``) has a kernel registered for dispatch key
``key`` (e.g. ``"Autograd"``).

For: a custom op with its own autograd kernel counts as recorded by autograd when
``pmap(jit=True)`` audits a trace; checking that vmap's decompositions are installed.
Public replacement: none (what we'd need: a public ``torch.library`` query).
Checked: torch 2.11.0, 2.13.0, 2.14.1 (``torch._C._dispatch_has_kernel_for_dispatch_key``)."""


def op_schema(op: Any) -> Any:
    """The schema (``torch._C.FunctionSchema``: ``.is_mutable``, ``.arguments``, each with
    ``.name`` and ``.alias_info.is_write``) of an ``OpOverload``, None for anything else.

    For: which arguments an op writes in place, when ``pmap(jit=True)`` audits a trace and
    when an in-place op on a ShardedTensor writes back into its shards; the argument names
    of the CUDA attention backwards, for their batching rule.
    Public replacement: none (``OpOverload._schema``; what we'd need: a public schema
    attribute). Checked: torch 2.11.0, 2.13.0, 2.14.1.
    """
    return getattr(op, "_schema", None)


def version_counter(t: torch.Tensor) -> int | None:
    """``t._version``: how many in-place writes the memory of ``t`` has had (a count that
    every view of one tensor shares); None for a tensor that keeps no count (an inference
    tensor).

    For: a pmap raises when its function writes in place to an argument whose memory
    several instances share (:mod:`torchpmap._frontend.aliasing`): the count before and
    after the call tells whether it was written, at the cost of reading an attribute.
    Public replacement: none (what we'd need: a public version counter, or tensors that
    can be made read-only).
    Checked: torch 2.11.0, 2.13.0, 2.14.1 (``Tensor._version``)."""
    try:
        return t._version
    except RuntimeError:  # "Inference tensors do not track version counter"
        return None
    except AttributeError as error:
        raise TorchPrivateError("version_counter", f"is missing ({type(error).__name__}: {error})") from None


def set_version_counters(tensors: Sequence[torch.Tensor], versions: Sequence[int]) -> None:
    """Sets each tensor's version counter (see :func:`version_counter`; the count that
    every view of it shares) to the given value.

    For: the device threads of one call write into their own slices of one tensor, views
    that share its count; each thread's writes are counted as if it ran alone, as one
    device's single vectorized write counts (:mod:`torchpmap._engines.turn_versions`).
    Public replacement: none (what we'd need: a version count per view, or a way to
    hand out a view that counts its own writes).
    Checked: torch 2.11.0, 2.13.0, 2.14.1 (``torch._C._autograd._unsafe_set_version_counter``)."""
    try:
        setter = torch._C._autograd._unsafe_set_version_counter
    except AttributeError as error:
        raise TorchPrivateError("set_version_counters", f"is missing ({type(error).__name__}: {error})") from None
    setter(tuple(tensors), tuple(versions))


# ======================================================================= ShardedTensor: a tensor subclass


make_wrapper_subclass = _bind("make_wrapper_subclass", lambda: torch.Tensor._make_wrapper_subclass)
"""``make_wrapper_subclass(cls, size, dtype=, device=, requires_grad=)``: a tensor of
class ``cls`` with the given metadata and no storage of its own; every aten op on it
reaches ``cls.__torch_dispatch__``.

For: :class:`torchpmap.ShardedTensor`, a ``torch.Tensor`` whose data lives in shards on
several devices (so ``torch.as_tensor`` and autograd treat it as the tensor it is); and
the sharded step's ``Unread`` placeholders (``_frontend/layer_gather.py``), parameters
gathered where they are read.
Public replacement: none (DTensor and every torch wrapper subclass use it; what we'd
need: a public constructor for wrapper subclasses).
Checked: torch 2.11.0, 2.13.0, 2.14.1 (``torch.Tensor._make_wrapper_subclass``)."""

disabled_torch_function = _bind("disabled_torch_function", lambda: torch._C._disabled_torch_function_impl)
"""The ``__torch_function__`` of a subclass that wants none: the function runs as on a
plain tensor, and its results stay plain tensors (the default ``__torch_function__``
would turn every result into the subclass).

For: :class:`torchpmap.ShardedTensor`, whose ops are handled at ``__torch_dispatch__``,
below autograd, and return plain tensors.
Public replacement: none (what we'd need: a public name for it); DTensor uses it too.
Checked: torch 2.11.0, 2.13.0, 2.14.1 (``torch._C._disabled_torch_function_impl``)."""


# ======================================================================= probes


def _expect(condition: bool, what: str) -> None:
    if not condition:
        raise AssertionError(what)


def _with_vmap_level(size: int, body: Callable[[int], None]) -> None:
    level = vmap_increment_nesting(size, "error")
    try:
        body(level)
    finally:
        vmap_decrement_nesting()


def _probe_current_vmap_level() -> None:
    _expect(current_vmap_level() is None, "no level outside every transform")

    def body(level: int) -> None:
        _expect(current_vmap_level() == level, "the level just opened is current")

    _with_vmap_level(2, body)
    seen = []

    def noting_the_level(x: torch.Tensor) -> torch.Tensor:
        seen.append(current_vmap_level())
        return x.sum()

    torch.func.grad(noting_the_level)(torch.ones(2))
    _expect(isinstance(seen[0], int), "grad opens a level too")


def _probe_functorch_value() -> None:
    seen = []

    def f(x: torch.Tensor) -> torch.Tensor:
        seen.append(functorch_value(x))
        return (x * 2).sum()

    torch.func.grad(f)(torch.ones(3))
    value, dim = seen[0]
    _expect(
        type(value) is torch.Tensor and not _is_wrapped(value) and dim is None, "under a grad wrapper: a plain tensor"
    )
    _expect(value.data_ptr() != 0, "the plain value has storage")

    def g(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        def loss(w: torch.Tensor) -> torch.Tensor:
            hook(w)
            return (w * x).sum()

        return torch.func.grad(loss)(w)

    def hook(w: torch.Tensor) -> None:
        level = innermost_vmap_level()
        w.register_hook(lambda grad: seen.append(functorch_value(grad, level)))

    seen.clear()
    torch.func.vmap(g, in_dims=(None, 0))(torch.ones(2), torch.arange(6.0).view(3, 2))
    value, dim = seen[0]
    _expect(type(value) is torch.Tensor and dim is not None, "under grad and vmap: the physical value and its dim")
    _expect(torch.equal(value.movedim(cast(int, dim), 0), torch.arange(6.0).view(3, 2)), "every instance's gradient")


def _probe_vmap_level_of() -> None:
    x = torch.ones(2, 3)
    _expect(vmap_level_of(x) == -1, "a plain tensor is at level -1")

    def body(level: int) -> None:
        _expect(vmap_level_of(add_batch_dim(x, 0, level)) == level, "a batched tensor reports its level")

    _with_vmap_level(2, body)


def _probe_batching() -> None:
    x = torch.arange(6.0).reshape(2, 3)

    def body(level: int) -> None:
        b = add_batch_dim(x, 1, level)  # batched along dim 1: instances are columns
        _expect(tuple(b.shape) == (2,), "a batched tensor shows the instance shape")
        value, dim = unwrap_batched(b * 10, level)
        _expect(torch.equal(value.movedim(dim, 0), (x * 10).movedim(1, 0)), "unwrap returns (value, dim)")
        _expect(unwrap_batched(x, level)[1] is None, "a tensor not batched at the level: dim None")
        out = remove_batch_dim(b + 1, level, 3, 0)
        _expect(torch.equal(out, (x + 1).T), "remove_batch_dim moves the batch to out_dim")
        out = remove_batch_dim(torch.ones(2), level, 3, 0)
        _expect(tuple(out.shape) == (3, 2), "an unbatched result is expanded to size")

    _with_vmap_level(3, body)
    _expect(current_vmap_level() is None, "decrement closes the level")


def _probe_pop_interpreter() -> None:
    seen = []

    def f(x: torch.Tensor) -> torch.Tensor:
        with pop_interpreter():
            seen.append(current_vmap_level())
        return x

    torch.func.vmap(f)(torch.ones(2))
    _expect(seen == [None], "inside one vmap, popping its interpreter leaves no level")


def _probe_ensure_vmap_decompositions() -> None:
    ensure_vmap_decompositions()
    _expect(_decompositions_loaded, "marked loaded")
    _expect(
        has_kernel_for_dispatch_key("aten::mse_loss_backward", "FuncTorchBatched"),
        "mse_loss_backward has a batching decomposition",
    )


def _probe_saved_tensors_hooks() -> None:
    previous = saved_tensors_hooks_disabled_message()
    try:
        enable_saved_tensors_hooks()
        _expect(saved_tensors_hooks_disabled_message() is None, "None when enabled")
        disable_saved_tensors_hooks("probe: no hooks")
        _expect(saved_tensors_hooks_disabled_message() == "probe: no hooks", "the message is kept")
        try:
            with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
                pass
        except RuntimeError as error:
            _expect("probe: no hooks" in str(error), "setting hooks raises the message")
        else:
            raise AssertionError("setting hooks while disabled did not raise")
    finally:
        if previous is None:
            enable_saved_tensors_hooks()
        else:
            disable_saved_tensors_hooks(previous)


def _probe_pytree() -> None:
    import collections

    for name in (
        "tree_flatten tree_unflatten tree_map tree_map_with_path tree_leaves tree_leaves_with_path "
        "tree_flatten_with_path tree_map_only tree_is_leaf keystr TreeSpec KeyPath"
    ).split():
        _expect(hasattr(pytree, name), f"pytree.{name} exists")
    tree = ({"b": 1, "a": [2, 3]}, (4,))
    leaves, spec = pytree.tree_flatten(tree)
    _expect(leaves == [1, 2, 3, 4] and pytree.tree_unflatten(leaves, spec) == tree, "flatten round trip")
    paths = [pytree.keystr(p) for p, _ in pytree.tree_leaves_with_path(tree)]
    _expect(paths == ["[0]['b']", "[0]['a'][0]", "[0]['a'][1]", "[1][0]"], f"key strings (got {paths})")
    _expect(pytree.tree_is_leaf(torch.ones(1)) and not pytree.tree_is_leaf([1]), "tree_is_leaf")
    point = collections.namedtuple("point", "x y")
    children, spec = pytree.tree_flatten(point([1], 2), is_leaf=lambda c: not isinstance(c, point))
    _expect(children == [[1], 2], "a one-level flatten stops at is_leaf")
    _expect(spec.context is point and spec.num_children == 2, "TreeSpec has .context and .num_children")
    _, other = pytree.tree_flatten(point(0, 0))
    _expect(spec.type == other.type, "TreeSpec.type is the node kind")
    _expect(pytree.tree_flatten(0)[1].is_leaf(), "TreeSpec.is_leaf")
    _expect(
        pytree.tree_map_with_path(lambda p, v: pytree.keystr(p), {"k": 1}) == {"k": "['k']"}, "tree_map_with_path"
    )


def _probe_make_fx_real_inputs() -> None:
    constant = torch.tensor([1.0, 2.0])
    graph = make_fx_real_inputs(lambda x: x + constant, decomposition_table={})(torch.zeros(2))
    _expect(torch.equal(graph(torch.ones(2)), torch.tensor([2.0, 3.0])), "a traced closure computes")
    _expect(any(n.op == "get_attr" for n in graph.graph.nodes), "the closed-over tensor is a graph constant")


def _probe_ensure_cuda_device_guard() -> None:
    _expect(callable(torch._C._ensureCUDADeviceGuardSet), "the guard's setter exists")
    ensure_cuda_device_guard()
    for _ in range(2):  # traces in threads that exit, one after the other (2.11 crashed on the second)
        _in_thread(lambda: make_fx_real_inputs(lambda x: x * 2)(torch.ones(2)))


def _probe_value_dependent_errors() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", TorchPrivateWarning)
        global _value_dependent
        _value_dependent = None
        errors = value_dependent_errors()
    _expect(len(errors) == 3 and all(issubclass(e, Exception) for e in errors), "three exception classes")
    for fn in (lambda x: torch.equal(x, x), lambda x: x if bool(x.sum() > 0) else -x):
        try:
            make_fx_real_inputs(fn)(torch.ones(2))
        except errors:
            continue
        except Exception as error:
            raise AssertionError(f"a value-dependent trace raised {type(error).__name__}, not one of them") from error
        raise AssertionError("a value-dependent trace did not raise")


def _probe_default_store() -> None:
    import torch.distributed as dist

    if not dist.is_available():
        return
    if dist.is_initialized():
        _expect(isinstance(default_store(), dist.Store), "a Store")
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        store = default_store()
        _expect(isinstance(store, dist.Store), "a Store")
        store.set("torchpmap-probe", "1")
        _expect(store.get("torchpmap-probe") == b"1", "the store works")
    finally:
        dist.destroy_process_group()


def _in_thread(fn: Callable[[], Any]) -> Any:
    """``fn()`` in a new thread (fresh thread-local torch state); its result or its error."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append((True, fn()))
        except BaseException as error:  # noqa: BLE001 - re-raised in the caller
            out.append((False, error))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    ok, value = out[0]
    if not ok:
        raise value
    return value


def _probe_global_backward_hooks() -> None:
    before = global_backward_hooks()
    for register in (
        torch.nn.modules.module.register_module_full_backward_hook,
        torch.nn.modules.module.register_module_full_backward_pre_hook,
    ):
        handle = register(lambda *args: None)
        try:
            _expect(global_backward_hooks() is True, f"seen after {register.__name__}")
        finally:
            handle.remove()
    _expect(global_backward_hooks() is before, "gone after the handle's remove()")


def _probe_forward_grad() -> None:
    _expect(_in_thread(forward_grad_enabled) is True, "on by default in a new thread")

    def toggled() -> tuple[bool, bool]:
        with forward_grad_set(False):
            inside = forward_grad_enabled()
        return inside, forward_grad_enabled()

    _expect(_in_thread(toggled) == (False, True), "set for a block, then restored")


def _probe_forward_ad_level() -> None:
    _expect(forward_ad_level() == -1, "no level open")
    with torch.autograd.forward_ad.dual_level():
        _expect(forward_ad_level() >= 0, "open inside dual_level")
    seen: list[int] = []

    def noting(x: torch.Tensor) -> torch.Tensor:
        seen.append(forward_ad_level())
        return x * 2

    torch.func.jvp(noting, (torch.ones(2),), (torch.ones(2),))
    _expect(len(seen) == 1 and seen[0] >= 0 and forward_ad_level() == -1, f"open inside torch.func.jvp ({seen})")


def _probe_function_modes() -> None:
    from torch.overrides import TorchFunctionMode

    seen = []

    class Record(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
            seen.append(getattr(func, "__name__", None))
            return func(*args, **(kwargs or {}))

    before = len(function_mode_stack())
    with Record() as mode:
        stack = function_mode_stack()
        _expect(len(stack) == before + 1 and stack[-1] is mode, "the entered mode is innermost")

        def elsewhere() -> tuple[int, int]:
            empty = len(function_mode_stack())
            with function_mode_pushed(mode):
                torch.ones(1).neg()
                pushed = len(function_mode_stack())
            return empty, pushed - empty

        _expect(_in_thread(elsewhere) == (0, 1), "another thread starts empty; pushing adds the mode")
    _expect("neg" in seen, "the pushed mode sees the other thread's ops")


def _probe_functorch_layers() -> None:
    seen: dict[str, Any] = {}

    def f(x: torch.Tensor) -> torch.Tensor:
        level = current_vmap_level()
        layers = functorch_layers()
        seen["count"] = len(layers)
        seen["kept"] = current_vmap_level() == level
        with functorch_layers_cleared():
            seen["cleared"] = current_vmap_level()
        seen["back"] = current_vmap_level() == level

        def elsewhere() -> tuple[Any, Any]:
            with functorch_layers_restored(layers):
                inside = current_vmap_level()
            return inside, current_vmap_level()

        seen["restored"] = _in_thread(elsewhere) == (level, None)
        return x

    torch.func.vmap(f)(torch.ones(2))
    _expect(seen == {"count": 1, "kept": True, "cleared": None, "back": True, "restored": True}, f"got {seen}")


def _probe_innermost_vmap_level() -> None:
    _expect(innermost_vmap_level() is None, "no vmap outside every transform")
    seen: list[Any] = []

    def noting_the_level(y: torch.Tensor) -> torch.Tensor:
        seen.append(innermost_vmap_level())
        return y.sum()

    torch.func.vmap(lambda x: torch.func.grad(noting_the_level)(x))(torch.ones(2, 3))
    _with_vmap_level(2, lambda level: seen.append(innermost_vmap_level() == level))
    _expect(seen[0] == 1 and seen[1] is True, f"the vmap under a grad is found ({seen})")


def _probe_jvp_nesting() -> None:
    seen = []
    _expect(jvp_nesting() == 0, "no jvp open")

    def noting_the_nesting(x: torch.Tensor) -> torch.Tensor:
        seen.append(jvp_nesting())
        return x * 2

    torch.func.jvp(noting_the_nesting, (torch.ones(2),), (torch.ones(2),))
    _expect(seen == [1], f"one inside torch.func.jvp (got {seen})")
    with jvp_nesting_raised():
        _expect(jvp_nesting() == 1, "raised by one")
    _expect(jvp_nesting() == 0, "lowered after")


def _probe_release_compiled() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        return x + 1

    compiled: Any = torch.compile(f, backend="eager")
    _expect(torch.equal(compiled(torch.ones(2)), torch.full((2,), 2.0)), "compiled")
    release_compiled(f)
    release_compiled(compiled.__call__)  # a callable without its own code object is fine too
    _expect(torch.equal(compiled(torch.ones(2)), torch.full((2,), 2.0)), "recompiles after a release")


def _probe_compile_graph() -> None:
    x = torch.arange(3.0, requires_grad=True)
    graph = make_fx_real_inputs(lambda t: [torch.sin(t) * 2])(x)
    compiled = compile_graph(graph, [x], {})
    (out,) = compiled(x)
    _expect(torch.allclose(out, torch.sin(x) * 2), "computes the graph")
    out.sum().backward()
    _expect(x.grad is not None and torch.allclose(x.grad, torch.cos(x.detach()) * 2), "differentiable")


def rounds_round_trips() -> bool:
    """Whether a program compiled with :func:`eager_rounding_options` rounds a round trip
    through bfloat16 (``t.to(torch.bfloat16).float()``) as eager PyTorch does (torch 2.13:
    yes; torch 2.11: no, inductor folds it away first). Compiles a small program: for tests
    and reports, not for the hot path."""
    x = torch.tensor([1.0 + 2.0**-10, 3.0 + 2.0**-9])
    graph = make_fx_real_inputs(lambda t: [t.to(torch.bfloat16).float() * 3])(x)
    (out,) = compile_graph(graph, [x], eager_rounding_options())(x)
    return bool(torch.equal(out, x.to(torch.bfloat16).float() * 3))


def _probe_eager_rounding_options() -> None:
    options = eager_rounding_options()
    _expect(options == {"emulate_precision_casts": True}, f"names inductor's option (got {options})")
    x = torch.tensor([1.0 + 2.0**-10, 3.0 + 2.0**-9])
    graph = make_fx_real_inputs(lambda t: [(t.to(torch.bfloat16) * 3).float()])(x)
    (out,) = compile_graph(graph, [x], options)(x)
    _expect(torch.allclose(out, (x.to(torch.bfloat16) * 3).float(), rtol=1e-2), f"compiles with it (got {out})")


def _recording_mode(seen: list) -> Any:
    """A dispatch mode that appends every op it sees to ``seen`` (the probes' witness)."""

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
            seen.append(func)
            return func(*args, **(kwargs or {}))

    return Record()


def _probe_modes_disabled() -> None:
    seen: list = []
    with _recording_mode(seen):
        with modes_disabled():
            inside = torch.ones(2) + 1
        torch.ones(2) * 2
    _expect(type(inside) is torch.Tensor and inside.tolist() == [2.0, 2.0], "ops compute on real tensors")
    _expect(torch.ops.aten.add.Tensor not in seen, "a mode set aside does not see aten.add.Tensor")
    _expect(torch.ops.aten.mul.Tensor in seen, "the mode sees aten.mul.Tensor again after the block")


def _probe_dispatch_mode() -> None:
    seen: list = []
    with _recording_mode(seen):
        torch.ones(2) + 1
    _expect(torch.ops.aten.add.Tensor in seen, "a dispatch mode sees aten.add.Tensor")


_probe_library: Any = None


def _probe_has_kernel() -> None:
    global _probe_library
    if _probe_library is None:  # an op with a CPU kernel and no autograd kernel, defined once
        _probe_library = torch.library.Library("torchpmap_probe", "FRAGMENT")
        _probe_library.define("plain(Tensor x) -> Tensor")
        _probe_library.impl("plain", lambda x: x.clone(), "CPU")
    _expect(has_kernel_for_dispatch_key("torchpmap_probe::plain", "CPU"), "a registered kernel is found")
    _expect(not has_kernel_for_dispatch_key("torchpmap_probe::plain", "Autograd"), "a missing one is not")
    _expect(has_kernel_for_dispatch_key("aten::add.Tensor", "Autograd"), "aten ops have autograd kernels")


def _probe_op_schema() -> None:
    schema = op_schema(torch.ops.aten.add_.Tensor)
    arguments = [(a.name, bool(a.alias_info and a.alias_info.is_write)) for a in schema.arguments]
    _expect(arguments == [("self", True), ("other", False), ("alpha", False)], f"add_'s arguments (got {arguments})")
    _expect(schema.is_mutable and not op_schema(torch.ops.aten.add.Tensor).is_mutable, "add_ mutates, add does not")
    _expect(op_schema(torch.add) is None, "None for a torch function")


def _probe_cpu_flash_attention() -> None:
    ops = cpu_flash_attention()
    _expect(ops is not None, "the ops exist")
    assert ops is not None
    q = torch.randn(1, 2, 4, 8)
    out, _ = ops[0](q, q, q, 0.0, False, attn_mask=None, scale=None)
    want = torch.nn.functional.scaled_dot_product_attention(q, q, q)
    _expect(torch.allclose(out, want, atol=1e-6), "the forward is F.scaled_dot_product_attention's")


def _probe_cuda_attention_backwards() -> None:
    ops = cuda_attention_backwards()
    _expect(len(ops) == len(_CUDA_ATTENTION_BACKWARDS), "every op exists")
    for op in ops:
        schema = op_schema(op)
        names = {a.name for a in schema.arguments}
        _expect({"query", "key", "value", "out", "logsumexp"} <= names, f"{op.name()} takes the folded arguments")
        _expect(all(r.type.kind() == "TensorType" for r in schema.returns), f"{op.name()} returns tensors")


def _probe_cuda_attention_forwards() -> None:
    ops = cuda_attention_forwards()
    _expect(len(ops) == len(_CUDA_ATTENTION_FORWARDS), "every op exists")
    for op in ops:
        names = [a.name for a in op_schema(op).arguments]
        expected = ["query", "key", "value", "attn_bias", "compute_log_sumexp"]
        _expect(names[:5] == expected, f"{op.name()} takes its arguments")
        _expect({"dropout_p", "is_causal", "scale"} <= set(names), f"{op.name()} takes dropout_p, is_causal, scale")
    if ops:  # the memory-efficient kernel's meta function: the log-sum-exp is there when asked for
        q = torch.empty(2, 3, 5, 8, device="meta")
        _, lse, *_ = ops[0](q, q, q, None, True, 0.0, False)
        _expect(lse.shape[:2] == (2, 3) and lse.shape[2] >= 5, "the log-sum-exp is batch x heads x length")


def _probe_recurrent_ops() -> None:
    want = ["input", "hx", "params", "has_biases", "num_layers", "dropout", "train", "bidirectional", "batch_first"]
    for op in recurrent_ops():
        _expect([a.name for a in op_schema(op).arguments] == want, f"{op.name()} takes {want}")
    gru = torch.nn.GRU(2, 3, batch_first=True)
    x, h = torch.randn(1, 4, 2), torch.zeros(1, 1, 3)
    out, _ = recurrent_ops()[0](x, h, list(gru._flat_weights), True, 1, 0.0, False, False, True)
    _expect(torch.allclose(out, gru(x, h)[0]), "gru.input is nn.GRU's forward")


def _probe_vmap_value_reads() -> None:
    ops = vmap_value_reads()
    for op in ops:
        schema = op_schema(op)
        _expect([a.name for a in schema.arguments] == ["self"], f"{op.name()} takes one tensor")
        _expect(len(schema.returns) == 1, f"{op.name()} returns one value")
        _expect(has_kernel_for_dispatch_key(op.name(), "FuncTorchBatched"), f"vmap has a rule for {op.name()}")
    _expect(ops[0](torch.ones(())) is True and ops[1](torch.full((), 2.5)) == 2.5, "they read the value")


def _probe_vmap_randomness() -> None:
    _expect(vmap_randomness() is None, "none outside vmap")
    for kind in ("error", "same", "different"):
        vmap_increment_nesting(2, kind)
        try:
            _expect(vmap_randomness() == kind, f"randomness {kind!r} is read back")
        finally:
            vmap_decrement_nesting()


def _probe_batching_excluded() -> None:
    level = vmap_increment_nesting(2, "error")
    try:
        batched = add_batch_dim(torch.arange(6.0).reshape(2, 3), 0, level)
        with batching_excluded():
            value, dim = unwrap_batched(batched, level)
            _expect(dim == 0 and value.shape == (2, 3), "the physical value is seen")
            _expect(vmap_level_of(value + 1) == -1, "ops run below the level")
        _expect(vmap_level_of(batched + 1) == level, "the level batches again after the block")
    finally:
        vmap_decrement_nesting()


def _probe_wrapper_subclass() -> None:
    seen = []

    class Wrapper(torch.Tensor):
        __torch_function__ = disabled_torch_function

        @classmethod
        def __torch_dispatch__(  # type: ignore[override]  # torch declares it without func
            cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
        ) -> Any:
            seen.append(func)
            return func(*[torch.ones(2) if isinstance(a, Wrapper) else a for a in args], **(kwargs or {}))

    wrapped = make_wrapper_subclass(Wrapper, (2,), dtype=torch.float32, device="cpu", requires_grad=False)
    _expect(wrapped.shape == (2,) and wrapped.dtype == torch.float32, "metadata without storage")
    out = wrapped + 1
    _expect(type(out) is torch.Tensor and torch.equal(out, torch.full((2,), 2.0)), "ops return plain tensors")
    _expect(torch.ops.aten.add.Tensor in seen, "ops reach __torch_dispatch__")


def _probe_version_counter() -> None:
    base = torch.zeros(2, 3)
    view = base[0]
    before = version_counter(base)
    _expect(before is not None, "a tensor keeps a count")
    view.add_(1)  # a write through a view moves the count of every view of the base
    _expect(
        version_counter(base) == cast(int, before) + 1 == version_counter(view),
        "a write through a view moves the shared count",
    )
    with torch.inference_mode():
        _expect(version_counter(torch.zeros(1)) is None, "an inference tensor has no count")


def _probe_is_fake_tensor() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = torch.zeros(2)
    _expect(is_fake_tensor(fake) and not is_fake_tensor(torch.zeros(2)), "a trace's tensors are fake, others not")


def _probe_set_version_counters() -> None:
    base = torch.zeros(2, 3)
    view = base[1]
    view.add_(1)
    view.add_(1)
    set_version_counters([view], [1])
    _expect(version_counter(base) == 1 == version_counter(view), "a view's count is its base's, set through it")


@dataclasses.dataclass(frozen=True)
class Entry:
    """One door entry: ``name`` is its attribute here, ``private`` the torch API behind it."""

    name: str
    private: str
    probe: Callable[[], None]


ENTRIES: dict[str, Entry] = {
    e.name: e
    for e in (
        Entry("current_vmap_level", "torch._C._functorch.maybe_current_level", _probe_current_vmap_level),
        Entry("vmap_level_of", "torch._C._functorch.maybe_get_level", _probe_vmap_level_of),
        Entry("unwrap_batched", "torch._C._functorch._unwrap_batched", _probe_batching),
        Entry("add_batch_dim", "torch._C._functorch._add_batch_dim", _probe_batching),
        Entry("remove_batch_dim", "torch._C._functorch._remove_batch_dim", _probe_batching),
        Entry("vmap_increment_nesting", "torch._C._functorch._vmap_increment_nesting", _probe_batching),
        Entry("vmap_decrement_nesting", "torch._C._functorch._vmap_decrement_nesting", _probe_batching),
        Entry(
            "pop_interpreter", "torch._functorch.pyfunctorch.temporarily_pop_interpreter_stack", _probe_pop_interpreter
        ),
        Entry(
            "ensure_vmap_decompositions",
            "torch._functorch.vmap.lazy_load_decompositions",
            _probe_ensure_vmap_decompositions,
        ),
        Entry(
            "saved_tensors_hooks_disabled_message",
            "torch._C._autograd._saved_tensors_hooks_get_disabled_error_message",
            _probe_saved_tensors_hooks,
        ),
        Entry(
            "disable_saved_tensors_hooks", "torch._C._autograd._saved_tensors_hooks_disable", _probe_saved_tensors_hooks
        ),
        Entry(
            "enable_saved_tensors_hooks", "torch._C._autograd._saved_tensors_hooks_enable", _probe_saved_tensors_hooks
        ),
        Entry("pytree", "torch.utils._pytree", _probe_pytree),
        Entry("make_fx_real_inputs", "make_fx(..., _allow_non_fake_inputs=True)", _probe_make_fx_real_inputs),
        Entry("ensure_cuda_device_guard", "torch._C._ensureCUDADeviceGuardSet", _probe_ensure_cuda_device_guard),
        Entry(
            "value_dependent_errors",
            "torch._subclasses.fake_tensor.DataDependentOutputException, DynamicOutputShapeException",
            _probe_value_dependent_errors,
        ),
        Entry("default_store", "torch.distributed.distributed_c10d._get_default_store", _probe_default_store),
        Entry(
            "global_backward_hooks",
            "torch.nn.modules.module._global_backward_hooks, _global_backward_pre_hooks",
            _probe_global_backward_hooks,
        ),
        Entry("forward_grad_enabled", "torch._C._is_fwd_grad_enabled", _probe_forward_grad),
        Entry("forward_grad_set", "torch.autograd.forward_ad._set_fwd_grad_enabled", _probe_forward_grad),
        Entry("forward_ad_level", "torch.autograd.forward_ad._current_level", _probe_forward_ad_level),
        Entry("function_mode_stack", "torch.overrides._get_current_function_mode_stack", _probe_function_modes),
        Entry("function_mode_pushed", "torch.overrides._push_mode, _pop_mode", _probe_function_modes),
        Entry(
            "functorch_layers",
            "torch._C._functorch.peek_interpreter_stack, pop_dynamic_layer_stack, push_dynamic_layer_stack",
            _probe_functorch_layers,
        ),
        Entry(
            "functorch_layers_restored",
            "torch._C._functorch.pop_dynamic_layer_stack, push_dynamic_layer_stack",
            _probe_functorch_layers,
        ),
        Entry(
            "functorch_layers_cleared",
            "torch._C._functorch.peek_interpreter_stack, pop_dynamic_layer_stack, push_dynamic_layer_stack",
            _probe_functorch_layers,
        ),
        Entry(
            "innermost_vmap_level",
            "torch._C._functorch.peek_interpreter_stack, TransformType",
            _probe_innermost_vmap_level,
        ),
        Entry("jvp_nesting", "torch._functorch.eager_transforms.JVP_NESTING", _probe_jvp_nesting),
        Entry("jvp_nesting_raised", "torch._functorch.eager_transforms.JVP_NESTING", _probe_jvp_nesting),
        Entry("release_compiled", "torch._dynamo.reset_code", _probe_release_compiled),
        Entry("compile_graph", "torch._inductor.compile", _probe_compile_graph),
        Entry(
            "eager_rounding_options",
            "torch._inductor.config.emulate_precision_casts",
            _probe_eager_rounding_options,
        ),
        Entry("TorchDispatchMode", "torch.utils._python_dispatch.TorchDispatchMode", _probe_dispatch_mode),
        Entry("modes_disabled", "torch.utils._python_dispatch._disable_current_modes", _probe_modes_disabled),
        Entry("has_kernel_for_dispatch_key", "torch._C._dispatch_has_kernel_for_dispatch_key", _probe_has_kernel),
        Entry("op_schema", "OpOverload._schema", _probe_op_schema),
        Entry(
            "cpu_flash_attention",
            "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu, _backward",
            _probe_cpu_flash_attention,
        ),
        Entry(
            "cuda_attention_backwards",
            "torch.ops.aten._scaled_dot_product_{efficient,flash,cudnn}_attention_backward",
            _probe_cuda_attention_backwards,
        ),
        Entry(
            "cuda_attention_forwards",
            "torch.ops.aten._scaled_dot_product_{efficient,cudnn}_attention",
            _probe_cuda_attention_forwards,
        ),
        Entry("recurrent_ops", "torch.ops.aten.{gru,lstm,rnn_tanh,rnn_relu}.input", _probe_recurrent_ops),
        Entry(
            "vmap_value_reads",
            "torch.ops.aten.{is_nonzero,item,_local_scalar_dense} (vmap's rules replaced)",
            _probe_vmap_value_reads,
        ),
        Entry(
            "vmap_randomness",
            "torch._C._functorch.peek_interpreter_stack, CVmapInterpreterPtr.randomness",
            _probe_vmap_randomness,
        ),
        Entry(
            "batching_excluded",
            "torch._C._ExcludeDispatchKeyGuard, DispatchKeySet, DispatchKey.FuncTorchBatched",
            _probe_batching_excluded,
        ),
        Entry(
            "functorch_value",
            "torch._C._functorch.get_unwrapped, is_functorch_wrapped_tensor",
            _probe_functorch_value,
        ),
        Entry("version_counter", "Tensor._version", _probe_version_counter),
        Entry("is_fake_tensor", "torch._subclasses.fake_tensor.FakeTensor", _probe_is_fake_tensor),
        Entry(
            "set_version_counters", "torch._C._autograd._unsafe_set_version_counter", _probe_set_version_counters
        ),
        Entry("make_wrapper_subclass", "torch.Tensor._make_wrapper_subclass", _probe_wrapper_subclass),
        Entry("disabled_torch_function", "torch._C._disabled_torch_function_impl", _probe_wrapper_subclass),
    )
}


def _isolated(probe: Callable[[], None]) -> None:
    """Runs ``probe`` in a new thread, where torch's thread-local state is its default: no
    torch.func transform (grad, vmap, jvp, a pmap's level) is active, grad mode is on, no
    autocast, inference mode, torch function or dispatch mode. A probe checks what torch
    does, not what the caller's context makes of it: under ``torch.func.grad`` a probe
    run in the caller's thread saw its ops wrapped by the grad level and failed.

    The CPU generator's state is put back after it: a probe that makes a module or draws
    (``nn.GRU(2, 3)``, ``torch.randn``) must not move the caller's random stream, or a
    run resumed from a checkpoint, whose first map runs the probes, would draw other
    dropout masks than the run it resumes."""

    def untouched_stream() -> None:
        with torch.random.fork_rng(devices=[]):
            probe()

    _in_thread(untouched_stream)


#: How a probe fails when torch changed the private API behind it: the API is missing
#: (AttributeError, ImportError), takes other arguments (TypeError), or no longer does what
#: torchpmap expects (AssertionError, from the probe's checks; NotImplementedError).
_CHANGED = (AttributeError, ImportError, TypeError, AssertionError, NotImplementedError, TorchPrivateError)


def check(*names: str) -> None:
    """Verifies the entries ``names`` (all when none given) on the running torch.

    Raises :class:`TorchPrivateError` naming every entry whose private API is missing or
    no longer behaves as torchpmap expects. Run it on a new torch release before anything
    else (``tests/test_torch_private.py`` does, one test per entry). Each probe runs in a
    thread of its own (see :func:`_isolated`), so the caller's transforms and modes play
    no part; any failure is reported.
    """
    failures = []
    for name in names or tuple(ENTRIES):
        entry = ENTRIES[name]
        try:
            _isolated(entry.probe)
        except Exception as error:  # noqa: BLE001 - every failure is reported, by entry
            failures.append((name, f"{type(error).__name__}: {error}"))
    if len(failures) == 1:
        name, problem = failures[0]
        raise TorchPrivateError(name, f"failed its check: {problem}")
    if failures:
        listing = "; ".join(f"{name}: {problem}" for name, problem in failures)
        others = len(failures) - 1
        raise TorchPrivateError(failures[0][0], f"and {others} other entries failed their checks ({listing})")


def changed(name: str) -> TorchPrivateError | None:
    """Whether torch changed the private API behind entry ``name``, for a feature that
    can go on without it (and then warns and turns itself off).

    Runs the entry's probe in a thread of its own (see :func:`_isolated`). Returns the
    :class:`TorchPrivateError` that says how when the probe fails the way a changed API
    does (see :data:`_CHANGED`); None when it passes, and None too when it fails for
    another reason (a RuntimeError, no memory, no thread to run it in): that says
    nothing about torch, and must not turn a feature off for the rest of the process.
    """
    try:
        _isolated(ENTRIES[name].probe)
    except _CHANGED as error:
        return TorchPrivateError(name, f"failed its check: {type(error).__name__}: {error}")
    except Exception as error:  # noqa: BLE001 - inconclusive: the feature stays on
        from torchpmap._state.log import logger

        logger.info(
            "torch_private.%s: its probe could not run (%s: %s); the feature stays on",
            name,
            type(error).__name__,
            error,
        )
    return None
