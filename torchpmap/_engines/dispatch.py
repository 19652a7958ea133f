"""The engine choice: which engine runs a mapped call, and the fallback to one instance at a time.

:func:`run` takes a :class:`~torchpmap._engines.mapped_call.MappedCall` and hands it to
the engine that fits it: across processes (:mod:`~torchpmap._engines.multi_process`), the
instances of a mesh axis (:mod:`~torchpmap._engines.mesh_axes`), several devices
(:mod:`~torchpmap._engines.multi_device`; compiled:
:mod:`~torchpmap._engines.compiled_devices`), a compiled program
(:mod:`~torchpmap._engines.compiled`) or one vectorized call
(:mod:`~torchpmap._engines.vectorized`). A ``jit=True`` call inside an enclosing map or
transform is part of that computation (see :func:`_inside_a_map`). When vmap cannot run
the function, its instances run one at a time (:mod:`~torchpmap._engines.one_at_a_time`)
from then on.
"""
from __future__ import annotations

import logging
import warnings
from collections.abc import Callable

import torch

from torchpmap._engines import (
    autograd_metadata,
    batching_fixes,
    closure_writes,
    compiled_devices,
    instance_autograd,
    mesh_axes,
    multi_device,
    multi_process,
    one_at_a_time,
    rerun_guard,
    thread_exchange,
    thread_ops,
    vectorized,
)
from torchpmap._engines.engine_warnings import JitFallbackWarning, VectorizationFallbackWarning
from torchpmap._engines.mapped_call import MappedCall
from torchpmap._state import axis_env as _axis_env
from torchpmap._state import context as _context
from torchpmap._state import torch_private as private
from torchpmap._state.config import vectorization_disabled
from torchpmap._state.faults import ExchangeMismatch, PeerFailed, SizeMismatch
from torchpmap._state.log import logger

#: Messages of failures that say vmap cannot run a program, where running its instances
#: one at a time can: data-dependent Python, ``.item()``, an op without a batching rule,
#: kernels whose backward mishandles a batched tensor (nn.GRU/RNN/LSTM's), results whose
#: shape depends on values (``t[t > 0] = 0``), reading an instance's memory (``tolist()``,
#: ``numpy()``), ``.data``, ``requires_grad_()``, module backward hooks and a mapped
#: value's ``grad_fn`` (see :mod:`~torchpmap._engines.instance_autograd`).
_CANNOT_VECTORIZE = (
    "vmap: It looks like you're",  # calling .item(), or data-dependent control flow (each torch words it its own way)
    "Batching rule not implemented for",
    "doesn't match the broadcast shape",
    "We do not support batching operators that can support dynamic shape",
    "Cannot access data pointer of Tensor that doesn't have storage",
    "`data` under vmap transform is not allowed",
    "`.data` under vmap transform is not allowed",
    "You are attempting to call Tensor.requires_grad_()",
    instance_autograd.HOOKS_MESSAGE_START,  # a module backward hook, which vmap would never call
    autograd_metadata.MESSAGE_START,  # an instance's grad_fn, which vmap cannot give
)


def _cannot_vectorize(failure: BaseException | None) -> str | None:
    """The first line of ``failure`` (or of its cause) when it says vmap cannot run the program."""
    seen: set[int] = set()
    while failure is not None and id(failure) not in seen:
        seen.add(id(failure))
        text = str(failure)
        if isinstance(failure, RuntimeError) and any(m in text for m in _CANNOT_VECTORIZE):
            return _described(failure)
        failure = failure.__cause__ or failure.__context__
    return None


