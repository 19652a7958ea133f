"""What a failed vectorized attempt wrote into the mapped arguments, undone before a re-run.

When ``torch.func.vmap`` cannot run a function (``.item()`` of values that differ
between instances, an op without a batching rule), the dispatcher runs its instances
again, one at a time (:mod:`torchpmap._engines.dispatch`); it also re-runs them to name
the instance behind an error. The function's Python code then runs a second time. If
the vectorized attempt had already written in place into a mapped argument
(``x.add_(1)`` before the ``.item()``), the re-run would write it again: on one device
the caller's tensor got ``+2``, where each instance run alone, or a device running one
instance, gives ``+1``.

So before a call the dispatcher notes each mapped argument's version counter (every
in-place write moves it; a few hundred nanoseconds a call), and until the mapped
function's code has once run vectorized it keeps a copy of them too (the first call pays a
copy of its mapped arguments; later calls nothing more, and neither do the calls of a new
function of the same code, such as a lambda written inline in a loop; devices that run
one instance each run it without vmap, so such a call keeps none, and does not count as
a vectorized run: a later call on one device still keeps its copy). After a failed attempt,
:func:`undo_writes` puts the written arguments back from that copy; without a
copy (a function that ran vectorized before and fails now, on other values), or for an
argument that requires grad (its autograd history now ends in the failed attempt's
write), it raises instead of running the function again.

With ``randomness="per_instance"`` the call's seed is one draw from the caller's
generator, from which every instance's stream is made, so that every placement draws the
same numbers. The failed attempt drew it already: the re-run would draw the next one, and
the first call after a fallback gave other numbers than a device that runs its instance
alone, or ``disable_vectorization()``. With ``randomness="same"`` every instance draws
what plain PyTorch draws from the caller's generator (the CPU's, and the call's device's
on CUDA); the failed attempt drew those numbers already, and the re-run drew the next
ones (until 2026-11-29: a ``torch.rand(())`` before a branch on a value gave 0.768 on one
device where 2 and 4 devices, debug mode and plain PyTorch gave 0.496, and every later
draw of the caller was shifted). :func:`note` keeps the generators' states for such
calls (half a microsecond each), and :func:`undo` rewinds them before the re-run.

Writes into tensors that are not arguments (a module's buffers the function closes
over) are undone by a journal of the attempt's writes, kept on the same calls
(:mod:`~torchpmap._engines.closure_writes`). A write into an ``in_axes=None`` argument
is refused on every placement (see :mod:`torchpmap._frontend.aliasing`).
"""
from __future__ import annotations

import dataclasses

import torch

from torchpmap._engines import closure_writes, multi_device
from torchpmap._engines.mapped_call import MappedCall, version_of, versions_of
from torchpmap._engines.random_per_thread import caller_generators
from torchpmap._placement.sharded import ShardedTensor


@dataclasses.dataclass
class Before:
    """What :func:`undo` needs of the state before a vectorized attempt.

    Attributes:
        versions: the mapped arguments' version counters (:func:`versions`).
        saved: copies of them while the function has not run vectorized (:func:`copies`).
        generators: the caller's generators and their states, for ``randomness="per_instance"``
            and ``"same"`` (see :func:`_drawn_from`).
        journal: what the attempt writes into other tensors, while copies are kept
            (:mod:`~torchpmap._engines.closure_writes`; the attempt runs under it).
    """

    versions: list[int]
    saved: list[torch.Tensor | None] | None
    generators: list[tuple[torch.Generator, torch.Tensor]]
    journal: closure_writes.Journal | None = None


def note(call: MappedCall) -> Before:
    """The state of ``call``'s arguments (and generators) before its vectorized attempt."""
    generators = [(g, g.get_state()) for g in _drawn_from(call)]
    fallback = call.vmap_fallback
    # each instance alone on a device, without vmap: a failure is the instance's own, never undone
    if fallback is None or fallback.ran.keeps_no_copies or multi_device.each_instance_alone(call):  # the common case
        return Before(versions(call), None, generators)
    # (inside a jit=True trace, the trace's own journal: see closure_writes.undone_after)
    journal = closure_writes.start(call.mapped)
    return Before(versions(call), copies(call), generators, journal)


def undo(call: MappedCall, before: Before, why: str) -> None:
    """Before the instances of ``call`` run again: puts back what its failed vectorized
    attempt wrote into the mapped arguments, or raises RuntimeError when it cannot
    (:func:`undo_writes`), and rewinds the caller's generators to where they were."""
    undo_writes(call, before.versions, before.saved, why)
    if before.journal is not None:
        before.journal.undo()
    for g, state in before.generators:
        g.set_state(state)


def _drawn_from(call: MappedCall) -> list[torch.Generator]:
    """The caller's generators that a vectorized attempt of ``call`` draws from, where a
    re-run must draw the same numbers: ``"per_instance"`` seeds every instance from one
    draw of the CPU's; ``"same"`` draws from the CPU's, and from the CUDA device's where
    the call runs on one. ``"different"`` draws numbers that depend on the placement
    anyway (see docs/device-threads.md), and ``"error"`` none."""
    if call.randomness == "per_instance":
        return [torch.default_generator]
    if call.randomness != "same":
        return []
    device = call.devices[0].torch_device if call.devices else (call.mapped[0].device if call.mapped else None)
    return caller_generators(device)


def versions(call: MappedCall) -> list[int]:
    """The version counters of ``call``'s mapped arguments (see :func:`versions_of`)."""
    return versions_of(call.mapped)


def copies(call: MappedCall) -> list[torch.Tensor | None] | None:
    """Copies of ``call``'s mapped arguments while its function has not run vectorized
    yet (None after: no copies; an entry None: a ShardedTensor, not copied)."""
    fallback = call.vmap_fallback
    if fallback is None or fallback.ran.keeps_no_copies:
        return None
    return [None if isinstance(t, ShardedTensor) else t.detach().clone() for t in call.mapped]


def undo_writes(
    call: MappedCall, before: list[int], saved: list[torch.Tensor | None] | None, why: str
) -> None:
    """Before the instances of ``call`` run again: puts back what its failed vectorized
    attempt wrote into the mapped arguments (``before``: their version counters before
    it, from :func:`versions`; ``saved``: :func:`copies`), or raises RuntimeError when
    it cannot (``why``: what failed)."""
    tensors = call.mapped
    written = [k for k, (t, v) in enumerate(zip(tensors, before)) if version_of(t) != v]
    if not written:
        return
    kept = saved or [None] * len(tensors)
    undo = {k: c for k in written if not tensors[k].requires_grad and (c := kept[k]) is not None}
    if len(undo) == len(written):
        with torch.no_grad():
            for k, copy in undo.items():
                tensors[k].copy_(copy)
        return
    k = next(k for k in written if k not in undo)
    t = tensors[k]
    if t.requires_grad:
        cause = "it requires grad, so its autograd history now ends in that write"
    elif saved is None:
        cause = "the function has run vectorized before, so no copy of the arguments was kept"
    else:
        cause = "it is a ShardedTensor, of which no copy is kept"
    raise RuntimeError(
        f"pmap over axis {call.axis_name!r}: its vectorized run failed ({why}) after the function had written in "
        f"place into mapped argument {k} (shape {tuple(t.shape)}), and that write cannot be undone ({cause}). "
        "Running the instances again, one at a time, would write it twice, so the call stops here; the argument "
        "holds the vectorized run's writes. Write into a clone of the argument inside the function "
        "(x = x.clone()), or run it under torchpmap.disable_vectorization()."
    )
