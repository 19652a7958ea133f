"""How a collective runs inside ``torch.func`` transforms.

A collective is a :class:`Primitive` (what to compute, given every instance's value at
once) bound through one ``torch.autograd.Function``, :class:`_Bind`, whose ``vmap`` rule
finds the vmap level that owns the named axis:

* The op receives the axis *token* (``arange(n)``, batched only at the owning level). At
  any other level the token is unbatched: the rule moves that level's batch dim to the
  front, records it as a pass-through "lead" dim and re-binds one level down.
* At the owning level the rule holds the values of all instances as one physical tensor
  ``X`` of shape ``(n, *lead, *instance_shape)`` and calls :meth:`Primitive.compute`.

``backward`` and ``jvp`` bind the primitive's transpose (or the primitive itself, for
``jvp`` of a linear op), so ``grad``/``jvp`` inside the map follow JAX's conventions;
transforms outside the map differentiate the plain torch ops of ``compute`` directly.

:func:`bind_many` binds several tensors (the leaves of a pytree) over one axis through
one ``_Bind`` node: when the axis is split over devices or processes, their values travel
in a single exchange, while each tensor's math stays its own (so results are bitwise
those of binding each tensor alone).
"""
from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch

from torchpmap._state import torch_private as private
from torchpmap._state.axis_env import AxisFrame


@dataclasses.dataclass(eq=False)
class InputKind:
    """Whether a primitive's input was the same on every instance of its axis (invariant:
    unbatched at the axis' vmap level), recorded when it ran there; None if it never did
    (one instance run without a vmap level). Under shard_map's ``check_vma`` the
    transpose depends on it, as JAX's does on the input's type."""

    invariant: bool | None = None


@dataclasses.dataclass(frozen=True, eq=False)
class Primitive:
    """A collective over one named axis. Subclasses define the math.

    ``lead`` counts the pass-through dims that sit between the member dim and the
    instance's own dims when :meth:`compute` runs; user-facing dim arguments are
    relative to the instance shape and get shifted by ``1 + lead``.
    """

    frame: AxisFrame
    lead: int = 0

    name = "collective"
    linear = True
    #: A value that is the same on every instance passes unchanged, without an exchange
    #: (see :class:`~torchpmap._collectives.math.PsumOfCotangent`).
    keeps_invariant = False
    #: Computed on this slice's own instances: no exchange with the other slices.
    local = False
    #: ``compute`` may return a view of its input (a reordering of the instances' values):
    #: where no exchange copies them, the result is copied, so that writing into it (or
    #: into the argument afterwards) acts as on another placement, where it is new memory.
    views_input = False

    @property
    def reduces(self) -> bool:
        """True for an associative reduction over all members (psum, pmax, pmin without
        groups): ``compute`` of the slices' own results gives the result of the whole axis."""
        return False

    @property
    def sums(self) -> bool:
        """True when that reduction is a plain sum (psum without groups): the slices' own
        results can be added by an all-reduce."""
        return False

    @property
    def scatters(self) -> bool:
        """True for a sum of which each instance keeps its own share (psum_scatter without
        groups): a slice can sum its instances first and send each slice its share only."""
        return False

    def compute(self, X: torch.Tensor) -> tuple[torch.Tensor, int | None]:
        """All instances' values ``X`` -> (result, member dim of the result or None)."""
        raise NotImplementedError

    def shares(self, X: torch.Tensor) -> torch.Tensor:
        """This slice's sum of its instances ``X`` (a :attr:`scatters` prim), cut into every
        slice's share, ``(slices, local size, ...)``: row ``q`` is what it sends to slice ``q``
        (in :func:`partial_sum_dtype`)."""
        raise NotImplementedError

    def compute_unbatched(self, x: torch.Tensor) -> tuple[torch.Tensor, int | None]:
        """Same as compute, when every instance holds the same ``x`` (no member dim)."""
        n = self.frame.local_size
        return self.compute(x.unsqueeze(0).expand(n, *x.shape))

    def partial(self, X: torch.Tensor) -> torch.Tensor:
        """This slice's own reduction of its instances ``X`` (a :attr:`reduces` prim), shaped
        ``(1, ...)``: what it sends to the other slices (a sum of half floats in float32: see
        :func:`partial_sum_dtype`)."""
        return self.compute(X)[0].unsqueeze(0)

    def transpose(self) -> Primitive:
        raise NotImplementedError(f"{self.name} has no transpose")

    def params(self) -> str:
        """The parameters that change the result and differ from their defaults, as
        ``(perm=((0, 1), (1, 0)))``; "" for none."""
        shown = [
            f"{f.name}={getattr(self, f.name)!r}"
            for f in dataclasses.fields(self)
            if f.name not in ("frame", "lead", "kind") and getattr(self, f.name) != f.default
        ]
        return f"({', '.join(shown)})" if shown else ""

    def with_lead(self, lead: int) -> Primitive:
        return dataclasses.replace(self, lead=lead)

    def dim(self, d: int) -> int:
        """Physical position in ``X`` of instance dim ``d``."""
        return 1 + self.lead + d


