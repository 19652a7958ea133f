"""Rewrites of a traced vectorized program before it is compiled (``pmap(jit=True)``):
:func:`fold_instance_sums` (one product where the vectorized form says ``n`` summed),
:func:`split_sliced_products` (a product whose slices travel in different gradient
buckets, computed per slice) and :func:`start_exchanges_early` (each gradient bucket's
exchange as soon as its gradients can exist); and one question the compiler's choice
depends on, :func:`writes_an_input`.

The vectorized program says "per instance, then across instances" where a plain
batched program says it once. The commonest case is a data-parallel step: each
instance's weight gradient is a product over its own samples, and ``pmean`` then adds
the instances' gradients. Traced, that is one ``bmm`` of ``n`` small products followed
by a ``sum`` over ``n``, where plain PyTorch (and ``torch.compile`` of it) computes one
``mm`` over all ``n * b`` samples: the same math, a bigger and faster product, and no
``(n, out, in)`` intermediate. :func:`fold_instance_sums` rewrites the first into the
second:

    sum_n bmm(A, B)[n] == mm(A.permute(1, 0, 2).reshape(o, n * b), B.reshape(n * b, i))

for ``A`` of shape ``(n, o, b)`` and ``B`` of shape ``(n, b, i)``. The result equals the
traced one to rounding (the products add in another order), as anything
``torch.compile`` fuses does.

    >>> import torch
    >>> from torch.fx.experimental.proxy_tensor import make_fx
    >>> def per_instance_then_sum(a, b):
    ...     return torch.bmm(a, b).transpose(1, 2).sum(0)
    >>> a, b = torch.randn(8, 3, 5), torch.randn(8, 5, 4)
    >>> graph = make_fx(per_instance_then_sum)(a, b)
    >>> fold_instance_sums(graph)
    1
    >>> [n.target.__name__ for n in graph.graph.nodes if n.op == "call_function"]
    ['permute.default', 'reshape.default', 'reshape.default', 'mm.default', 'transpose.int']
    >>> torch.allclose(graph(a, b), per_instance_then_sum(a, b), atol=1e-5)
    True
"""
from __future__ import annotations

import heapq
import operator
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.fx

from torchpmap._state import torch_private as private

aten = torch.ops.aten

#: View ops that may sit between the ``bmm`` and the ``sum`` (each checked to keep the
#: instance dim first and apart): a no-op reshape, a transpose or permute of the others.
_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.transpose.int, aten.permute.default)


def fold_instance_sums(graph: torch.fx.GraphModule) -> int:
    """Rewrites every ``sum`` over dim 0 of a ``bmm`` (through views that leave dim 0
    alone, and used nowhere else) into one ``mm``; returns how many it rewrote."""
    rewritten = 0
    for node in list(graph.graph.nodes):
        chain = _summed_bmm(node)
        if chain is None:
            continue
        bmm, views = chain
        a, b = _args(bmm)
        n, o, k = _shape(a)
        i = _shape(b)[2]
        g = graph.graph
        with g.inserting_before(node):
            lhs = _call(g, aten.reshape.default, (_call(g, aten.permute.default, (a, [1, 0, 2])), [o, n * k]))
            rhs = _call(g, aten.reshape.default, (b, [n * k, i]))
            out = _call(g, aten.mm.default, (lhs, rhs))
            for view in views:  # the same views, on the result without its instance dim
                out = _replay(g, view, out)
        node.replace_all_uses_with(out)
        rewritten += 1
    if rewritten:
        graph.graph.eliminate_dead_code(is_impure_node=kept)
        graph.recompile()
    return rewritten


def _args(node: torch.fx.Node) -> Any:
    """``node.args``, laid out as its op takes them (fx types each as any argument at all:
    the rewrites below read them as the ops they match define them)."""
    return node.args


def _shape(node: torch.fx.Node) -> tuple[int, ...]:
    return tuple(node.meta["val"].shape)


def _call(g: torch.fx.Graph, target: Any, args: tuple, kwargs: dict | None = None) -> torch.fx.Node:
    """A new ``call_function`` node, with the ``val`` of its result (from its arguments'
    fake values, as the trace records it) when they all have one: a later rewrite reads
    shapes from it."""
    node = g.call_function(target, args, kwargs or {})
    if all("val" in n.meta for n in node.all_input_nodes):
        values = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta["val"])
        try:
            node.meta["val"] = target(*values[0], **values[1])
        except Exception:  # noqa: BLE001 - e.g. values of two fake modes: the node goes without, rewrites skip it
            pass
    return node


