"""``jit=True``: the vectorized program traced once per input signature, then compiled.

``torch.compile`` cannot compile a pmap directly: dynamo ignores the custom batching
rules that implement collectives (see :mod:`torchpmap._state.compile_guard`). So the order is
reversed. First ``make_fx`` traces the *vectorized* engine on fake tensors: functorch
runs every batching rule, collectives included, and the trace records only the plain
batched aten ops that result (a ``psum`` becomes a ``sum`` over the batch dim). Then
inductor compiles that graph, which holds nothing it could get wrong, and AOTAutograd
makes it differentiable for a ``.backward()`` outside the map. With ``jit=True`` (or only
inductor ``options``) it does so without Dynamo (``torch_private.compile_graph``): the
cache's signature already decides at every call what Dynamo's guards would check, which
saves their cost (36 µs of the 1.6 ms benchmark MLP step). Other ``torch.compile``
options (a ``mode``, a ``backend``), and a program that writes into one of its inputs
(whose aliasing only Dynamo's guards follow), go through ``torch.compile``. A tensor
passed for two arguments is traced as two inputs that share memory, so that the program
serves two different tensors too.

AOTAutograd differentiates the recorded ops with the same derivative formulas as eager
autograd, but the trace does not show what autograd did *not* record: a ``detach()``
(which ``make_fx`` rewrites to a plain ``alias`` unless it is given a decomposition table,
since torch 2.14), ops under ``torch.no_grad()``, the ops inside a custom
``torch.autograd.Function``. :class:`_GradientAudit` watches the trace and writes every
such stop of the gradient into the graph as an ``aten.detach``; a gradient the graph
cannot express (a custom Function's own ``backward``) makes the call run eagerly.

What a trace bakes in, like ``jax.jit``: the Python control flow of the function, its
non-tensor arguments, and the identity of the tensors it closes over (those are passed to
the compiled graph by reference at every call, so in-place updates such as an optimizer
step are seen). A branch on a tensor's value cannot be traced: that
signature then runs eagerly, with a :class:`JitFallbackWarning`. The caller keys the
cache so that anything else that changes the program (shapes, strides, dtypes, devices,
``requires_grad``, non-tensor values, grad mode, autocast, the default dtype) traces anew.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import inspect
import threading
import warnings
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple, Protocol

import torch
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakTensorKeyDictionary

from torchpmap._engines import closure_writes, graph_rewrites, module_modes, output_views, rnn_weights, vectorized
from torchpmap._engines.engine_warnings import JitFallbackWarning, JitRecompileWarning
from torchpmap._engines.mapped_call import CompiledPrograms, Engine, MappedCall, OutputLayout
from torchpmap._engines.output_views import OutputViews
from torchpmap._placement import devices as _devices
from torchpmap._placement.sharded import ShardedTensor, as_local
from torchpmap._state import context as _context
from torchpmap._state import torch_private as private
from torchpmap._state.config import config
from torchpmap._state.log import logger
from torchpmap._state.torch_private import TorchDispatchMode

# Fake-tensor traces in threads that exit crashed torch 2.11 later: register what the
# first trace would, from the importing thread (see the entry's docstring).
private.ensure_cuda_device_guard()

#: After this many calls, a function that traced on most of them gets a warning.
_RECOMPILE_WINDOW = 8


class Signature(NamedTuple):
    """Everything about a call that a compiled program bakes in: a call whose signature
    differs from every kept program's is traced anew."""

    structure: Hashable  # the pytree structure of the arguments, in_axes applied
    statics: tuple  # static_broadcasted_argnums' values
    leaves: tuple  # per leaf: shape, strides, dtype, device, requires_grad; a value for a non-tensor
    grad_enabled: bool
    autocast: tuple  # the autocast regions in force, with their dtypes
    default_dtype: torch.dtype  # of the tensors the function creates
    devices: Any  # where a nested pmap is pinned


def signature_of(structure: Hashable, statics: dict[int, Any], leaves: Sequence[Any]) -> Signature:
    """The :class:`Signature` of a call with these flattened arguments, in the current state."""
    return Signature(
        structure,
        tuple(statics.items()),
        tuple(_leaf_signature(leaf) for leaf in leaves),
        torch.is_grad_enabled(),
        _autocast_state(),
        torch.get_default_dtype(),
        _devices.current_default(),
    )


