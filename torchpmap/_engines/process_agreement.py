"""Processes agree on every exchange before any payload is used.

Processes that reach an exchange with different dtypes, shapes, collectives or
parameters, or out of step, must all raise the same clear error, and payloads of
different byte counts must never meet in gloo or NCCL (gloo aborts the process). So every
transfer carries a :class:`Header` from each process (a digest of what it is doing, the
pmap call and transfer it belongs to, its local size and payload size), and every process
compares all of them before it reads a payload.

A safe check needs the headers *before* the payloads: a separate round of a few bytes.
That round costs a collective's latency (about 15% of a 2-process data-parallel step on
loopback gloo), so a *group* of processes usually skips it:

* **Announced (one round).** Each header also predicts the form of the group's next
  transfer (its kind and row size), learned from what followed the same exchange last
  time. When every process predicted the same form, the next transfer is *announced*:
  processes whose transfer has that form send header and payload together, in one
  collective of the announced size. A process whose transfer turns out different sends
  a *renegotiate* header in the announced form instead (with a zero payload); every
  process sees it in the same collective and all fall back to the two rounds below. A
  training loop repeats the same transfers, so after its first step every transfer is
  announced.
* **Unannounced (two rounds).** Headers alone, then, when they agree, the payloads.

Either way the collectives of a round have the same size in every process, and headers
are compared before any payload is used. Only the announced form's sizes must agree
beforehand, and every process learned it from the same headers.
"""
from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import torch

#: The kinds of transfer, as header codes (the digest covers the kind too).
KINDS = {"gather": 1, "gather-all": 2, "scatter": 3, "end": 4, "sum": 5}
#: int64 fields of a header, and its size in bytes (a multiple of 16, so that a payload
#: that follows it stays aligned for any dtype).
HEADER_FIELDS = 8
HEADER_BYTES = HEADER_FIELDS * 8
RENEGOTIATE = 1  # Header.flag: my transfer differs from the announced one; fall back to two rounds

Form = tuple[int, int]  # (kind code, payload bytes per row): what must match for one round


@dataclasses.dataclass(frozen=True)
class Header:
    """What one process is about to transfer, as eight integers that every process compares.

    Attributes:
        digest: stands for the kind of transfer, the collective and its parameters, the
            shape and dtype of every tensor, and the pmap it belongs to (its function's
            qualified name, in_axes, out_axes and axis name).
        call: the pmap call the transfer belongs to; transfer: which of its transfers.
            Processes out of step differ there.
        local_size: the process' number of instances in the call.
        nbytes: payload bytes per row, so that payloads of different sizes never meet.
        flag: :data:`RENEGOTIATE`, or 0.
        next_kind, next_nbytes: the form this process expects the group's next transfer
            to have (0, 0 when it has no guess).
    """

    digest: int
    call: int
    transfer: int
    local_size: int
    nbytes: int
    flag: int = 0
    next_kind: int = 0
    next_nbytes: int = 0

    def agrees_with(self, other: Header) -> bool:
        """The same transfer (the guesses about the next one may differ)."""
        return (self.digest, self.call, self.transfer, self.local_size, self.nbytes) == (
            other.digest, other.call, other.transfer, other.local_size, other.nbytes
        )

    def as_tensor(self, device: torch.device) -> torch.Tensor:
        fields = [getattr(self, f.name) for f in dataclasses.fields(self)]
        return torch.tensor(fields, dtype=torch.int64, device=device)

    @classmethod
    def from_bytes(cls, rows: torch.Tensor) -> list[Header]:
        """``(m, HEADER_BYTES)`` uint8 rows -> the m headers (rows that may be a slice of
        wider rows: ``reshape`` copies them apart, except a single row, already in one piece)."""
        return [cls(*row) for row in rows.reshape(-1).view(torch.int64).reshape(-1, HEADER_FIELDS).tolist()]


def digest_of(kind: str, what: str, shapes: tuple | None, dtypes: tuple | None, program: int = 0) -> int:
    """A stable 63-bit digest (the same in every process, unlike ``hash``), cached: most
    steps repeat the same exchanges. ``program`` is the digest of the pmap the transfer
    belongs to (its function, in_axes, out_axes, axis name; ``MappedCall.program``), so
    that processes running different programs disagree at their first exchange."""
    key = (kind, what, shapes, dtypes, program)
    digest = _digests.get(key)
    if digest is None:
        raw = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
        digest = int.from_bytes(raw, "little", signed=True)
        if len(_digests) > 4096:
            _digests.clear()
        _digests[key] = digest
    return digest


_digests: dict[tuple, int] = {}


@dataclasses.dataclass
class Chain:
    """What one process group has agreed about its next transfer, and what this process
    has learned about which transfer follows which.

    Attributes:
        announced: the form every process predicted for the group's next transfer, or None.
        last: the digest of the group's latest transfer.
        follows: digest -> the form of the transfer that followed it last time.
    """

    announced: Form | None = None
    last: int | None = None
    follows: dict[int, Form] = dataclasses.field(default_factory=dict)

    def guess_after(self, digest: int) -> Form:
        return self.follows.get(digest, (0, 0))

    def completed(self, digest: int, form: Form, headers: list[Header]) -> None:
        """A transfer every process agreed on is done: learn, and take the next announcement."""
        if self.last is not None:
            self.follows[self.last] = form
        self.last = digest
        guesses = {(h.next_kind, h.next_nbytes) for h in headers}
        (guess,) = guesses if len(guesses) == 1 else ((0, 0),)
        self.announced = guess if guess[0] else None

    def forget(self) -> None:
        """After a disagreement: the next transfer takes two rounds."""
        self.announced, self.last = None, None


_chains: dict[Any, Chain] = {}
_chains_of: list[Any] = [None]  # the process state the chains belong to


def chain(state: Any, group: Any) -> Chain:
    """The chain of ``group`` (None: all processes) in this process group's lifetime."""
    if _chains_of[0] is not state:  # a new initialize(): nothing carries over
        _chains.clear()
        _chains_of[0] = state
    found = _chains.get(group)
    if found is None:
        found = _chains[group] = Chain()
    return found
