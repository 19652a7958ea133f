"""In-place writes to memory that several instances share: refused on every placement.

An instance of a pmap may write in place to its own slice of a mapped argument (the
caller sees the write, as with ``torch.func.vmap``). It may not write to memory that
other instances see too:

* an argument passed with ``in_axes=None`` (every instance sees all of it);
* a mapped argument whose slices share memory: an expanded view (stride 0 along the
  mapped axis, ``x.expand(n, ...)``), or a strided view whose rows overlap
  (``as_strided``, ``unfold``);
* one tensor (or views of one tensor) passed in two mapped arguments whose slices
  overlap across instances (``in_axes=(0, 1)`` of one square matrix, say).

How many times such memory is written depends on the placement: one device runs a write
to an unmapped value once and refuses a write to an expanded one (torch: "more than one
element of the written-to tensor refers to a single memory location"), while every
device of several writes the shared memory itself (4.0 everywhere from four writes of
``+= 1``). So a pmap raises ``RuntimeError`` on every placement, quoting torch's reason,
naming the argument and how its instances share memory.

How it is found, cheaply: before the call, the arguments whose instances share memory are
listed from their metadata alone (strides, storages; the exact comparison of offsets
only for the rare layouts that may overlap), and their version counters are read (a
counter every view of one tensor shares, moved by every in-place write); after the call
a counter that moved means a write. Where torch itself refuses the write first (one
device, an expanded argument), its error is re-raised with the same explanation. The
check runs for the outermost pmap outside torch.func transforms, and for the
``in_axes=None`` arguments of a nested pmap (their counters read under the enclosing
maps' batching): a write found after the call has happened on the placements that do not
refuse it, so the argument's contents are undefined after the error.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import torch

from torchpmap._state import context as _context
from torchpmap._state import torch_private as private
from torchpmap._state.faults import SharedWrite

#: torch's reason for refusing a write to memory that several elements share.
TORCH_REASON = (
    "unsupported operation: more than one element of the written-to tensor refers to a single memory location. "
    "Please clone() the tensor before performing the operation."
)
_TORCH_MARK = "more than one element of the written-to tensor refers to a single memory location"
_BROADCAST = "it is passed with in_axes None, so every instance sees all of it"
#: A layout that may overlap is compared exactly up to this many offsets; beyond, it counts as overlapping.
_EXACT_LIMIT = 1 << 22


class _Shared:
    """An argument whose instances share memory (a plain class: made on the hot path)."""

    __slots__ = ("slot", "tensor", "counted", "version", "how", "expanded")

    def __init__(
        self, slot: int, tensor: torch.Tensor, how: str, expanded: bool = False, counted: torch.Tensor | None = None
    ):
        self.slot = slot  # the argument leaf's position among the flat arguments
        self.tensor = tensor
        # whose version counter tells a write: the tensor, or (an enclosing map's batched
        # value) the plain tensor under its torch.func wrappers, whose counters stay still
        self.counted = tensor if counted is None else counted
        self.version = private.version_counter(self.counted)  # None: an inference tensor, which keeps no count
        self.how = how  # how its instances share memory, for the message
        self.expanded = expanded  # stride 0 along the mapped axis: torch itself refuses a vectorized write to it


class Watch:
    """The arguments of one call whose instances share memory, and their version counters."""

    def __init__(
        self,
        shared: list[_Shared],
        size: int,
        label: Callable[[int], tuple[str, Any]],
        kind: str,
        leaves: Sequence[Any],
    ):
        self.shared, self.size, self.label, self.kind, self.leaves = shared, size, label, kind, leaves

    def check(self) -> None:
        """Raises if the call wrote in place to memory that several instances share."""
        for s in self.shared:
            if s.version is not None and private.version_counter(s.counted) != s.version:
                torch_says = f'torch refuses such a write on one device where it can tell: "{TORCH_REASON}"'
                raise SharedWrite(self._message(s, torch_says, self._views_of(s)), self.label(s.slot)[0])

    def _views_of(self, s: _Shared) -> str:
        """The other arguments a write to ``s``'s memory may have gone through (views of one tensor share
        the version counter that found it)."""
        if s.counted is not s.tensor:  # a nested map's argument: no storage of its own to compare
            return ""
        storage = s.tensor.untyped_storage().data_ptr()
        others = [
            self.label(k)[0] for k, t in enumerate(self.leaves)
            if k != s.slot and type(t) is torch.Tensor and t.layout is torch.strided and t.numel()
            and t.untyped_storage().data_ptr() == storage
        ]
        return f", through it or through {', '.join(others)} (views of one tensor)" if others else ""

    def explain(self, error: BaseException) -> RuntimeError | None:
        """The error to raise for torch's refusal of a write to an expanded argument, or None."""
        if not isinstance(error, RuntimeError) or _TORCH_MARK not in str(error):
            return None
        expanded = [s for s in self.shared if s.expanded]
        if not expanded:
            return None
        reason = (str(error).strip().splitlines() or [TORCH_REASON])[0]
        message = self._message(expanded[0], f'torch refused the write: "{reason}"')
        return SharedWrite(message, self.label(expanded[0].slot)[0])

    def _message(self, s: _Shared, torch_says: str, through: str = "") -> str:
        t = s.tensor
        name, axis = self.label(s.slot)
        strides = f", strides {tuple(t.stride())}" if s.counted is t else ""
        return (
            f"{self.kind}: the mapped function wrote in place to the memory of {name} (in_axes {axis}, shape "
            f"{tuple(t.shape)}{strides}){through}. Its {self.size} instances share that memory: "
            f"{s.how}. Every instance would "
            f"write the others' elements, as many times as the placement runs the write, so the write is refused on "
            f"every placement ({torch_says}). The argument's contents are undefined after this error (the placements "
            "that do not refuse the write have made it). Pass an argument of its own to every instance (x.clone(); "
            "torchpmap.training.replicate for a value every instance starts from), or return the new value instead "
            "of writing it in place."
        )


