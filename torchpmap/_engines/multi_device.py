"""The multi-device engine: one thread per device, each running its slice vectorized.

Instances ``d*k .. d*k + k - 1`` run on device ``d`` through the vectorized engine;
collectives over the mapped axis meet across the device threads through a
:class:`~torchpmap._engines.thread_exchange.Rendezvous`. Outputs stay where they were
computed, as :class:`~torchpmap._placement.sharded.ShardedTensor`.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import itertools
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from typing import Any, cast

import torch

from torchpmap._engines import batching_rules, closure_writes, module_guard, vectorized, written_copies
from torchpmap._engines.baton import Baton, FirstTurns
from torchpmap._engines.mapped_call import MappedCall, views_recorded
from torchpmap._engines.random_per_thread import Seed, call_seed, device_thread_mode, owned, settle
from torchpmap._engines.thread_exchange import PeerFailed, Rendezvous, ThreadExchange
from torchpmap._engines.turn_versions import TurnVersions
from torchpmap._engines.workers import pool
from torchpmap._placement import devices as _devices
from torchpmap._placement.devices import Device
from torchpmap._placement.sharded import ShardedTensor, ShardedView, has_nested_shards, shard_pieces
from torchpmap._state import context as _context
from torchpmap._state import torch_private as private
from torchpmap._state.config import config
from torchpmap._state.faults import OutputVaries


def split_on_the_graph(call: MappedCall) -> MappedCall:
    """``call`` with the pieces of each mapped ShardedTensor that requires grad (in grad
    mode), split once here on the caller's thread: a device thread that takes its shard in
    place takes that piece, on the graph through the ShardedTensor itself. The shard's own
    tensor would skip what autograd recorded on the ShardedTensor since it was made: an
    in-place write into it, a hook, ``retain_grad``, a leaf's gradient (``nn.Parameter`` of
    a result), so that the gradient differed from one device's."""
    if call.pieces is not None or not torch.is_grad_enabled():  # split already (a compiled call run eagerly)
        return call
    if not any(isinstance(t, (ShardedTensor, ShardedView)) and t.requires_grad for t in call.mapped):
        return call
    split: dict[int, list[torch.Tensor]] = {}
    return dataclasses.replace(call, pieces=[_pieces_on_the_graph(t, split) for t in call.mapped])


def _pieces_on_the_graph(t: Any, split: dict[int, list[torch.Tensor]]) -> list[torch.Tensor] | None:
    """A mapped argument's parts held by each shard, on the graph through the ShardedTensor
    (see :func:`split_on_the_graph`): a ShardedTensor's shards; a ShardedView's (one that is
    its op on each shard, see ``ShardedView.along``) the op on its base's; else None. One
    base is split once (``split``), so that arguments that view it are views of the same
    pieces: a write through one is seen by autograd through the others, as on one device."""
    if not (isinstance(t, (ShardedTensor, ShardedView)) and t.requires_grad):
        return None
    if isinstance(t, ShardedView) and (t.along is None or has_nested_shards(t.base)):
        return None
    base = t if isinstance(t, ShardedTensor) else t.base
    if id(base) not in split:
        split[id(base)] = shard_pieces(base)
    pieces = split[id(base)]
    return pieces if isinstance(t, ShardedTensor) else [t.replay(p) for p in pieces]


def slice_for_device(
    t: Any, dim: int, d: int, k: int, device: Device, pieces: Sequence[torch.Tensor] | None = None
) -> torch.Tensor:
    """Instances ``d*k .. d*k+k-1`` of ``t`` along ``dim``, on ``device``; a shard already
    in place is used as it is (its piece in ``pieces``, where given: see
    :func:`split_on_the_graph`)."""
    if isinstance(t, ShardedTensor):
        if t.shard_dim == dim and len(t.shards) > d:
            shard = t.shards[d]
            if shard.device == device and shard.tensor.shape[dim] == k and _starts_at(t, d, dim) == d * k:
                return shard.tensor if pieces is None else pieces[d]
    if isinstance(t, ShardedView) and t.along == dim and len(t.base.shards) > d:
        # a view of a result that keeps each shard's part in its shard (a column, a
        # transpose): this device's part is a view of its shard, so that two arguments
        # viewing one result share memory on every device, as on one device
        base, at = t.base, t.base.shard_dim
        shard = base.shards[d]
        if shard.device == device and shard.tensor.shape[at] == k and _starts_at(base, d, at) == d * k:
            if pieces is not None:
                return pieces[d]
            if not (t.requires_grad and torch.is_grad_enabled()):
                own = t.of_shard(dim, d)
                if own is not None:
                    return own
    with written_copies.trackable():
        # a view of a ShardedTensor is read as its value (a copy, written back where written:
        # torch's .to() of it onto its own device returned the view, which the instances
        # then wrote through out of the caller's sight)
        whole = t.gather() if isinstance(t, ShardedTensor) else t.materialized() if isinstance(t, ShardedView) else t
        return whole.narrow(dim, d * k, k).to(device.torch_device, non_blocking=True)


