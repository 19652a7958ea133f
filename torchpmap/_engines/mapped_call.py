"""The call record: one call of a mapped function, flattened for the engines.

The front end (:mod:`torchpmap._frontend.call`) turns a call into a :class:`MappedCall`, a
flat, engine-neutral description, and hands it to :func:`torchpmap._engines.dispatch.run`.
An engine returns every output leaf with the mapped axis at dim 0; it never sees pytrees,
in_axes or out_axes. :class:`OutputLayout` is how the front end stacks the flat outputs
back, and :class:`VmapFallback` what the engines remember about a function between calls.
"""
from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Protocol

import torch

from torchpmap._engines.instance_autograd import AutogradRecord
from torchpmap._placement.devices import Device
from torchpmap._placement.mesh import Mesh

#: Runs a mapped call: the vectorized engine, or one slice of a split axis.
Engine = Callable[["MappedCall"], list[torch.Tensor]]


class CompiledPrograms(Protocol):
    """A mapped function's compiled programs, as the engines run them (``jit=True``):
    :class:`torchpmap._engines.compiled.ProgramCache`, checked against this protocol there."""

    def run(
        self,
        call: MappedCall,
        signature: Hashable,
        engine: Engine = ...,
        traced_engine: Engine | None = None,
        may_retry: Callable[[Exception], bool] = ...,
    ) -> list[torch.Tensor]:
        """Runs ``call`` through the program for ``signature``, tracing it on first sight."""
        ...


@dataclasses.dataclass(eq=False, slots=True)  # not frozen: a frozen __init__ costs microseconds per call
class MappedCall:
    """One call of a mapped function, flattened.

    Attributes:
        body: runs one instance: ``body(mapped_slices, broadcast_values)`` returns the
            instance's output leaves, all tensors.
        mapped: the mapped tensor leaves; ``in_dims[k]`` is the mapped dim of ``mapped[k]``.
        broadcast: values every instance sees unchanged.
        axis_name: the name collectives use, or None.
        size: the size of the mapped axis.
        randomness: as in ``torch.func.vmap``.
        devices: where to run; None means "where the inputs are" (``vmap``).
        mesh: the mesh whose axis ``axis_name`` names, if the call maps a mesh axis.
        must_be_unmapped: after ``body`` ran, the positions of output leaves that must
            not vary along the axis (``vmap``'s ``out_axes=None``), with their key paths;
            None when there is nothing to check (``pmap``). An engine raises ValueError
            for an output that does vary.
        vma: shard_map's varying-manual-axes semantics for this axis (see
            :class:`~torchpmap._state.axis_env.AxisFrame`).
        programs: for ``jit=True``, the mapped function's compiled programs
            (:class:`CompiledPrograms`); None runs eagerly.
        signature: what identifies this call's program in ``programs``: everything
            about the arguments that a trace bakes in (structure, shapes, dtypes, ...).
        output_layout: what ``body`` records about the outputs as it runs (an
            :class:`OutputLayout`). When a compiled program answers a call without
            running ``body``, it copies in what ``body`` recorded when it was traced.
        program: ``(digest, description)`` of the mapped program (its function's
            qualified name, ``in_axes``, ``out_axes``, axis name), the same in every
            process that runs the same program: the headers of exchanges between
            processes carry the digest, so that processes running different programs
            raise at their first exchange. None for a ``vmap``.
        vmap_fallback: the mapped function's :class:`VmapFallback`, shared by its calls
            (None: a call that never falls back to one instance at a time).
        pieces: for each mapped ShardedTensor that requires grad (in grad mode), its
            shards split once on the caller's thread, on the graph through it (see
            :func:`torchpmap._engines.multi_device.split_on_the_graph`); None elsewhere.
    """

    body: Callable[[Sequence[torch.Tensor], Sequence[Any]], Sequence[torch.Tensor]]
    mapped: Sequence[torch.Tensor]
    in_dims: Sequence[int]
    broadcast: Sequence[Any]
    axis_name: Hashable | None
    size: int
    randomness: str
    devices: Sequence[Device] | None
    must_be_unmapped: Callable[[], dict[int, str]] | None = None
    mesh: Mesh | None = None
    programs: CompiledPrograms | None = None
    signature: Hashable = None
    output_layout: OutputLayout = dataclasses.field(default_factory=lambda: OutputLayout())
    vmap_fallback: VmapFallback | None = None
    vma: bool = False
    program: tuple[int, str] | None = None
    pieces: Sequence[Sequence[torch.Tensor] | None] | None = None


