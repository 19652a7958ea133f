"""The type aliases of torchpmap's signatures, one definition each.

``AxisName``/``AxisNames`` (what collectives and maps call an axis), ``AxisSpec``
(``in_axes``/``out_axes``), ``PyTree`` and ``Randomness``. Devices and meshes have their
own types (:class:`~torchpmap.Device`, :class:`~torchpmap.Mesh`); ``DeviceLike`` (a device
as ``devices=`` takes it) sits beside ``Device`` in :mod:`torchpmap._placement.devices`.
"""
from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any, Literal, SupportsIndex, TypeAlias

#: A pytree: a leaf (a tensor, a number, any object) or a container that torch's pytree
#: flattens (tuple, list, dict, namedtuple, OrderedDict, a registered class) of pytrees.
#: Leaves and registered containers are open-ended, so a type checker sees ``Any`` (as
#: torch's pytree module and JAX type their pytrees).
PyTree: TypeAlias = Any

#: The name of a mapped axis (``axis_name=``): any hashable value, usually a string.
AxisName: TypeAlias = Hashable

#: What a collective's ``axis_name`` takes: one axis name, or a tuple of them (their
#: product, row-major: the first name most significant).
AxisNames: TypeAlias = AxisName | tuple[AxisName, ...]

#: ``in_axes``/``out_axes``: the axis to map (an int, negative counting from the end; a
#: numpy integer too) or None (not mapped), or a pytree prefix of the arguments (the
#: outputs) holding those: a tuple or list (one entry per positional argument), a dict,
#: a namedtuple. (A prefix of another registered pytree class works too; a type checker
#: asks for a ``cast`` there.)
AxisSpec: TypeAlias = SupportsIndex | None | Sequence[Any] | Mapping[Any, Any]

#: How random ops behave across the instances (``randomness=``): as in ``torch.func.vmap``
#: ("error", "different", "same"), or "per_instance" (a stream per instance, the same
#: numbers on every placement).
Randomness: TypeAlias = Literal["error", "different", "same", "per_instance"]