def _starts_at(t: ShardedTensor, d: int, dim: int) -> int:
    return sum(s.tensor.shape[dim] for s in t.shards[:d])


def slice_label(d: int, k: int, device: Device) -> str:
    """How messages name slice ``d`` of ``k`` instances: the instance itself when k == 1."""
    which = f"instance {d}" if k == 1 else f"one of the instances {d * k}..{d * k + k - 1}"
    return f"{which} (on device {device})"


def run(call: MappedCall) -> list[torch.Tensor]:
    call = split_on_the_graph(call)
    devices = list(cast("Sequence[Device]", call.devices))  # a pmap's
    k = call.size // len(devices)
    rendezvous, group = Rendezvous(config.collective_timeout, Baton()), object()
    torch_devices = tuple(d.torch_device for d in devices)
    seed = call_seed(call.randomness, devices[0].torch_device)
    direct = each_instance_alone(call)

    def one_device(d: int) -> list[torch.Tensor]:
        with device_thread(call, rendezvous, seed, d, k, devices[d]) as part:
            exchange = ThreadExchange(rendezvous, d, torch_devices, group)
            if direct:  # nothing to vectorize: the instance runs as it is
                out = vectorized.run_one(part, offset=d, axis_size=call.size, exchange=exchange, seed=seed)
            else:
                out = vectorized.run(part, offset=d * k, axis_size=call.size, exchange=exchange, seed=seed)
            exchange.leave()
            return out

    reads = batching_rules.value_reads()
    bodies = [functools.partial(one_device, d) for d in range(len(devices))]
    try:
        per_device = run_threads(bodies, rendezvous, devices, k, versions=TurnVersions.of(call.mapped))
    finally:
        settle(seed)  # the caller's generator moves on only where a thread took the seed
    check_outputs_agree(per_device, devices)
    if batching_rules.value_reads() != reads:  # see batching_rules.value_reads
        check_replicated(call, per_device)
    return assembled(devices, per_device)


def assembled(devices: Sequence[Device], per_device: Sequence[Sequence[torch.Tensor]]) -> list:
    """The call's outputs from each device's: each leaf a ShardedTensor over the devices,
    or, when a torch.func transform encloses the call (it carries tensors only) or the
    outputs carry forward-mode tangents (the caller's own ``forward_ad.dual_level()``:
    a ShardedTensor has no tangent), the leaves concatenated on the first device."""
    with torch.enable_grad():  # a result the function computed with grad on (under the caller's no_grad) keeps it
        if private.current_vmap_level() is not None or any(map(_context.carries_tangent, itertools.chain(*per_device))):
            first = devices[0].torch_device
            return [_context.cat_as_they_are([o.to(first) for o in outs]) for outs in zip(*per_device)]
        return [ShardedTensor(list(zip(devices, outs))) for outs in zip(*per_device)]


def check_replicated(call: MappedCall, per_thread: list[list[torch.Tensor]]) -> None:
    """out_axes=None across threads, where their vmap levels cannot tell: compare the
    threads' values (debug mode runs no vmap; a value read into Python under vmap, the same
    on one thread's instances, may differ from another thread's)."""
    if call.must_be_unmapped is None:
        return
    for k, path in call.must_be_unmapped().items():
        first = per_thread[0][k]
        if any(not _same_value(first, outs[k]) for outs in per_thread[1:]):
            raise OutputVaries(
                f"vmap has out_axes=None for the output at {path or '(the root)'}, but that output differs between "
                "instances. Give it an out axis (e.g. 0), or return a value that is the same for every instance.",
                path,
            )