def _nested_watch(
    leaves: Sequence[Any], broadcast_slots: Sequence[int], size: int, label: Callable[[int], tuple[str, Any]], kind: str
) -> Watch | None:
    """A nested map's watch: its ``in_axes=None`` arguments, which its instances share as
    an outermost map's do. (One device ran a write into one once, vectorized; a thread per
    instance, on several devices or one at a time, once per instance.) Their version
    counters are read under the enclosing maps' batching: the shared layouts of mapped
    arguments are not looked for here (a batched slice has no strides to read)."""
    if size < 2 or not broadcast_slots:
        return None
    shared = [
        _Shared(slot, t, _BROADCAST, counted=private.functorch_base(t))
        for slot in broadcast_slots
        if isinstance(t := leaves[slot], torch.Tensor) and type(t) is torch.Tensor and t.layout is torch.strided
    ]
    return Watch(shared, size, label, kind, leaves) if shared else None


def watch(
    leaves: Sequence[Any],
    mapped_slots: Sequence[int],
    in_dims: Sequence[int],
    broadcast_slots: Sequence[int],
    size: int,
    processes: Callable[[], int],
    label: Callable[[int], tuple[str, Any]],
    kind: str,
) -> Watch | None:
    """A :class:`Watch` over the arguments of one call whose instances share memory, or None
    when there are none (the common case, decided from metadata)."""
    if _context.axis_frames.get():  # inside an enclosing map: its values, maybe batched there
        return _nested_watch(leaves, broadcast_slots, size, label, kind)
    if private.current_vmap_level() is not None:
        return None  # inside a transform: the arguments are batched slices
    shared: list[_Shared] = []
    if broadcast_slots and (size > 1 or processes() > 1):  # across processes: as one device holding every instance
        for slot in broadcast_slots:
            t = leaves[slot]
            if type(t) is torch.Tensor and t.layout is torch.strided:
                shared.append(_Shared(slot, t, _BROADCAST))
    if size > 1:
        plain = []
        for slot, d in zip(mapped_slots, in_dims):
            t = leaves[slot]
            if type(t) is not torch.Tensor:
                continue
            plain.append((slot, t, d))
            if t.is_contiguous():  # the common case: no two elements share memory (and no stride is 0)
                continue
            if t.stride(d) == 0:
                how = (
                    f"it is an expanded view (stride 0 along its mapped axis {d}), so every instance sees the same "
                    "elements"
                )
                shared.append(_Shared(slot, t, how, expanded=True))
            elif not _disjoint([(t, d)], size):
                how = "its slices overlap in memory (a view such as as_strided or unfold whose rows share elements)"
                shared.append(_Shared(slot, t, how))
        if len(plain) > 1:
            shared.extend(_shared_between(plain, size, label))
    return Watch(shared, size, label, kind, leaves) if shared else None


