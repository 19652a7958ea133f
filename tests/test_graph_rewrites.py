"""torchpmap._engines.graph_rewrites: a traced program's per-instance products summed over
the instances become one product, with the same result (to rounding), and nothing else
changes; rows of a product that travel in different gradient buckets become one product
per bucket; a gradient bucket's start moves ahead of the computation it does not need, and
nothing that must keep its place moves; a program that writes into an input, or a view of
one, is told apart from one that only reads its inputs."""
from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import torchpmap as tp
from torchpmap._engines import process_ops  # noqa: F401  (registers the torchpmap ops)
from torchpmap._engines.graph_rewrites import (
    fold_instance_sums,
    split_sliced_products,
    start_exchanges_early,
    writes_an_input,
)

aten = torch.ops.aten


def _ops(graph: torch.fx.GraphModule) -> list:
    return [n.target for n in graph.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize(
    "views",
    [
        lambda t: t,
        lambda t: t.transpose(1, 2),
        lambda t: t.transpose(2, 1).transpose(1, 2).permute(0, 2, 1),
        lambda t: t.view(t.shape).transpose(-1, -2),
    ],
)
def test_a_sum_over_instances_of_a_bmm_is_one_mm(views):
    a, b = torch.randn(6, 3, 5, dtype=torch.float64), torch.randn(6, 5, 4, dtype=torch.float64)
    f = lambda a, b: views(torch.bmm(a, b)).sum(0)  # noqa: E731
    graph = make_fx(f)(a, b)
    assert fold_instance_sums(graph) == 1
    assert aten.bmm.default not in _ops(graph) and aten.mm.default in _ops(graph)
    torch.testing.assert_close(graph(a, b), f(a, b))


@pytest.mark.parametrize(
    "f",
    [
        lambda a, b: torch.bmm(a, b).sum(1),  # not over the instances
        lambda a, b: torch.bmm(a, b).sum(0, keepdim=True),
        lambda a, b: torch.bmm(a, b).sum(0, dtype=torch.float64),  # into another dtype
        lambda a, b: torch.bmm(a, b).transpose(0, 1).sum(0),  # the instance dim moved away
        lambda a, b: torch.bmm(a, b).transpose(-1, 0).sum(0),
        lambda a, b: torch.bmm(a, b).reshape(3, 2, 3, 4).sum(0),  # instances regrouped
        lambda a, b: (lambda p: p.sum(0) + p[0])(torch.bmm(a, b)),  # the products are used elsewhere too
    ],
)
def test_other_sums_and_shared_products_stay(f):
    a, b = torch.randn(6, 3, 5), torch.randn(6, 5, 4)
    graph = make_fx(f)(a, b)
    before = _ops(graph)
    assert fold_instance_sums(graph) == 0
    assert _ops(graph) == before
    torch.testing.assert_close(graph(a, b), f(a, b))


def test_a_compiled_data_parallel_step_runs_one_product_per_weight_and_matches_eager():
    torch.manual_seed(0)
    params = {"w1": torch.randn(8, 16) / 3, "w2": torch.randn(16, 3) / 4}
    x, y = torch.randn(4, 10, 8), torch.randn(4, 10, 3)

    def step(p, x, y):
        loss = lambda p: ((torch.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2).mean()  # noqa: E731
        return tp.pmean(torch.func.grad(loss)(p), "i")

    seen = []
    from torchpmap._engines import compiled

    original = compiled.graph_rewrites.fold_instance_sums
    compiled.graph_rewrites.fold_instance_sums = lambda g: seen.append(original(g)) or seen[-1]
    try:
        # on one device: one trace (several devices in one process trace a slice each)
        one = tp.devices()[:1]
        got = tp.pmap(step, axis_name="i", in_axes=(None, 0, 0), out_axes=None, jit=True, devices=one)(params, x, y)
    finally:
        compiled.graph_rewrites.fold_instance_sums = original
    want = tp.pmap(step, axis_name="i", in_axes=(None, 0, 0), out_axes=None)(params, x, y)
    assert seen == [2]  # one per weight
    for k in params:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------- start_exchanges_early

torchpmap_ops = torch.ops.torchpmap


def _layer_backward(g2, h1, w2, h0, w1):
    """Two layers' backward as autograd orders it: each layer's input gradient, then its
    weight gradient, whose bucket starts."""
    token = g2.new_empty(0)
    grad_h1 = g2 @ w2                      # the input's gradient first...
    grad_w2 = g2.t() @ h1                  # ...then the weight's, which the first bucket waits for
    first = torchpmap_ops.start_sums(token, [grad_w2], 0, 0)
    grad_w1 = grad_h1.relu().t() @ h0
    second = torchpmap_ops.start_sums(token, [grad_w1], 0, 1)
    return first, second, grad_h1.sum()


def _fake_graph(fn, *shapes):
    return make_fx(fn, tracing_mode="fake")(*(torch.randn(s) for s in shapes))


def _order(graph) -> list[str]:
    return [n.name for n in graph.graph.nodes if n.op == "call_function"]


def test_a_bucket_starts_before_the_product_it_does_not_need():
    graph = _fake_graph(_layer_backward, (4, 3), (4, 5), (3, 5), (4, 2), (5, 2))
    before = _order(graph)
    assert before.index("mm") < before.index("mm_1") < before.index("start_sums")  # grad_h1, grad_w2, start
    assert start_exchanges_early(graph)
    after = _order(graph)
    assert after.index("mm_1") < after.index("start_sums") < after.index("mm"), after
    assert after.index("start_sums") < after.index("start_sums_1")
    graph.graph.lint()  # still a valid topological order
    assert sorted(after) == sorted(before)


def test_without_a_start_nothing_moves():
    graph = _fake_graph(lambda a, b: ((a @ b).relu(), a.sum()), (3, 3), (3, 3))
    before = _order(graph)
    assert not start_exchanges_early(graph)
    assert _order(graph) == before


def test_collectives_random_draws_and_writes_keep_their_places():
    def program(g2, h1, w2):
        token = g2.new_empty(0)
        noise = torch.rand(3)                          # a random draw before...
        grad_h1 = g2 @ w2
        gathered = torchpmap_ops.gather_processes([grad_h1], 0, 2, "x", True)[0]  # a collective before the start
        state = h1.clone()
        state.add_(1.0)                                # a write: nothing crosses it
        late = state * 2
        grad_w2 = g2.t() @ h1
        more_noise = torch.rand(3)                     # ...and one after
        started = torchpmap_ops.start_sums(token, [grad_w2], 0, 0)
        return started, gathered, late, noise + more_noise

    graph = _fake_graph(program, (4, 3), (4, 5), (3, 5))
    before = _order(graph)
    assert start_exchanges_early(graph)
    after = _order(graph)
    graph.graph.lint()

    def kept(*names):
        return [after.index(n) for n in names] == sorted(after.index(n) for n in names)

    assert kept("gather_processes", "start_sums")        # the collectives' order
    assert kept("rand", "rand_1")                         # the random draws' order
    assert kept("add_", "mul") and kept("clone", "add_")  # the write stays between its neighbours
    assert all(after.index(n) < after.index("add_") for n in before[: before.index("add_")])
    assert all(after.index(n) > after.index("add_") for n in before[before.index("add_") + 1 :])


def test_a_start_never_overtakes_an_earlier_collective_or_a_random_draw():
    def program(g2, h1, w2):
        token = g2.new_empty(0)
        grad_h1 = g2 @ w2
        gathered = torchpmap_ops.gather_processes([grad_h1], 0, 2, "x", True)[0]
        noise = torch.rand(3)
        grad_w2 = g2.t() @ h1
        started = torchpmap_ops.start_sums(token, [grad_w2], 0, 0)
        return started, gathered, noise * torch.rand(3)

    graph = _fake_graph(program, (4, 3), (4, 5), (3, 5))
    assert start_exchanges_early(graph)
    after = _order(graph)
    assert after.index("gather_processes") < after.index("start_sums"), after
    assert after.index("rand") < after.index("rand_1")
    assert after.index("mm_1") < after.index("start_sums")  # the weight's product still goes first


# ----------------------------------------------------------------------- split_sliced_products


def _weight_grad_in_two_buckets(gradient):
    """A weight gradient whose first rows travel in the first bucket and the rest in the
    second (what gradient_mean.buckets_of makes of a weight far bigger than the first
    bucket), and the same slices as outputs, to compare."""

    def program(g2, h1, bias_grad):
        token = g2.new_empty(0)
        grad_w2 = gradient(g2, h1)
        first, rest = grad_w2[:3], grad_w2[3:]
        started = torchpmap_ops.start_sums(token, [bias_grad, first], 0, 0)
        started_1 = torchpmap_ops.start_sums(token, [rest], 0, 1)
        return started, started_1, first, rest

    return program


_GRADIENTS = {
    "mm": lambda g2, h1: g2.t() @ h1,
    "mm, transposed": lambda g2, h1: (h1.t() @ g2).t(),  # the rows of the weight are columns of the product
    # as a traced data-parallel step has it: a batched product of one instance, viewed, selected
    "bmm": lambda g2, h1: torch.bmm(g2.t()[None], h1[None]).view(1, 8, 5).transpose(1, 2).transpose(1, 2).select(0, 0),
    "bmm, transposed": lambda g2, h1: torch.bmm(h1.t()[None], g2[None]).transpose(1, 2)[0],
}


def _runnable(graph):
    """The graph with its starts replaced by a no-op, to run it on real tensors."""
    for n in graph.graph.nodes:
        if n.target is torchpmap_ops.start_sums.default:
            n.target = lambda token, ts, key, k: token
    graph.recompile()
    return graph


@pytest.mark.parametrize("how", sorted(_GRADIENTS))
def test_rows_of_a_product_in_two_buckets_become_two_products_and_the_first_bucket_waits_for_its_own(how):
    program = _weight_grad_in_two_buckets(_GRADIENTS[how])
    shapes = ((4, 8), (4, 5), (2,))
    graph = _fake_graph(program, *shapes)
    products = [n for n in graph.graph.nodes if n.target in (aten.mm.default, aten.bmm.default)]
    assert len(products) == 1
    assert split_sliced_products(graph) == 1
    products = [n for n in graph.graph.nodes if n.target in (aten.mm.default, aten.bmm.default)]
    assert len(products) == 2, graph.graph  # one per slice, the whole one gone
    assert start_exchanges_early(graph)
    order = _order(graph)
    first_product = min(order.index(n.name) for n in products)
    assert first_product < order.index("start_sums") < max(order.index(n.name) for n in products), order
    # the same values, to rounding
    inputs = [torch.randn(s) for s in shapes]
    whole = _GRADIENTS[how](*inputs[:2])
    got = _runnable(graph)(*inputs)
    for k, want in ((2, whole[:3]), (3, whole[3:])):
        assert got[k].shape == want.shape
        torch.testing.assert_close(got[k], want)


def test_a_product_folded_over_instances_is_split_too():
    # several instances per process: their weight gradients' sum is folded into one product
    # first (fold_instance_sums), whose rows then travel in two buckets
    def program(g2, h1, bias_grad):
        token = g2.new_empty(0)
        grad_w2 = torch.bmm(g2.transpose(1, 2), h1).sum(0)  # (instances, out, samples) @ (instances, samples, in)
        first, rest = grad_w2[:3], grad_w2[3:]
        started = torchpmap_ops.start_sums(token, [bias_grad, first], 0, 0)
        return started, torchpmap_ops.start_sums(token, [rest], 0, 1), first, rest

    shapes = ((2, 4, 8), (2, 4, 5), (2,))
    graph = _fake_graph(program, *shapes)
    assert fold_instance_sums(graph) == 1 and split_sliced_products(graph) == 1
    assert [t for t in _ops(graph) if t in (aten.mm.default, aten.bmm.default)] == [aten.mm.default] * 2
    inputs = [torch.randn(s) for s in shapes]
    whole = torch.bmm(inputs[0].transpose(1, 2), inputs[1]).sum(0)
    got = _runnable(graph)(*inputs)
    torch.testing.assert_close(got[2], whole[:3])
    torch.testing.assert_close(got[3], whole[3:])


@pytest.mark.parametrize(
    "program",
    [
        # the whole product is used too: splitting would compute it twice
        lambda g2, h1: (lambda w: (torchpmap_ops.start_sums(g2.new_empty(0), [w[:3]], 0, 0), w))(g2.t() @ h1),
        lambda g2, h1: (lambda w: (torchpmap_ops.start_sums(g2.new_empty(0), [w[:3]], 0, 0), w.sum()))(g2.t() @ h1),
        # a slice with a step, and a slice of something that is not a product
        lambda g2, h1: torchpmap_ops.start_sums(g2.new_empty(0), [(g2.t() @ h1)[::2]], 0, 0),
        lambda g2, h1: torchpmap_ops.start_sums(g2.new_empty(0), [(g2.t() + 1)[:3]], 0, 0),
        # slices that overlap: split, the product would be computed one and a half times
        lambda g2, h1: (lambda w: (torchpmap_ops.start_sums(g2.new_empty(0), [w[:3]], 0, 0), w[2:]))(g2.t() @ h1),
        # a reshape that merges dims on the way
        lambda g2, h1: torchpmap_ops.start_sums(g2.new_empty(0), [(g2.t() @ h1).reshape(-1)[:3]], 0, 0),
    ],
)
def test_other_slices_and_shared_products_stay(program):
    graph = _fake_graph(program, (4, 8), (4, 5))
    before = _order(graph)
    assert split_sliced_products(graph) == 0
    assert _order(graph) == before


@pytest.mark.parametrize(
    "f, writes",
    [
        (lambda x, y: (x * 2 + y).relu_(), False),  # writes only into its own intermediate
        (lambda x, y: x.copy_(y), True),
        (lambda x, y: x.transpose(0, 1)[1].mul_(2), True),  # a view of a view of an input
        (lambda x, y: torch.unbind(y)[0].zero_(), True),  # an element of a list of views
        (lambda x, y: torch.add(y, 1, out=torch.empty_like(y)), False),  # out= a new tensor
        (lambda x, y: torch.add(x, 1, out=y), True),  # out= an input
    ],
)
def test_a_write_into_an_input_is_seen(f, writes):
    graph = make_fx(f)(torch.ones(3, 3), torch.ones(3, 3))
    assert writes_an_input(graph) is writes

