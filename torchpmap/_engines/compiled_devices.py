"""``jit=True`` across several devices in one process: a compiled slice per device thread.

The multi-device engine (:mod:`torchpmap._engines.multi_device`) runs each device's slice
of the axis in its own thread; collectives meet at the call's rendezvous. Compiled, the
same threads run the same slices, each through a program of its own:

1. **Trace.** On a signature's first call, every device thread traces its slice
   (:func:`torchpmap._engines.compiled.trace_graph`) with a stand-in exchange that records
   each collective's gather as one ``torchpmap::gather_threads`` node
   (:mod:`torchpmap._engines.thread_ops`). A trace never waits for another thread: the
   node's fake kernel gives the shapes. A slice's program bakes in its place on the axis
   (``axis_index``, the part of a ``ppermute`` it keeps), so each device has its own.
2. **Cut and compile.** Each trace is cut at its exchanges
   (:mod:`torchpmap._engines.segments`): inductor compiles the ops between two exchanges
   (AOTAutograd inside), the exchanges run eagerly through the thread's rendezvous.
3. **Run.** Later calls with the signature run each device's program in its thread: the
   segments compiled, the exchanges meeting as in the eager engine, and a ``.backward()``
   through a result, or ``torch.func.grad`` inside the map, differentiates as eagerly.

What a slice sends for a sum (``psum``, ``pmean``, ``pmax``, ``pmin``) is its own
instances' sum, as a process does (:class:`~torchpmap._engines.thread_ops.TracedThreadExchange`): the data-parallel
mean of per-instance weight gradients then compiles into one product over the slice's
samples (:func:`~torchpmap._engines.graph_rewrites.fold_instance_sums`), not a product per
instance gathered and summed across the devices, and the results agree with one device to
rounding, as compiled programs do. Under ``config.bitwise_placement`` every instance's value is
gathered, as the eager engine always does, and the math on them is one device's.

What is not compiled runs eagerly with a :class:`~torchpmap._engines.engine_warnings.JitFallbackWarning`
that names why: a trace that fails on any device (a branch on a tensor's value, ...), a
program that draws random numbers under ``randomness="same"`` (whose numbers are torch's
generator's on every placement), one that writes into its inputs, and ``torch.compile``
options other than inductor's ``options``. Under the default ``randomness="different"``
a program that draws compiles: each device's program draws from its device thread's own
stream (:func:`~torchpmap._engines.random_per_thread.compiled_draws`, around each segment
that draws). A ``jit=True`` pmap nested in the function is
part of the slice's program (see :func:`torchpmap._engines.dispatch.run`).
"""
from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import torch

from torchpmap._engines import (
    closure_writes,
    graph_rewrites,
    multi_device,
    segments,
    thread_ops,
    vectorized,
)
from torchpmap._engines.baton import Baton
from torchpmap._engines.compiled import (
    TRACING,
    BakedIn,
    DeviceSlices,
    ProgramCache,
    distinct,
    graph_inputs,
    inductor_options,
    trace_graph,
)
from torchpmap._engines.engine_warnings import JitFallbackWarning
from torchpmap._engines.mapped_call import MappedCall, OutputLayout
from torchpmap._engines.multi_device import (
    assembled,
    check_outputs_agree,
    device_thread,
    each_instance_alone,
    run_threads,
)
from torchpmap._engines.output_views import OutputViews
from torchpmap._engines.random_per_thread import Seed, call_seed, settle
from torchpmap._engines.thread_exchange import Rendezvous, ThreadExchange
from torchpmap._placement.devices import Device
from torchpmap._state import context as _context
from torchpmap._state import torch_private as private
from torchpmap._state.config import config
from torchpmap._state.log import logger


@dataclasses.dataclass
class _SliceProgram:
    """One device's compiled slice.

    Attributes:
        module: the slice's graph cut at its exchanges (:func:`segments.split_at_exchanges`).
        tensor_slots: positions in ``call.broadcast`` that are graph inputs.
        constants: tensors the function closes over, passed by reference at every call.
        output_views: views of the slice's values that its results are, taken outside the
            program (:mod:`~torchpmap._engines.output_views`): the instance dim that a device
            holding one instance adds, for one.
        baked: what the slice keeps of ``constants`` and of the modules its trace called.
    """

    module: torch.fx.GraphModule
    tensor_slots: list[int]
    constants: list[torch.Tensor]
    output_views: OutputViews | None
    baked: BakedIn

    def __call__(self, part: MappedCall, exchange: ThreadExchange) -> list[torch.Tensor]:
        with thread_ops.live(exchange), _context.autocast_off():  # as compiled._Program's
            outputs = list(self.module(*graph_inputs(part, self.tensor_slots), *self.constants))
        return outputs if self.output_views is None else self.output_views.apply(outputs)


