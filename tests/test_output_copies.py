"""torchpmap._frontend.output_copies: a result never shares memory with an argument, on
any placement, as a loop over the instances (``torch.stack``) and JAX's arrays do not."""
from __future__ import annotations

import contextlib
import warnings

import pytest
import torch

import torchpmap as tp


def _rows_then_read(t):
    t.sum().item()  # values that differ between instances: vmap cannot run it, it falls back
    return t[:1]


PROGRAMS = {
    "a view": (lambda t: t[:1], {}),
    "the argument itself": (lambda t: t, {}),
    "an in-place write's result": (lambda t: t.mul_(1), {}),
    "a view, after a fallback": (_rows_then_read, {}),
    "a view, compiled": (lambda t: t[:1], {"jit": True}),
    "a transposed view": (lambda t: t.unsqueeze(0).t(), {}),
    # memory shared without being a view: once aliased on some placements, copied on others
    "detach()": (lambda t: t.detach(), {}),
    "detach(), compiled": (lambda t: t.detach(), {"jit": True}),
    "view(dtype)": (lambda t: t.view(torch.int32).view(torch.float32), {}),
    ".data": (lambda t: t.data, {}),
}


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_writing_into_a_result_leaves_the_argument_alone(placement, name):
    fun, options = PROGRAMS[name]
    x = torch.arange(12.0).reshape(4, 3)
    want = torch.stack([fun(row.clone()) for row in x])
    for devices in (placement, placement[:1]):
        x = torch.arange(12.0).reshape(4, 3)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", tp.VectorizationFallbackWarning)
            got = tp.pmap(fun, devices=devices, **options)(x)
        torch.testing.assert_close(torch.as_tensor(got).cpu(), want)
        with torch.no_grad():
            got.add_(100)
        torch.testing.assert_close(x, torch.arange(12.0).reshape(4, 3), msg=f"{name} on {len(devices)} device(s)")


@pytest.mark.parametrize(
    "fun",
    [
        pytest.param(lambda t: (lambda y: (y, y))(t * 2), id="the-same-result-twice"),
        pytest.param(lambda t: (lambda y: (y, y[:1]))(t * 2), id="a-result-and-its-view"),
        pytest.param(lambda t: (lambda y: {"a": y[1:], "b": y})(t * 2), id="a-view-first"),
        pytest.param(lambda t: (t, t[:1]), id="the-argument-and-its-view"),
    ],
)
def test_results_share_no_memory_with_each_other(placement, fun):
    """One device returned results that share memory (a write into one showed in the
    other); several devices and a loop over the rows return them apart."""
    x = torch.arange(12.0).reshape(4, 3)
    rows = [fun(row.clone()) for row in x]
    want = {k: torch.stack([r[k] for r in rows]) for k in (rows[0] if isinstance(rows[0], dict) else range(2))}
    for devices in (placement, placement[:1]):
        got = tp.pmap(fun, devices=devices)(x.clone())
        keys = list(want)
        first, second = (torch.as_tensor(got[k]).cpu().clone() for k in keys)
        with torch.no_grad():
            got[keys[0]].add_(100)
        torch.testing.assert_close(torch.as_tensor(got[keys[0]]).cpu(), first + 100)
        torch.testing.assert_close(torch.as_tensor(got[keys[1]]).cpu(), second, msg=f"on {len(devices)} device(s)")
        torch.testing.assert_close(second, want[keys[1]])


def test_one_at_a_time_too(placement):
    x = torch.arange(12.0).reshape(4, 3)
    with tp.disable_vectorization():
        got = tp.pmap(lambda t: t[:1], devices=placement)(x)
    with torch.no_grad():
        got.add_(100)
    torch.testing.assert_close(x, torch.arange(12.0).reshape(4, 3))


def test_an_argument_every_instance_sees(placement):
    """``in_axes=None``: one device gave an expanded view of it (whose writes torch
    refuses), a device running one instance the argument itself."""
    w = torch.arange(3.0)
    got = tp.pmap(lambda t, v: v, in_axes=(0, None), devices=placement)(torch.zeros(4, 2), w)
    with torch.no_grad():
        got.add_(1)
    torch.testing.assert_close(w, torch.arange(3.0))
    torch.testing.assert_close(torch.as_tensor(got).cpu(), torch.arange(3.0).expand(4, 3) + 1)


def test_a_sharded_argument_returned_as_it_is(placement):
    """shard_map's blocks go in where they are; a result that is one of them is copied on
    its device, so that the next layer's writes do not reach the argument."""
    mesh = tp.make_mesh((len(placement),), ("batch",), devices=placement)
    identity = tp.shard_map(lambda x: x, mesh=mesh, in_specs=tp.P("batch"), out_specs=tp.P("batch"))
    h = identity(torch.arange(8.0))
    y = identity(h)  # h goes in shard by shard
    assert type(y) is type(h)
    with torch.no_grad():
        y.add_(1)
    torch.testing.assert_close(torch.as_tensor(h).cpu(), torch.arange(8.0))
    torch.testing.assert_close(torch.as_tensor(y).cpu(), torch.arange(8.0) + 1)


