"""How a collective is bound (torchpmap/_collectives/binding.py): the direct path at its own vmap
level, ``_Bind`` (an autograd.Function with a vmap rule) under inner transforms."""
from __future__ import annotations

import pytest
import torch

import torchpmap as tp
from torchpmap._collectives import binding as _primitive

ONE_DEVICE = tp.devices()[:1]


@pytest.fixture
def bind_calls(monkeypatch):
    """Counts the collectives that go through ``_Bind``."""
    calls = []
    original = _primitive._apply

    def counting(prims, token, xs):
        calls.append(prims[0].name)
        return original(prims, token, xs)

    monkeypatch.setattr(_primitive, "_apply", counting)
    return calls


def test_a_collective_at_its_own_level_skips_the_autograd_function(bind_calls):
    x = torch.randn(4, 3, requires_grad=True)
    out = tp.pmap(lambda v: tp.psum(v, "i") * v, "i", devices=ONE_DEVICE)(x)
    out.sum().backward()  # outer autograd differentiates the plain ops: d/dx sum_c S_c^2 = 2 S
    torch.testing.assert_close(x.grad, 2 * x.detach().sum(0).expand(4, 3))
    assert bind_calls == []


def test_under_grad_inside_the_map_the_collective_binds_its_transpose(bind_calls):
    x = torch.arange(4.0)
    g = tp.pmap(torch.func.grad(lambda v: tp.psum(v * v, "i")), "i", devices=ONE_DEVICE)(x)
    torch.testing.assert_close(g, 4 * 2 * x)  # JAX's convention: psum transposes to psum
    assert bind_calls == ["psum", "psum"]  # forward, then the transpose in backward


def test_a_collective_over_an_outer_axis_passes_inner_levels_through(bind_calls):
    x = torch.arange(6.0).reshape(2, 3)
    inner = lambda row: tp.pmap(lambda v: tp.psum(v, "outer"), "inner")(row)  # noqa: E731
    out = tp.pmap(inner, "outer", devices=ONE_DEVICE)(x)
    torch.testing.assert_close(out, x.sum(0).expand(2, 3))
    assert bind_calls == ["psum"]