@dataclasses.dataclass
class DeviceSlicePrograms:
    """The compiled slices of one signature, one per device, and what ``body`` recorded."""

    slices: list[_SliceProgram]
    output_layout: OutputLayout

    def constants_current(self) -> bool:
        """Whether every slice may run again (:meth:`~torchpmap._engines.compiled.BakedIn.current`):
        else the slices are traced anew."""
        return all(s.baked.current(s.constants) for s in self.slices)


class _NotCompiled(Exception):
    """A slice's program that this engine does not compile (the reason is the message)."""


def run(call: MappedCall) -> list[torch.Tensor]:
    """Runs ``call`` (``jit=True``, several devices, no transform around it) through its
    compiled slices, tracing them on the signature's first call; eagerly, with a
    warning, where they cannot be compiled."""
    call = multi_device.split_on_the_graph(call)
    cache = _slices_of(call)
    devices = list(call.devices or ())
    key = (call.signature, tuple(devices), config.bitwise_placement)  # it decides what a slice sends
    programs = cache.get(key, _UNTRACED)
    if programs is None:
        return multi_device.run(call)
    seed = call_seed(call.randomness, devices[0].torch_device)  # one seed: the trace and the run's
    try:
        return _traced_and_run(call, devices, programs, seed, cache, key)
    finally:
        settle(seed)  # the caller's generator moves on only where a thread took the seed


def _traced_and_run(
    call: MappedCall, devices: Sequence[Device], programs: DeviceSlicePrograms | object, seed: Seed,
    cache: dict, key: Hashable,
) -> list:
    """The call's outputs from its programs, traced first where there are none current."""
    if isinstance(programs, DeviceSlicePrograms) and programs.constants_current():
        call.output_layout.copy_from(programs.output_layout)  # body does not run
        return _run_slices(call, devices, programs, seed)
    try:
        programs = _trace_slices(call, devices, seed)
        outputs = _run_slices(call, devices, programs, seed)  # the first run compiles the segments
    except Exception as failure:  # the eager run below raises the user's own error, if any
        if isinstance(failure, TimeoutError):  # a device thread stopped in a collective: no limit of tracing
            raise
        outputs = multi_device.run(call)  # every thread of the failed attempt has stopped (one rendezvous each)
        cache[key] = None
        warnings.warn(_fallback_message(call, failure), JitFallbackWarning, stacklevel=6)
        return outputs
    cache.pop(key, None)  # traced anew: a closed-over tensor changed since
    while len(cache) >= config.jit_cache_size:
        cache.pop(next(iter(cache)))  # the oldest
    cache[key] = programs
    return outputs


_UNTRACED: Any = object()  # a signature not seen yet


def _slices_of(call: MappedCall) -> dict[Hashable, DeviceSlices | None]:
    """The device slices that ``call``'s function keeps, by (signature, devices): a
    :class:`DeviceSlicePrograms`, or None for a signature that runs eagerly."""
    cache = call.programs
    if not isinstance(cache, ProgramCache):
        raise TypeError(f"torchpmap: internal error: jit=True's programs are a {type(cache).__name__}")
    return cache.device_slices


def _trace_slices(call: MappedCall, devices: Sequence[Device], seed: Seed) -> DeviceSlicePrograms:
    """Every device thread traces its slice (no thread waits for another: see
    :mod:`thread_ops`); each trace is cut at its exchanges, to be compiled at its first run."""
    k = call.size // len(devices)
    rendezvous = Rendezvous(config.collective_timeout, Baton())
    direct = each_instance_alone(call)
    stand_in = thread_ops.TracedThreadExchange(len(devices), reduces_locally=not config.bitwise_placement)
    options = _cache_options(call)
    compile_segment = functools.partial(_compile_segment, options.get("options", {}))

    slices: dict[int, _SliceProgram] = {}

    def trace_one(d: int) -> list[torch.Tensor]:
        with device_thread(call, rendezvous, seed, d, k, devices[d]) as part:

            def engine(c: MappedCall) -> list[torch.Tensor]:
                if direct:
                    return vectorized.run_one(c, offset=d, axis_size=call.size, exchange=stand_in, seed=seed)
                return vectorized.run(c, offset=d * k, axis_size=call.size, exchange=stand_in, seed=seed)

            with TRACING, thread_ops.tracing():  # make_fx patches module globals: one trace at a time
                traced = trace_graph(part, engine)
            _check_compilable(traced.graph, call.randomness)
            module = segments.split_at_exchanges(traced.graph, compile_segment)
            slices[d] = _SliceProgram(
                module, traced.tensor_slots, traced.constants, traced.output_views, traced.baked
            )
            return []

    with closure_writes.undone_after():  # the slices write them when they run
        run_threads([functools.partial(trace_one, d) for d in range(len(devices))], rendezvous, devices, k)
    logger.info("pmap(jit=True) over axis %r: traced %d device slices", call.axis_name, len(slices))
    return DeviceSlicePrograms([slices[d] for d in range(len(devices))], dataclasses.replace(call.output_layout))