@dataclasses.dataclass(eq=False)
class OutputLayout:
    """The shape of a mapped function's output as a pytree, recorded by ``body``; the front
    end stacks the engine's flat outputs back into it.

    Attributes:
        spec: the output's pytree structure (a ``TreeSpec``).
        leaves: how many leaves it has.
        none_leaves: the positions of leaves that are None (they are not computed, and
            come back as None); the other leaves are the engine's outputs, in order.
    """

    spec: Any = None
    leaves: int = 0
    none_leaves: dict[int, None] = dataclasses.field(default_factory=dict)

    def record(self, spec: Any, leaves: int, none_leaves: dict[int, None]) -> None:
        self.spec, self.leaves, self.none_leaves = spec, leaves, none_leaves

    def copy_from(self, other: OutputLayout) -> None:
        self.record(other.spec, other.leaves, other.none_leaves)


def views_recorded(arguments: Sequence[Any]) -> contextlib.AbstractContextManager[Any]:
    """Where an engine makes the views, slices and copies of a call's ``arguments`` that
    the function receives. Under ``torch.no_grad()`` a view of a tensor that requires grad
    is made without a ``grad_fn``, so a function that turns grad mode back on itself
    (``with torch.enable_grad():`` inside) differentiated to the view, never to the
    caller's tensor (on one device its result required grad and ``.backward()`` left
    ``x.grad`` None; on several it was not differentiable): where grad mode is off and an
    argument requires grad, they are made with grad mode on, as ``torch.vmap``'s are.
    Nothing to do in grad mode (the common case: one check)."""
    if torch.is_grad_enabled() or torch.is_inference_mode_enabled():
        return contextlib.nullcontext()
    if not any(isinstance(t, torch.Tensor) and t.requires_grad for t in arguments):
        return contextlib.nullcontext()
    return torch.enable_grad()


def versions_of(ts: Sequence[torch.Tensor]) -> list[int]:
    """The version counters of ``ts`` (-1 for an inference tensor, which has none: a
    write into it is not seen)."""
    try:
        return [t._version for t in ts]
    except RuntimeError:  # "Inference tensors do not track version counter"
        return [version_of(t) for t in ts]


def version_of(t: torch.Tensor) -> int:
    return -1 if t.is_inference() else t._version


@dataclasses.dataclass(eq=False)
class RanVectorized:
    """Whether a function's code has once run vectorized under a map: until then, a call
    keeps a copy of its mapped arguments (see :mod:`torchpmap._engines.rerun_guard`).

    One record is shared by every mapped function made of the same code object
    (:mod:`torchpmap._frontend.function_cache`), so that ``pmap(lambda x: ...)(x)``
    written inline in a loop, a new function each time, copies on its first call only.
    """

    once: bool = False
    #: whether that run wrote into its mapped arguments: such a function keeps its copies
    #: at every call, since a later attempt (other values, another placement) may fail
    #: after its write, which only a copy can undo
    writes: bool = False

    @property
    def keeps_no_copies(self) -> bool:
        """A call skips the copies of its mapped arguments (see :mod:`~torchpmap._engines.rerun_guard`)."""
        return self.once and not self.writes


@dataclasses.dataclass(eq=False)
class VmapFallback:
    """Whether one mapped function's instances run one at a time, remembered between its
    calls (the engine choice in :mod:`torchpmap._engines.dispatch` records it).

    Attributes:
        reason: why ``torch.func.vmap`` could not run the function (its first failure),
            after which its instances run one at a time; None while vmap can run it.
        ran: whether the function's code has once run vectorized.
        autograd: what its watched vectorized run found: the modules it called, checked
            for backward hooks, and whether it read autograd metadata (see
            :mod:`torchpmap._engines.instance_autograd`).
    """

    reason: str | None = None
    ran: RanVectorized = dataclasses.field(default_factory=RanVectorized)
    autograd: AutogradRecord = dataclasses.field(default_factory=AutogradRecord)
