"""Engines: what runs the instances of a mapped call.

The front end (:mod:`torchpmap._frontend.call`) turns a call into a :class:`MappedCall`, a flat,
engine-neutral description, and hands it to :func:`run`. An engine returns every output
leaf with the mapped axis at dim 0; it never sees pytrees, in_axes or out_axes.
"""
from __future__ import annotations

import dataclasses
import logging
import warnings
from typing import TYPE_CHECKING, Any, Callable, Hashable, Optional, Sequence

import torch

from torchpmap._placement.devices import Device
from torchpmap._placement.mesh import Mesh

if TYPE_CHECKING:
    from torchpmap._engines.compiled import ProgramCache


@dataclasses.dataclass(eq=False, slots=True)  # not frozen: a frozen __init__ costs microseconds per call
class MappedCall:
    """One call of a mapped function, flattened.

    Attributes:
        body: runs one instance: ``body(mapped_slices, broadcast_values)`` returns the
            instance's output leaves, all tensors.
        mapped: the mapped tensor leaves; ``in_dims[k]`` is the mapped dim of ``mapped[k]``.
        broadcast: values every instance sees unchanged.
        axis_name: the name collectives use, or None.
        size: the size of the mapped axis.
        randomness: as in ``torch.func.vmap``.
        devices: where to run; None means "where the inputs are" (``vmap``).
        mesh: the mesh whose axis ``axis_name`` names, if the call maps a mesh axis.
        must_be_unmapped: after ``body`` ran, the positions of output leaves that must
            not vary along the axis (``vmap``'s ``out_axes=None``), with their key paths;
            None when there is nothing to check (``pmap``). An engine raises ValueError
            for an output that does vary.
        vma: shard_map's varying-manual-axes semantics for this axis (see
            :class:`~torchpmap._state.axis_env.AxisFrame`).
        programs: for ``jit=True``, the mapped function's compiled programs
            (a :class:`~torchpmap._engines.compiled.ProgramCache`); None runs eagerly.
        signature: what identifies this call's program in ``programs``: everything
            about the arguments that a trace bakes in (structure, shapes, dtypes, ...).
        output_layout: what ``body`` records about the outputs as it runs (an
            :class:`OutputLayout`). When a compiled program answers a call without
            running ``body``, it copies in what ``body`` recorded when it was traced.
        program: ``(digest, description)`` of the mapped program (its function's
            qualified name, ``in_axes``, ``out_axes``, axis name), the same in every
            process that runs the same program: the headers of exchanges between
            processes carry the digest, so that processes running different programs
            raise at their first exchange. None for a ``vmap``.
    """

    body: Callable[[Sequence[torch.Tensor], Sequence[Any]], Sequence[torch.Tensor]]
    mapped: Sequence[torch.Tensor]
    in_dims: Sequence[int]
    broadcast: Sequence[Any]
    axis_name: Optional[Hashable]
    size: int
    randomness: str
    devices: Optional[Sequence[Device]]
    must_be_unmapped: Optional[Callable[[], dict[int, str]]] = None
    mesh: Optional[Mesh] = None
    programs: Optional["ProgramCache"] = None
    signature: Hashable = None
    output_layout: "OutputLayout" = dataclasses.field(default_factory=lambda: OutputLayout())
    memory: Optional["FunctionMemory"] = None
    vma: bool = False
    program: Optional[tuple[int, str]] = None


@dataclasses.dataclass(eq=False)
class OutputLayout:
    """The shape of a mapped function's output as a pytree, recorded by ``body``; the front
    end stacks the engine's flat outputs back into it.

    Attributes:
        spec: the output's pytree structure (a ``TreeSpec``).
        leaves: how many leaves it has.
        none_leaves: the positions of leaves that are None (they are not computed, and
            come back as None); the other leaves are the engine's outputs, in order.
    """

    spec: Any = None
    leaves: int = 0
    none_leaves: dict[int, None] = dataclasses.field(default_factory=dict)

    def record(self, spec: Any, leaves: int, none_leaves: dict[int, None]) -> None:
        self.spec, self.leaves, self.none_leaves = spec, leaves, none_leaves

    def copy_from(self, other: "OutputLayout") -> None:
        self.record(other.spec, other.leaves, other.none_leaves)


