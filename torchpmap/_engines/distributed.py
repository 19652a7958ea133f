"""The distributed engine: one slice of the mapped axis per process (multi-controller).

Every process runs the same program, as in JAX's multi-host pmap. A pmap call in a
process receives that process' *local* portion of the mapped axis (``n_local``
instances) and returns its local portion of the result as plain tensors. The global
axis has ``n_local * group_size`` instances; process ``r`` of the group holds instances
``r*n_local .. r*n_local + n_local - 1``. The local slice runs through the vectorized
engine with ``offset``/``axis_size`` set accordingly, so ``axis_index`` is global, and a
:class:`ProcessExchange` gathers every process' slice for a collective
(:func:`torchpmap._collective_binding.run_owning` then runs the same math as a single process
would on the whole axis, so forward results are bitwise those of one process).

Which processes form the axis:

* a pmap whose ``axis_name`` is an axis of the mesh of an enclosing
  ``with torchpmap.distributed.mesh(...)`` (or of ``pmap(..., mesh=)``) uses that mesh
  axis' process group (``DeviceMesh.get_group(name)``);
* otherwise, the outermost pmap spans all processes (the world group), and a pmap
  nested inside a distributed pmap runs within each process (vectorized), as a nested
  pmap on one device does.

The exchange is an autograd Function (backward: every process' cotangent for this
slice, summed, via all_to_all), so ``.backward()`` across processes and the gradient
conventions of the collectives (psum transposes to psum, ...) hold. A collective over a
pytree moves all its leaves in one transfer each way (packed as bytes): a data-parallel
step makes one all-gather for the ``pmean`` of its gradients, not one per parameter.
Every wait goes through :func:`torchpmap._process_group.wait`, which turns a failed or
dead peer into an error naming its rank instead of a hang.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Hashable, Optional, Sequence

import torch
import torch.distributed as dist

from torchpmap import _context
from torchpmap import _process_group as pg
from torchpmap import _torch_private as private
from torchpmap._mesh import ProcessMesh
from torchpmap._engines import MappedCall, process_ops, vectorized
from torchpmap._engines.process_transpose import differentiable, transpose_gather

active = pg.active


@dataclasses.dataclass(eq=False)
class ProcessExchange:
    """One process' door to the other processes' slices of a split axis.

    Every process of a call must pass the same local size. The first transfer of the
    call checks it: one that moves partial results (whose size does not depend on the
    local size) carries each process' local size along; before any other, the sizes are
    compared in a transfer of their own. A call without transfers compares them at its
    end (:meth:`settle`).

    Attributes:
        group: the process group of the axis (None: all processes).
        index: this process' position in the group (its coordinate along the axis).
        size: the number of processes in the group.
        label: how error messages name the group.
        unchecked: (local size, axis name) until the processes have compared local sizes.
    """

    group: Any
    index: int
    size: int
    label: str
    unchecked: Optional[tuple[int, Hashable]] = dataclasses.field(default=None, repr=False)

    #: A reduction sends each process' own partial result, not all its instances' values
    #: (see torchpmap._collective_binding.run_owning): traffic independent of the local size.
    reduces_locally = True

    def settle(self) -> None:
        """Compares the processes' local sizes, unless a transfer did; raises :class:`SizeMismatch`."""
        if self.unchecked is not None:
            mine = torch.tensor([self.unchecked[0]], device=pg.state().local_device.torch_device)
            self._compare_sizes(self._gather_bytes([mine], "the size check")[0])

    def all_gather_many(self, ts: Sequence[torch.Tensor], what: str, partial: bool = False) -> list[torch.Tensor]:
        """For each ``ts[k]``: every process' value stacked along a new dim 0 (in group
        order), all tensors in one transfer. ``partial``: the values are this process'
        partial results, shaped independently of its local size.

        Differentiable: the gradient of ``ts[k]`` is the sum of every process' cotangent
        for this process' entry of stack ``k`` (all tensors again in one transfer).
        """
        return list(_GatherProcesses.apply(self, what, partial, *ts))

    def gather_plain(self, ts: Sequence[torch.Tensor], what: str, partial: bool = False) -> list[torch.Tensor]:
        """``all_gather_many`` without autograd: one all-gather of every tensor's bytes."""
        if self.unchecked is None or not partial:
            self.settle()  # never send values shaped by a local size that the others do not share
            return self._gather_bytes(ts, what)
        size = torch.tensor([self.unchecked[0]], device=ts[0].device)  # the check rides along
        *gathered, sizes = self._gather_bytes([*ts, size], what)
        self._compare_sizes(sizes)
        return gathered

    def _gather_bytes(self, ts: Sequence[torch.Tensor], what: str) -> list[torch.Tensor]:
        layout = _Layout.of(ts)
        send = layout.pack(ts, rows=1).view(-1)
        received = send.new_empty(self.size * send.numel())  # one flat buffer: gloo's fastest all-gather
        work = _all_gather_flat(received, send, group=self.group, async_op=True)
        pg.wait(work, f"{what} across {self.label}")
        return layout.unpack(received.view(self.size, layout.row))

    def _compare_sizes(self, sizes: torch.Tensor) -> None:
        (_, name), self.unchecked = self.unchecked, None  # checked now, whatever the outcome
        found = sizes.view(-1).tolist()
        if len(set(found)) == 1:
            return
        ranks = range(self.size) if self.group is None else dist.get_process_group_ranks(self.group)
        who = ", ".join(f"rank {r}: {s}" for r, s in zip(ranks, found))
        raise SizeMismatch(
            f"pmap over axis {name!r} across {self.label}: every process must pass the same number of local "
            f"instances (the size of its local portion of the mapped axis), but they differ: {who} (this is rank "
            f"{pg.state().rank}). Split the global batch evenly over the processes."
        )

    def scatter_sum(self, grads: Sequence[torch.Tensor], what: str) -> list[torch.Tensor]:
        """``grads[k]`` has one entry per process along dim 0; returns, for each ``k``, the
        sum over processes of their entries for this process (the transpose of
        :meth:`all_gather_many`), all tensors in one all-to-all."""
        layout = _Layout.of([g[0] for g in grads])
        send = layout.pack(grads, rows=self.size)  # row p: what process p receives
        received = torch.empty_like(send)
        work = dist.all_to_all_single(received, send, group=self.group, async_op=True)
        pg.wait(work, f"the gradient of {what} across {self.label}")
        return [r.sum(0) for r in layout.unpack(received)]  # each contiguous, as a lone tensor's