def _summed_bmm(node: torch.fx.Node) -> tuple[torch.fx.Node, list[torch.fx.Node]] | None:
    """(the bmm, the views from it to ``node``) when ``node`` is a plain sum over dim 0 of
    a bmm's result; None otherwise."""
    if node.op != "call_function" or node.target is not aten.sum.dim_IntList:
        return None
    if list(_args(node)[1]) != [0] or len(_args(node)) > 2 or node.kwargs.get("keepdim") or "val" not in node.meta:
        return None
    if node.kwargs.get("dtype", node.meta["val"].dtype) != node.meta["val"].dtype:
        return None  # a sum into another dtype
    views: list[torch.fx.Node] = []
    source = _args(node)[0]
    while isinstance(source, torch.fx.Node) and source.target in _VIEWS:
        if len(source.users) != 1 or not _keeps_instance_dim(source):
            return None
        views.append(source)
        source = _args(source)[0]
    if not isinstance(source, torch.fx.Node) or source.target is not aten.bmm.default or len(source.users) != 1:
        return None
    if any("val" not in n.meta for n in (source, *_args(source))) or source.meta["val"].dtype != node.meta["val"].dtype:
        return None
    return source, views[::-1]


def _keeps_instance_dim(view: torch.fx.Node) -> bool:
    if view.target is aten.transpose.int:
        return all(d % len(_shape(view)) >= 1 for d in _args(view)[1:3])
    if view.target is aten.permute.default:
        return _args(view)[1][0] % len(_shape(view)) == 0
    return _shape(_args(view)[0]) == _shape(view)  # a reshape to the same shape


def _replay(g: torch.fx.Graph, view: torch.fx.Node, value: torch.fx.Node) -> torch.fx.Node:
    """``view``, applied to ``value``, which lacks the instance dim that ``view`` had first."""
    rank = len(_shape(view))
    if view.target is aten.transpose.int:
        d1, d2 = (d % rank - 1 for d in _args(view)[1:3])
        return _call(g, aten.transpose.int, (value, d1, d2))
    if view.target is aten.permute.default:
        return _call(g, aten.permute.default, (value, [d % rank - 1 for d in _args(view)[1][1:]]))
    return value  # a reshape to the same shape


# --------------------------------------------------------------------------- sliced products

#: Ops between a product and the slices of it that an exchange start takes (each maps
#: the sliced dim to one dim of its input): transposes and permutes, the select of a
#: size-1 dim, and reshapes that only add or drop size-1 dims.
_PASS_THROUGH = (*_VIEWS, aten.t.default, aten.select.int)


def split_sliced_products(graph: torch.fx.GraphModule) -> int:
    """Rewrites each product (``mm``, ``bmm``) whose result an exchange start takes only in
    slices into one smaller product per slice; returns how many products it split.

    A weight much bigger than the first gradient bucket sends its first rows with that
    bucket and the rest later (see ``torchpmap._collectives.gradient_mean.buckets_of``);
    the trace then slices one product's result. Computed as one product, the first
    slice waits for all of it; computed per slice, the first bucket needs only its part,
    and :func:`start_exchanges_early` puts that part first. The same math: each slice of
    the result is the product of the slice of one factor (rows of ``a @ b`` are
    ``a[rows] @ b``); the bits may differ from the whole product's, as another blocking
    of one product may.

        >>> a, b = torch.randn(6, 3), torch.randn(3, 5)
        >>> torch.allclose((a @ b)[:2], a[:2] @ b) and torch.allclose((a @ b).t()[1:], (a @ b[:, 1:]).t())
        True

    Tested on traced data-parallel steps in ``tests/test_graph_rewrites.py``.
    """
    starts = {n for n in graph.graph.nodes if _qualified(n) in _STARTS}
    sliced = dict.fromkeys(  # the values that starts take slices of, in graph order: every process rewrites alike
        _args(n)[0] for n in graph.graph.nodes
        if n.target is aten.slice.Tensor and isinstance(_args(n)[0], torch.fx.Node) and starts.intersection(n.users)
    )
    split = 0
    g = graph.graph
    for value in sliced:
        slices = list(value.users)
        if not slices or not all(u.target is aten.slice.Tensor and _args(u)[0] is value for u in slices):
            continue  # the whole value is used too: splitting would compute it twice
        plans = [_sliced_product(value, s) for s in slices]
        if any(p is None for p in plans) or not _disjoint([(p[2], *p[3]) for p in plans if p is not None]):
            continue  # slices that overlap (or run along different dims) would compute rows twice
        for s, plan in zip(slices, plans):
            assert plan is not None
            product, chain, dim, (start, stop) = plan
            a, b = _args(product)
            operands: tuple[torch.fx.Node, ...]
            with g.inserting_before(s):
                if dim == len(_shape(product)) - 2:  # rows of the result: rows of a
                    operands = (_call(g, aten.slice.Tensor, (a, dim, start, stop)), b)
                elif dim == len(_shape(product)) - 1:  # its columns: columns of b
                    operands = (a, _call(g, aten.slice.Tensor, (b, dim, start, stop)))
                else:  # the batch dim of a bmm: both
                    operands = tuple(_call(g, aten.slice.Tensor, (f, 0, start, stop)) for f in (a, b))
                out = _call(g, product.target, operands)
                for view, view_dim in chain:  # from the product on
                    out = _replay_sliced(g, view, out, view_dim, stop - start)
            s.replace_all_uses_with(out)
            g.erase_node(s)
        split += 1
    if split:
        g.eliminate_dead_code(is_impure_node=kept)
        g.lint()
        graph.recompile()
    return split


