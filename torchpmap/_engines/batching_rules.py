"""Batching rules that ``torch.func.vmap`` lacks, for the ops where its fallback costs most.

An op without a batching rule runs once per instance under vmap (torch warns "There is
a performance drop because we have not yet implemented the batching rule"). The worst
such op in real models is the CPU flash attention behind
``F.scaled_dot_product_attention`` (every transformer layer, forward and backward): a
rule here folds the instances into the op's own batch dim and calls it once.

The results are the fallback's, bit for bit: the kernel computes each (batch, head) on
its own, so folding the instances into the batch changes nothing but the number of
calls (``tests/test_batching_rules.py`` checks it against one call per instance, with
masks, nested vmaps, and gradients). A call with dropout keeps one call per instance,
as the fallback does, so its random numbers are drawn as they were.

:func:`install` registers the rules with ``torch.library`` at the ``FuncTorchBatched``
key, once, the first time the vectorized engine runs, unless torch has a rule of its own
for the op. Like vmap's own decompositions, they then hold for every vmap in the process.
Measured (``docs/performance.md``): forward and backward of 4 instances of an 8 x 4 x 32
x 16 attention, 1.40 ms with the fallback, 1.14 ms with the rule (2-core CPU).

On CUDA, vmap folds the instances of the attention kernels' forwards itself, but has no
rule for their backwards, which then ran once per instance; the rule here folds them the
same way (see :func:`_attention_backward`), so that a gradient taken inside the map
(``data_parallel_step``) makes one call, on the forward's own log-sum-exp and random
state. vmap's rules for the memory-efficient and cuDNN forwards are replaced (see
:func:`_attention_forward`): they skipped the log-sum-exp when the gradient is taken
outside the map (``.backward()`` on a pmap result), which failed on an H200 in the
memory-efficient backward and gave silently wrong gradients in bfloat16 (``docs/gpu.md``).

Two more kinds of rule send fewer functions to one instance at a time:

* **Recurrent networks** (``aten::gru/lstm/rnn_tanh/rnn_relu.input``, behind ``nn.GRU``,
  ``nn.LSTM``, ``nn.RNN``), for which vmap has no rule and no loop: with the weights
  shared by every instance, the instances fold into the op's batch (see
  :func:`_recurrent`); with weights per instance, one call per instance. Under
  ``torch.func.grad`` inside the map the op is decomposed before vmap sees it (see
  :mod:`torchpmap._engines.recurrent`).
* **Reading a value** (``bool(t)``, ``t.item()``): vmap refuses it for a batched tensor;
  the rule here reads it once when every instance of a torchpmap map holds the same
  value (see :func:`_value_read`), which is what each instance would read run alone.
  This one replaces torch's rule; under a plain ``torch.func.vmap`` the read is still
  refused, as torch refuses it.

One rule replaces vmap's where its single call left a wrong gradient for a
``.backward()`` through the map's results: **embeddings** (``aten::embedding``) with
``scale_grad_by_freq`` and a shared weight, or ``padding_idx`` and a weight per
instance, call once per instance (see :func:`_embedding`); every other embedding makes
vmap's one call.

And rules refuse what vmap gets silently wrong: ``resize_``, ``resize_as_``,
``as_strided_`` and ``set_`` of a batched tensor (see :func:`_install_metadata_writes`),
so that the map runs its instances one at a time.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any, Protocol, cast

import torch

from torchpmap._engines import rnn_weights
from torchpmap._state import context as _context
from torchpmap._state import torch_private as private


class AtenOp(Protocol):
    """An aten op overload (``torch.ops.aten.item.default``): callable, and named."""

    def __call__(self, *args: Any) -> Any: ...

    def name(self) -> str: ...


_library: torch.library.Library | None = None


def install() -> None:
    """Registers the rules, once. An op torch already batches keeps torch's rule; when
    the private pieces the rules need are missing or changed, nothing is registered (vmap
    then loops, as without torchpmap) and a ``TorchPrivateWarning`` says so. The check
    runs apart from the caller (the first vectorized call may run under
    ``torch.func.grad``, whose level a check in the caller's thread would see), and a
    check that cannot run for another reason (memory, say) turns nothing off."""
    global _library
    if _library is not None:
        return
    _library = torch.library.Library("aten", "IMPL")
    problem = private.changed("batching_excluded")  # probed in a thread of its own: never under the caller's transforms
    if problem is not None:
        warnings.warn(f"{problem} torchpmap's batching rules are off.", private.TorchPrivateWarning, stacklevel=2)
        return
    _install_value_reads(_library)
    _install_metadata_writes(_library)
    _install_recurrent(_library)
    _install_embedding(_library)
    flash = private.cpu_flash_attention()
    if flash is None:
        return
    for op, rule in zip(flash, (_flash_forward, _flash_backward)):
        if not private.has_kernel_for_dispatch_key(op.name(), "FuncTorchBatched"):
            _library.impl(op, rule, "FuncTorchBatched")
    for op in private.cuda_attention_backwards():
        if not private.has_kernel_for_dispatch_key(op.name(), "FuncTorchBatched"):
            _library.impl(op, _attention_backward(op), "FuncTorchBatched")
    if private.changed("cuda_attention_forwards") is not None:  # keep torch's rules (and their defect)
        return
    with warnings.catch_warnings():  # torch's own rules for these forwards are replaced on purpose (torch warns)
        warnings.simplefilter("ignore")
        for op in private.cuda_attention_forwards():
            _library.impl(op, _attention_forward(op), "FuncTorchBatched")


def _flash_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, ...]:
    op = cast("tuple[Any, Any]", private.cpu_flash_attention())[0]  # registered only where it exists

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> tuple:
        return op(q, k, v, dropout_p, is_causal, attn_mask=mask, scale=scale)

    return _folded(call, [query, key, value], attn_mask, per_instance=dropout_p != 0.0)


def _flash_backward(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    logsumexp: torch.Tensor,
    dropout_p: float,
    is_causal: bool,
    *,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, ...]:
    op = cast("tuple[Any, Any]", private.cpu_flash_attention())[1]  # registered only where it exists

    def call(*tensors: torch.Tensor | None) -> tuple:
        *inputs, mask = tensors
        return op(*inputs, dropout_p, is_causal, attn_mask=mask, scale=scale)

    return _folded(call, [grad_out, query, key, value, out, logsumexp], attn_mask, per_instance=dropout_p != 0.0)


def _attention_forward(op: Callable[..., tuple]) -> Callable[..., tuple]:
    """The rule for the forward of a CUDA attention kernel that computes its log-sum-exp
    only when asked (memory-efficient, cuDNN). It replaces vmap's own rule, which folds the
    instances into the batch the same way but passes on the ``compute_log_sumexp`` that
    ``F.scaled_dot_product_attention`` chose from the batched wrappers: False when the
    gradient is taken outside the map, whose backward then has no log-sum-exp (an error in
    the memory-efficient kernel, silently wrong gradients in bfloat16, on an H200 with torch
    2.11). Here the log-sum-exp is computed whenever grad mode is on and an unwrapped input
    requires grad, as plain PyTorch decides on the whole batch.

    Dropout follows vmap's rule: refused under ``randomness="error"``, and under "same"
    with a batched input; under "different" the instances fold into one call, which draws
    a mask per (instance, batch) row."""
    names = [a.name for a in private.op_schema(op).arguments]

    def rule(*args: object, **kwargs: object) -> tuple:
        level, values, batched, size = _unwrapped(names, args, kwargs)
        if torch.is_grad_enabled() and any(isinstance(v, torch.Tensor) and v.requires_grad for v in values.values()):
            values["compute_log_sumexp"] = True
        if batched and float(values.get("dropout_p") or 0.0) != 0.0:
            _check_randomness(op)
        with private.batching_excluded():
            if not batched:  # nothing batched at this level: the op as it is, for the levels below
                return op(**values)
            folded = dict(values)
            for k in ("query", "key", "value"):
                folded[k] = _instances_first(values[k], batched.get(k), size).flatten(0, 1)
            if isinstance(values.get("attn_bias"), torch.Tensor):
                folded["attn_bias"] = _folded_bias(values["attn_bias"], batched.get("attn_bias"), size, folded)
            outs = op(**folded)
        rows = folded["query"].shape[0]
        return tuple(
            private.add_batch_dim(o.unflatten(0, (size, -1)), 0, level)
            if isinstance(o, torch.Tensor) and o.dim() > 0 and o.shape[0] == rows
            else o
            for o in outs
        )

    return rule


def _unwrapped(names: Sequence[str], args: tuple, kwargs: dict) -> tuple[int, dict, dict[str, int], int]:
    """A rule's arguments by schema name, unwrapped at the innermost vmap level: (the
    level, the physical values, the batched ones' batch dims, the batch size or 0)."""
    level = private.current_vmap_level()
    values: dict = {}
    batched: dict[str, int] = {}
    for name, value in dict(zip(names, args), **kwargs).items():
        dim = None
        if isinstance(value, torch.Tensor):
            value, dim = private.unwrap_batched(value, level)
        values[name] = value
        if dim is not None and dim >= 0:
            batched[name] = dim
    size = next((values[k].shape[d] for k, d in batched.items()), 0)
    return level, values, batched, size


def _check_randomness(op: object) -> None:
    """vmap's check of a random op with batched inputs (its message), for rules that fold
    a random kernel."""
    randomness = private.vmap_randomness()
    if randomness == "error":
        raise RuntimeError(
            f"vmap: called random operation {op} (attention with dropout_p > 0) while in randomness error mode. "
            "Pass randomness='different' (or 'same') to vmap or pmap, or set dropout_p=0."
        )
    if randomness == "same":
        raise RuntimeError(
            f"vmap: randomness='same' with a batched input is not supported for {op} (attention with "
            "dropout_p > 0), as in torch's own rule: use randomness='different', or pass the inputs unbatched."
        )


def _kernel_layout(value: torch.Tensor) -> torch.Tensor:
    """A folded argument of an attention backward, its layout kept where folding was a
    view: the kernels read ``out`` in the layout their forward wrote it (the
    memory-efficient bfloat16 backward gave wrong query and key gradients on an H200 when
    ``out`` was made contiguous), and need only the last dim contiguous."""
    return value if value.stride(-1) == 1 else value.contiguous()


def _folded_bias(bias: torch.Tensor, dim: int | None, size: int, folded: dict) -> torch.Tensor:
    """An attention bias with the instances folded into the batch as ``folded["query"]``
    has them, laid out as the memory-efficient kernel needs (:func:`_aligned_bias`)."""
    batch = folded["query"].shape[0] // size
    return _aligned_bias(_mask_instances_first(bias, dim, size, batch).flatten(0, 1))


def _aligned_bias(bias: torch.Tensor) -> torch.Tensor:
    """An attention bias as the memory-efficient kernel needs it: the last dim contiguous
    and every other stride a multiple of 16 elements (``F.scaled_dot_product_attention``
    pads the bias the same way before calling the kernel). Folding instances into the
    batch can copy the bias into a layout without that padding."""
    if bias.stride(-1) == 1 and all(s % 16 == 0 for s in bias.stride()[:-1]):
        return bias
    length = bias.shape[-1]
    padded = bias.new_empty(*bias.shape[:-1], length + (-length) % 16)[..., :length]
    padded.copy_(bias)
    return padded


def _attention_backward(op: Callable[..., tuple]) -> Callable[..., tuple]:
    """The rule for the backward of a CUDA attention kernel (memory-efficient, flash,
    cuDNN): the instances fold into the batch, as vmap's own rule folds them in the
    forward, so the backward sees the log-sum-exp and the random state of that one call.

    The arguments that hold the batch first (``query``, ``out``, ``logsumexp``, ...) fold;
    an ``attn_bias`` folds as a mask; anything else (the random state, the sequence
    offsets) must be the same for every instance. Otherwise (another argument batched, or
    the bias' own gradient asked for) the instances run one at a time, each with its own
    slices."""
    names = [a.name for a in private.op_schema(op).arguments]

    def rule(*args: object, **kwargs: object) -> tuple:
        level, values, batched, size = _unwrapped(names, args, kwargs)
        if not batched:  # nothing batched at this level: the op as it is, for the levels below
            with private.batching_excluded():
                return op(**values)
        mask = values.get("attn_bias")
        mask_grad = values.get("grad_input_mask")
        bias_grad = bool(mask_grad[3]) if isinstance(mask_grad, (list, tuple)) else False
        foldable = set(batched) <= private.CUDA_ATTENTION_BATCH_FIRST | {"attn_bias"} and not bias_grad
        with private.batching_excluded():
            if not foldable:
                outs = _one_at_a_time(op, values, batched, size)
            else:
                folded = dict(values)
                for k in private.CUDA_ATTENTION_BATCH_FIRST & set(values):
                    if values[k] is not None:
                        folded[k] = _kernel_layout(_instances_first(values[k], batched.get(k), size).flatten(0, 1))
                if isinstance(mask, torch.Tensor):
                    folded["attn_bias"] = _folded_bias(mask, batched.get("attn_bias"), size, folded)
                outs = [o if o is None else o.unflatten(0, (size, -1)) for o in op(**folded)]
        return tuple(o if o is None else private.add_batch_dim(o, 0, level) for o in outs)

    return rule


def _one_at_a_time(op: Callable[..., tuple], values: dict, batched: dict, size: int) -> list:
    """``op`` once per instance (slices in the layout they have), the results stacked instances first."""
    results = []
    for i in range(size):
        one = {k: (_kernel_layout(v.select(batched[k], i)) if k in batched else v) for k, v in values.items()}
        results.append(op(**one))
    return [None if parts[0] is None else torch.stack(parts) for parts in zip(*results)]


def _folded(
    call: Callable[..., tuple], tensors: Sequence[torch.Tensor], mask: torch.Tensor | None, per_instance: bool
) -> tuple[torch.Tensor, ...]:
    """``call(*tensors, mask)`` for every instance of the innermost vmap level at once.

    Each tensor has the op's batch as its first logical dim; the instances fold into it
    (instance-major), and the outputs, batch first too, unfold again. ``per_instance``
    calls once per instance instead (the fallback's behaviour).
    """
    level = private.current_vmap_level()
    unwrapped = [private.unwrap_batched(t, level) for t in tensors]
    masked = private.unwrap_batched(mask, level) if mask is not None else (None, None)
    dims = [d for _, d in (*unwrapped, masked) if d is not None and d >= 0]
    if not dims:  # nothing batched at this level: the op as it is, for the levels below
        with private.batching_excluded():
            return call(*(v for v, _ in unwrapped), masked[0])
    size = next(v.shape[d] for v, d in (*unwrapped, masked) if d is not None and d >= 0)
    stacked = [_instances_first(v, d, size) for v, d in unwrapped]
    batch = stacked[0].shape[1]
    mask_stacked = None
    if masked[0] is not None:
        mask_stacked = _mask_instances_first(masked[0], masked[1], size, batch)
    with private.batching_excluded():
        if per_instance:
            results = [
                call(*(t[i] for t in stacked), None if mask_stacked is None else mask_stacked[i]) for i in range(size)
            ]
            outs = [torch.stack(parts) for parts in zip(*results)]
        else:
            flat = [t.flatten(0, 1) for t in stacked]
            folded = call(*flat, None if mask_stacked is None else mask_stacked.flatten(0, 1))
            outs = [o.unflatten(0, (size, -1)) for o in folded]
    return tuple(private.add_batch_dim(o, 0, level) for o in outs)


def _instances_first(value: torch.Tensor, dim: int | None, size: int) -> torch.Tensor:
    """``value`` with the instances as dim 0 (expanded when it is the same for all)."""
    if dim is None or dim < 0:
        return value.unsqueeze(0).expand(size, *value.shape)
    return value.movedim(dim, 0)


def _mask_instances_first(mask: torch.Tensor, dim: int | None, size: int, batch: int) -> torch.Tensor:
    """An attention mask (broadcastable to batch x heads x L x S) as instances x batch x
    (heads or 1) x L x S, so that it folds like the query."""
    stacked = _instances_first(mask, dim, size)
    logical = stacked.shape[1:]
    four = stacked.reshape(size, *([1] * (4 - len(logical))), *logical)
    return four.expand(size, batch, *four.shape[2:])


def _install_value_reads(library: torch.library.Library) -> None:
    """Replaces vmap's rules for ``bool(t)``, ``t.item()``, ``int(t)`` and ``float(t)``
    with :func:`_value_read` (unless torch changed the ops: then vmap keeps refusing them,
    and a function that reads a batched value runs one instance at a time, as before)."""
    problem = private.changed("vmap_value_reads")
    if problem is not None:
        message = f"{problem} bool()/.item() of a batched tensor stays refused."
        warnings.warn(message, private.TorchPrivateWarning, stacklevel=3)
        return
    with warnings.catch_warnings():  # torch's own (refusing) rules for these ops are replaced on purpose (torch warns)
        warnings.simplefilter("ignore")
        for op in private.vmap_value_reads():
            library.impl(op, _value_read(op), "FuncTorchBatched")


def _value_read(op: AtenOp) -> Callable[[torch.Tensor], object]:
    """The rule for an op that reads a tensor's value into Python (``bool(t)``,
    ``t.item()``): the value, read once, when every instance of this vmap level holds the
    same one (bit for bit); vmap's own refusal otherwise.

    Running the instances one at a time (torchpmap's fallback), each instance would read
    that same value and take the same Python branch, so reading it once and going on
    vectorized computes what the fallback computes. Hugging Face models check
    ``padding_mask.all()`` this way before building an attention mask: with padding in
    every shard (or in none), every instance agrees. Where the instances differ, the
    refusal keeps vmap's words ("It looks like you're ..."), and torchpmap falls back to
    one instance at a time, as before.

    Only torchpmap's own maps read a value this way (see :func:`torchpmap_levels`): under a
    ``torch.func.vmap`` of the user's, inside a map or not, the read is refused as vmap
    refuses it.

    Inside a trace (``pmap(jit=True)`` traces with fake tensors), the comparison has no
    value to read: it raises the trace's data-dependent error, and the call runs eagerly
    (a value is never baked into a compiled program). A value batched at an outer level
    too is checked there in turn (the comparison's own ``bool`` reaches that level's rule).
    """

    def rule(tensor: torch.Tensor) -> object:
        level = private.current_vmap_level()
        value, dim = private.unwrap_batched(tensor, level)
        with private.batching_excluded():
            if dim is None or dim < 0:  # the same for every instance of this level by construction
                return op(value)
            own = level in torchpmap_levels()
            if own and same_bits(value.movedim(dim, 0)):
                _reads[0] += 1
                return op(value.select(dim, 0))
        why = "whose value differs between the instances of the map" if own else "batched by a torch.func.vmap"
        raise RuntimeError(
            "vmap: It looks like you're either (1) calling .item() on a Tensor or (2) attempting to use a Tensor in "
            f"some data-dependent control flow ({op.name()} of a tensor {why}). Rewrite the branch with tensor ops "
            "(torch.where), or let the instances run one at a time."
        )

    return rule


#: In-place changes of a tensor's metadata (its size, strides or storage), which vmap
#: gets silently wrong for a batched tensor (see :func:`_install_metadata_writes`).
_METADATA_WRITES = ("resize_", "resize_as_", "as_strided_", "set_")


def _install_metadata_writes(library: torch.library.Library) -> None:
    """Rules for ``resize_``, ``resize_as_``, ``as_strided_`` and every ``set_``, which
    vmap gets silently wrong for a batched tensor. Its rule for ``resize_`` resizes the
    tensor that holds every instance, so instance ``i`` got elements of instance ``i - 1``
    (``x.clone().resize_(2)`` of rows ``[0, 1, 2]``, ``[3, 4, 5]`` gave ``[0, 1]``,
    ``[2, 3]``, where each row run alone keeps its own first two, ``[3, 4]``); the others
    have no rule, and vmap's fallback applies them to per-instance slices it then drops,
    so the tensor kept its shape and values. A batched tensor among their arguments is
    now refused as an op without a rule, so the map runs its instances one at a time
    (each as run alone) with a ``VectorizationFallbackWarning``; tensors the same for
    every instance are changed as outside the map."""
    with warnings.catch_warnings():  # torch's own (wrong) rule for resize_ is replaced on purpose (torch warns)
        warnings.simplefilter("ignore")
        for name in _METADATA_WRITES:
            packet = getattr(torch.ops.aten, name)
            for overload in packet.overloads():
                op = getattr(packet, overload)
                library.impl(op, _metadata_write(op), "FuncTorchBatched")


def _metadata_write(op: AtenOp) -> Callable[..., torch.Tensor]:
    def rule(*args: Any, **kwargs: Any) -> torch.Tensor:
        level = private.current_vmap_level()
        unwrapped = []
        for arg in args:
            if isinstance(arg, torch.Tensor):
                value, dim = private.unwrap_batched(arg, level)
                if dim is not None and dim >= 0:
                    raise RuntimeError(
                        f"Batching rule not implemented for {op.name()} of a tensor that differs between the "
                        "instances (vmap's own changes the tensor holding them all, or a slice of it it drops)."
                    )
                arg = value
            unwrapped.append(arg)
        with private.batching_excluded():
            op(*unwrapped, **kwargs)
        return args[0]

    return rule


def torchpmap_levels() -> list[int]:
    """The vmap levels that torchpmap's maps opened (innermost last), in this thread and,
    for a device thread, in the threads that started it (their levels enclose it too)."""
    return _context.own_vmap_levels()


#: How many values of a batched tensor the rule of :func:`_value_read` has read, ever, in
#: this process. The rule sees the instances of its own vmap only: where an axis is split
#: over threads (devices, mesh positions), the other threads' instances may hold another
#: value, so a call whose threads read one compares what they return as the same.
_reads = [0]


def value_reads() -> int:
    """The count above (compare two readings: a change means a read in between)."""
    return _reads[0]


def same_bits(stacked: torch.Tensor) -> bool:
    """Whether every slice of ``stacked`` along dim 0 equals the first, bit for bit (0.0
    and -0.0 differ, a NaN equals the same NaN): what Python would read from each."""
    rows = stacked.reshape(stacked.shape[0], -1)
    if rows.dtype.is_floating_point or rows.dtype.is_complex:
        rows = rows.contiguous().view(torch.uint8)
    return bool((rows == rows[:1]).all())


def _install_embedding(library: torch.library.Library) -> None:
    """Replaces vmap's rule for ``aten::embedding`` with :func:`_embedding`."""
    with warnings.catch_warnings():  # torch's own rule is replaced on purpose (torch warns)
        warnings.simplefilter("ignore")
        library.impl(torch.ops.aten.embedding.default, _embedding, "FuncTorchBatched")


def _embedding(
    weight: torch.Tensor, indices: torch.Tensor, padding_idx: int = -1, scale_grad_by_freq: bool = False,
    sparse: bool = False,
) -> torch.Tensor:
    """The rule for ``aten::embedding`` (``nn.Embedding``, ``F.embedding``): vmap's own,
    but where its one call for all instances gave a ``.backward()`` through the map's
    results another gradient than each instance's call. The forward is a gather either
    way; what differs is the autograd node that call leaves for the levels below:

    * a weight shared by every instance, ``scale_grad_by_freq=True``: vmap's call looked
      the indices of every instance up at once, so the backward divided each row's
      gradient by its count over all instances, not over the instance's own batch (a
      row's gradient 6.0 off with 4 instances on one device, exact on 4 devices, which
      run one instance each). It now calls once per instance.
    * a weight per instance and per-instance indices, ``padding_idx`` set: vmap's call
      stacked the weights into one table and shifted each instance's indices by its
      offset, but kept one ``padding_idx``, so only the first instance's padding row got
      no gradient (3.0 off). It now calls once per instance.

    Otherwise one call, as vmap's rule makes it (a shared weight: the batched indices as
    they are; a weight per instance: the instances in the embedding dim for shared
    indices, or the weights stacked into one table with offset indices), bit for bit
    its results. Under ``torch.func.grad`` inside the map the gradient never sees these
    calls (vmap's rule for the backward counts per instance).
    """
    op = torch.ops.aten.embedding.default
    level = private.current_vmap_level()
    table, table_dim = private.unwrap_batched(weight, level)
    index, index_dim = private.unwrap_batched(indices, level)
    per_table = table_dim is not None and table_dim >= 0
    per_index = index_dim is not None and index_dim >= 0
    with private.batching_excluded():
        if not per_table and not per_index:  # nothing batched at this level: the op, for the levels below
            return op(table, index, padding_idx, scale_grad_by_freq, sparse)
        if not per_table and not scale_grad_by_freq:
            return private.add_batch_dim(op(table, index, padding_idx, False, sparse), index_dim, level)
        if per_table and not per_index:  # the instances side by side in the embedding dim
            size = table.shape[table_dim]
            out = op(table.movedim(table_dim, 1).flatten(1, 2), index, padding_idx, scale_grad_by_freq, sparse)
            return private.add_batch_dim(out.unflatten(-1, (size, -1)), out.dim() - 1, level)
        ids = index.movedim(index_dim, 0)
        size = ids.shape[0]
        tables = _instances_first(table, table_dim, size)
        if per_table and padding_idx < 0:  # one table, each instance's indices offset to its own rows
            rows = tables.shape[1]
            offsets = torch.arange(size, device=ids.device, dtype=ids.dtype).mul_(rows)
            shifted = ids + offsets.view(size, *([1] * (ids.dim() - 1)))
            return private.add_batch_dim(op(tables.flatten(0, 1), shifted, -1, scale_grad_by_freq, sparse), 0, level)
        out = torch.stack([op(tables[i], ids[i], padding_idx, scale_grad_by_freq, sparse) for i in range(size)])
        return private.add_batch_dim(out, 0, level)


def _install_recurrent(library: torch.library.Library) -> None:
    """Registers :func:`_recurrent` for ``aten::gru/lstm/rnn_tanh/rnn_relu.input`` (unless
    torch has a rule of its own, or changed the ops: vmap then refuses them, and the
    function runs one instance at a time, as before)."""
    if private.changed("recurrent_ops") is not None:
        return
    rnn_weights.install()  # RNN modules on CUDA whose weights cuDNN cannot take (see there)
    for op in private.recurrent_ops():
        if not private.has_kernel_for_dispatch_key(op.name(), "FuncTorchBatched"):
            library.impl(op, _recurrent(op), "FuncTorchBatched")


def _recurrent(op: AtenOp) -> Callable[..., tuple]:
    """The rule for a recurrent network's op (``nn.GRU``, ``nn.LSTM``, ``nn.RNN``):
    ``op(input, hx, params, has_biases, num_layers, dropout, train, bidirectional,
    batch_first)``, whose ``input`` is batch x time x features (time first without
    ``batch_first``) and whose ``hx`` (a list of two for the LSTM) is layers x batch x
    hidden.

    Where the weights are the same for every instance (a map with ``in_axes=None`` for
    the parameters: data parallelism), the instances fold into the op's batch, one call
    instead of one per instance: each row of the batch is computed on its own, with the
    same weights, so the rows of an instance are what its own call gives (to rounding: a
    product over more rows may block its sums differently). The gradients flow through
    that call to the levels below (a ``.backward()`` on the map's result): a shared weight
    gets the sum over all rows, as it gets the sum over the instances without the rule.
    Where the weights differ per instance, folding is not possible: the op runs once per
    instance, on its slices, and the results are stacked (what vmap's loop would do, had it
    one for these ops). With dropout between the layers (random draws) the rule refuses,
    in vmap's words ("Batching rule not implemented"), and the function runs one instance
    at a time, drawing as it did before the rule.

    Under ``torch.func.grad`` *inside* the map the op never reaches this rule: ``grad``
    decomposes it into its cells first, whose ops vmap batches itself (see
    :mod:`torchpmap._engines.recurrent` for what that path needs).
    """
    lstm = "lstm" in op.name()

    def rule(
        input: torch.Tensor, hx: torch.Tensor | list[torch.Tensor], params: list[torch.Tensor], has_biases: bool,
        num_layers: int, dropout: float, train: bool, bidirectional: bool, batch_first: bool,
    ) -> tuple[torch.Tensor, ...]:
        level = private.current_vmap_level()
        states = list(hx) if lstm else [hx]
        x, x_dim = private.unwrap_batched(input, level)
        unwrapped_states = [private.unwrap_batched(h, level) for h in states]
        weights = [private.unwrap_batched(p, level) for p in params]
        dims = [d for _, d in ((x, x_dim), *unwrapped_states, *weights) if d is not None and d >= 0]

        def call(x: torch.Tensor, states: list[torch.Tensor], weights: list[torch.Tensor]) -> tuple:
            h = states if lstm else states[0]
            return op(x, h, weights, has_biases, num_layers, dropout, train, bidirectional, batch_first)

        if not dims:  # nothing batched at this level: the op as it is, for the levels below
            with private.batching_excluded():
                return call(x, [s for s, _ in unwrapped_states], [w for w, _ in weights])
        size = next(v.shape[d] for v, d in ((x, x_dim), *unwrapped_states, *weights) if d is not None and d >= 0)
        xs = _instances_first(x, x_dim, size)
        hs = [_instances_first(s, d, size) for s, d in unwrapped_states]
        if dropout > 0.0 and train and num_layers > 1:  # random draws: the old path (one instance at a time)
            raise RuntimeError(
                f"Batching rule not implemented for {op.name()} with dropout between the layers (torchpmap's rule "
                "leaves random draws to running the instances one at a time)."
            )
        shared = all(d is None or d < 0 for _, d in weights)
        with private.batching_excluded():
            if shared and xs.dim() == 4:
                outs = _recurrent_folded(call, xs, hs, [w for w, _ in weights], batch_first)
            else:
                ws = [_instances_first(w, d, size) for w, d in weights]
                results = [call(xs[i], [h[i] for h in hs], [w[i] for w in ws]) for i in range(size)]
                outs = [(torch.stack(parts), 0) for parts in zip(*results)]
        return tuple(private.add_batch_dim(o, d, level) for o, d in outs)

    return rule


def _recurrent_folded(
    call: Callable[..., tuple], xs: torch.Tensor, hs: list[torch.Tensor], weights: list[torch.Tensor], batch_first: bool
) -> list[tuple[torch.Tensor, int]]:
    """One call of a recurrent op for all instances: ``xs`` is instances x (batch x time
    or time x batch) x features, each of ``hs`` instances x layers x batch x hidden. The
    instances fold into the batch next to it (instance-major), and the results unfold
    again; returns each result with the dim its instances are on."""
    size = xs.shape[0]
    x = xs.flatten(0, 1) if batch_first else xs.movedim(0, 1).flatten(1, 2)
    states = [h.movedim(0, 1).flatten(1, 2) for h in hs]
    out, *final = call(x, states, weights)
    out_dim = 0 if batch_first else 1
    return [(out.unflatten(out_dim, (size, -1)), out_dim), *((h.unflatten(1, (size, -1)), 1) for h in final)]
