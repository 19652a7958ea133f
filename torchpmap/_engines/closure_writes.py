"""What a failed vectorized attempt wrote into tensors that are not its arguments, undone
before the re-run.

:mod:`~torchpmap._engines.rerun_guard` undoes a failed attempt's writes into the mapped
arguments. A function also writes into tensors it closes over or reads from a module:
``nn.BatchNorm1d``'s forward counts its batches with ``self.num_batches_tracked.add_(1)``
and only then calls ``batch_norm``, which vmap refuses for running statistics that are
not batched. The instances then ran again one at a time and counted again: a module
closed over by a pmap of 4 instances counted 5 batches on one device, 6 on two devices
(each device's attempt once), and 4 on four devices, in debug mode and in a loop.

So while a function has not run vectorized yet (the calls for which the rerun guard
keeps copies of the arguments), its vectorized attempt runs under a :class:`Journal`: a
torch dispatch mode, which sees every op below autograd and vmap with its schema. Before
an op writes into a tensor that was there before the attempt (not one made by an op of
the attempt, and not a mapped argument, which the rerun guard restores), the journal
keeps a copy of it; after a failed attempt, :meth:`Journal.undo` writes the copies back,
the last write first. Dispatch modes are per thread: the device threads of the attempt
enter the same journal (:func:`entered`). A call after the function once ran vectorized
runs without one (the journal costs a Python call per op).
"""
from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from torchpmap._state import torch_private as private

#: The journal of the vectorized attempt that this thread's code runs in (None: none).
_active: contextvars.ContextVar[Journal | None] = contextvars.ContextVar("torchpmap_closure_writes", default=None)


def _storage(t: torch.Tensor) -> int | None:
    """The address of ``t``'s storage; None for a tensor without one of real memory (a
    fake or meta tensor of a trace, an empty one), whose writes need no undoing."""
    if private.is_fake_tensor(t):
        return None
    try:
        address = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None
    return address or None


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            if isinstance(v, torch.Tensor):
                yield v


class Journal:
    """Copies of the tensors that an attempt wrote into and did not make (module docstring)."""

    def __init__(self, arguments: Sequence[torch.Tensor]) -> None:
        self._lock = threading.Lock()  # device threads write it (in turns)
        self._made: set[int] = {a for t in arguments if (a := _storage(t)) is not None}  # not ours to undo
        self._kept: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._seen: set[tuple[int, int, tuple[int, ...], tuple[int, ...]]] = set()

    def before_write(self, t: torch.Tensor) -> None:
        """An op is about to write into ``t``: keeps a copy of it if the attempt did not make it."""
        address = _storage(t)
        if address is None:
            return
        key = (address, int(t.storage_offset()), tuple(t.shape), tuple(t.stride()))
        with self._lock:
            if address in self._made or key in self._seen:
                return
            self._seen.add(key)
        with torch.no_grad(), private.modes_disabled():  # a real copy, also under a trace's fake mode
            copy = t.clone()
        with self._lock:
            self._kept.append((t, copy))

    def made(self, t: torch.Tensor) -> None:
        """An op of the attempt made ``t``: writes into its memory are the attempt's own."""
        address = _storage(t)
        if address is not None:
            with self._lock:
                self._made.add(address)

    def undo(self) -> None:
        """Writes back what the attempt's ops found in the tensors they wrote into, the
        last write first."""
        with torch.no_grad(), private.modes_disabled():
            for t, copy in reversed(self._kept):
                t.copy_(copy)
        self._kept.clear()


class _Watch(private.TorchDispatchMode):
    """One thread's view of a :class:`Journal`: tells it of every op's writes and outputs.
    (A mode object is entered in one thread only: it keeps the flags it replaced.)"""

    def __init__(self, journal: Journal) -> None:
        super().__init__()
        self.journal = journal

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """torch.compile inside the attempt compiles as without the journal, which sees the
        compiled code's ops when it runs (a mode that does not say so makes Dynamo skip
        every frame it meets: a ``fullgraph=True`` function then fails to compile)."""
        return True

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        schema = func._schema
        if schema.is_mutable:
            for k, argument in enumerate(schema.arguments):
                if argument.alias_info is None or not argument.alias_info.is_write:
                    continue
                value = kwargs[argument.name] if argument.name in kwargs else args[k] if k < len(args) else None
                for t in _tensors(value):
                    self.journal.before_write(t)
        out = func(*args, **kwargs)
        returns = schema.returns
        results = (out,) if len(returns) == 1 else out  # one result: a tensor, or a list of them (split)
        for returned, value in zip(returns, results):
            if returned.alias_info is None:  # not a view of an input, nor an input written in place
                for t in _tensors(value):
                    self.journal.made(t)
        return out


def watching() -> bool:
    """Whether a journal's dispatch mode watches the attempt running here."""
    return _active.get() is not None


def start(arguments: Sequence[torch.Tensor]) -> Journal | None:
    """A journal for a vectorized attempt over ``arguments`` (None inside another's attempt,
    whose journal sees this one's writes)."""
    return None if _active.get() is not None else Journal(arguments)


@contextlib.contextmanager
def kept(journal: Journal | None) -> Iterator[None]:
    """Runs the block (the vectorized attempt) under ``journal`` (nothing for None)."""
    if journal is None:
        yield
        return
    token = _active.set(journal)
    try:
        with entered():
            yield
    finally:
        _active.reset(token)


@contextlib.contextmanager
def undone_after() -> Iterator[None]:
    """Runs the block (a ``pmap(jit=True)`` trace) under a journal of its own, and undoes
    its writes after it, whether it succeeds or fails.

    A trace runs the function's Python once, on the real tensors the function closes
    over, so a write into one of them (``nn.BatchNorm1d`` counting its batches, in train
    mode) happened there, and then once more when the compiled program (or, where the
    trace failed, the eager run) ran the call: ``num_batches_tracked`` went up by 2 on
    the first call on one device and by 4 on four devices, where it counts 1 per call.
    The device threads of a trace enter the same journal (:func:`entered`)."""
    journal = Journal(())
    try:
        with kept(journal):
            yield
    finally:
        journal.undo()


@contextlib.contextmanager
def entered() -> Iterator[None]:
    """This thread enters the journal of the attempt it runs in, if any: the caller's
    thread, and each device thread of the attempt (dispatch modes are per thread)."""
    journal = _active.get()
    if journal is None:
        yield
        return
    with _Watch(journal):
        yield
