"""Results of a compiled program that are views of its own values: taken outside the program.

A program's result may be a view of a value the program computed (``v.exp().T``, the
instance dim that a device holding one instance adds with ``unsqueeze(0)``). When that
value is also saved for the backward (``exp``'s gradient reads it), a compiled program
hands the caller a view that does not share the saved value's version counter
(``torch.compile``'s own behaviour, in plain torch too). An in-place write into the result
before ``.backward()`` then goes unnoticed, and the gradient reads the overwritten values,
where eager autograd raises "modified by an inplace operation"::

    >>> import torch
    >>> from torch.fx.experimental.proxy_tensor import make_fx
    >>> def f(v):  # a program returns a list of results
    ...     return [v.exp().t()]
    >>> graph = make_fx(f)(torch.ones(2, 3))
    >>> views = peel(graph)
    >>> [n.target.__name__ for n in graph.graph.nodes if n.op == "call_function"]
    ['exp.default']
    >>> views.apply(graph(torch.zeros(2, 3)))[0].shape
    torch.Size([3, 2])

:func:`peel` rewrites the traced graph to return the value itself, which the compiled
program returns as a result of its own (and whose saved copy is then checked as eager
checks it), and records the view ops; :meth:`OutputViews.apply` runs them eagerly on the
program's results, as eager would. A view of an input, or of a tensor the program closes
over, is left in the graph (the caller copies results that alias arguments).
"""
from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx

from torchpmap._engines import graph_rewrites
from torchpmap._state import torch_private as private


@dataclasses.dataclass(frozen=True)
class _Step:
    """One view op: ``target(value, *args, **kwargs)``."""

    target: Any
    args: tuple
    kwargs: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class OutputViews:
    """The view ops that :func:`peel` took out of a program, per result (empty: none)."""

    steps: tuple[tuple[_Step, ...], ...]

    def apply(self, outputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The program's results, each through the view ops taken out of it."""
        viewed = []
        for value, steps in zip(outputs, self.steps):
            for step in steps:
                value = step.target(value, *step.args, **step.kwargs)
            viewed.append(value)
        return viewed


def peel(graph: torch.fx.GraphModule) -> OutputViews | None:
    """Rewrites ``graph`` (whose output is a list of tensors) to return, for each result
    that is a chain of view ops of a value it computes, that value; returns the chains,
    or None where no result is such a view (the graph is then unchanged)."""
    (output,) = [n for n in graph.graph.nodes if n.op == "output"]
    results = output.args[0]
    if not isinstance(results, (list, tuple)):
        return None
    bases, chains = [], []
    for result in results:
        base, chain = _view_chain(result) if isinstance(result, torch.fx.Node) else (result, ())
        bases.append(base)
        chains.append(chain)
    if not any(chains):
        return None
    output.args = (type(results)(bases),)
    graph.graph.eliminate_dead_code(is_impure_node=graph_rewrites.kept)  # the views; every exchange stays
    graph.recompile()
    return OutputViews(tuple(chains))


def _view_chain(node: torch.fx.Node) -> tuple[torch.fx.Node, tuple[_Step, ...]]:
    """The value computed in the graph that ``node`` is a chain of views of, and the chain
    (``node`` itself and no steps where it is no view of such a value)."""
    steps: list[_Step] = []
    value = node
    while True:
        source = _viewed(value)
        if source is None:
            break
        steps.append(_Step(value.target, tuple(value.args[1:]), dict(value.kwargs)))
        value = source
    if not steps or value.op != "call_function":  # a view of an input or of a constant: the caller copies it
        return node, ()
    return value, tuple(reversed(steps))


def _viewed(node: torch.fx.Node) -> torch.fx.Node | None:
    """The node that ``node`` is a view of, through one view op whose other arguments are
    constants (None: no such view)."""
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], torch.fx.Node):
        return None
    if any(_has_node(a) for a in (*node.args[1:], *node.kwargs.values())):
        return None
    source = node.args[0]
    if node.target is operator.getitem:  # one piece of a view op with several results (split, unbind)
        return source if source.op == "call_function" and _is_view_op(source.target) else None
    return source if _is_view_op(node.target) else None


def _is_view_op(target: Any) -> bool:
    """Whether ``target`` is an aten op whose results alias its first argument, unwritten."""
    schema = private.op_schema(target)
    if schema is None or schema.is_mutable or not schema.arguments or not schema.returns:
        return False
    first, result = schema.arguments[0].alias_info, schema.returns[0].alias_info
    return first is not None and result is not None and not first.is_write and not result.is_write


def _has_node(value: Any) -> bool:
    if isinstance(value, torch.fx.Node):
        return True
    if isinstance(value, (list, tuple)):
        return any(map(_has_node, value))
    if isinstance(value, dict):
        return any(map(_has_node, value.values()))
    return False
