"""``jit=True``: the vectorized program traced once per input signature, then compiled.

``torch.compile`` cannot compile a pmap directly: dynamo ignores the custom batching
rules that implement collectives (see :mod:`torchpmap._compile_guard`). So the order is
reversed. First ``make_fx`` traces the *vectorized* engine on fake tensors: functorch
runs every batching rule, collectives included, and the trace records only the plain
batched aten ops that result (a ``psum`` becomes a ``sum`` over the batch dim). Then
``torch.compile`` compiles that graph, which holds nothing it could get wrong, and
AOTAutograd makes it differentiable for a ``.backward()`` outside the map.

What a trace bakes in, like ``jax.jit``: the Python control flow of the function, its
non-tensor arguments, and the identity of the tensors it closes over (those are passed to
the compiled graph by reference at every call, so in-place updates such as an optimizer
step are seen). A branch on a tensor's value cannot be traced: that
signature then runs eagerly, with a :class:`JitFallbackWarning`. The caller keys the
cache so that anything else that changes the program (shapes, dtypes, devices,
``requires_grad``, non-tensor values, grad mode, autocast, the default dtype) traces anew.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable, Hashable, Mapping, Optional, Sequence

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from torchpmap._engines import MappedCall, vectorized
from torchpmap._sharded import ShardedTensor, as_local

#: Runs a mapped call: the vectorized engine, or one slice of a split axis.
Engine = Callable[[MappedCall], list[torch.Tensor]]

_MAX_PROGRAMS = 32  # compiled programs kept per mapped function (oldest dropped first)


class JitFallbackWarning(UserWarning):
    """``pmap(jit=True)`` could not compile a call, which ran eagerly instead."""


class ProgramCache:
    """The compiled programs of one mapped function, by input signature.

    A signature whose trace or compilation fails runs eagerly from then on, with a
    warning that says why: if the eager run fails too, its error (the user's) is what
    the caller sees; if it succeeds, the failure was a limit of tracing, and eager
    results are the right ones.
    """

    def __init__(self, options: Mapping[str, Any]):
        self.options = dict(options)  # for torch.compile
        self._programs: dict[Hashable, Optional[_Program]] = {}  # None: runs eagerly

    def __len__(self) -> int:
        return len(self._programs)

    def compiled_count(self) -> int:
        return sum(p is not None for p in self._programs.values())

    def run(
        self,
        call: MappedCall,
        signature: Hashable,
        engine: Engine = vectorized.run,
        traced_engine: Optional[Engine] = None,
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
        if signature in self._programs:
            program = self._programs[signature]
            if program is None:
                return engine(call)
            call.body_record.update(program.body_record)  # body will not run
            return program(call)
        if len(self._programs) >= _MAX_PROGRAMS:
            del self._programs[next(iter(self._programs))]
        try:
            program = _trace(call, self.options, traced_engine or engine)
            outputs = program(call)  # the first call compiles; body ran while tracing
        except Exception as failure:  # noqa: BLE001 - retried eagerly below; the eager error wins
            if not may_retry(failure):
                raise
            outputs = engine(call)
            self._programs[signature] = None
            warnings.warn(_fallback_message(call, failure), JitFallbackWarning, stacklevel=4)
            return outputs
        self._programs[signature] = program
        return outputs


def _fallback_message(call: MappedCall, failure: Exception) -> str:
    first_line = (str(failure).strip().splitlines() or [""])[0]
    why = f"{type(failure).__name__}: {first_line}"
    if isinstance(failure, _VALUE_DEPENDENT):
        why = (
            f"it depends on the value of a tensor ({why}); a compiled program fixes its control flow and output "
            "shapes when it is traced. Compute such a branch with torch.where"
        )
    return (
        f"pmap(jit=True) over axis {call.axis_name!r} could not be compiled for these argument shapes and types, "
        f"so it runs eagerly for them (same results, no compilation): {why}."
    )


@dataclasses.dataclass
class _Program:
    compiled: Callable[..., list[torch.Tensor]]
    tensor_slots: list[int]  # positions in call.broadcast that are graph inputs
    constants: list[torch.Tensor]  # tensors the function closes over, passed by reference
    body_record: dict  # what body recorded while it was traced

    def __call__(self, call: MappedCall) -> list[torch.Tensor]:
        return self.compiled(*_graph_inputs(call, self.tensor_slots), *self.constants)


def _graph_inputs(call: MappedCall, tensor_slots: Sequence[int]) -> list[torch.Tensor]:
    device = call.devices[0].torch_device if call.devices else None
    return [as_local(t, device) for t in call.mapped] + [as_local(call.broadcast[k], device) for k in tensor_slots]


def _trace(call: MappedCall, options: Mapping[str, Any], engine: Engine) -> _Program:
    tensor_slots = [k for k, v in enumerate(call.broadcast) if isinstance(v, (torch.Tensor, ShardedTensor))]
    n_mapped = len(call.mapped)

    def program(*tensors: torch.Tensor) -> list[torch.Tensor]:
        broadcast = list(call.broadcast)
        for k, t in zip(tensor_slots, tensors[n_mapped:]):
            broadcast[k] = t
        return engine(dataclasses.replace(call, mapped=tensors[:n_mapped], broadcast=broadcast))

    graph = make_fx(program, tracing_mode="fake", _allow_non_fake_inputs=True)(*_graph_inputs(call, tensor_slots))
    graph.graph.eliminate_dead_code()  # e.g. forward-AD shape checks that return a bool dynamo refuses
    constants = _lift_constants(graph)
    # the forward function, not the module: nn.Module.__call__ would cost microseconds per call
    compiled = torch.compile(graph.forward, **{"fullgraph": True, "dynamic": False, **options})
    return _Program(compiled, tensor_slots, constants, dict(call.body_record))


def _value_dependent_errors() -> tuple[type[BaseException], ...]:
    from torch._subclasses import fake_tensor

    errors = [fake_tensor.DataDependentOutputException, fake_tensor.DynamicOutputShapeException]
    try:
        from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

        errors.append(GuardOnDataDependentSymNode)
    except ImportError:  # pragma: no cover - older torch
        pass
    return tuple(errors)


_VALUE_DEPENDENT = _value_dependent_errors()


def _lift_constants(graph: torch.fx.GraphModule) -> list[torch.Tensor]:
    """Turns the tensors the trace captured as attributes into extra graph inputs.

    Passed at every call, a closed-over parameter that requires grad gets its gradient
    through the compiled graph, and an in-place update of it is seen by the next call.
    """
    first_op = next(n for n in graph.graph.nodes if n.op != "placeholder")  # the output node at least
    inputs: dict[str, torch.fx.Node] = {}  # attribute -> its placeholder (several nodes may read one)
    constants: list[torch.Tensor] = []
    for node in list(graph.graph.nodes):
        value = getattr(graph, node.target, None) if node.op == "get_attr" else None
        if not isinstance(value, torch.Tensor):
            continue
        if node.target not in inputs:
            with graph.graph.inserting_before(first_op):
                inputs[node.target] = graph.graph.placeholder(f"constant_{len(constants)}")
            constants.append(value)
        node.replace_all_uses_with(inputs[node.target])
        graph.graph.erase_node(node)
    for target in inputs:
        delattr(graph, target)
    graph.recompile()
    return constants
