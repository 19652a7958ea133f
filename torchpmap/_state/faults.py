"""Faults that cross layers: a peer (device thread or process) that failed, and processes
that disagree about an exchange."""
from __future__ import annotations

from collections.abc import Sequence


class PeerFailed(RuntimeError):
    """Raised in the threads (or processes) that were waiting when another instance failed."""


class SharedWrite(RuntimeError):
    """The mapped function wrote in place into memory that several of its instances share
    (an ``in_axes=None`` argument, an expanded or overlapping view): refused on every
    placement.

    Attributes:
        argument: how the message names the argument leaf (``"argument 'params' at
            ['0.weight']"``).
    """

    def __init__(self, message: str, argument: str = ""):
        super().__init__(message)
        self.argument = argument


class SizeMismatch(ValueError):
    """The processes passed different numbers of local instances to a pmap (every process
    raises it, at the same point: they stay in step)."""


class ExchangeMismatch(ValueError):
    """The processes reached an exchange with different collectives, parameters, shapes or
    dtypes, or in different pmap calls. Every process raises it, before any payload is
    used; the message names what each process called.

    Attributes:
        ranks: the processes whose exchange differs from the first process' of the group.
    """

    def __init__(self, message: str, ranks: Sequence[int] = ()):
        super().__init__(message)
        self.ranks = list(ranks)


class OutputVaries(ValueError):
    """An output whose out axis is None (vmap's ``out_axes=None``, a shard_map out spec
    that leaves a mesh axis out) varies along the mapped axis.

    Attributes:
        path: the output's key path (``""`` for the root).
    """

    def __init__(self, message: str, path: str):
        super().__init__(message)
        self.path = path