@dataclasses.dataclass(eq=False)
class FunctionMemory:
    """What the engines remember about one mapped function between its calls.

    Attributes:
        unvectorized: why ``torch.func.vmap`` could not run the function (its first
            failure), after which its instances run one at a time; None while it can.
    """

    unvectorized: Optional[str] = None


class VectorizationFallbackWarning(UserWarning):
    """``torch.func.vmap`` could not run a mapped function, whose instances then ran one at
    a time (same results, slower)."""


#: Messages of failures that say vmap cannot run a program, where running its instances
#: one at a time can: data-dependent Python, ``.item()``, an op without a batching rule,
#: and kernels whose backward mishandles a batched tensor (nn.GRU/RNN/LSTM's).
_CANNOT_VECTORIZE = (
    "vmap: It looks like you're",  # calling .item(), or data-dependent control flow (each torch words it its own way)
    "Batching rule not implemented for",
    "doesn't match the broadcast shape",
)


def _cannot_vectorize(failure: BaseException) -> Optional[str]:
    """The first line of ``failure`` (or of its cause) when it says vmap cannot run the program."""
    seen: set[int] = set()
    while failure is not None and id(failure) not in seen:
        seen.add(id(failure))
        text = str(failure)
        if isinstance(failure, RuntimeError) and any(m in text for m in _CANNOT_VECTORIZE):
            return f"{type(failure).__name__}: {(text.strip().splitlines() or [''])[0]}"
        failure = failure.__cause__ or failure.__context__
    return None


def run(call: MappedCall) -> list[torch.Tensor]:
    """Runs ``call`` on the engine that fits it; outputs have the mapped axis at dim 0.

    ``body`` may not run at all: a compiled program of an earlier call with the same
    ``signature`` computes the outputs. When vmap cannot run the function (see
    :data:`_CANNOT_VECTORIZE`), its instances run one at a time instead, from then on,
    with a :class:`VectorizationFallbackWarning`: in a single process, at the outermost
    vectorized map only (an inner map's failure reaches the outer one, which falls back as
    a whole). The function's Python code then runs again: once for the failed attempt,
    then once per instance.
    """
    if call.devices is not None and distributed.active():  # several processes: one slice each (compiled or not)
        _log_engine(call, "distributed (this process' slice)")
        return distributed.run(call)

    if vectorization_disabled() or (call.memory is not None and call.memory.unvectorized is not None):
        _log_engine(call, "one instance at a time")
        return threaded.run_one_at_a_time(call)
    try:
        if batching_fixes.needed():
            with batching_fixes.fixed():
                return _run_vectorized(call)
        return _run_vectorized(call)
    except Exception as failure:  # noqa: BLE001 - re-raised unless vmap is what failed
        why = _cannot_vectorize(failure)
        outermost = not any(f.vectorized for f in _axis_env.current_frames())
        if why is None and outermost and _names_no_instance(failure):
            _raise_naming_the_instance(call, failure)
        if why is None or call.memory is None or not outermost:
            raise
        call.memory.unvectorized = why
        logger.info("pmap over axis %r: vmap cannot run it (%s); its instances run one at a time from now on", call.axis_name, why)
        warnings.warn(
            f"torch.func.vmap cannot run the function mapped over axis {call.axis_name!r} ({why}), so its instances "
            "run one at a time from now on (same results, slower; with several devices they still meet at "
            "collectives). Tensor ops instead of Python branches on values (torch.where) keep it vectorized.",
            VectorizationFallbackWarning,
            stacklevel=3,
        )
        return threaded.run_one_at_a_time(call)


#: Failures of torchpmap's own machinery, which name what failed already (running the
#: instances again would not tell more).
_OWN_FAILURES: tuple[type[BaseException], ...] = ()