#: Half floats whose partial sums travel widened: torch sums a float16 or bfloat16 tensor in
#: float32 and rounds once, so one device's ``psum`` of ``[6e4, 6e4, -6e4, -6e4]`` in float16
#: is 0; a slice's partial sum rounded to float16 would be inf (NaN once added to -inf). The
#: slices (compiled device slices, processes) send float32 sums, and the total is rounded
#: once, as on one device (see :func:`narrowed`).
_PARTIAL_SUM_DTYPES = {torch.float16: torch.float32, torch.bfloat16: torch.float32}


def partial_sum_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype in which a slice's partial sum of ``dtype`` values travels."""
    return _PARTIAL_SUM_DTYPES.get(dtype, dtype)


def narrowed(total: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A total of partial sums (see :func:`partial_sum_dtype`) of ``dtype`` values, in the
    dtype their sum on one device has."""
    return total.to(dtype) if total.dtype != dtype and dtype in _PARTIAL_SUM_DTYPES else total


def bind_many(prims: Sequence[Primitive], xs: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
    """Applies ``prims[k]`` to this instance's ``xs[k]`` for every ``k``, in one exchange.

    The prims share one frame (typically one collective over the leaves of a pytree) but
    each keeps its own ``lead``: leaves may be batched at different enclosing vmap levels.
    Only the transfer is shared. Each leaf is computed on its own, exactly as it would be
    bound alone, so results are bitwise those of binding the leaves one by one.
    """
    if not xs:
        return ()
    frame = prims[0].frame
    level = private.current_vmap_level()
    if not frame.vectorized and level is None:
        return _run_unvectorized(prims, xs)  # plain torch ops: outer autograd sees them directly
    if level is not None and frame.vectorized and private.vmap_level_of(frame.token) == level:
        return _run_at_innermost_owner(prims, xs, level)
    if not frame.vectorized:
        return _run_beneath_vmaps(prims, xs)
    return _apply(prims, frame.token, xs)


def _run_beneath_vmaps(prims: Sequence[Primitive], xs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """A collective over an axis of device threads or processes (no vmap level of its own)
    called inside the vmap levels of other axes: each level's batch dims become lead dims,
    one level at a time, and the collective runs on the plain tensors, as ``_Bind``'s vmap
    rule would, but without ``_Bind``. Autograd outside the map then records the exchange's
    own nodes, whose backward meets no other thread (through ``_Bind``, a ``.backward()``
    outside would reach a node that must meet the other threads' nodes, in one thread).
    A grad or jvp level among them is left to ``_Bind``, as before."""
    level = private.current_vmap_level()
    if level is None:
        return _run_unvectorized(prims, xs)
    if private.vmap_randomness() is None:  # the innermost transform is a grad or jvp, not a vmap
        return _apply(prims, prims[0].frame.token, xs)
    unwrapped = [private.unwrap_batched(x, level) for x in xs]
    led = [p if d is None else p.with_lead(p.lead + 1) for p, (_, d) in zip(prims, unwrapped)]
    with private.pop_interpreter():
        outs = _run_beneath_vmaps(led, [v if d is None else v.movedim(d, 0) for v, d in unwrapped])
    return tuple(out if d is None else private.add_batch_dim(out, 0, level) for out, (_, d) in zip(outs, unwrapped))


def _run_at_innermost_owner(
    prims: Sequence[Primitive], xs: Sequence[torch.Tensor], level: int
) -> tuple[torch.Tensor, ...]:
    """The common case: the innermost transform is the vmap level that owns the axis (no
    grad/jvp/vmap between it and the collective). What ``_Bind``'s vmap rule would do,
    without the autograd.Function machinery (about 150 us a call): unwrap this level,
    compute on all instances at once, wrap again. Transforms and autograd outside this
    level see the plain torch ops of ``compute``, exactly as through ``_Bind``."""
    unwrapped = [private.unwrap_batched(x, level) for x in xs]
    with private.pop_interpreter():  # below this level, as a vmap rule runs (exchanges use autograd Functions)
        owned = _run_at_owner(prims, [value for value, _ in unwrapped], [dim for _, dim in unwrapped])
    return tuple(out if dim is None else private.add_batch_dim(out, dim, level) for out, dim in owned)


class _Prims(tuple):
    """The prims of one ``_Bind`` call. A tuple subclass is a single leaf to pytree, and
    functorch flattens the arguments of every autograd.Function call: as a plain tuple the
    prims would cost dispatch time on every collective."""


def _apply(prims: Sequence[Primitive], token: torch.Tensor, xs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """``_Bind`` on ``xs``, its results as a tuple."""
    out = _Bind.apply(_Prims(prims), token, *xs)
    return (out,) if len(xs) == 1 else out


def _single_or_tuple(values: Sequence[Any]) -> Any:
    """What ``_Bind`` returns for its outputs: one alone (a lone tensor, the common case,
    skips functorch's handling of tuple outputs, which costs dispatch time), else the tuple."""
    return values[0] if len(values) == 1 else tuple(values)


def _run_unvectorized(prims: Sequence[Primitive], xs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """``prims`` on a slice that holds a single instance and has no vmap level."""
    owned = run_owning(prims, [x.unsqueeze(0) for x in xs])
    return tuple(out if member_dim is None else out.select(member_dim, 0) for out, member_dim in owned)


class _Bind(torch.autograd.Function):
    """``(prims, token, *xs) -> (result of each x)``: one node for the tensors bound
    together (a lone tensor's result comes alone, not in a tuple)."""

    generate_vmap_rule = False

    @staticmethod
    def forward(prims: _Prims, token: torch.Tensor, *xs: torch.Tensor) -> Any:
        prim = prims[0]
        if not prim.frame.vectorized:  # every vmap level above was peeled off
            return _single_or_tuple(_not_inputs(_run_unvectorized(prims, xs), xs))
        raise RuntimeError(
            f"torchpmap: {prim.name} over axis {prim.frame.name!r} ran outside the vmap level "
            "of that axis. This happens when the axis token escapes its pmap, or under "
            "torch.compile, which ignores custom batching rules."
        )

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        ctx.prims, ctx.token = inputs[0], inputs[1]
        ctx.thread = threading.get_ident()  # an instance's own thread, for an unvectorized frame
        ctx.set_materialize_grads(False)  # a result that gets no gradient needs no transposed exchange

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple:
        prim = ctx.prims[0]
        if not prim.frame.vectorized and private.current_vmap_level() is None:
            # plain autograd runs this node in one thread; the other devices' nodes would never meet it
            raise NotImplementedError(
                f"torchpmap: the backward of {prim.name} over axis {prim.frame.name!r} ran through plain autograd "
                "inside the map, on a device that holds one instance (no vmap level), where the other devices' "
                "nodes would never meet it: not supported (a torch.func.vjp pullback called inside the map does "
                "this; one device runs it). Differentiate inside the map with torch.func.grad or jacrev, or, in a "
                "pmap, set torchpmap.config.bitwise_placement = True (every instance then runs in a vmap of its "
                "own, as on one device)."
            )
        if not prim.frame.vectorized and threading.get_ident() != ctx.thread:
            # a transform around the map differentiates after its instances ran one at a time, each
            # in a thread of its own: its backward runs every instance's node in this one thread,
            # where the first would wait for the others' transposed exchange until the timeout
            raise NotImplementedError(
                f"torchpmap: a torch.func transform around a pmap differentiates through {prim.name} over axis "
                f"{prim.frame.name!r}, whose instances ran one at a time (disable_vectorization(), or a "
                "function vmap cannot run): its gradient cannot be exchanged between them. Take the gradient "
                "inside the pmap (torch.func.grad in the mapped function), or let the instances run vectorized."
            )
        return None, None, *_bind_given(ctx.prims, ctx.token, grads, _transposed)

    @staticmethod
    def jvp(ctx: Any, _prims_t: Any, _token_t: Any, *x_ts: torch.Tensor | None) -> Any:
        return _single_or_tuple(_bind_given(ctx.prims, ctx.token, x_ts, _linear))

    @staticmethod
    def vmap(info: Any, in_dims: tuple, prims: _Prims, token: torch.Tensor, *xs: torch.Tensor) -> tuple[Any, Any]:
        token_dim, x_dims = in_dims[1], in_dims[2:]
        if token_dim is None:  # another level: pass its batch dims through as lead dims
            moved = tuple(x if d is None else x.movedim(d, 0) for x, d in zip(xs, x_dims))
            led = _Prims(p if d is None else p.with_lead(p.lead + 1) for p, d in zip(prims, x_dims))
            return _Bind.apply(led, token, *moved), _single_or_tuple([None if d is None else 0 for d in x_dims])
        outs, member_dims = zip(*_run_at_owner(prims, xs, x_dims))
        return _single_or_tuple(_not_inputs(outs, xs)), _single_or_tuple(member_dims)


def _not_inputs(outs: Sequence[torch.Tensor], xs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """``outs``, each that is one of ``xs`` itself (a collective that leaves an invariant
    value as it is: ``psum``'s transpose under ``check_vma``) as a view of it.

    torch.func keeps the identity of a custom function's output that *is* one of its
    inputs: the transform levels above then see the input itself, not the function's
    output, and a gradient from outside the map that flows through such a result inside
    a ``grad``'s backward (a cotangent that depends on the weights: ``grad`` of
    ``grad(loss)(w) ** 2``) lost that dependence (a third of the gradient, in the test).
    A view is a new tensor, and costs no copy."""
    return tuple(out.view_as(out) if any(out is x for x in xs) else out for out in outs)


def _transposed(prim: Primitive) -> Primitive:
    return prim.transpose()


def _linear(prim: Primitive) -> Primitive:
    """``prim`` itself, the jvp of a linear collective; raises for the others."""
    if not prim.linear:
        prim.transpose()  # raises the primitive's own "not differentiable" error
    return prim


def _bind_given(
    prims: Sequence[Primitive],
    token: torch.Tensor,
    values: Sequence[torch.Tensor | None],
    derive: Callable[[Primitive], Primitive],
) -> tuple[torch.Tensor | None, ...]:
    """Binds ``derive(prims[k])`` to each ``values[k]`` that is not None, all in one node;
    None stays None (an output without gradient or tangent costs no exchange)."""
    given = [k for k, v in enumerate(values) if v is not None]
    out: list[torch.Tensor | None] = [None] * len(values)
    if given:
        results = _apply([derive(prims[k]) for k in given], token, [cast(torch.Tensor, values[k]) for k in given])
        for k, result in zip(given, results):
            out[k] = result
    return tuple(out)


def _run_at_owner(
    prims: Sequence[Primitive], xs: Sequence[torch.Tensor], x_dims: Sequence[int | None]
) -> list[tuple[torch.Tensor, int | None]]:
    """At the vmap level that owns the axis: ``xs[k]`` is batched along ``x_dims[k]``, or
    is the same on every instance (None)."""
    frame = prims[0].frame
    for p, d in zip(prims, x_dims):
        kind = getattr(p, "kind", None)
        if kind is not None:
            kind.invariant = d is None
    if frame.exchange is None or all(p.local for p in prims):
        return [
            _fresh(p, p.compute_unbatched(x) if d is None else p.compute(x.movedim(d, 0)))
            for p, x, d in zip(prims, xs, x_dims)
        ]
    kept = [k for k, (p, d) in enumerate(zip(prims, x_dims)) if d is None and p.keeps_invariant]
    if kept:  # invariant values that stay as they are: no exchange for them (the same on every slice)
        rest = [k for k in range(len(prims)) if k not in kept]
        results: list = [None] * len(prims)
        for k in kept:
            results[k] = prims[k].compute_unbatched(xs[k])
        if rest:
            for k, out in zip(
                rest, _run_at_owner([prims[k] for k in rest], [xs[k] for k in rest], [x_dims[k] for k in rest])
            ):
                results[k] = out
        return results
    n = frame.local_size  # the other slices hold other values: gather them as a batch
    Xs = [x.unsqueeze(0).expand(n, *x.shape) if d is None else x.movedim(d, 0) for x, d in zip(xs, x_dims)]
    return run_owning(prims, Xs)


def run_owning(prims: Sequence[Primitive], Xs: Sequence[torch.Tensor]) -> list[tuple[torch.Tensor, int | None]]:
    """Runs ``prims[k]`` at the level that owns their axis, on this slice's instances ``Xs[k]``;
    returns (result, member dim or None) for each.

    When the axis is split over devices, every slice's values are gathered first, all
    tensors in one exchange, and the same math runs on the whole axis, so results are
    bitwise those of one device. An exchange that sets ``reduces_locally`` (across
    processes, where bandwidth counts, and in compiled device slices, where a slice's sum
    folds into its products) gathers only each slice's own reduction for
    :attr:`Primitive.reduces` prims: a slice's instances are summed first, then the
    slices' sums, in the same order in every process (the replicas stay bitwise equal;
    against one process the float sums differ in rounding unless a slice holds one
    instance). Large sums (:attr:`Primitive.sums`) go through the exchange's all-reduce
    instead, when it has one (:meth:`Exchange.sum_with_grad`): the same bits in every process
    again, in the all-reduce's own order. A sum of which each instance keeps a share
    (:attr:`Primitive.scatters`) sends each slice only its share of the partial sums, when
    the exchange can (:meth:`Exchange.scatter_sum_with_grad`): a reduce-scatter.
    """
    exchange = prims[0].frame.exchange
    if exchange is None:
        return [_fresh(p, p.compute(X)) for p, X in zip(prims, Xs)]
    dtypes = [X.dtype for X in Xs]  # partial sums of half floats travel as float32: narrowed back
    if exchange.reduces_locally and all(p.scatters for p in prims):  # a reduce-scatter: each slice's share only
        received = exchange.scatter_sum_with_grad([p.shares(X) for p, X in zip(prims, Xs)], _describe(prims))
        if received is not None:
            return [(narrowed(R, d), 0) for R, d in zip(received, dtypes)]
    if exchange.reduces_locally and all(p.reduces for p in prims):
        # even a slice of one instance sends compute's result: its dtype (psum of bools
        # sends int64) must not depend on the local size, and the bits are those of one process
        Xs = [p.partial(X) for p, X in zip(prims, Xs)]
        if all(p.sums for p in prims):  # large sums across processes: one all-reduce
            summed = exchange.sum_with_grad(Xs, _describe(prims))
            if summed is not None:
                return [(narrowed(S[0], d), None) for S, d in zip(summed, dtypes)]
        everyone = exchange.all_gather_with_grad(Xs, _describe(prims), partial=True)
        results = [p.compute(E.flatten(0, 1)) for p, E in zip(prims, everyone)]
        return [(narrowed(R, d), dim) for (R, dim), d in zip(results, dtypes)]
    everyone = exchange.all_gather_with_grad(Xs, _describe(prims))
    return [_own_part(p, *p.compute(E.flatten(0, 1))) for p, E in zip(prims, everyone)]


def _fresh(prim: Primitive, result: tuple[torch.Tensor, int | None]) -> tuple[torch.Tensor, int | None]:
    """``result`` in memory of its own where ``prim`` may return a view of its input."""
    return (result[0].clone(), result[1]) if prim.views_input else result


def _describe(prims: Sequence[Primitive]) -> str:
    """How waits and errors name the exchange, with the collective's parameters (a
    ``ppermute`` perm, groups, dims): processes compare it before they exchange, so it
    must name everything that changes the result. The count also tells instances that
    bundle different numbers of tensors apart."""
    prim = prims[0]
    params = sorted({p.params() for p in prims})
    what = f"{prim.name}{', '.join(params) if len(params) > 1 else params[0]} over axis {prim.frame.name!r}"
    return what if len(prims) == 1 else f"{what} ({len(prims)} tensors at once)"


def _own_part(prim: Primitive, out: torch.Tensor, member_dim: int | None) -> tuple[torch.Tensor, int | None]:
    """This slice's instances of a result computed for the whole axis."""
    if member_dim is None:
        return out, None
    return out.narrow(member_dim, prim.frame.offset, prim.frame.local_size), member_dim