def test_gradients_flow_through_the_copy(placement):
    x = torch.arange(12.0).reshape(4, 3).requires_grad_()
    tp.pmap(lambda t: t[:2], devices=placement)(x).pow(2).sum().backward()
    want = torch.zeros(4, 3)
    want[:, :2] = 2 * torch.arange(12.0).reshape(4, 3)[:, :2]
    torch.testing.assert_close(x.grad, want)


def test_a_computed_result_is_not_copied():
    """The common case costs the check only: a result of a computation is returned as the
    engine made it."""
    from torchpmap._frontend import output_copies

    out = torch.ones(4, 3) + 1
    assert output_copies.unaliased([out], [torch.ones(4, 3)])[0] is out


def test_a_detached_broadcast_argument_comes_back_in_memory_of_its_own(placement):
    w = torch.arange(3.0)
    for devices in (placement, placement[:1]):
        got = tp.pmap(lambda x, w: w.detach(), in_axes=(0, None), out_axes=None, devices=devices)(torch.zeros(4, 1), w)
        got.add_(1)
        torch.testing.assert_close(w, torch.arange(3.0), msg=f"on {len(devices)} device(s)")


@pytest.mark.parametrize(
    "fun, in_axes",
    [
        pytest.param(lambda x: tp.psum(x, "i"), 0, id="a-psum"),
        pytest.param(lambda x: torch.zeros(2), 0, id="a-constant"),
        pytest.param(lambda x, w: w * 2, (0, None), id="from-a-broadcast-argument"),
    ],
)
@pytest.mark.parametrize("jit", [False, True])
def test_each_instance_has_a_row_of_its_own(placement, fun, in_axes, jit):
    """A value the same on every instance, stacked: one device returned one row expanded
    over the instances, so a write into instance 1's row changed every row; several
    devices and a loop hold a row each."""
    x = torch.arange(8.0).reshape(4, 2)
    args = (x,) if in_axes == 0 else (x, torch.ones(2))
    results = []
    for devices in (placement, placement[:1]):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = torch.as_tensor(tp.pmap(fun, axis_name="i", in_axes=in_axes, devices=devices, jit=jit)(*args))
        expected = out[0].clone()
        out[1].mul_(0)
        assert torch.equal(out[0], expected) and torch.equal(out[2], expected), f"on {len(devices)} device(s)"
        results.append(out)
    torch.testing.assert_close(results[0], results[1])


@pytest.mark.parametrize(
    "fun",
    [
        pytest.param(lambda x: x.sum().expand(3), id="expanded-per-instance"),
        pytest.param(lambda x: tp.psum(x, "i")[:1].expand(2, 3), id="expanded-psum"),
    ],
)
@pytest.mark.parametrize("jit", [False, True])
def test_each_element_has_memory_of_its_own(placement, fun, jit):
    """An instance that returns one number expanded (stride 0 inside its row): a write
    into one element changed the whole row on one device and raised on several, where a
    loop's ``torch.stack`` holds each element apart."""
    x = torch.arange(8.0).reshape(4, 2)
    for devices in (placement, placement[:1]):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = tp.pmap(fun, axis_name="i", devices=devices, jit=jit)(x)
        whole = torch.as_tensor(out).clone()
        out[0, 0] = -1.0
        whole[0, 0] = -1.0
        torch.testing.assert_close(torch.as_tensor(out), whole, msg=f"on {len(devices)} device(s)")


@pytest.mark.parametrize("debug", [False, True], ids=["vectorized", "one-at-a-time"])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_tensor_the_function_closes_over(placement, debug, jit):
    """Every instance returns the same tensor, which no instance computed. Stacked
    (``out_axes=0``): one device expanded it and copied the rows, where each of 4 devices
    returned a view of it (a write into the result wrote it). Taken once (``out_axes=None``):
    the tensor itself on every placement, as ``torch.func.vmap`` returns an unbatched
    result (one at a time, the instances' rows were concatenated into a copy)."""
    if debug and jit:
        pytest.skip("debug mode runs no compiled program")
    for devices in (placement, placement[:1]):
        for out_axes in (0, None):
            w = torch.zeros(3)
            f = tp.pmap(lambda x: w, out_axes=out_axes, devices=devices, jit=jit)
            with tp.disable_vectorization() if debug else contextlib.nullcontext(), warnings.catch_warnings():
                warnings.simplefilter("ignore", tp.JitFallbackWarning)
                got = f(torch.ones(4, 2))
            with torch.no_grad():
                got.add_(1)
            want = torch.zeros(3) if out_axes == 0 else torch.ones(3)
            torch.testing.assert_close(w, want, msg=f"out_axes={out_axes} on {len(devices)} device(s)")
