"""The process exchange as PyTorch custom ops, so that a compiled program can hold it.

``pmap(jit=True)`` across processes is traced like any other compiled call (see
:mod:`torchpmap._engines.compiled`), but its collectives must still reach the other
processes when the program runs. During the trace each exchange is recorded as one
opaque call of ``torchpmap::gather_processes``; when the compiled program runs, that
op calls :meth:`ProcessExchange.all_gather_no_grad`, the very transfer of the eager engine:
its waits watch for failed peers, and a compiled process meets an eager one (after a
fallback) in the same collective. The op's gradient, for a ``.backward()`` outside
the map, is ``torchpmap::scatter_sum_processes``, the transpose the eager engine uses.
A large ``psum`` is ``torchpmap::sum_processes`` (:meth:`ProcessExchange.sum_no_grad_flat`, an
all-reduce), its own transpose. Gradient buckets are four ops (below): the agreement
(``agree_sums``, or ``post_gather``, which also starts the step's loss mean without
waiting), each bucket's start and wait, and the posted mean's result (``posted_gather``).

The ops take the exchange as a small integer (ops only take tensors and plain values):
a key for the process group, this process' place in it and its size, under which
:func:`traced` files the exchange of the call now running.
"""
from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from torchpmap._engines.process_exchange import ProcessExchange
from torchpmap._engines.process_exchange_rules import (
    by_dtype,
    differentiable,
    split_flat,
    sums_by_all_reduce,
    transpose_gather,
)
from torchpmap._state import context as _context
from torchpmap._state import torch_private as private
from torchpmap._state.axis_env import Exchange

_keys: dict[tuple, int] = {}  # (group, index, size, label) -> key; holds the group, so its id is never reused
_live: dict[int, ProcessExchange] = {}  # key -> the ProcessExchange of the latest call over it


@dataclasses.dataclass(frozen=True)
class TracedExchange:
    """What a traced program's collectives see in place of a :class:`ProcessExchange`.

    Attributes:
        key: the exchange's key (see :func:`traced`).
        size: the number of processes in its group.
        pending: gradient sums agreed on in :meth:`sums_in_order` whose agreement is not
            recorded yet (at most one; see :meth:`TracedOrderedSums.also_gather`).
    """

    key: int
    size: int
    pending: list[TracedOrderedSums] = dataclasses.field(default_factory=list)

    starts_sums = True  # as ops of the graph, where the trace met them (gradient buckets: in the backward)
    reduces_locally = True  # as the ProcessExchange it stands in for

    def all_gather_with_grad(self, ts: Sequence[torch.Tensor], what: str, partial: bool = False) -> list[torch.Tensor]:
        self.agree_pending()  # the eager exchange settles before any other transfer, too
        return list(torch.ops.torchpmap.gather_processes(list(ts), self.key, self.size, what, partial))

    def sum_with_grad(self, ts: Sequence[torch.Tensor], what: str) -> list[torch.Tensor] | None:
        if not sums_by_all_reduce(ts):  # decided as the eager exchange decides: they meet in the same collectives
            return None
        self.agree_pending()
        return split_flat(ts, torch.ops.torchpmap.sum_processes(list(ts), self.key, what))

    def scatter_sum_with_grad(self, ts: Sequence[torch.Tensor], what: str) -> None:
        return None  # a compiled program gathers the instances' values (its ops have no reduce-scatter yet)

    def sums_in_order(self, groups: Sequence[Sequence[torch.Tensor]], what: str) -> TracedOrderedSums | None:
        """The ops of :meth:`ProcessExchange.sums_in_order`: the agreement (with the
        gather of :meth:`TracedOrderedSums.also_gather`, or alone before the first sum
        starts), each group's sum where the trace starts it, its wait where the trace
        waits. Groups of one dtype each (None otherwise: the caller sums another way)."""
        if any(len({t.dtype for t in g}) != 1 for g in groups):
            return None
        plain = [private.functorch_value(t)[0] for g in groups for t in g]
        expected = [[(t.shape, t.dtype) for t in g] for g in groups]
        sums = TracedOrderedSums(self, plain, [len(g) for g in groups], what, expected)
        self.pending[:] = [sums]
        return sums

    def agree_pending(self) -> None:
        """Records the pending sums' agreement as an op of its own (one header round)."""
        if self.pending:
            sums = self.pending.pop()
            with private.functorch_layers_cleared():
                sums.token = torch.ops.torchpmap.agree_sums(sums.plain, self.key, sums.what, sums.parts)


