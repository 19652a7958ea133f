"""A traced device slice cut at its exchanges: compiled segments, eager exchanges between.

A slice's trace (see :mod:`torchpmap._engines.compiled_devices`) holds its collectives as
``torchpmap::gather_threads`` nodes. :func:`split_at_exchanges` cuts the graph there: the
ops between two exchanges form a segment that inductor compiles (AOTAutograd inside, so
each segment is one differentiable node), and each exchange runs eagerly through the
device thread's own :class:`~torchpmap._engines.thread_exchange.ThreadExchange`
(:func:`~torchpmap._engines.thread_ops.gather_live`).

Why not compile the exchange into the graph, as the processes' compiled programs do
(:mod:`torchpmap._engines.process_ops`)? A process has its own autograd engine, so the
backward of its program can wait for the other processes' backward. The device threads of
one process share one: a ``.backward()`` through a result runs every device's backward
in the thread that called it (on CPU), one node after the other. A compiled program's
backward that waited there for the other devices' would wait forever. Cut at the
exchanges, every compiled segment's backward is its own device's alone, and the eager
exchange's single autograd node joins the devices, as it does in the eager engine.

A segment is compiled at its first call, on the tensors it gets then (the exchanges'
outputs among them, with their ``requires_grad``), which the call's signature fixes.

A compiled segment runs with its device thread's turn set down
(:func:`~torchpmap._engines.thread_ops.turn_set_down`): the turn keeps Python code of
two threads from interleaving (see :func:`~torchpmap._engines.multi_device.run_threads`),
and a compiled segment runs none of the user's, only kernels on its own device's tensors.
So the devices compute at once, CPU devices too (whose kernels, unlike CUDA's, run in
the calling thread), and the first thread's exchange waits for the slowest device's
kernels, not for the sum of every device's.
"""
from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.fx.passes.split_module import split_module

from torchpmap._engines import graph_rewrites, thread_ops
from torchpmap._engines.random_per_thread import compiled_draws

#: Compiles a segment's graph for inputs like the given ones: a callable that takes the
#: graph's inputs and returns its outputs, differentiable.
CompileSegment = Callable[[torch.fx.GraphModule, Sequence[torch.Tensor]], Callable[..., Any]]


class _Segment(torch.nn.Module):
    """The ops between two exchanges, compiled at the first call."""

    def __init__(self, graph: torch.fx.GraphModule, compile_segment: CompileSegment):
        super().__init__()
        self.graph_module = graph
        self.compile_segment = compile_segment
        self.compiled: Callable[..., Any] | None = None
        self.draws = graph_rewrites.random_draw(graph) is not None  # from the thread's stream

    def forward(self, *args: torch.Tensor) -> Any:
        if self.compiled is None:  # compiled in turn: one compilation at a time
            self.compiled = self.compile_segment(self.graph_module, args)
            with compiled_draws() if self.draws else contextlib.nullcontext():
                return _refusing_double_backward(self.compiled(*args))
        with thread_ops.turn_set_down():  # the devices' kernels run at once (module docstring)
            with compiled_draws() if self.draws else contextlib.nullcontext():
                return _refusing_double_backward(self.compiled(*args))


_DOUBLE_BACKWARD = (
    "torch.compile with aot_autograd does not currently support double backward: a pmap(jit=True) result "
    "differentiated with create_graph=True (a second derivative through torch.autograd.grad). Differentiate "
    "inside the map with torch.func (compiled with it), or call the pmap without jit=True"
)


def _refuse_double_backward(grad: torch.Tensor) -> None:
    if torch.is_grad_enabled():  # the engine runs a backward with create_graph=True in grad mode
        raise RuntimeError(_DOUBLE_BACKWARD)


def _refusing_double_backward(outputs: Any) -> Any:
    """``outputs``, each that requires grad hooked to raise in a backward that records a
    graph: a segment's compiled backward gave a gradient without one there (a second
    derivative came back None), where one device's program raises AOTAutograd's error."""
    if torch.is_grad_enabled():
        for out in outputs if isinstance(outputs, (list, tuple)) else (outputs,):
            if isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(_refuse_double_backward)
    return outputs


def split_at_exchanges(graph: torch.fx.GraphModule, compile_segment: CompileSegment) -> torch.fx.GraphModule:
    """``graph`` as a module that calls compiled segments and eager exchanges in turn.

    Each segment is compiled by ``compile_segment`` at its first call, for the tensors it
    gets then (see the module docstring).
    """
    part: dict[torch.fx.Node, int] = {}
    exchanges = 0
    for node in graph.graph.nodes:
        if thread_ops.is_gather(node):
            exchanges += 1
            part[node] = 2 * exchanges - 1  # the exchange alone, with its getitems (below)
        elif node.op == "call_function" and node.target is operator.getitem and thread_ops.is_gather(node.args[0]):
            part[node] = part[node.args[0]]
        else:
            part[node] = 2 * exchanges
    split = split_module(graph, graph, lambda node: part[node], keep_original_order=True)
    for name, sub in list(split.named_children()):
        if not isinstance(sub, torch.fx.GraphModule):
            continue
        if any(thread_ops.is_gather(n) for n in sub.graph.nodes):
            for n in sub.graph.nodes:
                if thread_ops.is_gather(n):
                    n.target = thread_ops.gather_live  # runs eagerly: the device thread's rendezvous
            sub.recompile()
        else:
            setattr(split, name, _Segment(sub, compile_segment))
    return split