def _slice_range(s: torch.fx.Node) -> tuple[int, int, int] | None:
    """(dim, start, stop) of a step-1 ``aten.slice.Tensor`` node, normalized; None otherwise."""
    x, dim, start, end, step = (list(_args(s)) + [0, None, None, 1][len(_args(s)) - 1 :])[:5]
    if step != 1 or "val" not in x.meta:
        return None
    shape = _shape(x)
    dim = dim % len(shape)
    size = shape[dim]
    start, end, _ = slice(start, end).indices(size)
    return dim, start, max(start, end)


def _sliced_product(
    value: torch.fx.Node, s: torch.fx.Node
) -> tuple[torch.fx.Node, list[tuple[torch.fx.Node, int]], int, tuple[int, int]] | None:
    """For slice ``s`` of ``value``: the product that ``value`` comes from, the ops from
    the product to ``value`` (each with the dim of its result that the slice runs along),
    the product's dim that the slice runs along and the slice's range; None when
    ``value`` is not such a product's result (or is used elsewhere on the way)."""
    r = _slice_range(s)
    if r is None:
        return None
    dim, start, stop = r
    chain: list[tuple[torch.fx.Node, int]] = []
    node = value
    while node.target in _PASS_THROUGH:
        if (node is not value and len(node.users) != 1) or "val" not in node.meta or "val" not in _args(node)[0].meta:
            return None
        before = _dim_before(node, dim)
        if before is None:
            return None
        chain.append((node, dim))
        node, dim = _args(node)[0], before
    if node.target not in (aten.mm.default, aten.bmm.default) or (node is not value and len(node.users) != 1):
        return None
    if any("val" not in n.meta for n in (node, *_args(node))):
        return None
    return node, chain[::-1], dim, (start, stop)


def _disjoint(ranges: list[tuple[int, int, int]]) -> bool:
    """Whether the ``(dim, start, stop)`` ranges run along one dim and share no index."""
    if len({dim for dim, _, _ in ranges}) != 1:
        return False
    ordered = sorted((start, stop) for _, start, stop in ranges)
    return all(stop <= start for (_, stop), (start, _) in zip(ordered, ordered[1:]))


def _dim_before(view: torch.fx.Node, dim: int) -> int | None:
    """The dim of ``view``'s input that its result's ``dim`` is (None if none is)."""
    rank = len(_shape(view))
    if view.target is aten.transpose.int:
        d1, d2 = (d % rank for d in _args(view)[1:3])
        return d2 if dim == d1 else d1 if dim == d2 else dim
    if view.target is aten.t.default:
        return 1 - dim if rank == 2 else dim
    if view.target is aten.permute.default:
        return _args(view)[1][dim] % rank
    if view.target is aten.select.int:
        return dim + 1 if dim >= _args(view)[1] % (rank + 1) else dim
    # a reshape that only adds or drops size-1 dims: the dims of other sizes pair up in order
    before, after = _shape(_args(view)[0]), _shape(view)
    big_before = [d for d, n in enumerate(before) if n != 1]
    big_after = [d for d, n in enumerate(after) if n != 1]
    if [before[d] for d in big_before] != [after[d] for d in big_after] or dim not in big_after:
        return None
    return big_before[big_after.index(dim)]


