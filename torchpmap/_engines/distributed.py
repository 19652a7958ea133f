"""The distributed engine: one slice of the mapped axis per process (multi-controller).

Every process runs the same program, as in JAX's multi-host pmap. A pmap call in a
process receives that process' *local* portion of the mapped axis (``n_local``
instances) and returns its local portion of the result as plain tensors. The global
axis has ``n_local * group_size`` instances; process ``r`` of the group holds instances
``r*n_local .. r*n_local + n_local - 1``. The local slice runs through the vectorized
engine with ``offset``/``axis_size`` set accordingly, so ``axis_index`` is global, and a
:class:`ProcessExchange` gathers every process' slice for a collective
(:func:`torchpmap._primitive.run_owning` then runs the same math as a single process
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
conventions of the collectives (psum transposes to psum, ...) hold. Every wait goes
through :func:`torchpmap._process_group.wait`, which turns a failed or dead peer into
an error naming its rank instead of a hang.
"""
from __future__ import annotations

import dataclasses
import threading
from typing import Any, Callable, Hashable, Optional

import torch
import torch.distributed as dist

from torchpmap import _process_group as pg
from torchpmap._engines import MappedCall, vectorized

active = pg.active


@dataclasses.dataclass(eq=False)
class ProcessExchange:
    """One process' door to the other processes' slices of a split axis.

    Attributes:
        group: the process group of the axis (None: all processes).
        index: this process' position in the group (its coordinate along the axis).
        size: the number of processes in the group.
        label: how error messages name the group.
    """

    group: Any
    index: int
    size: int
    label: str
    pending_check: Optional[Callable[[], None]] = dataclasses.field(default=None, repr=False)

    #: The slices are separate processes, each with its own autograd and functorch state
    #: (unlike device threads, which share the process' forward-mode AD state).
    spans_threads = False

    def settle(self) -> None:
        """Completes the call's size check (started early so that it overlaps the local
        work before the first collective); raises :class:`SizeMismatch`."""
        check, self.pending_check = self.pending_check, None
        if check is not None:
            check()

    def all_gather(self, t: torch.Tensor, what: str) -> torch.Tensor:
        """Every process' ``t`` stacked along a new dim 0 (in group order), on ``t``'s device.

        Differentiable: the gradient of ``t`` is the sum of every process' cotangent for
        this process' entry of the stack.
        """
        return _GatherProcesses.apply(self, what, t)

    def gather_plain(self, t: torch.Tensor, what: str) -> torch.Tensor:
        """``all_gather`` without autograd."""
        self.settle()  # never send values shaped by a local size that the others do not share
        send = torch.view_as_real(t) if t.is_complex() else t
        flat = send.contiguous().reshape(-1)
        received = flat.new_empty(self.size * flat.numel())  # one flat buffer: gloo's fastest all-gather
        work = _all_gather_flat(received, flat, group=self.group, async_op=True)
        pg.wait(work, f"{what} across {self.label}")
        out = received.view(self.size, *send.shape)
        return torch.view_as_complex(out) if t.is_complex() else out

    def scatter_sum(self, grad: torch.Tensor, what: str) -> torch.Tensor:
        """``grad`` has one entry per process along dim 0; returns the sum over processes
        of their entries for this process (the transpose of :meth:`all_gather`)."""
        send = grad.contiguous()
        if send.is_complex():
            send = torch.view_as_real(send)
        received = torch.empty_like(send)
        work = dist.all_to_all_single(received, send, group=self.group, async_op=True)
        pg.wait(work, f"the gradient of {what} across {self.label}")
        if grad.is_complex():
            received = torch.view_as_complex(received)
        return received.sum(0)


# torch >= 2.10 names the flat all-gather all_gather_single (all_gather_into_tensor is deprecated there)
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class _GatherProcesses(torch.autograd.Function):
    """``t`` of every process -> their stack; backward sums the cotangents per slice."""

    generate_vmap_rule = False

    @staticmethod
    def forward(exchange: ProcessExchange, what: str, t: torch.Tensor) -> torch.Tensor:
        return exchange.gather_plain(t, what)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.exchange, ctx.what = inputs[0], inputs[1]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return None, None, ctx.exchange.scatter_sum(grad, ctx.what)

    @staticmethod
    def vmap(info, in_dims, exchange: ProcessExchange, what: str, t: torch.Tensor):
        # An enclosing map batches t (a pmap over one mesh axis nested in a pmap over
        # another): gather the whole batch at once; the processes of this group hold
        # the same instances of the enclosing axis, so entry b matches entry b.
        t_dim = in_dims[2]
        if t_dim is None:
            return _GatherProcesses.apply(exchange, what, t), None
        return _GatherProcesses.apply(exchange, what, t.movedim(t_dim, 0)), 1


# --------------------------------------------------------------------------- which processes form the axis

_running = threading.local()  # the mesh axes (or _WORLD) of the distributed pmaps running in this thread
_WORLD = object()


def _enclosing() -> list[Any]:
    stack = getattr(_running, "stack", None)
    if stack is None:
        stack = _running.stack = []
    return stack


def _plan(call: MappedCall) -> tuple[Optional[ProcessExchange], Any]:
    """The exchange for this call and its key in the running stack; None to run locally."""
    from torchpmap.distributed import ProcessMesh

    st = pg.state()
    mesh, name, enclosing = getattr(call, "mesh", None), call.axis_name, _enclosing()
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


def _start_size_check(exchange: ProcessExchange, n_local: int, name: Hashable, device: torch.device) -> None:
    """Gathers every process' local size, without waiting: the check completes at the
    call's first collective (or at its end), so its latency overlaps the local work."""
    mine = torch.tensor([n_local], device=device)
    sizes = [torch.empty_like(mine) for _ in range(exchange.size)]
    work = dist.all_gather(sizes, mine, group=exchange.group, async_op=True)

    def check() -> None:
        pg.wait(work, f"the size check of pmap {name!r} across {exchange.label}")
        found = [int(s.item()) for s in sizes]
        if len(set(found)) == 1:
            return
        ranks = range(exchange.size) if exchange.group is None else dist.get_process_group_ranks(exchange.group)
        who = ", ".join(f"rank {r}: {s}" for r, s in zip(ranks, found))
        raise SizeMismatch(
            f"pmap over axis {name!r} across {exchange.label}: every process must pass the same number of local "
            f"instances (the size of its local portion of the mapped axis), but they differ: {who} (this is rank "
            f"{pg.state().rank}). Split the global batch evenly over the processes."
        )

    exchange.pending_check = check


def run(call: MappedCall) -> list[torch.Tensor]:
    st = pg.state()
    st.check_usable()
    exchange, key = _plan(call)
    if exchange is None:  # nested inside a distributed pmap, over a name that is no mesh axis
        return vectorized.run(call)
    device = st.local_device.torch_device
    n_local = call.size
    _start_size_check(exchange, n_local, call.axis_name, device)
    part = dataclasses.replace(call, devices=st.local_devices)
    stack = _enclosing()
    stack.append(key)
    st.calls += 1
    try:
        outputs = vectorized.run(
            part, offset=exchange.index * n_local, axis_size=exchange.size * n_local, exchange=exchange
        )
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
        stack.pop()