@dataclasses.dataclass(eq=False)
class TracedOrderedSums:
    """What a traced program's gradient buckets see in place of an :class:`OrderedSums`:
    each call records an op (``torchpmap::start_sums``, ``torchpmap::wait_sums``); the
    token of the agreement, which they take, keeps them after it in the graph.

    Attributes:
        exchange: the traced exchange that records the agreement (and whose key the ops take).
        plain: the tensors summed later, outside the transforms (for their shapes and dtypes).
        parts: how many of them each group holds.
        what: how headers and errors name the sums.
        expected: each group's shapes and dtypes.
        token: the agreement op's output, once recorded.
        posted: :meth:`also_gather`'s tensors.
        started: each started group's op output.
        waited: the output of the latest wait (what :meth:`gathered` comes after).
    """

    exchange: TracedExchange
    plain: list[torch.Tensor]
    parts: list[int]
    what: str
    expected: list[list[tuple[torch.Size, torch.dtype]]]
    token: torch.Tensor | None = None
    posted: list[torch.Tensor] = dataclasses.field(default_factory=list)
    started: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    waited: list[torch.Tensor] = dataclasses.field(default_factory=list)

    def also_gather(self, ts: Sequence[torch.Tensor], what: str) -> None:
        """Records ``torchpmap::post_gather``: the gather of ``ts`` (plain tensors),
        started with the agreement and not waited for (see :meth:`OrderedSums.also_gather`)."""
        if self.exchange.pending != [self]:
            raise RuntimeError(f"torchpmap: internal error: {self.what} agreed on before also_gather")
        self.exchange.pending.clear()
        with private.functorch_layers_cleared():
            self.token = torch.ops.torchpmap.post_gather(
                list(ts), self.plain, self.exchange.key, what, self.what, self.parts
            )
        self.posted = list(ts)

    def gathered(self) -> list[torch.Tensor]:
        """Records ``torchpmap::posted_gather``, after the latest wait: the stacks."""
        with private.functorch_layers_cleared():
            ex = self.exchange
            return list(torch.ops.torchpmap.posted_gather(self.token, self.posted, self.waited, ex.key, ex.size))

    def start(self, k: int, ts: Sequence[torch.Tensor]) -> None:
        if k in self.started:
            return
        self.exchange.agree_pending()
        with private.functorch_layers_cleared():
            self.started[k] = torch.ops.torchpmap.start_sums(self.token, list(ts), self.exchange.key, k)

    def wait(self, k: int, divisor: int = 1, after: Sequence[torch.Tensor] = ()) -> list[torch.Tensor]:
        shapes = self.expected[k]
        with private.functorch_layers_cleared():
            # after every start the trace made (a compiled program must not wait for one
            # bucket before it has started the others), and after ``after`` (inductor
            # would otherwise compute what only the outputs need at the very end)
            (flat,) = torch.ops.torchpmap.wait_sums(
                self.started[k],
                [*self.started.values(), *after],
                self.exchange.key,
                k,
                sum(shape.numel() for shape, _ in shapes),
                shapes[0][1],
                divisor,
            )
        self.waited[:] = [flat]
        return [piece.view(shape) for piece, (shape, _) in zip(flat.split([s.numel() for s, _ in shapes]), shapes)]


def _implements_exchange(exchange: TracedExchange) -> Exchange:
    """For the type checker: a :class:`TracedExchange` is an
    :class:`~torchpmap._state.axis_env.Exchange` (mypy checks this return)."""
    return exchange