def _names_no_instance(failure: BaseException) -> bool:
    """Whether ``failure`` was raised by the function while several instances ran as one
    vectorized program (so that no instance is named), and is not torchpmap's own."""
    return vectorized.raised_vectorized(failure) and not isinstance(failure, _OWN_FAILURES)


def _raise_naming_the_instance(call: MappedCall, failure: Exception) -> None:
    """Raises the error of the first instance that fails when they run one at a time,
    with a note naming it and its device, as every other placement names it.

    Vectorized, an error is raised for all instances at once (often in vmap's own words:
    ``torch.vdot`` of 2-D tensors says "Got wrong shapes for dot" under vmap, "1D tensors
    expected" on a device that runs one instance). Run one at a time, the function raises
    torch's own error for the instance that fails. The function's Python code runs again
    (on this error path only). When every instance succeeds one at a time, vmap is what
    failed: ``failure`` is raised with a note saying so.
    """
    first = (str(failure).strip().splitlines() or [""])[0]
    try:
        threaded.run_one_at_a_time(call)
    except Exception as exact:  # noqa: BLE001 - the instance's own error is the one to see
        if hasattr(exact, "add_note"):
            exact.add_note(
                f"torchpmap: found by running the instances one at a time, after their vectorized run raised "
                f"{type(failure).__name__}: {first}"
            )
        raise exact from None
    where = ", ".join(map(str, call.devices)) if call.devices else "the inputs' device"
    if hasattr(failure, "add_note"):
        failure.add_note(
            f"torchpmap: raised while instances 0..{call.size - 1} ran as one vectorized program (on {where}); run one "
            "at a time, every instance succeeds, so torch.func.vmap is what failed: with torchpmap.disable_vectorization() "
            "the function runs that way"
        )
    raise failure


def _run_vectorized(call: MappedCall) -> list[torch.Tensor]:
    if call.mesh is not None:
        _warn_not_compiled(call, "maps an axis of a device mesh")
        _log_engine(call, "mesh (one thread per mesh position)")
        return threaded.run_mesh(call, call.mesh)
    if call.devices is not None and len(call.devices) > 1:
        _warn_not_compiled(call, f"runs on {len(call.devices)} devices")
        _log_engine(call, "multi-device (one thread per device)")
        return multi_device.run(call)
    if call.programs is not None and private.current_vmap_level() is None:
        _log_engine(call, "compiled")
        return call.programs.run(call, call.signature)
    _log_engine(call, "vectorized")
    return vectorized.run(call)


def _log_engine(call: MappedCall, engine: str) -> None:
    if logger.isEnabledFor(logging.DEBUG):  # the hot path pays for the level check only
        where = "where the inputs are" if call.devices is None else ", ".join(map(str, call.devices))
        logger.debug("map over axis %r: %d instances on %s, engine: %s", call.axis_name, call.size, where, engine)  # eager, or jit=True inside a transform: part of the enclosing computation


def _warn_not_compiled(call: MappedCall, why: str) -> None:
    if call.programs is not None:
        warnings.warn(
            f"pmap(jit=True) over axis {call.axis_name!r} {why}; only the single-device vectorized engine "
            "compiles, so this call runs eagerly (same results). Pass devices=torchpmap.devices()[:1] to compile it.",
            JitFallbackWarning,
            stacklevel=4,
        )


# The engines import MappedCall from here, so they come after it (imported once, not per call).
from torchpmap._state import axis_env as _axis_env  # noqa: E402
from torchpmap._state.log import logger  # noqa: E402
from torchpmap._state import torch_private as private  # noqa: E402
from torchpmap._state.config import vectorization_disabled  # noqa: E402
from torchpmap._engines import batching_fixes, distributed, multi_device, threaded, vectorized  # noqa: E402
from torchpmap._engines.compiled import JitFallbackWarning  # noqa: E402
from torchpmap._state.faults import ExchangeMismatch, PeerFailed, SizeMismatch  # noqa: E402

_OWN_FAILURES = (PeerFailed, SizeMismatch, ExchangeMismatch, TimeoutError, private.TorchPrivateError)
