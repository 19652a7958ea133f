"""The thread exchange: how the device threads of one call meet at a collective.

:class:`ThreadExchange` is a device thread's door to the other slices of a split axis (as
:class:`~torchpmap._engines.process_exchange.ProcessExchange` is a process'). It meets the
others at a :class:`Rendezvous`, the call's meeting points: every participating thread
deposits its values (all the leaves of a pytree: one meeting per collective); the last to
arrive combines them with one autograd Function per leaf, so that a later ``.backward()``
meets a single node and never waits for another thread; each thread then takes its own
results. A failure in any thread, a wait past ``config.collective_timeout`` or two
threads disagreeing on the collective all end the call with an error instead of a hang.
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any

import torch

from torchpmap._engines.baton import Baton
from torchpmap._state.axis_env import Exchange
from torchpmap._state.faults import PeerFailed


@dataclasses.dataclass
class _Slot:
    what: str
    values: dict[int, Any] = dataclasses.field(default_factory=dict)
    results: Sequence[Any] | None = None
    taken: int = 0


class Rendezvous:
    """The meeting points of one call; ``meet`` is called once per thread per collective."""

    def __init__(self, timeout: float, baton: Baton | None = None):
        self.timeout = timeout
        self.baton = baton  # debug mode: only the holder runs; a waiting thread passes it on
        self._cond = threading.Condition()
        self._slots: dict[Hashable, _Slot] = {}
        self._left: dict[Hashable, set[int]] = {}  # group -> the participants whose function returned
        self.failure: str | None = None

    def fail(self, who: str) -> None:
        """Marks the call failed (``who`` raised) and wakes every waiting thread."""
        with self._cond:
            if self.failure is None:
                self.failure = who
            self._cond.notify_all()

    def leave(self, group: Hashable, index: int) -> None:
        """Participant ``index`` of ``group`` has returned: it calls no more collectives, so
        a meeting that still waits for it can never complete (see :meth:`meet`)."""
        with self._cond:
            self._left.setdefault(group, set()).add(index)
            self._cond.notify_all()

    def meet(
        self,
        group: Hashable,
        seq: int,
        index: int,
        count: int,
        what: str,
        value: Any,
        combine: Callable[[list[Any]], Sequence[Any]],
    ) -> Any:
        """Deposits ``value`` as participant ``index`` of ``count`` in ``group``'s ``seq``-th
        meeting; returns result ``index``."""
        key = (group, seq)
        with self._cond:
            self._raise_if_failed(what)
            slot = self._slots.setdefault(key, _Slot(what))
            if slot.what != what:
                raise RuntimeError(
                    f"torchpmap: the instances disagree on the collective they run: one runs {slot.what}, another "
                    f"{what}. Every instance of a pmap must call the same collectives in the same order."
                )
            slot.values[index] = value
            if len(slot.values) == count:
                slot.results = combine([slot.values[i] for i in range(count)])
                self._cond.notify_all()
            deadline = time.monotonic() + self.timeout
            while slot.results is None:
                self._raise_if_failed(what)
                self._raise_if_left(group, slot, count)
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(range(count)) - set(slot.values))
                    raise TimeoutError(
                        f"torchpmap: {what} waited {self.timeout:g} s for the participants {missing} of {count} "
                        "along the axis (device slices; single instances in debug mode), which never arrived: a "
                        "deadlock, or a device that stopped. Raise torchpmap.config.collective_timeout if they "
                        "are just slow."
                    )
                self._wait(left)
            result = slot.results[index]
            slot.taken += 1
            if slot.taken == count:
                del self._slots[key]
            return result

    def _wait(self, seconds: float) -> None:
        if self.baton is None:
            self._cond.wait(seconds)
            return
        held = self.baton.set_down()  # let another instance run up to this collective
        try:
            self._cond.wait(seconds)
        finally:
            self._cond.release()  # take the baton first, then the lock: the order every thread uses
            self.baton.pick_up(held)
            self._cond.acquire()

    @contextlib.contextmanager
    def turn(self) -> Iterator[None]:
        """Debug mode: hold the baton while running this thread's Python code."""
        if self.baton is None:
            yield
            return
        with self.baton:
            yield

    @contextlib.contextmanager
    def passing_turn(self) -> Iterator[None]:
        """Debug mode: an instance that waits for nested instances lets them run."""
        if self.baton is None:
            yield
            return
        held = self.baton.set_down()
        try:
            yield
        finally:
            self.baton.pick_up(held)

    def _raise_if_left(self, group: Hashable, slot: _Slot, count: int) -> None:
        gone = sorted(self._left.get(group, set()) - set(slot.values))
        if gone:
            came = sorted(slot.values)
            raise RuntimeError(
                f"torchpmap: {slot.what} was called by the participants {came} of {count} along the axis "
                f"(device slices; single instances where they run one at a time), but {gone} returned without "
                "calling it. Every instance of a pmap must call the same collectives in the same order: a "
                "branch on a value that differs between instances (`if x.sum() > 0:`) must not skip one. "
                "Call the collective on every path, or compute both sides and choose with torch.where."
            )

    def _raise_if_failed(self, what: str) -> None:
        if self.failure is not None:
            raise PeerFailed(f"torchpmap: {what} was abandoned because {self.failure} failed")