def _cache_options(call: MappedCall) -> dict[str, Any]:
    """The function's ``torch.compile`` options, when inductor alone compiles them: a
    ``mode`` or a ``backend`` (Dynamo's) is used on one device only."""
    cache = call.programs
    options = dict(cache.options) if isinstance(cache, ProgramCache) else {}
    if not set(options) <= {"options"}:
        raise _NotCompiled(f"torch.compile options {sorted(set(options) - {'options'})} are only used on one device")
    return options


def _compile_segment(
    options: Mapping[str, Any], graph: torch.fx.GraphModule, inputs: Sequence[torch.Tensor]
) -> Callable[..., Any]:
    """Inductor's program for a segment, for inputs like ``inputs`` (``options`` patch its
    config); one compilation at a time in the process, as for any program."""
    with TRACING, _context.autocast_off():  # as compiled._trace's
        return private.compile_graph(graph, distinct(inputs), inductor_options(options))


def _check_compilable(graph: torch.fx.GraphModule, randomness: str) -> None:
    """Raises :class:`_NotCompiled` for a slice's trace that this engine leaves eager.

    A program that draws random numbers compiles under ``randomness="different"``: each
    device's program draws from its thread's own stream
    (:func:`~torchpmap._engines.random_per_thread.compiled_draws`), other numbers than the
    eager engine's, as one device's compiled program draws other numbers than its eager
    run. Under ``"same"`` the numbers are the eager ones on every placement, which a
    compiled program would not draw (``"per_instance"`` refuses ``jit=True`` before)."""
    if graph_rewrites.writes_an_input(graph):
        raise _NotCompiled("the program writes into one of its inputs, which only the one-device program compiles")
    draw = graph_rewrites.random_draw(graph)
    if draw is not None and randomness != "different":
        raise _NotCompiled(
            f'the program draws random numbers ({draw.target}) under randomness="{randomness}", whose numbers '
            "are the eager engine's on every placement, which a compiled program would not draw"
        )


def _run_slices(
    call: MappedCall, devices: Sequence[Device], programs: DeviceSlicePrograms, seed: Seed
) -> list[torch.Tensor]:
    """Each device thread runs its compiled slice; the exchanges meet at one rendezvous.
    Device ``d``'s program draws from stream ``seed + d`` (see :func:`_check_compilable`)."""
    k = call.size // len(devices)
    rendezvous, group = Rendezvous(config.collective_timeout, Baton()), object()
    torch_devices = tuple(d.torch_device for d in devices)
    threads = _cores_per_device(devices)

    def one_device(d: int) -> list[torch.Tensor]:
        with device_thread(call, rendezvous, seed, d, k, devices[d]) as part:
            if threads is not None and torch.get_num_threads() != threads:
                torch.set_num_threads(threads)  # this thread's (and the next new thread's: restored below)
            exchange = ThreadExchange(rendezvous, d, torch_devices, group)
            out = programs.slices[d](part, exchange)
            exchange.leave()
            return out

    bodies = [functools.partial(one_device, d) for d in range(len(devices))]
    try:
        per_device = run_threads(bodies, rendezvous, devices, k)
    finally:
        if threads is not None:
            torch.set_num_threads(torch.get_num_threads())  # the process' default: the caller's again
    check_outputs_agree(per_device, devices)
    return assembled(devices, per_device)


def _cores_per_device(devices: Sequence[Device]) -> int | None:
    """How many intra-op threads each CPU device's slice uses: the caller's, shared out
    (None: the caller's, as in the eager engine).

    A CPU device's kernels run in its device thread, on OpenMP, which gives every thread
    that starts a parallel region a team of threads of its own. The compiled slices of
    CPU devices run at once (see :mod:`~torchpmap._engines.segments`); with the caller's
    count each, N devices would start N times the threads the caller uses, on the same
    cores. Worse, OpenMP's idle threads then stop spinning and sleep (libgomp does so
    once a process has more threads than cores), and every parallel region pays for
    waking them, in every thread of the process. So the caller's threads are shared out
    between the CPU devices (2 devices on 2 cores: one each), which also keeps the
    caller's own team fast after the call.

    Not under ``config.bitwise_placement``, whose slices must reduce as one device does,
    and not for CUDA devices, whose kernels do not run in the device thread.
    """
    if config.bitwise_placement or len(devices) < 2 or any(d.torch_device.type != "cpu" for d in devices):
        return None
    return max(1, torch.get_num_threads() // len(devices))


def _fallback_message(call: MappedCall, failure: Exception) -> str:
    first_line = (str(failure).strip().splitlines() or [""])[0]
    why = first_line if isinstance(failure, _NotCompiled) else f"{type(failure).__name__}: {first_line}"
    return (
        f"pmap(jit=True) over axis {call.axis_name!r} on {len(call.devices or ())} devices could not be compiled for "
        f"these argument shapes and types, so it runs eagerly for them (same results, no compilation): {why}."
    )
