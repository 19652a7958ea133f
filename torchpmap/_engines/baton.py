"""The baton: the turn that the threads of one call take to run Python code.

The device threads of a call (and the instance threads of debug mode) run one at a time:
only the holder of the call's :class:`Baton` runs; a thread that waits at a collective,
or for threads nested in it, sets the baton down so another can run, and picks it up
again before it goes on (see :mod:`torchpmap._engines.multi_device`).

A lock owned by a thread would do, but for one case: autograd runs the backward nodes
of CUDA tensors in its own thread for the device, not in the thread that called
``backward`` (or ``torch.func.grad``), which blocks until they are done. A collective's
backward node that waits for the other devices then runs in autograd's thread, and must
set down a baton that the blocked caller holds, for the caller. So this baton knows its
holder and how many times the holder took it (it is reentrant for the holder), and
:meth:`Baton.set_down` hands it on whoever calls it, giving the holder back exactly as it
was on :meth:`Baton.pick_up`: a thread runs Python code here only as the holder or for
the holder, so whoever sets it down acts for the holder.
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator

from torchpmap._engines.turn_versions import TurnVersions


@dataclasses.dataclass(frozen=True)
class Held:
    """Who held the baton when it was set down, and how many times: what ``pick_up`` restores."""

    holder: int | None
    depth: int


class Baton:
    """A reentrant turn that a thread acting for its holder may set down and pick up."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._holder: int | None = None
        self._depth = 0
        self._on_free: dict[int, Callable[[], None]] = {}  # holder -> called when its turn ends
        self._versions: list[TurnVersions] = []  # calls' shared version counters, switched with the turn

    def when_turn_ends(self, callback: Callable[[], None]) -> None:
        """Calls ``callback`` once, when the calling holder's present turn ends: it sets the
        baton down (at a collective) or gives back its last take of it."""
        with self._cond:
            if self._holder != threading.get_ident():
                raise RuntimeError("torchpmap: a thread watched a turn it does not hold (an engine bug)")
            self._on_free[self._holder] = callback

    def _turn_ended(self, holder: int | None) -> None:
        for versions in self._versions:
            versions.left(holder)
        callback = self._on_free.pop(holder, None) if holder is not None else None
        if callback is not None:
            callback()

    @contextlib.contextmanager
    def switching(self, versions: TurnVersions | None) -> Iterator[None]:
        """While a call's threads run: its shared version counters follow the turn (see
        :mod:`~torchpmap._engines.turn_versions`), and are settled after it."""
        if versions is None:
            yield
            return
        with self._cond:
            self._versions.append(versions)
        try:
            yield
        finally:
            with self._cond:
                self._versions.remove(versions)
            versions.finish()

    def acquire(self) -> None:
        """Waits for the baton and takes it (again, if this thread holds it)."""
        me = threading.get_ident()
        with self._cond:
            if self._holder == me:
                self._depth += 1
                return
            self._cond.wait_for(lambda: self._holder is None)
            self._holder, self._depth = me, 1
            for versions in self._versions:
                versions.entered(me)

    def release(self) -> None:
        """Gives back one take of this thread's; the last one frees the baton."""
        with self._cond:
            if self._holder != threading.get_ident():
                raise RuntimeError("torchpmap: a thread gave back a baton it does not hold (an engine bug)")
            self._depth -= 1
            if self._depth == 0:
                self._holder = None
                self._turn_ended(threading.get_ident())
                self._cond.notify()

    def __enter__(self) -> Baton:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def set_down(self) -> Held:
        """Frees the baton, all takes of it, for whichever thread holds it; returns them."""
        with self._cond:
            held = Held(self._holder, self._depth)
            self._holder, self._depth = None, 0
            self._turn_ended(held.holder)
            self._cond.notify()
            return held

    def pick_up(self, held: Held) -> None:
        """Waits for the baton and gives it back to ``held``'s holder, as it was."""
        with self._cond:
            self._cond.wait_for(lambda: self._holder is None)
            self._holder, self._depth = held.holder, held.depth
            for versions in self._versions:
                versions.entered(held.holder)


class FirstTurns:
    """The threads of one call take their first turns in their order (0, 1, 2, ...): thread
    ``j`` starts once thread ``j - 1``'s first turn has ended (at its first collective, or
    at its end). So a function without collectives runs its instances in order, as a loop
    does (``print``, a list it appends to, a buffer it updates in place), and so does
    every function up to its first collective. Later turns go to whichever thread a
    collective frees first."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._next = 0

    def wait(self, j: int) -> None:
        """Waits until the threads before ``j`` have had their first turns."""
        with self._cond:
            self._cond.wait_for(lambda: self._next >= j)

    def ended(self, j: int) -> None:
        """Thread ``j``'s first turn ended (or it ended without one: it raised before)."""
        with self._cond:
            if self._next <= j:
                self._next = j + 1
                self._cond.notify_all()