def _leaf_signature(leaf: Any) -> Hashable:
    if isinstance(leaf, ShardedTensor):  # first: it is a torch.Tensor, whose strides are not its shards'
        return (
            "sharded", leaf.shape, leaf.dtype, leaf.requires_grad, leaf.shard_dim,
            tuple((s.device, _leaf_signature(s.tensor)) for s in leaf.shards),
        )
    if isinstance(leaf, torch.Tensor):
        return (leaf.shape, leaf.stride(), leaf.dtype, leaf.device, leaf.requires_grad)
    try:
        hash(leaf)
    except TypeError:
        return _ByIdentity(leaf)  # baked in by identity
    return (type(leaf), leaf)


def _autocast_state() -> tuple:
    """The autocast regions in force, with their dtypes: a trace bakes in their casts."""
    return tuple(
        (d, torch.get_autocast_dtype(d)) for d in _context.DEVICE_AUTOCAST_TYPES if torch.is_autocast_enabled(d)
    )


class _ByIdentity:
    """A key for an unhashable object: equal only to itself. It holds the object, so
    that its id cannot be reused by another object while a compiled program keys on it."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any):
        self.obj = obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _ByIdentity) and other.obj is self.obj


def _what_changed(old: Hashable, new: Hashable) -> str:
    """Which fields of two signatures differ, for the recompilation warning."""
    old, new = _innermost(old), _innermost(new)
    if isinstance(old, Signature) and isinstance(new, Signature):
        fields = [f for f in Signature._fields if getattr(old, f) != getattr(new, f)]
        if fields == ["leaves"]:
            changed = [i for i, (a, b) in enumerate(zip(old.leaves, new.leaves)) if a != b]
            return f"the shapes, strides, dtypes or values of argument leaves {changed[:5]}"
        return ", ".join(fields) or "the program's place in its process group"
    return "the arguments"


def _innermost(signature: Hashable) -> Hashable:
    """A distributed call keys on (signature, exchange): the Signature inside."""
    while isinstance(signature, tuple) and not isinstance(signature, Signature) and signature:
        signature = signature[0]
    return signature


class DeviceSlices(Protocol):
    """What :class:`ProgramCache` keeps for a signature compiled across the devices of one
    process: :class:`torchpmap._engines.compiled_devices.DeviceSlicePrograms` (which
    imports this module, so the cache names it by what it reads)."""

    output_layout: OutputLayout


class ProgramCache:
    """The compiled programs of one mapped function, by input signature.

    A signature whose trace or compilation fails runs eagerly from then on, with a
    warning that says why: if the eager run fails too, its error (the user's) is what
    the caller sees; if it succeeds, the failure was a limit of tracing, and eager
    results are the right ones.
    """

    def __init__(self, options: Mapping[str, Any]):
        self.options = dict(options)  # for torch.compile
        # least recently used first; None: that signature runs eagerly
        self._programs: collections.OrderedDict[Hashable, _Program | None] = collections.OrderedDict()
        self._calls = self._traces = 0
        self._last: Hashable = None
        self._warned = False
        # several devices in one process: (signature, devices) -> the compiled device slices
        # (see torchpmap._engines.compiled_devices); None: that signature runs eagerly
        self.device_slices: dict[Hashable, DeviceSlices | None] = {}

    def __len__(self) -> int:
        return len(self._programs)

    def compiled_count(self) -> int:
        return sum(p is not None for p in self._programs.values())

    def run(
        self,
        call: MappedCall,
        signature: Hashable,
        engine: Engine = vectorized.run,
        traced_engine: Engine | None = None,
        may_retry: Callable[[Exception], bool] = lambda failure: True,
    ) -> list[torch.Tensor]:
        """Runs ``call`` through the program for ``signature``, tracing it on first sight.

        ``engine`` runs a call eagerly (a signature that could not be compiled);
        ``traced_engine`` (default: ``engine``) is what the trace records, where the
        two differ in how the slices talk (an exchange across processes must be an op).
        A failure for which ``may_retry`` is False is no limit of tracing but a fault of
        the run (a collective failed, so the other processes have moved on): it
        propagates instead of an eager retry.
        """
        self._calls += 1
        program = self._programs.get(signature, _UNTRACED)
        if program is not _UNTRACED:
            self._programs.move_to_end(signature)  # recently used
        if program is None:
            return engine(call)
        if program is not _UNTRACED and program.constants_current():
            call.output_layout.copy_from(program.output_layout)  # body will not run
            return program(call)
        # Tracing and compiling are not thread-safe (make_fx patches module globals): one
        # thread at a time traces, in the whole process, and a thread that waited for
        # another's trace of this signature runs that program instead of tracing again.
        with TRACING:
            program = self._programs.get(signature, _UNTRACED)
            if program is not _UNTRACED and (program is None or program.constants_current()):
                traced_meanwhile = program
            else:
                return self._trace_and_run(call, signature, engine, traced_engine, may_retry)
        if traced_meanwhile is None:
            return engine(call)
        call.output_layout.copy_from(traced_meanwhile.output_layout)
        return traced_meanwhile(call)

    def _trace_and_run(
        self,
        call: MappedCall,
        signature: Hashable,
        engine: Engine,
        traced_engine: Engine | None,
        may_retry: Callable[[Exception], bool],
    ) -> list[torch.Tensor]:
        """Traces ``call``'s program for ``signature`` and runs it (its first call compiles
        it); eagerly, from then on, when that fails (see :meth:`run`). Holds ``TRACING``."""
        # traced anew: first sight, or a closed-over tensor changed (constants_current)
        self._programs.pop(signature, None)
        while len(self._programs) >= config.jit_cache_size:
            _, evicted = self._programs.popitem(last=False)  # the least recently used
            if evicted is not None:
                evicted.release()
        self._note_trace(call, signature)
        try:
            with closure_writes.undone_after():  # the program writes them when it runs
                program = _trace(call, self.options, traced_engine or engine)
            outputs = program(call)  # the first call compiles; body ran while tracing
        except Exception as failure:
            if not may_retry(failure):
                raise
            outputs = engine(call)
            self._programs[signature] = None
            warnings.warn(_fallback_message(call, failure), JitFallbackWarning, stacklevel=5)
            return outputs
        self._programs[signature] = program
        return outputs

    def _note_trace(self, call: MappedCall, signature: Hashable) -> None:
        """Counts a trace; warns once when most calls trace, saying what keeps changing."""
        self._traces += 1
        previous, self._last = self._last, signature
        logger.info(
            "pmap(jit=True) over axis %r: tracing program %d (call %d)", call.axis_name, self._traces, self._calls
        )
        if self._warned or self._calls < _RECOMPILE_WINDOW or self._traces * 2 <= self._calls or previous is None:
            return
        self._warned = True
        warnings.warn(
            f"pmap(jit=True) over axis {call.axis_name!r} traced and compiled on {self._traces} of its "
            f"{self._calls} calls: {_what_changed(previous, signature)} keep changing between calls, and each "
            f"new combination is a new program (at most torchpmap.config.jit_cache_size = {config.jit_cache_size} "
            "are kept). Keep those fixed (pad shapes to a few sizes), or use jit=False for this function.",
            JitRecompileWarning,
            stacklevel=6,
        )


def _is_compiled_programs(cache: ProgramCache) -> CompiledPrograms:
    """For the type checker: a :class:`ProgramCache` is the :class:`CompiledPrograms` that
    ``MappedCall.programs`` holds (its ``run`` takes the calls the engines make)."""
    return cache


def _fallback_message(call: MappedCall, failure: Exception) -> str:
    first_line = (str(failure).strip().splitlines() or [""])[0]
    why = f"{type(failure).__name__}: {first_line}"
    if isinstance(failure, private.value_dependent_errors()):
        why = (
            f"it depends on the value of a tensor ({why}); a compiled program fixes its control flow and output "
            "shapes when it is traced. Compute such a branch with torch.where"
        )
    return (
        f"pmap(jit=True) over axis {call.axis_name!r} could not be compiled for these argument shapes and types, "
        f"so it runs eagerly for them (same results, no compilation): {why}."
    )


_UNTRACED: Any = object()  # ProgramCache: a signature not seen yet

#: Held while a program is traced and compiled (see :meth:`ProgramCache.run`).
TRACING = threading.RLock()


@dataclasses.dataclass
class _Program:
    compiled: Callable[..., list[torch.Tensor]]
    tensor_slots: list[int]  # positions in call.broadcast that are graph inputs
    constants: list[torch.Tensor]  # tensors the function closes over, passed by reference
    output_layout: OutputLayout  # what body recorded while it was traced
    output_views: OutputViews | None  # views of the program's values that its results are, taken outside
    baked: BakedIn  # what it keeps of its constants and of the modules it called
    graph_forward: Any = None  # what was handed to torch.compile (None: compiled by inductor alone)

    def __call__(self, call: MappedCall) -> list[torch.Tensor]:
        with _context.autocast_off():  # the trace has the caller's casts (see _trace)
            outputs = self.compiled(*graph_inputs(call, self.tensor_slots), *self.constants)
        return outputs if self.output_views is None else self.output_views.apply(outputs)

    def release(self) -> None:
        """Frees what torch.compile keeps for this program (it is being evicted)."""
        if self.graph_forward is not None:
            private.release_compiled(self.graph_forward)

    def constants_current(self) -> bool:
        """See :meth:`BakedIn.current`."""
        return self.baked.current(self.constants)


@dataclasses.dataclass(frozen=True)
class BakedIn:
    """What a traced program keeps of what is not its arguments, checked before it is
    reused (one device's program, and each device's slice alike).

    Attributes:
        constant_signatures: the :func:`_leaf_signature` of each tensor it closes over.
        module_modes: the modules the trace called, in the train/eval mode they had
            (:mod:`~torchpmap._engines.module_modes`).
    """

    constant_signatures: tuple[Hashable, ...]
    module_modes: module_modes.ModuleModes

    def current(self, constants: Sequence[torch.Tensor]) -> bool:
        """False when a closed-over tensor changed since the trace in what the program
        bakes in: its ``requires_grad`` (which decides where the graph stops gradients: a
        layer unfrozen after the first call), or its shape, strides, dtype or device
        (``module.half()`` and ``.to()`` change a parameter in place, through ``.data``);
        or when a module it called is in the other train/eval mode now (``model.eval()``)."""
        if constants and any(_leaf_signature(c) != k for c, k in zip(constants, self.constant_signatures)):
            return False
        return module_modes.current(self.module_modes)


def graph_inputs(call: MappedCall, tensor_slots: Sequence[int]) -> list[torch.Tensor]:
    """A compiled program's tensor inputs for ``call``: the mapped tensors, then the
    broadcast tensors at ``tensor_slots``, on the call's device."""
    device = call.devices[0].torch_device if call.devices else None
    # resolve_neg: inductor reads a tensor with the negative bit (``x.conj().imag``) as if it
    # were unset, in plain torch.compile too (``v * 2 + 1`` of [-2, -4] gave [5, 9]); a copy
    # only for such a tensor
    return [as_local(t, device).resolve_neg() for t in call.mapped] + [
        as_local(call.broadcast[k], device).resolve_neg() for k in tensor_slots
    ]


