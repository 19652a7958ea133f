"""torchpmap._engines.graph_rewrites: a traced program's per-instance products summed over
the instances become one product, with the same result (to rounding), and nothing else
changes."""
from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import torchpmap as tp
from torchpmap._engines.graph_rewrites import fold_instance_sums

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
        # on one device: across devices in one process, jit=True runs eagerly (nothing to trace)
        one = tp.devices()[:1]
        got = tp.pmap(step, axis_name="i", in_axes=(None, 0, 0), out_axes=None, jit=True, devices=one)(params, x, y)
    finally:
        compiled.graph_rewrites.fold_instance_sums = original
    want = tp.pmap(step, axis_name="i", in_axes=(None, 0, 0), out_axes=None)(params, x, y)
    assert seen == [2]  # one per weight
    for k in params:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6)