def traced(exchange: ProcessExchange) -> TracedExchange:
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
    return _live[key].all_gather_no_grad(ts, what, partial)


@_gather.register_fake
def _(ts: list[torch.Tensor], key: int, size: int, what: str, partial: bool) -> list[torch.Tensor]:
    return [t.new_empty((size, *t.shape)) for t in ts]


@torch.library.custom_op("torchpmap::scatter_sum_processes", mutates_args=())
def _scatter_sum(grads: list[torch.Tensor], key: int, what: str) -> list[torch.Tensor]:
    return _live[key].scatter_sum(grads, what)


@_scatter_sum.register_fake
def _(grads: list[torch.Tensor], key: int, what: str) -> list[torch.Tensor]:
    return [g.new_empty(g.shape[1:]) for g in grads]


# The eager engine's own transpose (process_exchange_rules.transpose_gather) with the traceable
# op as its transfer.


def _setup_gather(ctx: Any, inputs: tuple, output: Any) -> None:
    ts, ctx.key, size, ctx.what, _ = inputs
    ctx.blanks = [((size, *t.shape), t.dtype, t.device) for t in ts]  # the shape of each cotangent
    ctx.differentiable = [differentiable(t) for t in ts]


def _zeros_where_none(ctx: Any, grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """A float output that got no gradient sends zeros: every process packs the same layout."""
    return [
        torch.zeros(shape, dtype=dtype, device=device) if g is None and ok else g
        for g, ok, (shape, dtype, device) in zip(grads, ctx.differentiable, ctx.blanks)
    ]


def _gather_backward(ctx: Any, grads: Sequence[torch.Tensor | None]) -> tuple:
    given = _zeros_where_none(ctx, grads)
    scatter = lambda gs: torch.ops.torchpmap.scatter_sum_processes(gs, ctx.key, ctx.what)  # noqa: E731
    return transpose_gather(given, ctx.differentiable, scatter), None, None, None, None


_gather.register_autograd(_gather_backward, setup_context=_setup_gather)


@torch.library.custom_op("torchpmap::sum_processes", mutates_args=())
def _sum(ts: list[torch.Tensor], key: int, what: str) -> list[torch.Tensor]:
    # the all-reduces' own flat buffers, one per dtype: the program views them as the
    # tensors (an op's outputs must not alias each other, and a copy would cost a pass)
    return _live[key].sum_no_grad_flat(ts, what)


@_sum.register_fake
def _(ts: list[torch.Tensor], key: int, what: str) -> list[torch.Tensor]:
    return [ts[which[0]].new_empty(sum(ts[k].numel() for k in which)) for which in by_dtype(ts)]


def _setup_sum(ctx: Any, inputs: tuple, output: Any) -> None:
    ts, ctx.key, ctx.what = inputs
    ctx.blanks = [(t.shape, t.dtype, t.device) for t in ts]
    ctx.differentiable = [differentiable(t) for t in ts]


def _sum_backward(ctx: Any, flat_grads: Sequence[torch.Tensor | None]) -> tuple:
    # the inputs' shapes and dtypes, without their memory: all that by_dtype and split_flat read
    blanks = [torch.empty(shape, dtype=dtype, device="meta") for shape, dtype, _ in ctx.blanks]
    filled = [  # an output that got no gradient sends zeros: every process sums the same layout
        g
        if g is not None
        else torch.zeros(
            sum(blanks[k].numel() for k in which), dtype=blanks[which[0]].dtype, device=ctx.blanks[which[0]][2]
        )
        for g, which in zip(flat_grads, by_dtype(blanks))
    ]
    given = split_flat(blanks, filled)

    def summed(gs: list[torch.Tensor]) -> list[torch.Tensor]:
        return split_flat(gs, torch.ops.torchpmap.sum_processes(gs, ctx.key, f"the gradient of {ctx.what}"))

    return transpose_gather(given, ctx.differentiable, summed), None, None


_sum.register_autograd(_sum_backward, setup_context=_setup_sum)


# Gradient buckets (torchpmap._collectives.gradient_mean): the processes agree on every bucket
# before the first starts (in post_gather's headers, or in agree_sums' round); each
# bucket's all-reduce starts where the trace met its last gradient and is waited for
# where the trace waited. The eager OrderedSums of the running call does the work; it is
# filed under the exchange's key between the ops. The ops' tensor arguments order them
# in the compiled program: every start takes the agreement's token first (inductor then
# runs the agreement as soon as it can), every wait takes every start, and the posted
# mean's result comes after the last wait.
_ordered: dict[int, Any] = {}


def _groups(ts: list[torch.Tensor], parts: list[int]) -> list[list[torch.Tensor]]:
    groups, start = [], 0
    for n in parts:
        groups.append(ts[start : start + n])
        start += n
    return groups


@torch.library.custom_op("torchpmap::agree_sums", mutates_args=())
def _agree_sums(ts: list[torch.Tensor], key: int, what: str, parts: list[int]) -> torch.Tensor:
    _ordered[key] = _live[key].sums_in_order(_groups(ts, parts), what)
    _live[key].settle_posted()
    return ts[0].new_empty(0)


@_agree_sums.register_fake
def _(ts: list[torch.Tensor], key: int, what: str, parts: list[int]) -> torch.Tensor:
    return ts[0].new_empty(0)


@torch.library.custom_op("torchpmap::post_gather", mutates_args=())
def _post_gather(
    ts: list[torch.Tensor], sums: list[torch.Tensor], key: int, what: str, sums_what: str, parts: list[int]
) -> torch.Tensor:
    _ordered[key] = _live[key].sums_in_order(_groups(sums, parts), sums_what)
    _ordered[key].also_gather(ts, what)
    return sums[0].new_empty(0)


@_post_gather.register_fake
def _(
    ts: list[torch.Tensor], sums: list[torch.Tensor], key: int, what: str, sums_what: str, parts: list[int]
) -> torch.Tensor:
    return sums[0].new_empty(0)


@torch.library.custom_op("torchpmap::posted_gather", mutates_args=())
def _posted_gather(
    token: torch.Tensor, like: list[torch.Tensor], after: list[torch.Tensor], key: int, size: int
) -> list[torch.Tensor]:
    # like: the tensors posted (their shapes and dtypes); after: what the graph runs first
    return _ordered[key].gathered()


@_posted_gather.register_fake
def _(
    token: torch.Tensor, like: list[torch.Tensor], after: list[torch.Tensor], key: int, size: int
) -> list[torch.Tensor]:
    return [token.new_empty((size, *t.shape), dtype=t.dtype) for t in like]


@torch.library.custom_op("torchpmap::start_sums", mutates_args=())
def _start_sums(token: torch.Tensor, ts: list[torch.Tensor], key: int, part: int) -> torch.Tensor:
    _ordered[key].start(part, ts)
    return token.new_empty(0)


@_start_sums.register_fake
def _(token: torch.Tensor, ts: list[torch.Tensor], key: int, part: int) -> torch.Tensor:
    return token.new_empty(0)


@torch.library.custom_op("torchpmap::wait_sums", mutates_args=())
def _wait_sums(
    token: torch.Tensor, after: list[torch.Tensor], key: int, part: int, numel: int, dtype: torch.dtype, divisor: int
) -> list[torch.Tensor]:
    # the division of a mean happens here, in the all-reduce's buffer: as a graph op it
    # would write a fresh one (and each bucket's, not only the last, as the buckets arrive)
    return _ordered[key].wait_flat(part, divisor)


@_wait_sums.register_fake
def _(
    token: torch.Tensor, after: list[torch.Tensor], key: int, part: int, numel: int, dtype: torch.dtype, divisor: int
) -> list[torch.Tensor]:
    return [token.new_empty(numel, dtype=dtype)]