@dataclasses.dataclass
class TracedGraph:
    """A mapped call's program as an aten graph, before compilation.

    Attributes:
        graph: the graph; its inputs are the mapped tensors, then the broadcast tensors
            at ``tensor_slots``, then ``constants``.
        inputs: the tensors it was traced on (the call's; each repeat a distinct object).
        tensor_slots: positions in ``call.broadcast`` that are graph inputs.
        constants: tensors the function closes over, passed by reference at every call.
        output_layout: what ``body`` recorded while it was traced.
        output_views: the view ops that the graph's results were of its own values, taken
            out of the graph (:mod:`~torchpmap._engines.output_views`), to be run on what the
            compiled graph returns; None where there were none.
        baked: what the program keeps of ``constants`` and of the modules the trace called.
    """

    graph: torch.fx.GraphModule
    inputs: list[torch.Tensor]
    tensor_slots: list[int]
    constants: list[torch.Tensor]
    output_layout: OutputLayout
    output_views: OutputViews | None
    baked: BakedIn


def trace_graph(call: MappedCall, engine: Engine) -> TracedGraph:
    """Traces what ``engine`` runs for ``call`` on fake tensors (see the module docstring),
    with the gradient stops of eager autograd written in, and the rewrites that every
    compiled program gets."""
    tensor_slots = [k for k, v in enumerate(call.broadcast) if isinstance(v, (torch.Tensor, ShardedTensor))]
    n_mapped = len(call.mapped)

    def program(*tensors: torch.Tensor) -> list[torch.Tensor]:
        broadcast = list(call.broadcast)
        for k, t in zip(tensor_slots, tensors[n_mapped:]):
            broadcast[k] = t
        traced_call = dataclasses.replace(call, mapped=tensors[:n_mapped], broadcast=broadcast)
        with _NoDataAssignment(), _EagerChecks(tensors):
            if not torch.is_grad_enabled():  # part of the signature: the program never runs with autograd
                return engine(traced_call)
            with _GradientAudit() as audit:
                outputs = engine(traced_call)
        return [audit.returned(t) for t in outputs]

    # An explicit decomposition table, even empty: without one, make_fx (torch >= 2.14) records
    # detach as alias, and AOTAutograd would differentiate through it.
    # A tensor passed for two arguments is traced as two inputs (that share its memory), not as one,
    # which the graph would then read for both at every later call.
    inputs = distinct(graph_inputs(call, tensor_slots))
    with _onednn_off(), rnn_weights.traced(), module_modes.recorded() as called:  # fused RNN kernels: as cells
        graph = private.make_fx_real_inputs(program, decomposition_table={})(*inputs)
    # e.g. forward-AD shape checks that return a bool dynamo refuses; every exchange stays
    graph.graph.eliminate_dead_code(is_impure_node=graph_rewrites.kept)
    graph_rewrites.fold_instance_sums(graph)  # per-instance products summed over instances -> one product
    graph_rewrites.split_sliced_products(graph)  # a bucket's rows of a weight gradient: their own product
    constants = _lift_constants(graph)
    _refuse_meta_values(graph, constants, inputs)
    views = output_views.peel(graph)  # results that are views of the program's values: taken outside
    layout = dataclasses.replace(call.output_layout)
    baked = BakedIn(tuple(_leaf_signature(c) for c in constants), module_modes.modes_of(called))
    return TracedGraph(graph, inputs, tensor_slots, constants, layout, views, baked)


