"""The process exchange as PyTorch custom ops, so that a compiled program can hold it.

``pmap(jit=True)`` across processes is traced like any other compiled call (see
:mod:`torchpmap._engines.compiled`), but its collectives must still reach the other
processes when the program runs. During the trace each exchange is recorded as one
opaque call of ``torchpmap::gather_processes``; when the compiled program runs, that
op calls :meth:`ProcessExchange.gather_plain`, the very transfer of the eager engine:
its waits watch for failed peers, and a compiled process meets an eager one (after a
fallback) in the same collective. The op's gradient, for a ``.backward()`` outside
the map, is ``torchpmap::scatter_sum_processes``, the transpose the eager engine uses.
A large ``psum`` is ``torchpmap::sum_processes`` (:meth:`ProcessExchange.sum_plain`, an
all-reduce), its own transpose.

The ops take the exchange as a small integer (ops only take tensors and plain values):
a key for the process group, this process' place in it and its size, under which
:func:`traced` files the exchange of the call now running.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator, Optional, Sequence

import torch

from torchpmap._state import context as _context
from torchpmap._state import torch_private as private

from torchpmap._engines.process_transpose import by_dtype, differentiable, split_flat, sums_by_all_reduce, transpose_gather

_keys: dict[tuple, int] = {}  # (group, index, size, label) -> key; holds the group, so its id is never reused
_live: dict[int, Any] = {}  # key -> the ProcessExchange of the latest call over it


@dataclasses.dataclass(frozen=True)
class TracedExchange:
    """What a traced program's collectives see in place of a :class:`ProcessExchange`."""

    key: int
    size: int

    starts_sums = True  # as ops of the graph, where the trace met them (gradient buckets: in the backward)
    reduces_locally = True  # as the ProcessExchange it stands in for

    def all_gather_many(self, ts: Sequence[torch.Tensor], what: str, partial: bool = False) -> list[torch.Tensor]:
        return list(torch.ops.torchpmap.gather_processes(list(ts), self.key, self.size, what, partial))

    def sum_many(self, ts: Sequence[torch.Tensor], what: str) -> Optional[list[torch.Tensor]]:
        if not sums_by_all_reduce(ts):  # decided as the eager exchange decides: they meet in the same collectives
            return None
        return split_flat(ts, torch.ops.torchpmap.sum_processes(list(ts), self.key, what))

    def sums_in_order(self, groups: Sequence[Sequence[torch.Tensor]], what: str) -> Optional["TracedOrderedSums"]:
        """The ops of :meth:`ProcessExchange.sums_in_order`: agreeing now, each group's sum
        where the trace starts it, its wait where the trace waits. Groups of one dtype
        each (None otherwise: the caller sums another way)."""
        if any(len({t.dtype for t in g}) != 1 for g in groups):
            return None
        plain = [private.functorch_value(t)[0] for g in groups for t in g]
        with private.functorch_layers_cleared():
            token = torch.ops.torchpmap.agree_sums(plain, self.key, what, [len(g) for g in groups])
        return TracedOrderedSums(self.key, token, [[(t.shape, t.dtype) for t in g] for g in groups])


@dataclasses.dataclass(eq=False)
class TracedOrderedSums:
    """What a traced program's gradient buckets see in place of an :class:`OrderedSums`:
    each call records an op (``torchpmap::start_sums``, ``torchpmap::wait_sums``); the
    tokens they pass on keep them in order in the graph."""

    key: int
    token: torch.Tensor
    expected: list[list[tuple[torch.Size, torch.dtype]]]
    started: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)

    def start(self, k: int, ts: Sequence[torch.Tensor]) -> None:
        if k in self.started:
            return
        with private.functorch_layers_cleared():
            self.started[k] = torch.ops.torchpmap.start_sums(list(ts), self.token, self.key, k)

    def wait(self, k: int) -> list[torch.Tensor]:
        shapes = self.expected[k]
        with private.functorch_layers_cleared():
            (flat,) = torch.ops.torchpmap.wait_sums(
                self.started[k], self.key, k, sum(shape.numel() for shape, _ in shapes), shapes[0][1]
            )
        return [piece.view(shape) for piece, (shape, _) in zip(flat.split([s.numel() for s, _ in shapes]), shapes)]


def traced(exchange: Any) -> TracedExchange:
    """The traceable stand-in for ``exchange``; the ops of a program compiled with it use
    ``exchange`` (this call's, with its pending size check) from now on."""
    ident = (exchange.group, exchange.index, exchange.size, exchange.label)
    key = _keys.setdefault(ident, len(_keys))
    _live[key] = exchange
    return TracedExchange(key, exchange.size)


@contextlib.contextmanager
def tracing() -> Iterator[None]:
    """Marks this thread as tracing a program across processes (see :func:`is_tracing`)."""
    with _context.setting(_context.tracing_processes, True):
        yield


def is_tracing() -> bool:
    """True while a distributed program is traced in this thread: a distributed pmap
    nested in it cannot run its own (eager) exchange on the tracer's fake tensors."""
    return _context.tracing_processes.get()


@torch.library.custom_op("torchpmap::gather_processes", mutates_args=())
def _gather(ts: list[torch.Tensor], key: int, size: int, what: str, partial: bool) -> list[torch.Tensor]:
    return _live[key].gather_plain(ts, what, partial)


@_gather.register_fake
def _(ts: list[torch.Tensor], key: int, size: int, what: str, partial: bool) -> list[torch.Tensor]:
    return [t.new_empty((size, *t.shape)) for t in ts]


