"""PartitionSpec: how a tensor's dims are split over the axes of a mesh.

``P('x', None)`` splits dim 0 over mesh axis ``x`` and keeps dim 1 whole; ``P(('x', 'y'))``
splits dim 0 over ``x`` and ``y`` together, ``x`` major; dims past the spec's length are
whole; a mesh axis that a spec does not name replicates the tensor over that axis.
"""
from __future__ import annotations

from collections.abc import Hashable

#: One entry of a spec: a mesh axis, several (major first), or None (the dim is whole).
SpecEntry = Hashable | tuple[Hashable, ...] | None


class PartitionSpec(tuple):
    """The mesh axes each dim of a tensor is split over (``torchpmap.P`` for short).

    Example:
        >>> from torchpmap import P
        >>> spec = P("batch", None, ("x", "y"))
        >>> spec.axes_of(2), spec.axes()
        (('x', 'y'), ('batch', 'x', 'y'))
        >>> P()  # every dim whole: replicated over every mesh axis
        PartitionSpec()
    """

    def __new__(cls, *entries: SpecEntry) -> PartitionSpec:
        for entry in entries:
            if isinstance(entry, list):
                raise TypeError(
                    f"PartitionSpec: an entry that names several mesh axes is a tuple, got the list {entry!r}; "
                    f"write {tuple(entry)!r}"
                )
        return super().__new__(cls, entries)

    def axes_of(self, dim: int) -> tuple[Hashable, ...]:
        """The mesh axes dim ``dim`` is split over, major first (``()``: whole)."""
        if dim >= len(self):
            return ()
        entry = self[dim]
        if entry is None:
            return ()
        return tuple(entry) if isinstance(entry, tuple) else (entry,)

    def axes(self) -> tuple[Hashable, ...]:
        """Every mesh axis the spec names, in the order they appear."""
        return tuple(a for d in range(len(self)) for a in self.axes_of(d))

    def __repr__(self) -> str:
        return f"PartitionSpec({', '.join(map(repr, self))})"

    def __reduce__(self) -> tuple[type, tuple]:  # a tuple subclass whose __new__ takes the entries, not one tuple
        return (PartitionSpec, tuple(self))


P = PartitionSpec