def _trace(call: MappedCall, options: Mapping[str, Any], engine: Engine) -> _Program:
    # The trace records the casts of the caller's autocast and of the regions the function
    # enters itself (autocast(enabled=False) around a product, say); the program is then
    # compiled and run with autocast off, where AOTAutograd's trace of the graph would
    # cast its ops again, over those regions (_Program.__call__).
    traced = trace_graph(call, engine)
    graph, inputs, tensor_slots, constants = traced.graph, traced.inputs, traced.tensor_slots, traced.constants
    draw = graph_rewrites.random_draw(graph) if call.randomness == "same" else None
    if draw is not None:  # "same": torch's generator's numbers, which a compiled program would not draw
        raise NotImplementedError(
            f'randomness="same" draws the numbers of torch\'s generator, as one device does eagerly, and the '
            f"program draws random numbers ({draw.target}), which a compiled program would draw from a stream "
            "of its own"
        )
    output_layout = traced.output_layout
    kwargs = {"fullgraph": True, "dynamic": False, **options}
    if graph_rewrites.start_exchanges_early(graph) and "mode" not in kwargs:  # a bucket starts once its gradients exist
        # and inductor keeps that order: its peak-memory pass would put the next layer's
        # product back before the bucket's start (torch.compile takes a mode or options)
        kwargs["options"] = {"reorder_for_peak_memory": False, **kwargs.get("options", {})}
    if "mode" not in kwargs and kwargs.get("backend", "inductor") == "inductor":  # torch.compile: a mode or options
        kwargs["options"] = inductor_options(kwargs.get("options", {}))
    if set(options) <= {"options"} and not graph_rewrites.writes_an_input(graph):  # no mode, backend or dynamic
        # Inductor alone: the signature decides everything Dynamo's guards would check, except
        # which inputs share memory, which a program that only reads them need not know
        with _context.autocast_off():  # see above
            compiled = private.compile_graph(graph, distinct([*inputs, *constants]), kwargs.get("options", {}))
        return _Program(compiled, tensor_slots, constants, output_layout, traced.output_views, traced.baked)
    # the forward function, not the module: nn.Module.__call__ would cost microseconds per call
    compiled = torch.compile(graph.forward, **kwargs)
    return _Program(
        compiled, tensor_slots, constants, output_layout, traced.output_views, traced.baked, graph_forward=graph.forward
    )


