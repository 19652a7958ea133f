"""The engine across processes: one slice of the mapped axis per process (multi-controller).

Every process runs the same program, as in JAX's multi-host pmap. A pmap call in a
process receives that process' *local* portion of the mapped axis (``n_local``
instances) and returns its local portion of the result as plain tensors. The global
axis has ``n_local * group_size`` instances; process ``r`` of the group holds instances
``r*n_local .. r*n_local + n_local - 1``. The local slice runs through the vectorized
engine with ``offset``/``axis_size`` set accordingly, so ``axis_index`` is global, and a
:class:`~torchpmap._engines.process_exchange.ProcessExchange` connects it to the other
processes' slices for its collectives.

Which processes form the axis:

* a pmap whose ``axis_name`` is an axis of the mesh of an enclosing
  ``with torchpmap.distributed.mesh(...)`` (or of ``pmap(..., mesh=)``) uses that mesh
  axis' process group (``DeviceMesh.get_group(name)``);
* otherwise, the outermost pmap spans all processes (the world group), and a pmap
  nested inside a distributed pmap runs within each process (vectorized), as a nested
  pmap on one device does.
"""
from __future__ import annotations

import dataclasses
from typing import Any, cast

import torch

from torchpmap._engines import process_ops, vectorized
from torchpmap._engines.mapped_call import CompiledPrograms, MappedCall
from torchpmap._engines.multi_device import runs_directly as _runs_directly
from torchpmap._engines.process_exchange import ProcessExchange
from torchpmap._placement.mesh import ProcessMesh
from torchpmap._state import context as _context
from torchpmap._state import process_group as pg
from torchpmap._state import torch_private as private
from torchpmap._state.faults import ExchangeMismatch, SizeMismatch

active = pg.active


_WORLD = object()  # the key of a pmap over all processes in _context.process_axes


def _plan(call: MappedCall) -> tuple[ProcessExchange | None, Any]:
    """The exchange for this call and its key in the running stack; None to run locally."""
    st = pg.state()
    mesh, name, enclosing = call.mesh, call.axis_name, _context.process_axes.get()
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
    st.calls += 1
    exchange.call, exchange.local_size, exchange.axis_name = st.calls, call.size, call.axis_name
    exchange.program = call.program
    part = dataclasses.replace(call, devices=st.local_devices)
    token = _context.process_axes.set(_context.process_axes.get() + (key,))
    try:
        if call.programs is not None and private.current_vmap_level() is None:
            outputs = _run_compiled(part, exchange)
        elif part.size == 1 and _runs_directly(part):  # one instance per process: nothing to vectorize
            outputs = vectorized.run_one(part, offset=exchange.index, axis_size=exchange.size, exchange=exchange)
        else:
            try:
                outputs = _run_slice(part, exchange, exchange)
            except RuntimeError as failure:
                if hasattr(failure, "add_note") and not isinstance(failure, pg.RankFailed):
                    failure.add_note(_NO_FALLBACK)
                raise
        exchange.settle()  # a call without collectives still checks the sizes
        return outputs
    except (SizeMismatch, ExchangeMismatch):
        raise  # every process raises it at the same point: they stay in step
    except BaseException as e:
        if not getattr(e, "_torchpmap_reported", False) and not isinstance(e, (pg.RankFailed, TimeoutError)):
            pg.report_own_failure(e, f"pmap over axis {call.axis_name!r}")
            try:
                e._torchpmap_reported = True  # type: ignore[attr-defined]
                note = f"torchpmap: raised on rank {st.rank} of {st.world_size} (pmap call #{st.calls})"
                e.add_note(note)  # type: ignore[attr-defined]  # Python >= 3.11; else AttributeError below
            except AttributeError:
                pass
        raise
    finally:
        _context.process_axes.reset(token)


_NO_FALLBACK = (
    "torchpmap: across processes, a process' instances run vectorized only. In one process, a function that "
    "torch.func.vmap cannot run (an in-place write of a per-instance value into a tensor the instances share, "
    "data-dependent Python) falls back to running its instances one at a time; across processes their "
    "collectives could not meet that way. If this error comes from vmap, give each process one instance (it then "
    "runs without vmap), or write the value out of place (e.g. buffer = buffer + value, returned)."
)


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

    return cast(CompiledPrograms, part.programs).run(  # jit=True: there are programs
        part,
        (part.signature, stand_in.key),
        engine=lambda call: _run_slice(call, exchange, exchange),
        traced_engine=trace,
        may_retry=_is_no_fault_of_the_run,
    )


def _is_no_fault_of_the_run(failure: Exception) -> bool:
    """False for a failure that an eager retry must not repeat: a size mismatch, or any
    failed collective (the process state is then poisoned: the others have moved on)."""
    return (
        not isinstance(failure, (SizeMismatch, ExchangeMismatch, pg.PeerFailed, TimeoutError))
        and pg.state().poisoned is None
    )