def _same_value(first: torch.Tensor, other: torch.Tensor) -> bool:
    """Whether two threads' copies of a value the same on every instance agree: bitwise on
    one kind of device; across kinds (a CUDA device and a CPU device compute one sum with
    other roundings), within ``torch.testing.assert_close``'s default tolerance for the dtype.
    Values batched by enclosing maps (threads of a mesh axis nested in another's) compare
    under those maps' batching rules."""
    if private.vmap_level_of(first) != -1 or private.vmap_level_of(other) != -1:
        if first.shape != other.shape or first.dtype != other.dtype:
            return False
        return batching_rules.same_bits(torch.stack([first, other.to(first.device)]))
    if first.device.type == other.device.type or not (first.is_floating_point() or first.is_complex()):
        return torch.equal(first, other.to(first.device))
    try:
        torch.testing.assert_close(other.to(first.device), first, equal_nan=True)
    except AssertionError:
        return False
    return True


def each_instance_alone(call: MappedCall) -> bool:
    """Whether the multi-device engines run ``call`` with one instance per device, each
    directly (without vmap: see :func:`runs_directly`)."""
    devices = call.devices
    return (
        devices is not None and call.mesh is None and len(devices) > 1 and call.size == len(devices)
        and runs_directly(call)
    )


def runs_directly(call: MappedCall) -> bool:
    """Whether a device's single instance runs without vmap: unless the user asked for
    bitwise placement, or a torch.func transform encloses the call (its levels then
    carry the instance through vmap, as on one device)."""
    return not config.bitwise_placement and call.must_be_unmapped is None and private.current_vmap_level() is None


def check_outputs_agree(per_device: Sequence[Sequence[torch.Tensor]], devices: Sequence[Device]) -> None:
    """Every device's output leaf ``k`` must have the same dtype and per-instance shape."""
    for k, outs in enumerate(zip(*per_device)):
        first = outs[0]
        for d, out in enumerate(outs[1:], start=1):
            if out.dtype != first.dtype or out.shape[1:] != first.shape[1:]:
                raise ValueError(
                    f"pmap: output {k} differs between devices: {devices[0]} returns {first.dtype} with per-instance "
                    f"shape {tuple(first.shape[1:])}, {devices[d]} returns {out.dtype} with shape "
                    f"{tuple(out.shape[1:])}. Every instance must return outputs of the same shape and dtype."
                )


def run_threads(
    bodies: Sequence[Callable[[], list[torch.Tensor]]],
    rendezvous: Rendezvous,
    devices: Sequence[Device],
    k: int,
    nested: bool = False,
    versions: TurnVersions | None = None,
) -> list[list[torch.Tensor]]:
    """Runs each body in a device thread that sees its caller's state (see
    :mod:`torchpmap._state.context`), taking turns on ``rendezvous``' baton; waits for all.
    ``nested``: the caller is itself a thread holding that baton, which it passes on.

    The threads take turns: only the baton's holder runs, and it passes the baton on when
    it waits in a collective or ends. So a thread's Python code between two collectives
    runs as one piece, as it does on one device: a module that ``functional_call``
    reparametrizes is never seen half-swapped by another thread, and Python state
    (forward-AD nesting, module attributes) never races. Device work is only enqueued in
    that piece on an asynchronous device (CUDA), so the devices still compute at once.
    A module reparametrized by several threads across a collective inside its forward
    is refused (see :mod:`torchpmap._engines.module_guard`). ``versions``: the call's
    mapped arguments' version counters, each thread's own while it holds the turn (see
    :mod:`torchpmap._engines.turn_versions`).
    """
    state, context, watch = _context.CallerState.capture(devices), contextvars.copy_context(), module_guard.Watch()
    first_turns = FirstTurns()  # in the threads' order: see FirstTurns

    def in_turn(j: int, body: Callable[[], list[torch.Tensor]]) -> list[torch.Tensor]:
        try:
            if versions is not None:
                versions.register(threading.get_ident())
            first_turns.wait(j)
            with rendezvous.turn(), state.entered(), module_guard.watching(watch), closure_writes.entered():
                if rendezvous.baton is not None:
                    rendezvous.baton.when_turn_ends(functools.partial(first_turns.ended, j))
                return body()
        finally:
            first_turns.ended(j)  # also when it raised before its turn ended

    module_guard.install()
    try:
        switching = rendezvous.baton.switching(versions) if rendezvous.baton is not None else contextlib.nullcontext()
        with _context.shared_forward_ad(), switching:
            futures = [
                pool.submit(functools.partial(_context.run_in_copy, context, functools.partial(in_turn, j, body)))
                for j, body in enumerate(bodies)
            ]
            with rendezvous.passing_turn() if nested else contextlib.nullcontext():
                return collect(futures, devices, k)
    finally:
        module_guard.uninstall()