def run(call: MappedCall) -> list[torch.Tensor]:
    """Runs ``call`` on the engine that fits it; outputs have the mapped axis at dim 0.

    ``body`` may not run at all: a compiled program of an earlier call with the same
    ``signature`` computes the outputs. When vmap cannot run the function (see
    :data:`_CANNOT_VECTORIZE`, or any error of the vectorized run after which every
    instance succeeds alone), its instances run one at a time instead, from then on,
    with a :class:`VectorizationFallbackWarning`: in a single process, at the outermost
    vectorized map only (an inner map's failure reaches the outer one, which falls back as
    a whole). The function's Python code then runs again: once for the failed attempt,
    then once per instance.
    """
    vectorized.refuse_saved_tensor_hooks()  # every placement, as the vectorized engine's vmap refuses them
    if call.devices is not None and multi_process.active():  # several processes: one slice each (compiled or not)
        _log_engine(call, "distributed (this process' slice)")
        return _corrected(multi_process.run, call)

    fell_back = call.vmap_fallback is not None and call.vmap_fallback.reason is not None
    # inside a device thread a remembered fallback is not taken: one at a time there, the
    # instances' collectives over the enclosing axis would wait for the other device
    # threads, whose turn this thread holds (a failure of the vectorized run goes to the
    # enclosing map instead: see below)
    if vectorization_disabled() or (fell_back and not _inside_a_device_thread()):
        _log_engine(call, "one instance at a time")
        return one_at_a_time.run(call)
    before = rerun_guard.note(call)  # see rerun_guard
    try:
        with closure_writes.kept(before.journal):
            outputs = _corrected(_run_vectorized, call)
    except Exception as failure:
        if _inside_a_device_thread():
            # instances run one at a time here would meet the other device threads at a
            # collective over the enclosing axis while this thread holds their turn (a
            # deadlock): the failure goes to the enclosing map, which falls back or names
            # the instance as a whole
            raise
        why = _cannot_vectorize(failure)
        outermost = _outermost_vectorized()
        # inside an instance thread, an enclosing map is running its instances one at a
        # time already (naming them): a second such run nested in it would wait for the
        # baton that the enclosing instance holds
        named_outside = _context.instance_thread.get() is not None
        if why is None and outermost and not named_outside and _names_no_instance(failure):
            described = _described(failure)
            try:
                rerun_guard.undo(call, before, described)
            except RuntimeError as stuck:
                raise stuck from failure
            outputs = _rerun_naming_the_instance(call, failure)
            _remember_fallback(call, described)
            return outputs
        if why is None or call.vmap_fallback is None or not outermost:
            raise
        rerun_guard.undo(call, before, why)
        _remember_fallback(call, why)
        return one_at_a_time.run(call)
    return outputs


def _inside_a_device_thread() -> bool:
    """Whether an enclosing map's axis is split over device threads, this call running in
    one of them (with its one instance, or its instances vectorized) outside an instance
    thread of its own."""
    if _context.instance_thread.get() is not None:
        return False
    return any(isinstance(f.exchange, thread_exchange.ThreadExchange) for f in _axis_env.current_frames())


def _outermost_vectorized() -> bool:
    """Whether no enclosing map runs instances vectorized around this one, but for the
    vmap of one of the instance thread it runs in (a mesh position under check_vma, or an
    instance of a map that fell back): threads of its own can start under that level, so
    this map can fall back to one instance at a time alone."""
    state = _context.instance_thread.get()
    own = {id(f.token) for f in state.frames} if state is not None else set()
    return not any(f.vectorized and id(f.token) not in own for f in _axis_env.current_frames())


def _first_line(failure: BaseException) -> str:
    """The first line of ``failure``'s message (how notes and warnings quote it)."""
    return (str(failure).strip().splitlines() or [""])[0]


def _described(failure: BaseException) -> str:
    """``failure`` as notes and warnings name it: ``"RuntimeError: <its first line>"``."""
    return f"{type(failure).__name__}: {_first_line(failure)}"


#: Failures of torchpmap's own machinery, which name what failed already (running the
#: instances again would not tell more).
_OWN_FAILURES: tuple[type[BaseException], ...] = (
    PeerFailed,
    SizeMismatch,
    ExchangeMismatch,
    TimeoutError,
    private.TorchPrivateError,
)


def _names_no_instance(failure: BaseException) -> bool:
    """Whether ``failure`` was raised by the function while several instances ran as one
    vectorized program (so that no instance is named), and is not torchpmap's own."""
    return vectorized.raised_vectorized(failure) and not isinstance(failure, _OWN_FAILURES)


def _remember_fallback(call: MappedCall, why: str) -> None:
    """Records that vmap cannot run ``call``'s function (``why``), so that its instances
    run one at a time from now on, and says so with a :class:`VectorizationFallbackWarning`."""
    if call.vmap_fallback is not None:
        call.vmap_fallback.reason = why
    logger.info(
        "pmap over axis %r: vmap cannot run it (%s); its instances run one at a time from now on",
        call.axis_name,
        why,
    )
    warnings.warn(
        f"torch.func.vmap cannot run the function mapped over axis {call.axis_name!r} ({why}), so its instances "
        "run one at a time from now on (same results, slower; with several devices they still meet at "
        "collectives). Tensor ops instead of Python branches on values (torch.where) keep it vectorized.",
        VectorizationFallbackWarning,
        stacklevel=4,
    )


