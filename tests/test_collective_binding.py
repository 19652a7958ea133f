"""How a collective is bound (torchpmap/_collectives/binding.py): the direct path at its own vmap
level, ``_Bind`` (an autograd.Function with a vmap rule) under inner transforms."""
from __future__ import annotations

import pytest
import torch
from torch.func import grad

import torchpmap as tp
from torchpmap import P
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


def _second_order(kind: str):
    """A shard_map body with a gradient of a gradient inside, whose outer cotangent
    depends on the weight: ``w`` is replicated, so shard_map's implicit ``pvary`` makes
    the inner gradient ``G = psum(3 x^3 w^2)``; its transpose in the outer ``grad`` is
    ``psum``'s under ``check_vma``, which passes the invariant cotangent as it is."""

    def body(w, x):
        s = lambda w: ((x * w) ** 3).sum()  # noqa: E731
        if kind == "square":
            return grad(lambda w: grad(s)(w) ** 2)(w)
        return grad(lambda w: grad(s)(w) * w**2)(w)

    def reference(w, x):  # the same math on the whole x, in plain torch
        G = lambda w: (3 * x**3 * w**2).sum()  # noqa: E731
        return torch.func.grad(lambda w: G(w) ** 2 if kind == "square" else G(w) * w**2)(w)

    return body, reference


@pytest.mark.parametrize("kind", ["square", "times_w2"])
@pytest.mark.parametrize("jit", [False, True])
def test_a_gradient_from_outside_reaches_through_a_collective_that_returns_its_input(four_devices, kind, jit):
    """A collective that leaves an invariant value as it is returned its input itself,
    and torch.func then handed the levels above the input, not the collective's result:
    a ``.backward()`` from outside lost what flowed through that cotangent (a third of
    ``dw`` and half of ``dx`` for ``grad(G ** 2)``), on every placement alike."""
    body, reference = _second_order(kind)
    w0, x0 = torch.tensor(0.7), torch.tensor([0.5, -1.0, 1.5, 2.0])
    wr, xr = w0.clone().requires_grad_(), x0.clone().requires_grad_()
    want = reference(wr, xr)
    want.backward()
    for devices in (four_devices[:1], four_devices):
        mesh = tp.make_mesh((4,), ("x",), devices=devices)  # 4 positions: vectorized on one device, one each on 4
        f = tp.shard_map(body, mesh=mesh, in_specs=(P(), P("x")), out_specs=P(), jit=jit)
        w, x = w0.clone().requires_grad_(), x0.clone().requires_grad_()
        out = f(w, x)
        out.backward()
        torch.testing.assert_close(torch.as_tensor(out), want.detach())
        torch.testing.assert_close(w.grad, wr.grad)
        torch.testing.assert_close(x.grad, xr.grad)