# torch >= 2.10 names the flat all-gather all_gather_single (all_gather_into_tensor is deprecated there)
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Where the bytes of several tensors sit in one row of a ``uint8`` buffer, so that
    tensors of any dtypes and shapes travel in one collective.

    Each tensor starts at a multiple of its element size and a row spans a multiple of the
    largest, so that a segment can be viewed back as its dtype in place (a lone tensor
    needs no padding, and packing it copies nothing).
    """

    shapes: tuple[torch.Size, ...]
    dtypes: tuple[torch.dtype, ...]
    offsets: tuple[int, ...]
    nbytes: tuple[int, ...]
    row: int

    @classmethod
    def of(cls, ts: Sequence[torch.Tensor]) -> "_Layout":
        align = max(t.element_size() for t in ts)
        offsets, nbytes, end = [], [], 0
        for t in ts:
            start = -(-end // t.element_size()) * t.element_size()
            offsets.append(start)
            nbytes.append(t.numel() * t.element_size())
            end = start + nbytes[-1]
        row = -(-end // align) * align
        return cls(tuple(t.shape for t in ts), tuple(t.dtype for t in ts), tuple(offsets), tuple(nbytes), row)

    def pack(self, ts: Sequence[torch.Tensor], rows: int) -> torch.Tensor:
        """``ts[k]`` of shape ``(rows, *shapes[k])`` (or ``shapes[k]`` when rows == 1) ->
        a ``(rows, row)`` byte buffer whose row ``r`` holds entry ``r`` of every tensor."""
        flats = [t.contiguous().reshape(rows, t.numel() // rows).view(torch.uint8) for t in ts]
        if len(flats) == 1:
            return flats[0]
        buffer = flats[0].new_empty(rows, self.row)
        for flat, start in zip(flats, self.offsets):
            buffer[:, start : start + flat.shape[1]].copy_(flat)
        return buffer

    def unpack(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """A ``(m, row)`` byte buffer -> tensor ``k`` of every row, ``(m, *shapes[k])``, contiguous."""
        m = buffer.shape[0]
        return [
            buffer[:, start : start + n].view(dtype).reshape(m, *shape).contiguous()
            for shape, dtype, start, n in zip(self.shapes, self.dtypes, self.offsets, self.nbytes)
        ]


class _GatherProcesses(torch.autograd.Function):
    """``ts`` of every process -> their stacks; backward sums the cotangents per slice.

    Each direction is one transfer for all tensors. Backward sends the cotangents of the
    floating-point tensors only (zeros where a result got no gradient): their dtypes, the
    same in every process, decide the layout, so every process packs the same one.
    """

    generate_vmap_rule = False

    @staticmethod
    def forward(exchange: ProcessExchange, what: str, partial: bool, *ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(exchange.gather_plain(ts, what, partial))

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.exchange, ctx.what = inputs[0], inputs[1]
        ctx.differentiable = [differentiable(t) for t in inputs[3:]]

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        scatter = lambda gs: ctx.exchange.scatter_sum(gs, ctx.what)  # noqa: E731
        return None, None, None, *transpose_gather(grads, ctx.differentiable, scatter)

    @staticmethod
    def vmap(info, in_dims, exchange: ProcessExchange, what: str, partial: bool, *ts: torch.Tensor):
        # An enclosing map batches some ts (a pmap over one mesh axis nested in a pmap over
        # another): gather the whole batch at once; the processes of this group hold the
        # same instances of the enclosing axis, so entry b matches entry b.
        t_dims = in_dims[3:]
        moved = [t if d is None else t.movedim(d, 0) for t, d in zip(ts, t_dims)]
        return _GatherProcesses.apply(exchange, what, partial, *moved), tuple(None if d is None else 1 for d in t_dims)


# --------------------------------------------------------------------------- which processes form the axis

_WORLD = object()  # the key of a pmap over all processes in _context.process_axes


def _plan(call: MappedCall) -> tuple[Optional[ProcessExchange], Any]:
    """The exchange for this call and its key in the running stack; None to run locally."""
    st = pg.state()
    mesh, name, enclosing = getattr(call, "mesh", None), call.axis_name, _context.process_axes.get()
    if mesh is not None:
        if not isinstance(mesh, ProcessMesh):
            raise NotImplementedError(
                f"pmap over axis {name!r} of {mesh!r}: in a multi-process run, build the mesh with "
                "torchpmap.distributed.mesh(shape, axis_names), which gives each mesh axis its process group"
            )
        if _WORLD in enclosing:
            raise ValueError(
                f"pmap over mesh axis {name!r} is nested inside a pmap over all processes; map the mesh axes "
                "from the outermost pmap on (the outer pmap already spans every process)"
            )
        if name in enclosing:
            raise ValueError(
                f"pmap: axis_name={name!r} is a mesh axis that an enclosing pmap already maps over; each mesh "
                "axis can be mapped by one pmap at a time"
            )
        return ProcessExchange(mesh.group(name), mesh.coordinate(name), mesh.shape[name], f"mesh axis {name!r}"), name
    if enclosing:  # nested, over a name that is no mesh axis: within this process
        return None, None
    return ProcessExchange(None, st.rank, st.world_size, "all processes"), _WORLD


class SizeMismatch(ValueError):
    """The processes passed different numbers of local instances (every process raises it)."""


def run(call: MappedCall) -> list[torch.Tensor]:
    st = pg.state()
    st.check_usable()
    exchange, key = _plan(call)
    if exchange is None:  # nested inside a distributed pmap, over a name that is no mesh axis
        return vectorized.run(call)
    if process_ops.is_tracing():
        raise NotImplementedError(
            f"pmap(jit=True): the distributed pmap over axis {call.axis_name!r} is nested in another one that is "
            "being compiled; nested pmaps across processes run eagerly"
        )
    exchange.unchecked = (call.size, call.axis_name)
    part = dataclasses.replace(call, devices=st.local_devices)
    token = _context.process_axes.set(_context.process_axes.get() + (key,))
    st.calls += 1
    try:
        if call.programs is not None and private.current_vmap_level() is None:
            outputs = _run_compiled(part, exchange)
        else:
            outputs = _run_slice(part, exchange, exchange)
        exchange.settle()  # a call without collectives still checks the sizes
        return outputs
    except SizeMismatch:
        raise  # every process raises it at the same point: they stay in step
    except BaseException as e:
        if not getattr(e, "_torchpmap_reported", False) and not isinstance(e, (pg.RankFailed, TimeoutError)):
            pg.report_own_failure(e, f"pmap over axis {call.axis_name!r}")
            try:
                e._torchpmap_reported = True  # type: ignore[attr-defined]
                e.add_note(f"torchpmap: raised on rank {st.rank} of {st.world_size} (pmap call #{st.calls})")
            except AttributeError:
                pass
        raise
    finally:
        _context.process_axes.reset(token)


def _run_slice(part: MappedCall, exchange: ProcessExchange, through: Any) -> list[torch.Tensor]:
    """This process' slice of the axis, vectorized; its collectives go ``through`` the exchange."""
    n_local = part.size
    return vectorized.run(part, offset=exchange.index * n_local, axis_size=exchange.size * n_local, exchange=through)


def _run_compiled(part: MappedCall, exchange: ProcessExchange) -> list[torch.Tensor]:
    """``jit=True``: this process' slice as a compiled program whose exchanges are ops
    (see :mod:`torchpmap._engines.process_ops`); the program bakes in the slice's place."""
    stand_in = process_ops.traced(exchange)

    def trace(call: MappedCall) -> list[torch.Tensor]:
        with process_ops.tracing():
            return _run_slice(call, exchange, stand_in)

    return part.programs.run(
        part,
        (part.signature, stand_in.key),
        engine=lambda call: _run_slice(call, exchange, exchange),
        traced_engine=trace,
        may_retry=_is_no_fault_of_the_run,
    )


def _is_no_fault_of_the_run(failure: Exception) -> bool:
    """False for a failure that an eager retry must not repeat: a size mismatch, or any
    failed collective (the process state is then poisoned: the others have moved on)."""
    return not isinstance(failure, (SizeMismatch, pg.PeerFailed, TimeoutError)) and pg.state().poisoned is None