def _replay_sliced(
    g: torch.fx.Graph, view: torch.fx.Node, value: torch.fx.Node, dim: int, length: int
) -> torch.fx.Node:
    """``view`` applied to ``value``, whose dim (of ``view``'s input) that maps to the
    result's ``dim`` now has ``length`` entries."""
    if view.target in (aten.view.default, aten._unsafe_view.default, aten.reshape.default):
        shape = list(_shape(view))
        shape[dim] = length
        return _call(g, view.target, (value, shape))
    return _call(g, view.target, (value, *_args(view)[1:]), dict(view.kwargs))


# --------------------------------------------------------------------------- exchanges first

#: Ops that start an exchange and return without waiting (gradient buckets; see
#: torchpmap._engines.process_ops): the sooner they run, the sooner the bytes travel.
_STARTS = frozenset({"torchpmap::start_sums"})


def start_exchanges_early(graph: torch.fx.GraphModule) -> bool:
    """Reorders ``graph`` so that each exchange start runs as soon as its values can be
    computed: the computation it needs goes first, the rest after (returns whether the
    graph has such starts).

    A backward produces the gradient of a layer's input and that of its weight from the
    same upstream gradient; the trace computes the input's first, as autograd does, so a
    bucket whose last gradient is a weight's starts one product later than it could. DDP
    has the same wait; a compiled step need not. A stable topological order, with each
    node ranked by the first start that needs it, moves the weight's product (and the
    bucket's copy) ahead of the input's.

    What must not move keeps its place: the collectives and random ops keep their order
    among themselves (every process, eager or compiled, makes the same exchanges in the
    same order, and a random op draws what it drew), and an op that writes into a tensor
    stays between everything before it and everything after it.

        >>> import torch
        >>> from torch.fx.experimental.proxy_tensor import make_fx
        >>> def f(x):
        ...     late = x.exp()              # needed by nobody that starts an exchange
        ...     return late, x.sin()        # x.sin() feeds nothing here either: no start, no change
        >>> g = make_fx(f)(torch.ones(2))
        >>> start_exchanges_early(g)
        False
    """
    nodes = list(graph.graph.nodes)
    starts = [n for n in nodes if _qualified(n) in _STARTS]
    if not starts:
        return False
    rank: dict[torch.fx.Node, int] = {}
    for k, start in enumerate(starts):  # each start claims what it needs that no earlier one did
        stack = [start]
        while stack:
            n = stack.pop()
            if n not in rank:
                rank[n] = k
                stack.extend(n.all_input_nodes)
    after: dict[torch.fx.Node, list[torch.fx.Node]] = {n: list(n.all_input_nodes) for n in nodes}
    last_ordered: torch.fx.Node | None = None
    barrier: torch.fx.Node | None = None
    since_barrier: list[torch.fx.Node] = []
    for n in nodes:
        if _writes(n):  # everything before it stays before, everything after stays after
            after[n] += since_barrier
            barrier, since_barrier = n, []
        elif barrier is not None:
            after[n].append(barrier)
        if _ordered(n):
            if last_ordered is not None:
                after[n].append(last_ordered)
            last_ordered = n
        since_barrier.append(n)
    order = _stable_topological(nodes, after, key=lambda n: (-1 if n.op == "placeholder" else rank.get(n, len(starts))))
    anchor = next(n for n in reversed(nodes) if n.op == "placeholder") if nodes[0].op == "placeholder" else None
    for n in order:
        if n.op in ("placeholder", "output"):
            continue
        if anchor is None:
            nodes[0].prepend(n)
        else:
            anchor.append(n)
        anchor = n
    graph.graph.lint()
    graph.recompile()
    return True


def kept(n: torch.fx.Node) -> bool:
    """Whether dead-code elimination keeps ``n`` although nothing reads its result: an
    op FX calls impure, or an exchange between the slices of the axis (a torchpmap op).
    Every slice runs every exchange its Python code ran, in that order, as the eager
    engines do, whether or not it reads what arrives: a slice whose program dropped one
    (its part of a ``ppermute`` unread, under a Jacobian) would meet the others' next
    exchange with this one's values. Pass it as ``eliminate_dead_code(is_impure_node=kept)``."""
    return n.is_impure() or _qualified(n).startswith("torchpmap::")


def _qualified(n: torch.fx.Node) -> str:
    """``namespace::name`` of an op node ("" for anything else)."""
    schema = private.op_schema(n.target) if n.op == "call_function" else None
    return schema.name if schema is not None else ""


def _ordered(n: torch.fx.Node) -> bool:
    """A collective (a torchpmap op) or a random draw: keeps its order among its kind."""
    name = _qualified(n)
    return name.startswith("torchpmap::") or (
        bool(name) and torch.Tag.nondeterministic_seeded in cast(Any, n.target).tags  # an OpOverload
    )


