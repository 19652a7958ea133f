"""The vectorized engine: all instances of a mapped axis in one ``torch.func.vmap``.

The axis token (``arange(size)``) of a named axis is passed as an extra vmap input so
that collectives can find this axis' vmap level (see :mod:`torchpmap._collectives.binding`).
``chunk_size`` is never used: a chunked vmap would show each collective only its chunk.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch

from torchpmap._engines import batching_fixes, batching_rules, instance_autograd, written_copies
from torchpmap._engines.mapped_call import MappedCall, versions_of, views_recorded
from torchpmap._engines.random_per_instance import InstanceStreams
from torchpmap._engines.random_per_thread import Seed, call_seed
from torchpmap._placement import devices as _devices
from torchpmap._placement.sharded import ShardedTensor, as_local, select_of_shards, unsqueeze_of_shards
from torchpmap._state import axis_env as _axis_env
from torchpmap._state import context as _context
from torchpmap._state import torch_private as private
from torchpmap._state.faults import OutputVaries


def place(value: Any, device: torch.device | None) -> Any:
    if type(value) is torch.Tensor and (device is None or value.device == device):
        return value  # the common case: already there (comparing is cheaper than a no-op .to)
    value = as_local(value, device)
    if device is None or not isinstance(value, torch.Tensor):
        return value
    return value.to(device, non_blocking=True)


def _own_view(t: Any, device: torch.device | None) -> Any:
    """``t`` placed on ``device``, as a view of its own (see :func:`run`)."""
    with written_copies.trackable():
        t = place(t, device)
        return t.view_as(t) if type(t) is torch.Tensor else t


def run(
    call: MappedCall,
    *,
    offset: int = 0,
    axis_size: int | None = None,
    exchange: _axis_env.Exchange | None = None,
    seed: Seed = None,
    on_frame: Callable[[_axis_env.AxisFrame], None] | None = None,
) -> list[torch.Tensor]:
    """Runs all ``call.size`` instances vectorized on one device.

    ``offset``, ``axis_size`` and ``exchange`` let a multi-device engine run one slice of
    a larger axis: this slice holds instances ``offset .. offset + call.size - 1`` of an
    axis of ``axis_size`` instances, and ``exchange`` connects it to the other slices.
    ``seed``: the call seed of ``randomness="per_instance"`` (drawn here when None).
    ``on_frame`` sees the axis frame (its token batched at the vmap level of the axis)
    before the function runs, inside that level.
    """
    device = call.devices[0].torch_device if call.devices else None
    # each mapped argument goes in as a view of the caller's tensor, as a slice does on
    # several devices: an in-place change of its metadata (t_, unsqueeze_, resize_) then
    # changes the instances' view, not the caller's tensor (values written still reach it)
    mapped: list[torch.Tensor] = []
    moved: list[int] = []
    with views_recorded(call.mapped):
        for t in call.mapped:  # a plain loop: this runs on every call
            if type(t) is torch.Tensor and (device is None or t.device == device):
                mapped.append(t.view_as(t))  # the common case: one call per argument
            else:  # placed here (moved, gathered): a copy, whose writes are written back below
                moved.append(len(mapped))
                mapped.append(_own_view(t, device))
    copied = written_copies.copies(call.mapped, mapped, moved) if moved else None
    fallback = call.vmap_fallback
    first = fallback is not None and not fallback.ran.once  # the code's first vectorized run: does it write?
    versions_before = versions_of(mapped) if first else None
    broadcast = [place(v, device) for v in call.broadcast] if call.broadcast else []
    here = device if device is not None else (mapped[0].device if mapped else None)
    # the axis token is an extra vmap input (see torchpmap._collectives.binding); an unnamed axis needs
    # none, unless each instance draws from its own random stream (it tells which instance)
    per_instance = call.randomness == "per_instance"
    if per_instance and seed is None:
        seed = call_seed(call.randomness)
    token = None if call.axis_name is None and not per_instance else _token(call.size, here)

    def one_instance(*slices: torch.Tensor) -> tuple[torch.Tensor, ...]:
        try:
            if token is None:  # the hot path: an unnamed axis, no per-instance streams
                outputs = tuple(call.body(slices, broadcast))
                if call.must_be_unmapped is not None:  # vmap's out_axes=None
                    _check_unmapped(outputs, call.must_be_unmapped())
                return outputs
            token_slice, slices = slices[0], slices[1:]
            if per_instance:
                with InstanceStreams(cast(int, seed), offset, call.size, token_slice, here):  # drawn above
                    return _on_axis(token_slice, slices)
            return _on_axis(token_slice, slices)
        except Exception as failure:
            # which instance raised cannot be told here, nor, even for a vmap of one (a
            # device's one instance under bitwise_placement), whether vmap is what failed:
            # dispatch.run runs the instances alone to tell
            mark_vectorized(failure)
            raise

    def _on_axis(token_slice: torch.Tensor, slices: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        if call.axis_name is None:
            return _checked(call.body(slices, broadcast))
        frame = _axis_env.AxisFrame(
            call.axis_name, axis_size or call.size, token_slice, call.size, offset, exchange, vma=call.vma
        )
        if on_frame is not None:
            on_frame(frame)
        with _axis_env.bound(frame):
            return _checked(call.body(slices, broadcast))

    def _checked(outputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        outputs = tuple(outputs)
        if call.must_be_unmapped is not None:  # vmap's out_axes=None
            _check_unmapped(outputs, call.must_be_unmapped())
        return outputs

    # A pmap nested in this map runs vectorized here: its inputs are batched at this
    # thread's vmap level and cannot travel to other device threads.
    pinned = None
    if _context.default_devices.get() is None:  # see _devices.current_default
        pinned = _context.default_devices.set(
            tuple(call.devices[:1]) if call.devices else _devices.at(here or torch.device("cpu"))
        )
    inputs, in_dims = (mapped, call.in_dims) if token is None else ((token, *mapped), (0, *call.in_dims))
    # autograd as an instance sees it: module backward hooks, metadata reads (see instance_autograd)
    record = call.vmap_fallback.autograd if call.vmap_fallback is not None else None
    succeeded = False
    try:
        # the hot path: a function watched once, which called no module and read no metadata
        quiet = record is not None and record.watched and not record.modules and not record.reads_metadata
        watch = None if quiet else instance_autograd.enter(record)
        try:
            outputs = _vmap_flat(one_instance, call.size, inputs, in_dims, call.randomness)
            succeeded = True
        finally:
            if watch is not None:
                instance_autograd.leave(watch, record, succeeded)
    finally:
        if pinned is not None:
            _context.default_devices.reset(pinned)
    if copied:
        written_copies.write_back(call.mapped, mapped, copied)
    if fallback is not None and first:  # the code has run vectorized (see rerun_guard)
        fallback.ran.once = True
        fallback.ran.writes = fallback.ran.writes or versions_of(mapped) != versions_before
    return outputs


def mark_vectorized(failure: BaseException) -> None:
    """Marks ``failure`` as raised while several instances ran as one vectorized program."""
    try:
        failure._torchpmap_vectorized = True  # type: ignore[attr-defined]
    except AttributeError:  # an exception type that takes no attributes
        pass


def raised_vectorized(failure: BaseException) -> bool:
    """Whether ``failure`` was raised while several instances ran vectorized, by the
    function (not by torchpmap's own checks, which name what failed)."""
    return getattr(failure, "_torchpmap_vectorized", False) and not getattr(failure, "_torchpmap_own", False)


def run_one(
    call: MappedCall,
    *,
    offset: int,
    axis_size: int,
    exchange: _axis_env.Exchange,
    seed: Seed = None,
    on_frame: Callable[[_axis_env.AxisFrame], None] | None = None,
    keep_sharded: bool = False,
) -> list[torch.Tensor]:
    """Runs the single instance of ``call`` (one of a larger axis) directly, without vmap.

    A device that holds one instance of a split axis has nothing to vectorize: its
    function runs on the instance's own tensors at plain PyTorch speed, and every op works
    (no batching rule needed). Collectives apply directly through ``exchange``; the same
    math runs on the gathered values as in :func:`run`.

    ``on_frame`` sees the instance's axis frame before the function runs (the instance
    engine records it for maps nested in this instance). With ``keep_sharded``, an output
    that is a ShardedTensor (a nested mesh map's result) stays where it was computed
    instead of being gathered onto this device, and so does such an input.
    """
    device = call.devices[0].torch_device if call.devices else None
    with torch.enable_grad():  # as vmap's batch dims: see multi_device.device_thread
        slices = [
            select_of_shards(t, dim, 0) if keep_sharded and isinstance(t, ShardedTensor)
            else place(t, device).select(dim, 0)
            for t, dim in zip(call.mapped, call.in_dims)
        ]
        broadcast = [place(v, device) for v in call.broadcast]
    here = device if device is not None else torch.device("cpu")
    token = torch.zeros((), dtype=torch.long, device=here)
    frame = _axis_env.AxisFrame(call.axis_name, axis_size, token, 1, offset, exchange, vectorized=False, vma=call.vma)
    if on_frame is not None:
        on_frame(frame)
    per_instance = call.randomness == "per_instance"
    if per_instance and seed is None:
        seed = call_seed(call.randomness)
    previous = _devices.current_default()
    if previous is None:
        _devices.set_current_default(tuple(call.devices[:1]) if call.devices else _devices.at(here))
    try:
        with _axis_env.bound(frame) if call.axis_name is not None else contextlib.nullcontext():
            with InstanceStreams(cast(int, seed), offset, 1, None, here) if per_instance else contextlib.nullcontext():
                outputs = call.body(slices, broadcast)
    finally:
        _devices.set_current_default(previous)
    # a result that is (a view of) an argument is copied by the caller: see torchpmap._frontend.output_copies;
    # with grad on, as vmap's batch dims are: a result the function computed with grad on keeps its graph
    with torch.enable_grad():
        return [
            unsqueeze_of_shards(o, 0) if keep_sharded and isinstance(o, ShardedTensor)
            else as_local(o, here).unsqueeze(0)
            for o in outputs
        ]


_tokens: dict[tuple[int, Any], torch.Tensor] = {}


def _token(size: int, device: torch.device | None) -> torch.Tensor:
    """``arange(size)`` on ``device``, made once: the token is only read, never written."""
    key = (size, device)
    token = _tokens.get(key)
    if token is None:
        token = torch.arange(size, device=device)
        # never keep a tracer's fake tensor, nor an inference tensor (autograd could not save it later)
        if type(token) is torch.Tensor and not token.is_inference() and len(_tokens) < 256:
            _tokens[key] = token
    return token


_decompositions_loaded = False
_NO_SAVED_TENSOR_HOOKS = (
    "torchpmap: saved tensor hooks (such as torch.autograd.graph.save_on_cpu) cannot be used while a pmap/vmap "
    "runs, as with torch.func.vmap; call the pmap outside that context"
)


def refuse_saved_tensor_hooks() -> None:
    """Raises, as a vmap does, when the caller has set saved tensor hooks
    (``save_on_cpu``, non-reentrant ``torch.utils.checkpoint``): device threads and
    processes run without them (autograd keeps them per thread), so one device refused
    them and several ignored them (a hook that changes what is saved changed nothing).
    Checked on the caller's thread for every engine, as :func:`_vmap_flat` does."""
    if private.saved_tensors_hooks_disabled_message() is None:  # else none can be set
        try:
            private.disable_saved_tensors_hooks(_NO_SAVED_TENSOR_HOOKS)  # raises (after disabling) if hooks are set
        finally:
            private.enable_saved_tensors_hooks()


def _vmap_flat(
    fn: Callable[..., Any], size: int, inputs: Sequence[torch.Tensor], in_dims: Sequence[int], randomness: str
) -> list:
    """``torch.func.vmap(fn, in_dims, out_dims=0, randomness)(*inputs)`` on flat lists.

    The same functorch calls torch.func.vmap makes, without its pytree handling: the front
    end has already flattened the arguments and checked the axes, and this is the hot path.
    Every private call goes through :mod:`torchpmap._state.torch_private`, whose entries say why
    the public ``torch.func.vmap`` (about 95 us more per call) and
    ``torch.autograd.graph.disable_saved_tensors_hooks`` (about 1.2 us more) are not used.
    """
    global _decompositions_loaded
    if not _decompositions_loaded:
        private.ensure_vmap_decompositions()
        batching_rules.install()
        batching_fixes.install()  # autocast entered inside a mapped function
        _decompositions_loaded = True
    previous_message = private.saved_tensors_hooks_disabled_message()
    try:
        private.disable_saved_tensors_hooks(_NO_SAVED_TENSOR_HOOKS)  # raises (after disabling) if hooks are set
        # per_instance draws outside vmap (see random_per_instance): any other random op is refused
        level = private.vmap_increment_nesting(size, "error" if randomness == "per_instance" else randomness)
        own_levels = _context.own_vmap_levels()
        own_levels.append(level)
        try:
            batched = [private.add_batch_dim(t, d, level) for t, d in zip(inputs, in_dims)]
            return [private.remove_batch_dim(out, level, size, 0) for out in fn(*batched)]
        finally:
            own_levels.pop()
            private.vmap_decrement_nesting()
    finally:
        if previous_message is None:
            private.enable_saved_tensors_hooks()
        else:
            private.disable_saved_tensors_hooks(previous_message)


def _check_unmapped(outputs: Sequence[torch.Tensor], required: dict[int, str]) -> None:
    """Raises if an output that must be the same on every instance is batched at this level."""
    level = private.current_vmap_level()  # this vmap's: one_instance runs directly inside it
    for k, path in required.items():
        if private.vmap_level_of(outputs[k]) == level:
            raise _own(OutputVaries(
                f"vmap has out_axes=None for the output at {path or '(the root)'}, but that output varies along "
                "the mapped axis. Give it an out axis (e.g. 0), or return a value that is the same for every "
                "instance, such as the result of psum.",
                path,
            ))


def _own(error: Exception) -> Exception:
    """``error``, marked as torchpmap's own (see :func:`raised_vectorized`)."""
    error._torchpmap_own = True  # type: ignore[attr-defined]
    return error