def inductor_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """The inductor options of a program: the caller's ``options``, over roundings like
    eager's at each low-precision cast (:func:`torch_private.eager_rounding_options`), so
    that one device's program and each device's slice, fused differently, give the same
    numbers (``jit={"options": {"emulate_precision_casts": False}}`` turns that off)."""
    return {**private.eager_rounding_options(), **options}


@contextlib.contextmanager
def _onednn_off() -> Iterator[None]:
    """oneDNN off while a program is traced (``torch.backends.mkldnn.enabled``, nothing
    else of its settings). A float32 ``nn.LSTM`` on CPU otherwise records
    ``aten::mkldnn_rnn_layer``, which AOTAutograd cannot differentiate when the gradient
    is taken outside the map ("expected Tensor() for op ... mkldnn_rnn_layer"); without
    it the LSTM is recorded as its cells' ops, which inductor compiles. The flag is read
    as ops decompose, so the trace sees it and inductor's later choices do not. It is the
    process' flag: an eager oneDNN op in another thread during the trace takes torch's
    native kernel instead (the same math, rounded its own way)."""
    mkldnn: Any = torch.backends.mkldnn  # a module whose flags are properties (typed as descriptors)
    previous = mkldnn.enabled
    mkldnn.enabled = False
    try:
        yield
    finally:
        mkldnn.enabled = previous


