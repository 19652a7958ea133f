"""The mean of a gradient over a named axis, its exchange started while the backward runs.

``pmean(grad(f)(params), axis)`` cannot send anything before ``grad`` has returned every
gradient. DDP does better: it all-reduces the gradients bucket by bucket, each as soon
as the backward has produced it, and the backward goes on while the bytes travel.
:class:`GradientMean` gives a data-parallel step the same overlap with the same result:

    >>> import torch, torchpmap
    >>> from torch.func import grad
    >>> from torchpmap._collectives.gradient_mean import GradientMean
    >>> def step(w, x):
    ...     mean = GradientMean("i")
    ...     g = grad(lambda w: (mean.watch({"w": w})["w"] * x).sum())(w)
    ...     return mean({"w": g})["w"]            # what pmean({"w": g}, "i")["w"] returns
    >>> torchpmap.pmap(step, axis_name="i", in_axes=(None, 0))(torch.ones(2), torch.arange(8.).view(4, 2))
    tensor([[3., 4.],
            [3., 4.],
            [3., 4.],
            [3., 4.]])

``watch(params)`` plans the buckets and puts a gradient hook on each parameter. The
processes agree on the buckets before the first one starts, and a process whose
parameters or buckets differ raises there, before anything is summed. Values that are
averaged over the axis too (a step's loss) can travel with that agreement:
``average_later(values)`` after the forward starts their exchange and returns at once;
the backward runs while they travel, and ``averages()`` returns what ``pmean(values,
axis_name)`` would. So the processes meet once in the step, as DDP's do: at the
buckets' waits (the agreement is waited for when the first bucket starts, by which time
it has arrived). Without ``average_later`` the agreement is a header round of its own.

Once the backward has produced the gradients of every parameter in a bucket, the hooks
start its all-reduce and return at once
(:meth:`~torchpmap._state.axis_env.Exchange.sums_in_order`; buckets start in order, in
every process). Hooks, as DDP's, rather than an identity node per bucket: autograd runs
a node created before the forward after every other ready node, i.e. at the very end of
the backward. Calling the object with the gradients waits for those sums and divides by
the axis size in their own buffers, as ``pmean`` does. Buckets follow DDP: parameters in
reverse order of the dict (the order a backward usually produces them), a first bucket
of about 1 MiB so that the first exchange starts early, then ``config.bucket_bytes``;
except that a parameter much bigger than the first bucket is split across it (its first
rows in it, the rest a bucket of its own), which a compiled step turns into an earlier
first exchange (see :func:`buckets_of`).

It overlaps only where that pays and keeps the result ``pmean`` would give: across
processes (each process sends the sum of its own instances' gradients, as ``pmean``
does), eager or compiled, for gradients large enough that ``pmean`` would all-reduce
them (``config.all_reduce_bytes``, not under ``bitwise_placement``). Everywhere else
(one device, device threads, small gradients) the call is exactly ``pmean(grads,
axis_name)``. With two processes the bits are those of ``pmean``'s all-reduce; with
more, each bucket's all-reduce adds in its own order, so the last bits may differ from
one all-reduce of everything, while every process still gets the same bits. Every
process must watch the same parameters (the buckets' headers are compared, as for any
exchange).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Sequence
from typing import cast

import torch

from torchpmap._collectives.binding import narrowed, partial_sum_dtype
from torchpmap._collectives.math import Psum
from torchpmap._collectives.public import pmean
from torchpmap._engines.process_exchange_rules import sums_by_all_reduce
from torchpmap._state import axis_env as _axis_env
from torchpmap._state import torch_private as private
from torchpmap._state.axis_env import OrderedSums
from torchpmap._state.config import config

Tensors = dict[str, torch.Tensor]

#: DDP's first bucket: small, so that the first exchange starts early in the backward.
FIRST_BUCKET_BYTES = 1 << 20


@dataclasses.dataclass(frozen=True)
class Piece:
    """What a bucket holds of one parameter's gradient: all of it, or rows
    ``rows[0]:rows[1]`` of its first dim (a parameter much bigger than the first bucket is
    split across it: see :func:`buckets_of`).

    >>> Piece("w", (0, 2)).of(torch.arange(6).view(3, 2))
    tensor([[0, 1],
            [2, 3]])
    """

    name: str
    rows: tuple[int, int] | None = None

    def of(self, t: torch.Tensor) -> torch.Tensor:
        """This piece of ``t`` (the parameter, or its gradient): a view."""
        return t if self.rows is None else t[self.rows[0] : self.rows[1]]


def buckets_of(params: Sequence[tuple[str, int, int]], bucket_bytes: int) -> list[list[Piece]]:
    """Pieces of the ``(name, bytes, rows)`` parameters grouped into buckets, last name
    first: each bucket closes once it holds at least its limit (``FIRST_BUCKET_BYTES`` for
    the first, capped by ``bucket_bytes``; ``bucket_bytes`` after), as DDP's do.

    Unlike DDP's, the first bucket does not wait for all of a parameter that would take
    it past twice its limit: it takes the parameter's first rows, up to its limit, and the
    rest of that parameter is a bucket of its own. A compiled step computes those rows'
    gradient first (``graph_rewrites.split_sliced_products``), so the first exchange
    starts after a fraction of that product instead of all of it.

    >>> buckets_of([("a", 3 << 20, 1), ("b", 10, 1), ("c", 2 << 20, 1), ("d", 10, 1)], bucket_bytes=4 << 20)
    [[Piece(name='d', rows=None), Piece(name='c', rows=None)], [Piece(name='b', rows=None), Piece(name='a', rows=None)]]
    >>> [[(p.name, p.rows) for p in b] for b in buckets_of([("w", 4 << 20, 1024), ("b", 4096, 1024)], 25 << 20)]
    [[('b', None), ('w', (0, 255))], [('w', (255, 1024))]]
    """
    out: list[list[Piece]] = []
    current: list[Piece] = []
    held = 0
    for name, size, rows in reversed(params):
        limit = min(FIRST_BUCKET_BYTES, bucket_bytes) if not out else bucket_bytes
        if not out and held + size > 2 * limit and rows > 1:  # the first bucket takes its first rows
            row_bytes = size // rows
            first = min(rows - 1, max(1, -(-(limit - held) // row_bytes)))
            out += [[*current, Piece(name, (0, first))], [Piece(name, (first, rows))]]
            current, held = [], 0
            continue
        current.append(Piece(name))
        held += size
        if held >= limit:
            out.append(current)
            current, held = [], 0
    if current:
        out.append(current)
    return out


class GradientMean:
    """``pmean`` of the gradients of watched parameters over ``axis_name``, each bucket's
    exchange started during the backward where the placement allows it (see the module
    docstring). Make one per call of the mapped function.

    Args:
        axis_name: the axis to average over; it must be bound (inside the pmap).
        bucket_bytes: the size of a bucket after the first (default ``config.bucket_bytes``).
    """

    def __init__(self, axis_name: Hashable, bucket_bytes: int | None = None):
        self.axis_name = axis_name
        self.bucket_bytes = config.bucket_bytes if bucket_bytes is None else bucket_bytes
        #: the buckets, once watched across processes: pieces of parameters, in the order they start
        self.buckets: list[list[Piece]] = []
        self._sums: OrderedSums | None = None
        self._arrived: list[dict[Piece, torch.Tensor]] = []
        self._pieces: dict[str, int] = {}  # how many pieces of each parameter the buckets hold
        self._averaging = False
        self._average_dtypes: list[torch.dtype] = []
        frame = _axis_env.lookup(axis_name)
        self._frame = frame
        #: the vmap level of the axis in this slice (None: a lone instance, run directly)
        self._level = private.vmap_level_of(frame.token) if frame.vectorized else None

    def watch(self, params: Tensors) -> Tensors:
        """``params``, each with a gradient hook (call it inside the function that
        ``torch.func.grad`` differentiates, on the tensors it differentiates by)."""
        exchange = self._frame.exchange
        if exchange is None or not exchange.starts_sums or self._sums is not None or not torch.is_grad_enabled():
            return params
        if not params or not all(t.requires_grad for t in params.values()):
            return params  # not under the gradient transform: nothing to hook
        if self._level is not None and self._level != private.innermost_vmap_level():
            return params  # another vmap inside the instance: its gradients are not the instance's
        if not sums_by_all_reduce(list(params.values())):
            return params  # small enough that pmean gathers the partial sums: its bits, its way
        sizes = [(k, t.numel() * t.element_size(), t.shape[0] if t.dim() else 1) for k, t in params.items()]
        buckets = buckets_of(sizes, self.bucket_bytes)
        what = f"pmean of the gradient over axis {self.axis_name!r}"
        sums = exchange.sums_in_order([[_as_sent(p.of(params[p.name])) for p in bucket] for bucket in buckets], what)
        if sums is None:
            return params
        self.buckets, self._sums = buckets, sums
        self._arrived = [{} for _ in buckets]
        where: dict[str, list[tuple[int, Piece]]] = {}
        for i, bucket in enumerate(buckets):
            for piece in bucket:
                where.setdefault(piece.name, []).append((i, piece))
        self._pieces = {k: len(pieces) for k, pieces in where.items()}
        for k, pieces in where.items():
            params[k].register_hook(self._hook(pieces))
        return params

    def average_later(self, values: Sequence[torch.Tensor], note: str = "") -> bool:
        """Starts the mean of ``values`` over the axis, after the forward and before the
        backward (inside the function that ``grad`` differentiates; the values are not
        differentiated): it travels with the buckets' agreement, not waited for. Returns
        False, doing nothing, when the gradients are not bucketed (call ``pmean``).
        ``note`` is part of what the processes agree on (a process whose note differs
        raises), and of how errors name the exchange."""
        if self._sums is None:
            return False
        n, prim = self._frame.local_size, Psum(self._frame)
        self._average_dtypes = [v.dtype for v in values]
        partials = []
        for v in values:  # as pmean's slice sends its instances' sum: the same math, the same bits
            value, dim = private.functorch_value(v, self._level)
            X = value.unsqueeze(0).expand(n, *value.shape) if dim is None else value.movedim(dim, 0)
            partials.append(prim.partial(X))
        self._sums.also_gather(partials, f"pmean over axis {self.axis_name!r} (with the gradient buckets{note})")
        self._averaging = True
        return True

    def averages(self) -> list[torch.Tensor]:
        """The means of :meth:`average_later`'s values (what ``pmean`` returns), once the
        gradients have been waited for (call it after calling this object)."""
        if not self._averaging:
            raise RuntimeError("torchpmap: internal error: averages() without average_later()")
        prim = Psum(self._frame)
        sums = cast(OrderedSums, self._sums)  # average_later() started them
        return [
            narrowed(prim.compute(everyone.flatten(0, 1))[0], dtype) / self._frame.size
            for everyone, dtype in zip(sums.gathered(), self._average_dtypes)
        ]

    def _partial(self, grad: torch.Tensor) -> torch.Tensor:
        """This slice's sum of its instances' gradients (what pmean sends, too)."""
        value, dim = private.functorch_value(grad, self._level)
        value = value.to(partial_sum_dtype(value.dtype))  # half floats: summed as one device sums them
        if dim is None:  # the same gradient on every instance of the slice
            n = self._frame.local_size
            return value if n == 1 else value * n
        return value.select(dim, 0) if value.shape[dim] == 1 else value.sum(dim)

    def _hook(self, pieces: list[tuple[int, Piece]]) -> Callable[[torch.Tensor], None]:
        """A parameter's gradient hook: each bucket holding a piece of it starts once all
        its pieces have arrived (each gradient arrives once, summed over its uses)."""

        sums = cast(OrderedSums, self._sums)  # a hook is registered once the sums are agreed on

        def arrived(grad: torch.Tensor) -> None:
            partial = self._partial(grad)
            for i, piece in pieces:
                got = self._arrived[i]
                got[piece] = piece.of(partial)
                if len(got) == len(self.buckets[i]):
                    sums.start(i, [got.pop(p) for p in self.buckets[i]])

        return arrived

    def __call__(self, grads: Tensors) -> Tensors:
        """The mean of ``grads`` (the gradients of the watched parameters, same keys) over
        the axis: the sums started in the backward, waited for; ``pmean`` without them."""
        sums = self._sums
        if sums is None:
            return pmean(grads, self.axis_name)
        arrived: dict[str, list[torch.Tensor]] = {}
        out: Tensors = {}
        joined: list[torch.Tensor] = []
        for i, bucket in enumerate(self.buckets):
            # a bucket the backward never completed (a parameter it did not reach) starts now
            sums.start(i, [p.of(self._partial(grads[p.name])) for p in bucket])
            # divided in the sum's own buffer (the bits of pmean's total / size); a split
            # parameter's pieces come in row order, joined before the next bucket's wait.
            # Half floats were summed in float32: rounded first, then divided, as pmean does.
            dtypes = [grads[p.name].dtype for p in bucket]
            widened = any(partial_sum_dtype(d) != d for d in dtypes)
            totals = sums.wait(i, 1 if widened else self._frame.size, after=joined)
            for p, total, dtype in zip(bucket, totals, dtypes):
                mean = narrowed(total, dtype) / self._frame.size if widened else total
                got = arrived.setdefault(p.name, [])
                got.append(mean)
                if len(got) == self._pieces[p.name]:
                    out[p.name] = mean if len(got) == 1 else torch.cat(got)
                    if len(got) > 1:
                        joined.append(out[p.name])
        return {k: out[k] for k in grads}


def _as_sent(t: torch.Tensor) -> torch.Tensor:
    """A tensor of a gradient's shape, in the dtype its partial sum travels in (only its
    shape and dtype are read: see :func:`~torchpmap._collectives.binding.partial_sum_dtype`)."""
    wide = partial_sum_dtype(t.dtype)
    return t if wide == t.dtype else t.new_empty(t.shape, dtype=wide)