def _writes(n: torch.fx.Node) -> bool:
    """An op that writes into one of its arguments, or whose effects FX cannot see (not
    an aten, prims or torchpmap op): nothing moves across it."""
    if n.op != "call_function":
        return False
    schema = private.op_schema(n.target)
    if schema is None:
        return n.target is not operator.getitem
    if schema.name.split("::")[0] not in ("aten", "prims", "torchpmap"):
        return True
    return any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


def _stable_topological(
    nodes: list[torch.fx.Node], after: dict[torch.fx.Node, list[torch.fx.Node]], key: Callable[[torch.fx.Node], int]
) -> list[torch.fx.Node]:
    """``nodes`` in an order where each comes after those in ``after[n]``: among the
    ready ones, the smallest ``key`` first, then the earliest in ``nodes``."""
    index = {n: i for i, n in enumerate(nodes)}
    waiting = {n: len(set(after[n])) for n in nodes}
    users: dict[torch.fx.Node, list[torch.fx.Node]] = {n: [] for n in nodes}
    for n in nodes:
        for d in set(after[n]):
            users[d].append(n)
    ready = [(key(n), index[n], n) for n in nodes if waiting[n] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        *_, n = heapq.heappop(ready)
        order.append(n)
        for u in users[n]:
            waiting[u] -= 1
            if waiting[u] == 0:
                heapq.heappush(ready, (key(u), index[u], u))
    if len(order) != len(nodes):
        raise RuntimeError("torchpmap: internal error: the graph's order constraints form a cycle")
    return order


def writes_an_input(graph: torch.fx.GraphModule) -> bool:
    """Whether the traced program writes into one of its inputs, or into a view of one.

    Such a program is compiled through Dynamo, whose guards see when two inputs share
    memory; a program that only reads its inputs computes the same from aliased inputs.
    An op whose effects FX cannot see (no schema) counts as a write when it takes an input.

        >>> from torch.fx.experimental.proxy_tensor import make_fx
        >>> writes_an_input(make_fx(lambda x: x.add(1))(torch.ones(2)))
        False
        >>> writes_an_input(make_fx(lambda x: x[0].add_(1))(torch.ones(2)))
        True
    """
    from_input: set[torch.fx.Node] = set()
    for n in graph.graph.nodes:
        if n.op == "placeholder":
            from_input.add(n)
        if n.op != "call_function" or not from_input.intersection(n.all_input_nodes):
            continue
        schema = private.op_schema(n.target)
        if schema is None:
            if n.target is not operator.getitem:
                return True
            from_input.add(n)  # an element of an input-derived list
            continue
        for k, a in enumerate(schema.arguments):
            value = _args(n)[k] if k < len(_args(n)) else n.kwargs.get(a.name)
            if a.alias_info is not None and a.alias_info.is_write and _nodes_in(value) & from_input:
                return True
        if any(r.alias_info is not None for r in schema.returns):  # a view: it shares its input's memory
            from_input.add(n)
    return False


def random_draw(graph: torch.fx.GraphModule) -> torch.fx.Node | None:
    """The first op of the traced program that draws random numbers, or None.

    An op tagged ``nondeterministic_seeded`` draws unless its dropout probability
    (``dropout_p``, or ``p`` of a dropout) is a constant 0: attention without dropout
    (``scaled_dot_product_attention``'s kernels carry the tag) draws nothing.

        >>> from torch.fx.experimental.proxy_tensor import make_fx
        >>> random_draw(make_fx(lambda x: x + torch.rand_like(x))(torch.ones(2))).target
        <OpOverload(op='aten.rand_like', overload='default')>
        >>> attention = torch.nn.functional.scaled_dot_product_attention
        >>> random_draw(make_fx(lambda q: attention(q, q, q, dropout_p=0.0))(torch.ones(1, 2, 4)))
    """
    for n in graph.graph.nodes:
        if n.op != "call_function" or torch.Tag.nondeterministic_seeded not in getattr(n.target, "tags", ()):
            continue
        schema = private.op_schema(n.target)
        named = {a.name: (_args(n)[k] if k < len(_args(n)) else n.kwargs.get(a.name, a.default_value))
                 for k, a in enumerate(schema.arguments)} if schema is not None else {}
        probability = named.get("dropout_p", named.get("p"))
        if isinstance(probability, (int, float)) and probability == 0:
            continue
        return n
    return None


def _nodes_in(value: Any) -> set[torch.fx.Node]:
    nodes: set[torch.fx.Node] = set()
    torch.fx.node.map_arg(value, nodes.add)
    return nodes