def _rerun_naming_the_instance(call: MappedCall, failure: Exception) -> list[torch.Tensor]:
    """After ``failure`` of the vectorized run, runs the instances one at a time: raises
    the error of the first instance that fails, with a note naming it and its device, as
    every other placement names it; returns their outputs when every instance succeeds.

    Vectorized, an error is raised for all instances at once (often in vmap's own words:
    ``torch.vdot`` of 2-D tensors says "Got wrong shapes for dot" under vmap, "1D tensors
    expected" on a device that runs one instance). Run one at a time, the function raises
    torch's own error for the instance that fails. The function's Python code runs again
    (on this path only). When every instance succeeds one at a time, vmap is what failed
    (``flip(0)`` of a 0-d instance, a batching rule's own limit): the instances computed
    what a loop, and a device running one instance, compute, and the caller falls back.
    """
    try:
        return one_at_a_time.run(call)
    except Exception as exact:
        if hasattr(exact, "add_note"):
            exact.add_note(
                f"torchpmap: found by running the instances one at a time, after their vectorized run raised "
                f"{_described(failure)}"
            )
        raise exact from None


def _corrected(
    run_on_engine: Callable[[MappedCall], list[torch.Tensor]], call: MappedCall
) -> list[torch.Tensor]:
    """``run_on_engine(call)`` with :mod:`batching_fixes`' corrections in force while autocast
    is on (autocast's casts under vmap, on every engine that vectorizes: one device,
    device threads, this process' slice of a distributed axis)."""
    if batching_fixes.needed():
        with batching_fixes.fixed():
            return run_on_engine(call)
    return run_on_engine(call)


def _run_vectorized(call: MappedCall) -> list[torch.Tensor]:
    programs = call.programs if call.programs is not None and not _inside_a_map() else None  # jit=True
    if programs is not None and private.forward_ad_level() >= 0:  # the caller's forward_ad.dual_level()
        # a compiled program carries no forward-mode tangents (torch.compile drops them too,
        # silently): the arguments' or the closed-over tensors' tangents would be lost
        _warn_eager(call, "runs inside torch.autograd.forward_ad.dual_level(), whose tangents a compiled "
                    "program does not carry")
        programs = None
    if call.mesh is not None:
        if programs is not None:
            _warn_not_compiled(call, "maps an axis of a device mesh")
        _log_engine(call, "mesh (one thread per mesh position)")
        return mesh_axes.run(call, call.mesh)
    if call.devices is not None and len(call.devices) > 1:
        if programs is not None:
            _log_engine(call, "compiled, one thread per device")
            return compiled_devices.run(call)
        _log_engine(call, "multi-device (one thread per device)")
        return multi_device.run(call)
    if programs is not None:
        _log_engine(call, "compiled")
        return programs.run(call, call.signature)
    _log_engine(call, "vectorized")
    return vectorized.run(call)


def _inside_a_map() -> bool:
    """Whether this call runs as part of an enclosing computation, which a ``jit=True``
    call then joins, eagerly (or as part of the enclosing trace): inside a
    ``torch.func`` transform or a vectorized map (a vmap level), inside an instance of an
    enclosing map that runs without vmap (a bound axis: a device thread's single
    instance, whose collectives over the outer axis meet the other device threads, which
    a program traced on its own would wait for while it holds the tracing lock), or while
    a device slice is traced (:mod:`torchpmap._engines.compiled_devices`)."""
    return private.current_vmap_level() is not None or bool(_axis_env.current_frames()) or thread_ops.is_tracing()


def _log_engine(call: MappedCall, engine: str) -> None:
    if logger.isEnabledFor(logging.DEBUG):  # the hot path pays for the level check only
        where = "where the inputs are" if call.devices is None else ", ".join(map(str, call.devices))
        # eager, or jit=True inside a transform: part of the enclosing computation
        logger.debug("map over axis %r: %d instances on %s, engine: %s", call.axis_name, call.size, where, engine)


def _warn_not_compiled(call: MappedCall, why: str) -> None:
    _warn_eager(call, f"{why}; a mesh axis is not compiled yet (one device, and several devices along a plain "
                "pmap axis, are)", stacklevel=7)


def _warn_eager(call: MappedCall, why: str, stacklevel: int = 6) -> None:
    warnings.warn(
        f"pmap(jit=True) over axis {call.axis_name!r} {why}, so this call runs eagerly (same results).",
        JitFallbackWarning,
        stacklevel=stacklevel,
    )
