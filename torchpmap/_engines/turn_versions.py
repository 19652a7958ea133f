"""Each device thread's writes into its slice of an argument, counted as if it ran alone.

Autograd notes a tensor's version counter when it saves the tensor for the backward, and
the backward refuses a tensor whose counter has moved since (it was written in place).
Every view of a tensor shares its counter. On one device a pmap's instances are one
vectorized computation: ``pmap(lambda a: a.mul_(3).sin())(x)`` writes ``x`` once, and
``sin`` saves it after that write. On several devices each device thread writes its own
slice, a view of ``x``: the second device's write moved the counter that the first
device's ``sin`` had noted, and ``.backward()`` raised "modified by an inplace
operation" where one device computed (the same with ``(a.mul_(3) * w).sin()`` for a
weight ``w``). Each thread's slice is its own memory; only the shared count was wrong.

So while the threads of a call take turns (:class:`~torchpmap._engines.baton.Baton`),
each counter the call's mapped arguments share is switched with the turn: a thread
that takes the turn finds the count as its own writes (and the writes of nobody's turn)
left it, as if it had run alone. After the call the count is the most any thread
counted: what one device's vectorized writes count. A thread's save is refused just
where its own slice was written after it (a write by another thread touches other
memory), so nothing passes that one device would refuse. Threads that are not the
call's own (a nested call sharing the baton) count for every thread.

A tensor that a thread sees whole (closed over) while another writes its slice shares
the count too: then the counts say less than the memory holds. That write is one that
one device and several already disagree about (see :mod:`torchpmap._engines.closure_writes`).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import cast

import torch

from torchpmap._state import torch_private as private


@dataclasses.dataclass
class _Holder:
    own: list[int]  # writes counted in this thread's turns, per counter
    entered_at: list[int]  # the counts when its present turn began


class TurnVersions:
    """The version counters of a call's mapped arguments, one count per device thread.

    :meth:`register` each device thread before its first turn; the baton calls
    :meth:`entered` and :meth:`left` as turns begin and end (under its lock), and the call
    calls :meth:`finish` once every thread has ended.
    """

    def __init__(self, tensors: Sequence[torch.Tensor], counts: Sequence[int]) -> None:
        self._tensors = list(tensors)
        self._start = list(counts)
        self._unattributed = [0] * len(counts)  # writes made in turns of no registered thread
        self._left_at = list(counts)  # the counts when the last registered turn ended
        self._holders: dict[int | None, _Holder] = {}  # None (nobody's turn) never registered

    @classmethod
    def of(cls, arguments: Sequence[object]) -> TurnVersions | None:
        """For the plain tensors among ``arguments`` that keep a count, one per counter
        (views of one tensor share it); None when there are none."""
        tensors: list[torch.Tensor] = []
        counts: list[int] = []
        seen: set[int] = set()
        for t in arguments:
            if not isinstance(t, torch.Tensor) or type(t) not in (torch.Tensor, torch.nn.Parameter):
                continue
            if private.is_functorch_wrapped(t):  # an enclosing transform's: its count is not the caller's
                continue
            root = t._base if t._base is not None else t
            count = private.version_counter(t)
            if count is None or id(root) in seen:
                continue
            seen.add(id(root))
            tensors.append(t)
            counts.append(count)
        return cls(tensors, counts) if tensors else None

    def _now(self) -> list[int]:
        return [cast(int, private.version_counter(t)) for t in self._tensors]

    def register(self, holder: int) -> None:
        """``holder`` (a thread's ident) is one of the call's own device threads."""
        self._holders[holder] = _Holder([0] * len(self._start), list(self._start))

    def entered(self, holder: int | None) -> None:
        """A turn begins: a registered thread finds the counts it would have alone."""
        mine = self._holders.get(holder)
        if mine is None:
            return
        now = self._now()
        self._unattributed = _moved(self._unattributed, now, self._left_at)
        target = [b + u + o for b, u, o in zip(self._start, self._unattributed, mine.own)]
        if target != now:
            private.set_version_counters(self._tensors, target)
        mine.entered_at = target

    def left(self, holder: int | None) -> None:
        """A turn ends: a registered thread's writes in it are its own."""
        mine = self._holders.get(holder)
        if mine is None:
            return
        now = self._now()
        mine.own = _moved(mine.own, now, mine.entered_at)
        self._left_at = now

    def finish(self) -> None:
        """After the call: each count is the most that any thread counted."""
        now = self._now()
        unattributed = _moved(self._unattributed, now, self._left_at)
        most = [max((h.own[i] for h in self._holders.values()), default=0) for i in range(len(now))]
        final = [b + u + m for b, u, m in zip(self._start, unattributed, most)]
        if final != now:
            private.set_version_counters(self._tensors, final)


def _moved(counted: list[int], now: list[int], since: list[int]) -> list[int]:
    """``counted`` plus each counter's writes from ``since`` to ``now``."""
    return [c + max(n - s, 0) for c, n, s in zip(counted, now, since)]
