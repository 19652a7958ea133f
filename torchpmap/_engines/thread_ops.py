"""The device threads' exchange as a PyTorch custom op, so that a traced program can hold it.

``pmap(jit=True)`` over several devices in one process traces each device's slice (see
:mod:`torchpmap._engines.compiled_devices`). While a slice is traced, its collectives go
through a :class:`TracedThreadExchange`, which records every gather across the device
threads as one opaque node, ``torchpmap::gather_threads``, whose fake kernel gives the
shapes: the trace never waits for another thread. The compiled program then runs that
node eagerly, between its compiled segments (:mod:`torchpmap._engines.segments`),
through :func:`gather_live`: the very :class:`~torchpmap._engines.thread_exchange.ThreadExchange`
of the eager engine, whose single autograd node per collective joins every device's
gradient, so a ``.backward()`` through the results needs no thread to wait for another.

The op has no autograd kernel of its own: in a compiled program it is replaced by
:func:`gather_live` before any segment is compiled, and while the slice is traced the
gradient audit of :mod:`torchpmap._engines.compiled` sees it as an op that eager autograd
records only under grad mode (where the eager exchange's autograd Function records it).
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator, Sequence

import torch

from torchpmap._engines.thread_exchange import ThreadExchange
from torchpmap._state.axis_env import Exchange

#: The exchange of the device thread whose compiled slice is running (None outside one).
_live: contextvars.ContextVar[ThreadExchange | None] = contextvars.ContextVar("torchpmap_thread_exchange", default=None)


#: True in a device thread while it traces its slice (see :func:`tracing`).
_tracing: contextvars.ContextVar[bool] = contextvars.ContextVar("torchpmap_tracing_slice", default=False)


@contextlib.contextmanager
def tracing() -> Iterator[None]:
    """Marks this thread as tracing its device slice (see :func:`is_tracing`)."""
    token = _tracing.set(True)
    try:
        yield
    finally:
        _tracing.reset(token)


def is_tracing() -> bool:
    """True while this thread traces its device slice: a ``jit=True`` pmap nested in it
    is traced into the slice's program (as a pmap nested in a vectorized map is), never
    compiled on its own inside the trace."""
    return _tracing.get()


@dataclasses.dataclass(frozen=True)
class TracedThreadExchange:
    """What a traced slice's collectives see in place of a :class:`ThreadExchange`: each
    gather becomes one ``torchpmap::gather_threads`` node of ``size`` slices.

    Attributes:
        size: the number of device slices along the axis.
        reduces_locally: a sum sends the slice's own instances' sum rather than every
            instance's value (see :mod:`torchpmap._engines.compiled_devices`); False
            under ``config.bitwise_placement``.
    """

    size: int
    reduces_locally: bool = True

    starts_sums = False  # the threads take turns: a sum completes when they meet

    def all_gather_with_grad(self, ts: Sequence[torch.Tensor], what: str, partial: bool = False) -> list[torch.Tensor]:
        return list(torch.ops.torchpmap.gather_threads(list(ts), self.size, what))

    def sum_with_grad(self, ts: Sequence[torch.Tensor], what: str) -> None:
        return None  # no all-reduce between threads: the slices' partial sums are gathered

    def scatter_sum_with_grad(self, ts: Sequence[torch.Tensor], what: str) -> None:
        return None  # the slices' instances are gathered: their sums, in one order, bitwise one device's

    def sums_in_order(self, groups: Sequence[Sequence[torch.Tensor]], what: str) -> None:
        raise NotImplementedError("the threads take turns: a sum completes when they meet, not in the background")


@contextlib.contextmanager
def live(exchange: ThreadExchange) -> Iterator[None]:
    """Makes ``exchange`` the one that :func:`gather_live` uses in this thread."""
    token = _live.set(exchange)
    try:
        yield
    finally:
        _live.reset(token)


@contextlib.contextmanager
def turn_set_down() -> Iterator[None]:
    """The running device thread sets its turn down for the block (nothing outside a
    compiled slice): the other device threads run their own code meanwhile. For a block
    that touches no Python state another thread could see, a compiled segment's kernels."""
    exchange = _live.get()
    if exchange is None:
        yield
        return
    with exchange.rendezvous.passing_turn():
        yield


def gather_live(ts: Sequence[torch.Tensor], size: int, what: str) -> list[torch.Tensor]:
    """What a ``torchpmap::gather_threads`` node does when a compiled slice runs: the
    running thread's eager exchange (differentiable, one autograd node across devices)."""
    exchange = _live.get()
    if exchange is None or len(exchange.devices) != size:
        raise RuntimeError(f"torchpmap: internal error: {what} ran outside the device thread of its compiled slice")
    return list(exchange.all_gather_with_grad(list(ts), what))


def is_gather(node: torch.fx.Node) -> bool:
    """Whether an FX node is a recorded gather across the device threads."""
    return node.op == "call_function" and node.target in (
        torch.ops.torchpmap.gather_threads.default,
        torch.ops.torchpmap.gather_threads,
    )


@torch.library.custom_op("torchpmap::gather_threads", mutates_args=())
def _gather(ts: list[torch.Tensor], size: int, what: str) -> list[torch.Tensor]:
    if _live.get() is None and is_tracing():
        # A trace met the op on constants of the program (``psum(2.0)``'s tensor): fake-tensor
        # mode runs such an op for real, to keep a one-element result as a constant, and
        # otherwise drops what it computed and records the node (a gather of several
        # devices' values never has one element). Nothing here is a value of the program.
        return [t.new_zeros((size, *t.shape)) for t in ts]
    return gather_live(ts, size, what)


@_gather.register_fake
def _(ts: list[torch.Tensor], size: int, what: str) -> list[torch.Tensor]:
    return [t.new_empty((size, *t.shape)) for t in ts]


def _implements_exchange(exchange: TracedThreadExchange) -> Exchange:
    """For the type checker: a :class:`TracedThreadExchange` is an
    :class:`~torchpmap._state.axis_env.Exchange` (mypy checks this return)."""
    return exchange
