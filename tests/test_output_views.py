"""torchpmap._engines.output_views: a compiled program's results that are views of its own
values are taken outside the program, so that an in-place write into such a result before
``.backward()`` is caught as eager autograd catches it, on every placement, instead of
differentiating with the overwritten values; what else the graph returns is unchanged."""
from __future__ import annotations

import operator

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import torchpmap as tp
from torchpmap._engines.output_views import peel

aten = torch.ops.aten


def _ops(graph: torch.fx.GraphModule) -> list:
    return [n.target for n in graph.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize(
    "f",
    [
        lambda v: [v.exp().t()],
        lambda v: [v.exp().unsqueeze(0)],
        lambda v: [v.exp()[:1].reshape(-1)],
        lambda v: [v.exp().split(1)[1]],
        lambda v: [v.sin(), v.exp().t(), v.exp().t().unsqueeze(0)],
    ],
    ids=["t", "unsqueeze", "slice-reshape", "split", "several"],
)
def test_views_of_computed_values_run_outside_and_give_the_same_results(f):
    x = torch.randn(2, 3)
    graph = make_fx(f)(x)
    views = peel(graph)
    assert views is not None
    assert not any(t in _ops(graph) for t in (aten.t.default, aten.unsqueeze.default, operator.getitem))
    for got, want in zip(views.apply(graph(x)), f(x)):
        assert got.shape == want.shape and got.stride() == want.stride()
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize(
    "f",
    [lambda v: [v.exp()], lambda v: [v.t()], lambda v: [v.exp() * 2, v[0]]],
    ids=["no-view", "view-of-input", "computed-and-input-view"],
)
def test_a_graph_without_views_of_its_values_is_left_alone(f):
    graph = make_fx(f)(torch.randn(2, 3))
    before = _ops(graph)
    assert peel(graph) is None
    assert _ops(graph) == before


def _views(v: torch.Tensor) -> dict[str, torch.Tensor]:
    e = v.exp()
    return {"t": e.t(), "slice": e[:1], "reshape": e.reshape(-1), "unsqueeze": e.unsqueeze(0)}


@pytest.mark.parametrize("view", ["t", "slice", "reshape", "unsqueeze"])
@pytest.mark.parametrize("per_device", [1, 2])
def test_a_write_into_a_view_of_a_saved_value_is_caught_on_every_placement(four_devices, view, per_device):
    """``exp`` saves its result for its backward: writing into (a view of) it, then
    differentiating, raises eagerly. Compiled, the view came out of the program with a
    version counter of its own, and the backward read the overwritten values: 2x the
    gradient on a device holding one instance (the instance dim added inside the
    program), and on every placement for a view that the function returns."""
    for devices in (four_devices[:1], four_devices[:2], four_devices):
        for jit in (False, True):
            x = torch.linspace(0.1, 1.0, len(devices) * per_device * 4).reshape(-1, 2, 2).requires_grad_()
            y = tp.pmap(lambda v: _views(v)[view], axis_name="i", devices=devices, jit=jit)(x)
            y.mul_(2)
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                y.sum().backward()


@pytest.mark.parametrize("jit", [False, True])
def test_views_taken_outside_keep_values_and_gradients(four_devices, jit):
    x = torch.randn(4, 2, 3)

    def f(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        e = (v * tp.psum(v, "i")).exp()
        return e.t(), e[:, 1:].unsqueeze(0)

    results = []
    for devices in (four_devices[:1], four_devices):
        xs = x.clone().requires_grad_()
        a, b = tp.pmap(f, axis_name="i", devices=devices, jit=jit)(xs)
        (a.sum() + (b * b).sum()).backward()
        results.append((torch.as_tensor(a).detach(), torch.as_tensor(b).detach(), xs.grad))
    for one, many in zip(*results):
        torch.testing.assert_close(many, one)