@torch.library.custom_op("torchpmap::scatter_sum_processes", mutates_args=())
def _scatter_sum(grads: list[torch.Tensor], key: int, what: str) -> list[torch.Tensor]:
    return _live[key].scatter_sum(grads, what)


@_scatter_sum.register_fake
def _(grads: list[torch.Tensor], key: int, what: str) -> list[torch.Tensor]:
    return [g.new_empty(g.shape[1:]) for g in grads]


# The eager engine's own transpose (process_transpose.transpose_gather) with the traceable
# op as its transfer.


def _setup_gather(ctx: Any, inputs: tuple, output: Any) -> None:
    ts, ctx.key, size, ctx.what, _ = inputs
    ctx.blanks = [((size, *t.shape), t.dtype, t.device) for t in ts]  # the shape of each cotangent
    ctx.differentiable = [differentiable(t) for t in ts]


def _zeros_where_none(ctx: Any, grads: Sequence[Optional[torch.Tensor]]) -> list[Optional[torch.Tensor]]:
    """A float output that got no gradient sends zeros: every process packs the same layout."""
    return [
        torch.zeros(shape, dtype=dtype, device=device) if g is None and ok else g
        for g, ok, (shape, dtype, device) in zip(grads, ctx.differentiable, ctx.blanks)
    ]


def _gather_backward(ctx: Any, grads: Sequence[Optional[torch.Tensor]]) -> tuple:
    given = _zeros_where_none(ctx, grads)
    scatter = lambda gs: torch.ops.torchpmap.scatter_sum_processes(gs, ctx.key, ctx.what)  # noqa: E731
    return transpose_gather(given, ctx.differentiable, scatter), None, None, None, None


_gather.register_autograd(_gather_backward, setup_context=_setup_gather)


@torch.library.custom_op("torchpmap::sum_processes", mutates_args=())
def _sum(ts: list[torch.Tensor], key: int, what: str) -> list[torch.Tensor]:
    # the all-reduces' own flat buffers, one per dtype: the program views them as the
    # tensors (an op's outputs must not alias each other, and a copy would cost a pass)
    return _live[key].sum_flat(ts, what)


@_sum.register_fake
def _(ts: list[torch.Tensor], key: int, what: str) -> list[torch.Tensor]:
    return [ts[which[0]].new_empty(sum(ts[k].numel() for k in which)) for which in by_dtype(ts)]


def _setup_sum(ctx: Any, inputs: tuple, output: Any) -> None:
    ts, ctx.key, ctx.what = inputs
    ctx.blanks = [(t.shape, t.dtype, t.device) for t in ts]
    ctx.differentiable = [differentiable(t) for t in ts]


def _sum_backward(ctx: Any, flat_grads: Sequence[Optional[torch.Tensor]]) -> tuple:
    # the inputs' shapes and dtypes, without their memory: all that by_dtype and split_flat read
    blanks = [torch.empty(shape, dtype=dtype, device="meta") for shape, dtype, _ in ctx.blanks]
    flat_grads = [  # an output that got no gradient sends zeros: every process sums the same layout
        g if g is not None else torch.zeros(sum(blanks[k].numel() for k in which), dtype=blanks[which[0]].dtype,
                                            device=ctx.blanks[which[0]][2])
        for g, which in zip(flat_grads, by_dtype(blanks))
    ]
    given = split_flat(blanks, flat_grads)

    def summed(gs: list[torch.Tensor]) -> list[torch.Tensor]:
        return split_flat(gs, torch.ops.torchpmap.sum_processes(gs, ctx.key, f"the gradient of {ctx.what}"))

    return transpose_gather(given, ctx.differentiable, summed), None, None


_sum.register_autograd(_sum_backward, setup_context=_setup_sum)


# Gradient buckets (torchpmap._collectives.gradient_mean): the processes agree on every bucket up
# front; each bucket's all-reduce starts where the trace met its last gradient and is
# waited for where the trace waited. The eager OrderedSums of the running call does the
# work; it is filed under the exchange's key between the ops.
_ordered: dict[int, Any] = {}


@torch.library.custom_op("torchpmap::agree_sums", mutates_args=())
def _agree_sums(ts: list[torch.Tensor], key: int, what: str, parts: list[int]) -> torch.Tensor:
    groups, start = [], 0
    for n in parts:
        groups.append(ts[start : start + n])
        start += n
    _ordered[key] = _live[key].sums_in_order(groups, what)
    return ts[0].new_empty(0)


@_agree_sums.register_fake
def _(ts: list[torch.Tensor], key: int, what: str, parts: list[int]) -> torch.Tensor:
    return ts[0].new_empty(0)


@torch.library.custom_op("torchpmap::start_sums", mutates_args=())
def _start_sums(ts: list[torch.Tensor], token: torch.Tensor, key: int, part: int) -> torch.Tensor:
    _ordered[key].start(part, ts)
    return token.new_empty(0)


@_start_sums.register_fake
def _(ts: list[torch.Tensor], token: torch.Tensor, key: int, part: int) -> torch.Tensor:
    return token.new_empty(0)


@torch.library.custom_op("torchpmap::wait_sums", mutates_args=())
def _wait_sums(token: torch.Tensor, key: int, part: int, numel: int, dtype: torch.dtype) -> list[torch.Tensor]:
    return _ordered[key].wait_flat(part)


@_wait_sums.register_fake
def _(token: torch.Tensor, key: int, part: int, numel: int, dtype: torch.dtype) -> list[torch.Tensor]:
    return [token.new_empty(numel, dtype=dtype)]