def _shared_between(
    plain: list[tuple[int, torch.Tensor, int]], size: int, label: Callable[[int], tuple[str, Any]]
) -> list[_Shared]:
    """Mapped arguments that are views of one memory whose slices overlap across instances."""
    storages = [t.untyped_storage().data_ptr() for _, t, _ in plain]
    if len(set(storages)) == len(storages):
        return []  # the common case: each its own memory
    by_storage: dict[int, list[tuple[int, torch.Tensor, int]]] = {}
    for (slot, t, d), storage in zip(plain, storages):
        if t.numel():
            by_storage.setdefault(storage, []).append((slot, t, d))
    found: dict[int, _Shared] = {}
    for group in by_storage.values():
        if len(group) < 2:
            continue
        for i, (slot_a, a, da) in enumerate(group):
            for slot_b, b, db in group[i + 1 :]:
                same_view = (
                    a.data_ptr() == b.data_ptr() and a.dtype == b.dtype and a.shape == b.shape
                    and a.stride() == b.stride() and da == db
                )
                if same_view or _disjoint([(a, da), (b, db)], size):
                    continue  # instance i sees the same elements through both, or no element of another instance
                for slot, other in ((slot_a, slot_b), (slot_b, slot_a)):
                    if slot not in found:
                        t, d = (a, da) if slot == slot_a else (b, db)
                        how = f"it shares memory with {label(other)[0]}, and their slices overlap across instances"
                        found[slot] = _Shared(slot, t, how)
    return list(found.values())


def _disjoint(views: list[tuple[torch.Tensor, int]], size: int) -> bool:
    """Whether no element of one tensor's memory is seen by two instances, through any of
    ``views`` (views of one storage, each mapped along its dim); False when unsure."""
    if len(views) == 1 and _injective(*views[0]):
        return True
    itemsize = views[0][0].element_size()
    if any(t.element_size() != itemsize for t, _ in views):
        return False  # views of one memory as different dtypes: rare, taken as overlapping
    if size * sum(t.numel() // size for t, _ in views) > _EXACT_LIMIT:
        return False
    rows = torch.cat([_offsets(t, d) for t, d in views], dim=1)  # (instances, elements): storage offsets
    rows = rows.sort(dim=1).values
    first = torch.ones_like(rows, dtype=torch.bool)
    first[:, 1:] = rows[:, 1:] != rows[:, :-1]  # each instance's elements once
    seen = rows[first]
    return seen.unique().numel() == seen.numel()


def _injective(t: torch.Tensor, d: int) -> bool:
    """A sufficient condition for instances that never share an element: ordered by
    stride, each dim steps past everything the smaller ones span (dims of size 1, and of
    stride 0 other than the mapped one, repeat an instance's own elements only)."""
    dims = sorted(
        (st, sz) for i, (sz, st) in enumerate(zip(t.shape, t.stride())) if sz > 1 and (st != 0 or i == d)
    )
    span = 0
    for stride, length in dims:
        if stride <= span:
            return False
        span += stride * (length - 1)
    return True


def _offsets(t: torch.Tensor, d: int) -> torch.Tensor:
    """The storage offsets (in elements) each instance of ``t`` mapped along ``d`` sees: (instances, elements)."""
    index = torch.full((1,) * t.dim(), cast(int, t.storage_offset()), dtype=torch.int64)
    for i, (length, stride) in enumerate(zip(t.shape, t.stride())):
        shape = [1] * t.dim()
        shape[i] = length
        index = index + (torch.arange(length, dtype=torch.int64) * stride).view(shape)
    return index.movedim(d, 0).reshape(t.shape[d], -1)
