"""ShardedTensor, the multi-device result: a torch.Tensor whose data stays in shards.

Every test computes the same thing from a pmap on one device (a plain tensor, the
oracle) and on four CPU devices (a ShardedTensor), and compares values and gradients.
"""
import copy
import pickle

import numpy as np
import pytest
import torch

import torchpmap as tp
from torchpmap import Device, ShardedTensor
from torchpmap._placement import devices as _devices


@pytest.fixture
def devices(monkeypatch):
    """Four CPU devices for this test, whatever TORCHPMAP_NUM_CPU_DEVICES the run uses."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("TORCHPMAP_NUM_CPU_DEVICES", "4")
    _devices._local_devices.cache_clear()
    yield tp.devices()
    monkeypatch.undo()
    _devices._local_devices.cache_clear()


def both(devices, fun, x):
    """``pmap(fun)`` of a fresh leaf copy of ``x`` on one device and on four: (leaf, out) each."""
    runs = []
    for placement in (devices[:1], devices):
        leaf = x.detach().clone().requires_grad_()
        runs.append((leaf, tp.pmap(fun, axis_name="i", devices=placement)(leaf)))
    (one_leaf, one), (many_leaf, many) = runs
    assert type(one) is torch.Tensor and isinstance(many, ShardedTensor)
    return one_leaf, one, many_leaf, many


def square_and_sum(v):
    return v * v + tp.psum(v, "i")


X = torch.arange(1.0, 9.0)


def test_it_is_a_tensor_and_as_tensor_keeps_its_graph(devices):
    one_leaf, one, many_leaf, many = both(devices, square_and_sum, X)
    converted = torch.as_tensor(many)
    assert converted is many and isinstance(many, torch.Tensor)
    assert many.shape == one.shape and many.dtype == one.dtype and many.requires_grad
    assert many.device == devices[0].torch_device and many.devices() == devices
    (torch.as_tensor(one) * 3).sum().backward()
    (converted * 3).sum().backward()
    assert torch.equal(many_leaf.grad, one_leaf.grad)


def test_as_tensor_with_a_dtype_converts_differentiably(devices):
    one_leaf, one, many_leaf, many = both(devices, square_and_sum, X)
    for leaf, out in ((one_leaf, one), (many_leaf, many)):
        converted = torch.as_tensor(out, dtype=torch.float64)
        assert type(converted) is torch.Tensor and converted.dtype == torch.float64
        (converted**2).sum().backward()
    assert torch.equal(many_leaf.grad, one_leaf.grad)


def test_ordinary_ops_backward_and_grad_with_respect_to_it(devices):
    one_leaf, one, many_leaf, many = both(devices, square_and_sum, X)
    for out in (one, many):
        assert type(torch.sin(out) @ out) is torch.Tensor
    g_one = torch.autograd.grad((one.sin() * one).sum(), one, retain_graph=True)[0]
    g_many = torch.autograd.grad((many.sin() * many).sum(), many, retain_graph=True)[0]
    assert torch.equal(g_one, g_many)
    one.backward(torch.ones(8))
    many.backward(torch.ones(8))
    assert torch.equal(many_leaf.grad, one_leaf.grad)


def test_hooks_and_retain_grad_see_every_use(devices):
    one_leaf, one, many_leaf, many = both(devices, square_and_sum, X)
    seen = {}
    for name, out in (("one", one), ("many", many)):
        out.retain_grad()
        out.register_hook(lambda g, name=name: seen.setdefault(name, []).append(g))
        # a gather, a row read from its shard, a kept-sharded view, and a torch function
        whole = out.gather() if isinstance(out, ShardedTensor) else out
        (whole.sum() + out[5] * 2 + out.unsqueeze(0).select(1, 3) + torch.sum(out * out)).backward()
    assert len(seen["one"]) == len(seen["many"]) == 1
    assert torch.equal(seen["one"][0], seen["many"][0])
    assert torch.equal(one.grad, many.grad)
    assert torch.equal(many_leaf.grad, one_leaf.grad)


def test_in_place_ops_and_assignment_write_into_the_shards(devices):
    one_leaf, one, many_leaf, many = both(devices, square_and_sum, X)
    values = [torch.tensor(100.0, requires_grad=True) for _ in range(2)]
    for out, value in zip((one, many), values):
        out.mul_(2)
        out[2] = value
        out.add_(torch.arange(8.0))
    assert torch.equal(many.gather(), one)
    assert torch.equal(torch.cat([s.tensor for s in many.shards]).detach(), one.detach())  # the shards hold it
    one.pow(2).sum().backward()
    many.pow(2).sum().backward()
    assert torch.equal(many_leaf.grad, one_leaf.grad) and torch.equal(values[1].grad, values[0].grad)


def test_an_in_place_op_after_a_use_is_caught_as_on_a_tensor(devices):
    _, _, _, many = both(devices, square_and_sum, X)
    product = many * many
    many.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        product.sum().backward()


def test_a_mesh_result_routes_gradients_into_its_blocks(devices):
    mesh = tp.Mesh(np.array(devices).reshape(2, 2), ("data", "model"))
    fun = tp.pmap(tp.pmap(lambda v: v * tp.psum(v, "model"), axis_name="model"), axis_name="data")
    x = torch.arange(1.0, 5.0).reshape(2, 2)
    on_one, on_mesh = x.clone().requires_grad_(), x.clone().requires_grad_()
    one = tp.pmap(tp.pmap(lambda v: v * tp.psum(v, "model"), axis_name="model"), axis_name="data", devices=devices[:1])(on_one)
    with mesh:
        out = fun(on_mesh)
    assert isinstance(out, ShardedTensor) and isinstance(out.shards[0].tensor, ShardedTensor)
    assert out.devices() == list(mesh.devices.flat)
    torch.as_tensor(one).pow(2).sum().backward()
    torch.as_tensor(out).pow(2).sum().backward()
    assert torch.equal(on_mesh.grad, on_one.grad)


def test_fed_back_it_stays_sharded_and_differentiable(devices):
    one_leaf, one, many_leaf, many = both(devices, square_and_sum, X)
    again = [tp.pmap(lambda v: v.exp() / 100, devices=d)(out) for d, out in ((devices[:1], one), (devices, many))]
    assert isinstance(again[1], ShardedTensor)
    for out in again:
        out.sum().backward()
    torch.testing.assert_close(many_leaf.grad, one_leaf.grad, rtol=1e-6, atol=0)


def test_tensor_methods_mean_what_they_mean_on_a_tensor(devices):
    labels = torch.tensor([[1], [0], [1], [1]])
    one_leaf, one, many_leaf, many = both(devices, lambda v: torch.stack([v, -v], -1), torch.arange(4.0))
    picked = [out.gather(1, labels) for out in (one, many)]  # torch.Tensor.gather, not the device gather
    assert type(picked[1]) is torch.Tensor and torch.equal(picked[0], picked[1])
    for p in picked:
        p.sum().backward()
    assert torch.equal(many_leaf.grad, one_leaf.grad)
    assert torch.equal(many.gather(dim=1, index=labels), picked[0]) and many.gather("cpu").shape == (4, 2)


def test_under_no_grad_it_does_not_require_grad(devices):
    with torch.no_grad():
        out = tp.pmap(square_and_sum, axis_name="i")(X.clone().requires_grad_())
    assert isinstance(out, ShardedTensor) and not out.requires_grad and out.grad_fn is None


def test_copies_pickles_and_numpy():
    st = ShardedTensor([(Device("cpu", 0), torch.zeros(2)), (Device("cpu", 1), torch.ones(2))])
    for copied in (copy.deepcopy(st), pickle.loads(pickle.dumps(st))):
        assert isinstance(copied, ShardedTensor) and copied.devices() == st.devices()
        assert torch.equal(copied, st) and copied.shards[1].tensor is not st.shards[1].tensor
    assert np.array_equal(np.asarray(st), [0, 0, 1, 1]) and st.tolist() == [0, 0, 1, 1]
    assert repr(st) == "tensor([0., 0., 1., 1.], devices=[cpu:0, cpu:1])"
    assert torch.equal(torch.from_dlpack(st), torch.tensor([0.0, 0.0, 1.0, 1.0]))


def test_dlpack_refuses_a_graph_it_cannot_carry(devices):
    _, _, _, many = both(devices, square_and_sum, X)
    with pytest.raises(RuntimeError, match="requires grad.*torch.as_tensor"):
        many.__dlpack__()