@dataclasses.dataclass(frozen=True)
class _Destinations:
    """The participants' devices, as one argument of :class:`GatherAll` that is not a
    pytree: torch.func's generated jvp-of-vmap rule pairs the flattened arguments with
    their tangents one to one, and a tuple of devices would flatten into several."""

    devices: tuple[torch.device, ...]


class GatherAll(torch.autograd.Function):
    """``ts[i]`` from every participant -> for each participant, ``stack(ts)`` on its device.

    Backward sums the cotangents of all participants' stacks back onto each input, in one
    node. It is written in torch.func's style (``setup_context``, a generated vmap rule,
    ``jvp``), so that transforms around a multi-device pmap go through it.
    """

    generate_vmap_rule = True

    @staticmethod
    def forward(to: _Destinations, *ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(torch.stack([t.to(dev) for t in ts]) for dev in to.devices)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        ctx.devices, ctx.sources = inputs[0].devices, [t.device for t in inputs[1:]]

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        grads_in = []
        for i, src in enumerate(ctx.sources):
            parts = [g[i].to(src) for g in grads if g is not None]
            grads_in.append(torch.stack(parts).sum(0) if parts else None)
        return (None, *grads_in)

    @staticmethod
    def jvp(ctx: Any, _: Any, *tangents: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # linear: the tangents travel as the values do
        return tuple(torch.stack([t.to(dev) for t in tangents]) for dev in ctx.devices)


@dataclasses.dataclass(eq=False)
class ThreadExchange:
    """One thread's door to the other slices of a split axis.

    Attributes:
        rendezvous: the call's meeting points.
        index: this slice's position along the axis.
        devices: the device of every slice, in axis order.
        group: identifies the set of threads that meet (one per slice of this axis).
    """

    rendezvous: Rendezvous
    index: int
    devices: tuple[torch.device, ...]
    group: Hashable
    seq: int = 0
    nested_calls: int = 0  # calls made in this slice that start threads of their own

    def for_nested(self, call: int, thread: Hashable) -> ThreadExchange:
        """This slice's door for ``thread`` of the ``call``-th call made in this slice that
        runs in threads of its own (a shard_map's positions inside a pmap): each of those
        threads meets the same thread of the other slices' same call, and only it. Shared
        by them all, the door had paired whichever threads came first (a ``psum`` over the
        pmap's axis added another position's block, differently from run to run)."""
        return dataclasses.replace(self, group=(self.group, call, thread), seq=0, nested_calls=0)

    starts_sums = False  # the threads take turns: a sum completes when they meet, not in the background
    reduces_locally = False  # device threads gather every instance's value: bitwise those of one device

    def sum_with_grad(self, ts: Sequence[torch.Tensor], what: str) -> None:
        return None  # never asked (reduces_locally is False): the threads gather every value

    def scatter_sum_with_grad(self, ts: Sequence[torch.Tensor], what: str) -> None:
        return None  # the slices' instances are gathered: their sums, in one order, bitwise one device's

    def sums_in_order(self, groups: Sequence[Sequence[torch.Tensor]], what: str) -> None:
        raise NotImplementedError("the threads take turns: a sum completes when they meet, not in the background")

    def all_gather_with_grad(self, ts: Sequence[torch.Tensor], what: str, partial: bool = False) -> list[torch.Tensor]:
        """For each ``ts[k]``: every slice's value stacked along a new dim 0, on this slice's
        device. All tensors travel in one meeting (one wait per collective, not per tensor).
        (``partial`` plays no part here: the slices never disagree on their sizes.)"""
        self.seq += 1
        devices = self.devices
        def combine(per_slice: list[Sequence[torch.Tensor]]) -> list[list[torch.Tensor]]:
            _check_agreement(per_slice, what)
            return _gather_each(devices, per_slice)

        return self.rendezvous.meet(self.group, self.seq, self.index, len(devices), what, ts, combine)

    def leave(self) -> None:
        """This slice's function has returned: no more meetings (see :meth:`Rendezvous.leave`)."""
        self.rendezvous.leave(self.group, self.index)


def _implements_exchange(exchange: ThreadExchange) -> Exchange:
    """For the type checker: a :class:`ThreadExchange` is an
    :class:`~torchpmap._state.axis_env.Exchange` (mypy checks this return)."""
    return exchange


def _signature(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"


def _check_agreement(per_slice: list[Sequence[torch.Tensor]], what: str) -> None:
    """Every slice must bring tensors of the same shapes and dtypes (never promoted,
    never stacked into an error of torch's)."""
    first = [_signature(t) for t in per_slice[0]]
    for i, ts in enumerate(per_slice[1:], start=1):
        mine = [_signature(t) for t in ts]
        if mine != first:
            raise RuntimeError(
                f"torchpmap: the device slices disagree on the values of {what}: slice 0 passes "
                f"{', '.join(first)}, slice {i} passes {', '.join(mine)}. Every instance of a pmap must pass "
                "values of the same shapes and dtypes to a collective."
            )


def _gather_each(
    devices: tuple[torch.device, ...], per_slice: list[Sequence[torch.Tensor]]
) -> list[list[torch.Tensor]]:
    """``per_slice[i][k]`` (tensor k of slice i) -> result ``[i][k]``: tensor k of every
    slice, stacked on slice i's device. One GatherAll node per tensor, as a lone tensor gets."""
    to = _Destinations(tuple(devices))
    stacks = [GatherAll.apply(to, *tensor_k) for tensor_k in zip(*per_slice)]  # stacks[k][i]
    return [list(mine) for mine in zip(*stacks)]