@contextlib.contextmanager
def device_thread(
    call: MappedCall, rendezvous: Rendezvous, seed: Seed, j: int, k: int, device: Device
) -> Iterator[MappedCall]:
    """A device thread's set-up and tear-down for slice ``j`` (``k`` instances) of ``call``.

    Pins nested pmaps to ``device``, gives the thread its own random stream, and yields
    the slice's call (its inputs moved there); a failure marks the rendezvous failed, so
    that the other threads stop waiting, and propagates.
    """
    _devices.set_current_default((device,))
    try:
        what = "vmap" if call.devices is None else "pmap"
        mode = device_thread_mode(seed, j, call.randomness, device.torch_device, what)
        # Under "per_instance" the instances' own streams (entered around the body) must see
        # a random op before this mode does, as they always have: the mode then stays outside.
        whole = call.randomness == "per_instance"
        with cuda_device(device.torch_device), owned(mode), mode if whole else contextlib.nullcontext():
            pieces = call.pieces or [None] * len(call.mapped)
            # the slices with grad on, as vmap's batch dims are: a function that enables grad
            # itself under the caller's no_grad differentiates back into the arguments
            with views_recorded(call.mapped), torch.enable_grad():
                mapped = [
                    slice_for_device(t, dim, j, k, device, p) for t, dim, p in zip(call.mapped, call.in_dims, pieces)
                ]
            copied = written_copies.copies(call.mapped, mapped)  # a write into one reaches the caller (below)
            yield dataclasses.replace(
                call,
                body=call.body if whole else _under(mode, call.body),
                mapped=mapped,
                size=k,
                devices=(device,),
            )
            # at the end of the thread's turn: threads write back one at a time
            written_copies.write_back(call.mapped, mapped, copied, lambda i, t: t.narrow(call.in_dims[i], j * k, k))
            if j == 0:
                mode.finish_same()
    except BaseException:
        rendezvous.fail(slice_label(j, k, device))
        raise
    finally:
        _devices.set_current_default(None)


def _under(
    mode: contextlib.AbstractContextManager, body: Callable[[Sequence[torch.Tensor], Sequence[Any]], Any]
) -> Callable[[Sequence[torch.Tensor], Sequence[Any]], Any]:
    """``body`` run with the thread's random-stream mode in force. The mode sees every
    torch call made while it is in force (a Python call each), so it covers the
    function's own body only, not torchpmap's slicing and stacking around it."""

    def run(mapped: Sequence[torch.Tensor], broadcast: Sequence[Any]) -> Any:
        with mode:
            return body(mapped, broadcast)

    return run


def cuda_device(device: torch.device) -> contextlib.AbstractContextManager:
    """``torch.cuda.device(device)`` for a CUDA device: the thread's current CUDA device,
    which CUDA keeps per thread (where ``torch.empty(..., device="cuda")`` lands, and
    whose current stream the thread uses)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def collect(futures: Sequence[Future], devices: Sequence[Device], k: int) -> list[list[torch.Tensor]]:
    """Waits for every device; re-raises the first real failure (not a peer's echo of it)."""
    errors = [f.exception() for f in futures]
    first = next((e for e in errors if e is not None and not isinstance(e, PeerFailed)), None)
    first = first or next((e for e in errors if e is not None), None)
    if first is not None:
        d = errors.index(first)
        if hasattr(first, "add_note"):
            first.add_note(f"torchpmap: raised by {slice_label(d, k, devices[d])}")
        raise first
    return [f.result() for f in futures]