def distinct(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors``, each repeat of one tensor object replaced by a new tensor object on the
    same memory, with the same ``requires_grad``: to trace or compile a program for inputs
    that may or may not be the same tensor."""
    seen: set[int] = set()
    distinct = []
    for t in tensors:
        if id(t) in seen:
            t = t.detach().requires_grad_(t.requires_grad)
        seen.add(id(t))
        distinct.append(t)
    return distinct


_DATA = inspect.getattr_static(torch.Tensor, "data")  # the ``Tensor.data`` descriptor


class _NoDataAssignment(TorchFunctionMode):
    """Refuses ``t.data = other`` while a program is traced, so that the call runs eagerly.

    The assignment swaps the tensor behind ``t`` without a dispatcher op, so ``make_fx``
    records nothing for it, and the compiled program would go on reading the old values:
    on several devices, where each device runs its instance without vmap (which refuses
    ``.data`` itself), ``jit=True`` returned ``t + 1`` for ``t.data = t * 3; return t + 1``.
    """

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if getattr(func, "__self__", None) is _DATA and getattr(func, "__name__", "") == "__set__":
            raise RuntimeError(
                "`tensor.data = ...` cannot be traced: the trace would not see the new values (use "
                "tensor.copy_(...) under torch.no_grad(), or a new tensor)"
            )
        return func(*args, **(kwargs or {}))


class _EagerChecks(TorchDispatchMode):
    """While a program is traced, refuses what eager PyTorch refuses and fake tensors let
    through, so that the call runs eagerly (eager's error, or eager's numbers):

    * an in-place write into a tensor several of whose elements share memory (a dim of
      stride 0: ``t.expand(3, 2)``). Fake tensors do not run eager's check, and the
      compiled program gets such writes wrong: ``t.expand(3, 2).add_(1)``, which every
      eager placement refuses ("more than one element of the written-to tensor refers to
      a single memory location"), compiled to a sum written through the view; ``fill_``,
      which eager allows there, compiled to other numbers (``(t * 1).unsqueeze(0)
      .expand(3, 2).fill_(2.0) + t`` gave ``[6, 5]`` for ``t = [0, 1]`` under plain
      ``torch.compile`` too, where eager gives ``[2, 3]``);
    * an elementwise op whose kernel refuses its dtypes. Fake tensors compute only
      result dtypes: ``torch.hypot`` of integers ("not implemented for 'Int'") compiled,
      and ``a.mul_(torch.tensor(2.5))`` on an integer ``a`` ("result type Float can't be
      cast to the desired output type Int") wrote truncated products. Each elementwise op
      runs once more on one-element real tensors of its dtypes, on its device (its
      random ones excepted: they would draw); its error refuses the trace;
    * a change of an argument's shape or strides in place (``v.t_()``, ``transpose_``,
      ``unsqueeze_`` of an instance's slice). Eager changes its own view of the argument
      (see :func:`torchpmap._engines.vectorized.run`); the compiled program, which goes
      through ``torch.compile`` for it, transposed the caller's tensor.

    ``inputs``: the program's input tensors (fake), whose views the function sees.
    """

    def __init__(self, inputs: Sequence[torch.Tensor]) -> None:
        super().__init__()
        self._inputs = {id(t) for t in inputs}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if _changes_metadata(func) and args and isinstance(args[0], torch.Tensor):
            if id(args[0]) in self._inputs or id(args[0]._base) in self._inputs:
                raise RuntimeError(
                    f"the program changes the shape or strides of an argument in place ({func}): a compiled "
                    "program would change the caller's tensor, where eager changes the instance's view of it"
                )
        written = _values_written(func)
        if written:
            names = [a.name for a in getattr(private.op_schema(func), "arguments", ())]
            for name, value in [*zip(names, args), *kwargs.items()]:
                if name in written and isinstance(value, torch.Tensor) and _overlaps_itself(value):
                    raise RuntimeError(
                        f"the program writes in place ({func}) into a tensor several of whose elements share "
                        f"memory (shape {tuple(value.shape)}, strides {value.stride()}, as from expand): eager "
                        "PyTorch refuses most such writes, and a compiled program gets the others wrong. Clone "
                        "the tensor before writing into it."
                    )
        if _checks_kernel(func):
            _run_on_one_element(func, args, kwargs)
        return func(*args, **kwargs)


@functools.cache
def _checks_kernel(func: Any) -> bool:
    """Whether the trace runs ``func`` on one-element real tensors: elementwise, not random."""
    tags = getattr(func, "tags", ())
    return torch.Tag.pointwise in tags and torch.Tag.nondeterministic_seeded not in tags


def _run_on_one_element(func: Any, args: tuple, kwargs: dict) -> None:
    """``func`` on real tensors of one element (rank 0 stays rank 0: it counts for type
    promotion) with the dtypes and devices of its tensor arguments, holding ones (no
    division by zero). Raises what eager's kernel raises for those dtypes."""
    leaves, spec = private.pytree.tree_flatten((args, kwargs))
    if any(isinstance(t, torch.Tensor) and t.device.type == "meta" for t in leaves):
        return
    with private.modes_disabled(), torch.no_grad():
        small = [
            torch.ones(() if t.dim() == 0 else (1,), dtype=t.dtype, device=t.device)
            if isinstance(t, torch.Tensor) else t
            for t in leaves
        ]
        small_args, small_kwargs = private.pytree.tree_unflatten(small, spec)
        func(*small_args, **small_kwargs)


@functools.cache
def _changes_metadata(func: Any) -> bool:
    """Whether ``func`` changes its first argument's shape, strides or storage in place
    (``t_``, ``unsqueeze_``, ``resize_``, ``set_``: tagged ``inplace_view``)."""
    return torch.Tag.inplace_view in getattr(func, "tags", ())


@functools.cache
def _values_written(func: Any) -> frozenset[str]:
    """The names of the arguments ``func`` writes values into (:func:`_written_arguments`),
    none for an op that changes only their metadata (:func:`_changes_metadata`)."""
    return frozenset() if _changes_metadata(func) else _written_arguments(func)


def _overlaps_itself(t: torch.Tensor) -> bool:
    """Whether elements of ``t`` surely share memory (a dim of more than one element with
    stride 0), the case eager PyTorch refuses to write into."""
    return any(size > 1 and stride == 0 for size, stride in zip(t.shape, t.stride()))


class _UntraceableGradient(RuntimeError):
    """The eager gradient of a call is one that its traced graph cannot express."""


class _GradientAudit(TorchDispatchMode):
    """While a program is traced, makes its graph stop gradients where eager autograd does.

    ``make_fx`` records the ops that reach the dispatcher below autograd; AOTAutograd then
    differentiates every recorded op with the op's own derivative formula, as eager
    autograd does. The two differ only where eager autograd did not record an op that the
    trace holds: with grad mode off (``torch.no_grad()``, and the forward of a custom
    ``torch.autograd.Function``) and at a ``detach``. This mode sees each op before
    ``make_fx`` records it, with the autograd state of its inputs:

    * an input that carries a gradient in the graph but not in eager autograd (grad mode
      is off, or the tensor was made with grad mode off) reaches the op through an
      ``aten.detach``, recorded in the graph. A tensor made with grad mode on that does not
      require grad was made below autograd, inside an op that autograd recorded (the
      conjugate fallback's copy of ``v.conj()`` for ``v * v.conj()``): no stop there, or
      the gradient through that op would be lost;
    * an input whose eager gradient comes from something other than the op that made it
      (a custom Function's ``backward``, set on an output its forward made with grad mode
      off) cannot be compiled: :class:`_UntraceableGradient`, and the call runs eagerly.

    A custom op with its own autograd kernel (``torch.library``) is recorded as one node
    that AOTAutograd differentiates with that same kernel, so it counts as recorded.
    """

    def __init__(self) -> None:
        super().__init__()
        # tensor made in the trace -> whether the graph would carry a gradient for it
        self._carries: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
        # tensors made in the trace by an op that eager autograd did not record
        self._unrecorded: WeakTensorKeyDictionary = WeakTensorKeyDictionary()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        recorded = torch.is_grad_enabled() or _has_own_autograd(func)
        written = _written_arguments(func)
        schema_args = getattr(private.op_schema(func), "arguments", ())
        args = tuple(
            self._stop(a, recorded, i < len(schema_args) and schema_args[i].name in written)
            for i, a in enumerate(args)
        )
        kwargs = {k: self._stop(v, recorded, k in written) for k, v in kwargs.items()}
        carries = func is not torch.ops.aten.detach.default and any(
            self._carried(t) for t in private.pytree.tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)
        )
        out = func(*args, **kwargs)
        for t in private.pytree.tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._carries[t] = carries and _differentiable_dtype(t)
                if recorded:
                    self._unrecorded.pop(t, None)
                else:
                    self._unrecorded[t] = True
        return out

    def returned(self, t: Any) -> Any:
        """An output of the traced program, as the graph must return it.

        Refuses one that requires grad where the graph carries no gradient: the function
        made a tensor require grad itself (``x.requires_grad_()``, ``torch.ones(2,
        requires_grad=True)``), and a compiled program's results require grad only
        through its inputs and the tensors it closes over."""
        for leaf in private.pytree.tree_leaves(t):
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad and not self._carried(leaf):
                raise _UntraceableGradient(
                    "the function makes a tensor require grad itself (requires_grad_(), or requires_grad=True), "
                    "which a compiled program cannot carry to its results"
                )
        return self._stop(t, recorded=True, written=False)

    def _carried(self, t: torch.Tensor) -> bool:
        carries = self._carries.get(t)
        if carries is None:  # an argument of the program, or a tensor it closes over
            return t.requires_grad and _differentiable_dtype(t)
        return carries

    def _stop(self, value: Any, recorded: bool, written: bool) -> Any:
        """``value`` (a tensor, a list of them, or anything else) as an op must see it."""
        return private.pytree.tree_map_only(torch.Tensor, lambda t: self._stop_one(t, recorded, written), value)

    def _stop_one(self, t: torch.Tensor, recorded: bool, written: bool) -> torch.Tensor:
        # (``grad_fn`` last: reading it regenerates a view's node through view ops that
        # this mode sees, and a second read of it from there waits on the view's own lock)
        if recorded and t.requires_grad and t in self._unrecorded and t.grad_fn is not None:
            raise _UntraceableGradient(
                "a tensor's gradient comes from a custom torch.autograd.Function's backward, which a compiled "
                "program cannot follow (it differentiates the ops the Function's forward traced)"
            )
        # The same edge in the graph and in eager: a tensor eager autograd tracks, or one made
        # below autograd, inside an op it recorded (the copy torch makes of a conjugate view
        # for the kernel of ``v * v.conj()``, say): its consumers are that op's own pieces,
        # which AOTAutograd differentiates into the recorded op's gradient.
        if not self._carried(t) or (recorded and (t.requires_grad or t not in self._unrecorded)):
            return t
        if written:  # an in-place update without autograd: the graph would differentiate it
            if t.requires_grad:
                raise _UntraceableGradient(
                    "a tensor that requires grad is updated in place with grad mode off, which a compiled "
                    "program, differentiating the traced ops, cannot follow"
                )
            return t
        return torch.ops.aten.detach.default(t)  # recorded by make_fx: the graph stops the gradient here


def _differentiable_dtype(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


@functools.cache
def _has_own_autograd(func: Any) -> bool:
    """A custom op (not aten's) with an autograd kernel: AOTAutograd differentiates its
    graph node with that kernel, as eager autograd did."""
    if getattr(func, "namespace", "aten") in ("aten", "prim", "prims"):
        return False
    try:
        return private.has_kernel_for_dispatch_key(func.name(), "Autograd")
    except RuntimeError:  # not a dispatcher op
        return False


@functools.cache
def _written_arguments(func: Any) -> frozenset[str]:
    """The names of the arguments an op writes to (in-place and out= ops)."""
    arguments = getattr(private.op_schema(func), "arguments", ())
    return frozenset(a.name for a in arguments if a.alias_info is not None and a.alias_info.is_write)


def _refuse_meta_values(
    graph: torch.fx.GraphModule, constants: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]
) -> None:
    """Raises where the trace moved a value to the meta device or captured a meta tensor
    while no input is one: the program would return values without data. A constant made
    inside ``torch.func.jacfwd`` traces so (its zero tangent; torch 2.11-2.14), and the
    program returned a meta tensor. ``torch.compile`` refuses such a program too; the call
    runs eagerly, with a JitFallbackWarning."""
    if any(t.device.type == "meta" for t in inputs):
        return
    moved = any(
        isinstance(device := node.kwargs.get("device"), torch.device) and device.type == "meta"
        for node in graph.graph.nodes
        if node.op == "call_function"
    )
    if moved or any(c.device.type == "meta" for c in constants):
        raise NotImplementedError(
            "the trace moves a value to the meta device (as a tensor made inside torch.func.jacfwd traces), so "
            "the program would return values without data"
        )


def _lift_constants(graph: torch.fx.GraphModule) -> list[torch.Tensor]:
    """Turns the tensors the trace captured as attributes into extra graph inputs.

    Passed at every call, a closed-over parameter that requires grad gets its gradient
    through the compiled graph, and an in-place update of it is seen by the next call.
    """
    first_op = next(n for n in graph.graph.nodes if n.op != "placeholder")  # the output node at least
    reads = [
        n for n in graph.graph.nodes if n.op == "get_attr" and isinstance(getattr(graph, n.target, None), torch.Tensor)
    ]
    inputs: dict[str, torch.fx.Node] = {}  # attribute -> its placeholder (several nodes may read one)
    constants: list[torch.Tensor] = []
    for node in reads:  # all placeholders first: first_op may be one of the reads erased below
        if node.target not in inputs:
            with graph.graph.inserting_before(first_op):
                inputs[node.target] = graph.graph.placeholder(f"constant_{len(constants)}")
            constants.append(getattr(graph, node.target))
    for node in reads:
        node.replace_all_uses_with(inputs[node.target])
        graph.graph.erase_node(node)
    for target in inputs:
        delattr(graph, target)
    graph.recompile()
    return constants
