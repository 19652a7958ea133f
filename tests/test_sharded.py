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


@pytest.fixture
def devices(four_devices):
    """Four CPU devices for this test (conftest's ``four_devices``)."""
    return four_devices


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
    for _leaf, out in ((one_leaf, one), (many_leaf, many)):
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


@pytest.mark.parametrize("jit", [False, True])
def test_an_in_place_op_on_a_result_its_backward_saved_is_caught_as_on_one_device(devices, jit):
    """``exp`` saves its result for its backward. A write into a ShardedTensor reached its
    shards below autograd, where no version counter moves: the backward then used the
    overwritten values (2x the gradient of ``y.mul_(2)``) where one device raises."""
    for placement in (devices[:1], devices[:2], devices):
        x = X.clone().requires_grad_()
        y = tp.pmap(torch.exp, axis_name="i", devices=placement, jit=jit)(x)
        y.mul_(2)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.sum().backward()
    # (one instance per device, and results that are views: tests/test_output_views.py)


def test_a_mesh_result_routes_gradients_into_its_blocks(devices):
    mesh = tp.Mesh(np.array(devices).reshape(2, 2), ("data", "model"))
    fun = tp.pmap(tp.pmap(lambda v: v * tp.psum(v, "model"), axis_name="model"), axis_name="data")
    x = torch.arange(1.0, 5.0).reshape(2, 2)
    on_one, on_mesh = x.clone().requires_grad_(), x.clone().requires_grad_()
    one = tp.pmap(tp.pmap(lambda v: v * tp.psum(v, "model"), axis_name="model"), axis_name="data", devices=devices[:1])(
        on_one
    )
    with mesh:
        out = fun(on_mesh)
    assert isinstance(out, ShardedTensor) and isinstance(out.shards[0].tensor, ShardedTensor)
    assert out.devices() == list(mesh.devices.flat)
    torch.as_tensor(one).pow(2).sum().backward()
    torch.as_tensor(out).pow(2).sum().backward()
    assert torch.equal(on_mesh.grad, on_one.grad)


def test_a_view_of_each_block_of_a_mesh_result_reads_as_the_view_of_the_whole(devices):
    # each shard a view of a nested ShardedTensor (what shard_map makes of a mesh result):
    # reading it once copied out of the view's meta tensor
    mesh = tp.Mesh(np.array(devices).reshape(2, 2), ("data", "model"))
    doubled = tp.pmap(tp.pmap(lambda v: v * 2, axis_name="model"), axis_name="data")
    with mesh:
        out = doubled(torch.arange(32.0).reshape(2, 2, 8))
    rows = out.map_shards(lambda block: block.reshape(1, 16), 0)
    want = torch.arange(32.0).reshape(2, 16) * 2
    assert torch.equal(torch.as_tensor(rows), want) and torch.equal(rows.clone(), want)
    assert torch.equal(rows.reshape(2, 2, 8).permute(2, 0, 1).clone(), want.reshape(2, 2, 8).permute(2, 0, 1))


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


# --------------------------------------------------------------------------- a tensor, or a refusal (issue 27)
#
# A ShardedTensor against a plain tensor with the same values, on 1 and on 4 devices (the
# `placement` fixture): hypothesis draws the values' shape, where the shards split, the
# indices and the ops.

import io  # noqa: E402

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@st.composite
def sharded_values(draw, n_devices):
    """(plain tensor, shard dim, shard sizes): a 2-D value split into n_devices shards."""
    dim = draw(st.sampled_from([0, 1]))
    sizes = [draw(st.integers(1, 3)) for _ in range(n_devices)]
    other = draw(st.integers(1, 4))
    shape = (sum(sizes), other) if dim == 0 else (other, sum(sizes))
    x = torch.arange(float(shape[0] * shape[1])).reshape(shape) - 3
    return x, dim, sizes


def make_sharded(devices, x, dim, sizes, requires_grad=False):
    parts = x.split(sizes, dim)
    return ShardedTensor([(d, p.clone().requires_grad_(requires_grad)) for d, p in zip(devices, parts)], dim)


def _outcome(fn):
    """("ok", plain value) or ("raised", exception type)."""
    try:
        out = fn()
    except (IndexError, RuntimeError, ValueError, TypeError) as e:
        return "raised", type(e)
    return "ok", torch.as_tensor(out).detach().clone() if not isinstance(
        out, ShardedTensor
    ) else out.gather().detach().clone()


def _same_outcome(got, want, what):
    assert got[0] == want[0], (what, got, want)
    if got[0] == "raised":
        assert got[1] is want[1] or issubclass(got[1], want[1]), (what, got, want)
    else:
        assert got[1].dtype == want[1].dtype and torch.equal(got[1], want[1]), (what, got, want)


bound = st.integers(-7, 7)
index_parts = st.one_of(
    bound,
    st.builds(slice, st.none() | bound, st.none() | bound, st.none() | st.integers(1, 3)),
    st.just(None),
    st.just(Ellipsis),
    st.lists(st.integers(-7, 6), min_size=1, max_size=3).map(torch.tensor),
)
indices = st.one_of(index_parts, st.lists(index_parts, min_size=1, max_size=3).map(tuple))


@SETTINGS
@given(data=st.data())
def test_indexing_is_torchs_bounds_checks_included(placement, data):
    """st[10] on 4 rows returned row 2, st[-5] row 3 (the index was taken modulo the length)."""
    x, dim, sizes = data.draw(sharded_values(len(placement)))
    sharded = make_sharded(placement, x, dim, sizes)
    index = data.draw(indices)
    _same_outcome(_outcome(lambda: sharded[index]), _outcome(lambda: x[index]), index)


def test_the_issues_out_of_range_rows_raise(placement):
    x = torch.arange(12.0).reshape(4, 3)
    sharded = make_sharded(placement, x, 0, [4] if len(placement) == 1 else [1, 1, 1, 1])
    for bad in (10, -5, 4):
        with pytest.raises(IndexError, match=f"index {bad} is out of bounds for dimension 0 with size 4"):
            sharded[bad]
    assert torch.equal(sharded[-4], x[0]) and torch.equal(sharded[3], x[3])


VIEWS = {
    "view(-1)": lambda t: t.view(-1),
    "reshape": lambda t: t.reshape(t.shape[1], t.shape[0]),
    "flatten": lambda t: t.flatten(),
    "t()": lambda t: t.t(),
    "transpose": lambda t: t.transpose(0, 1),
    "rows 1:": lambda t: t[1:],
    "every other column": lambda t: t[:, ::2],
    "select": lambda t: t.select(1, 0),
    "narrow": lambda t: t.narrow(0, 0, 1),
    "unsqueeze": lambda t: t.unsqueeze(0),
    "detach": lambda t: t.detach(),
    "diagonal": lambda t: t.diagonal(),
    "unbind": lambda t: t.unbind(1)[0],
    "a view of a view": lambda t: t.t()[1:].view(-1) if t.t()[1:].is_contiguous() else t.t()[1:],
}
WRITES = {
    "add_": lambda v: v.add_(100),
    "mul_": lambda v: v.mul_(-2),
    "fill_": lambda v: v.fill_(7),
    "zero_": lambda v: v.zero_(),
    "setitem": lambda v: (v.__setitem__(0, 42.0), v)[1],
    "copy_": lambda v: v.copy_(torch.full(v.shape, 9.0)),
    "clamp_": lambda v: v.clamp_(min=1.0),
}


@SETTINGS
@given(data=st.data())
def test_writes_through_a_view_reach_the_shards(placement, data):
    """A write through st.view(-1) did not reach st (the view was of a gathered copy)."""
    x, dim, sizes = data.draw(sharded_values(len(placement)))
    sharded = make_sharded(placement, x, dim, sizes)
    view, write = data.draw(st.sampled_from(sorted(VIEWS))), data.draw(st.sampled_from(sorted(WRITES)))
    plain = x.clone()
    want = _outcome(lambda: WRITES[write](VIEWS[view](plain)))
    got = _outcome(lambda: WRITES[write](VIEWS[view](sharded)))
    _same_outcome(got, want, (view, write))
    assert torch.equal(sharded.gather(), plain), (view, write)  # the write reached the shards
    assert torch.equal(torch.cat([s.tensor for s in sharded.shards], dim), plain)
    if want[0] == "ok":  # and a view made before a write to the base sees it
        later = VIEWS[view](sharded)
        sharded.add_(1)
        plain.add_(1)
        assert torch.equal(torch.as_tensor(later * 1), VIEWS[view](plain) * 1), view


OPS = {
    "neg": lambda t: -t,
    "add scalar": lambda t: t + 1.5,
    "times itself": lambda t: t * t,
    "sum over 0": lambda t: t.sum(0),
    "mean over 1": lambda t: t.mean(1),
    "max": lambda t: t.max(),
    "matmul": lambda t: t @ torch.ones(t.shape[1], 2),
    "compare": lambda t: t > 0,
    "cumsum": lambda t: t.cumsum(0),
    "where": lambda t: torch.where(t > 0, t, -t),
    "to int": lambda t: t.to(torch.int32),
}
IN_PLACE = {
    "add_": lambda t: t.add_(torch.ones(t.shape[1])),
    "masked_fill_": lambda t: t.masked_fill_(t > 2, -1.0),
    "setitem row": lambda t: (t.__setitem__(1, 5.0), t)[1],
    "setitem out of range": lambda t: (t.__setitem__(99, 5.0), t)[1],
    "setitem mask": lambda t: (t.__setitem__(t < 0, 0.0), t)[1],
    "index_put_": lambda t: t.index_put_((torch.tensor([0]),), torch.tensor(8.0)),
    "exp_": lambda t: t.exp_(),
}


@SETTINGS
@given(data=st.data())
def test_ops_and_in_place_ops_give_a_tensors_answers(placement, data):
    x, dim, sizes = data.draw(sharded_values(len(placement)))
    sharded = make_sharded(placement, x, dim, sizes)
    op = data.draw(st.sampled_from(sorted(OPS)))
    _same_outcome(_outcome(lambda: OPS[op](sharded)), _outcome(lambda: OPS[op](x)), op)
    name = data.draw(st.sampled_from(sorted(IN_PLACE)))
    plain = x.clone()
    _same_outcome(_outcome(lambda: IN_PLACE[name](sharded)), _outcome(lambda: IN_PLACE[name](plain)), name)
    assert torch.equal(sharded.gather(), plain), name


def test_in_place_ops_follow_autograds_rules_for_leaves(placement):
    """Shards that are leaves requiring grad: the ShardedTensor is their memory, so an
    in-place op on it is one on a view of a leaf, which autograd refuses (it was
    accepted, and wrote into the leaves)."""
    x = torch.arange(8.0).reshape(4, 2)
    sizes = [4] if len(placement) == 1 else [1, 1, 1, 1]
    leaf = x.clone().requires_grad_()
    with pytest.raises(RuntimeError, match="a view of a leaf Variable that requires grad"):
        leaf.view(4, 2).add_(1)
    sharded = make_sharded(placement, x, 0, sizes, requires_grad=True)
    for write in (lambda t: t.add_(1), lambda t: t.view(-1).mul_(2), lambda t: t.__setitem__(0, 3.0)):
        with pytest.raises(RuntimeError, match="shards are leaf tensors that require grad"):
            write(sharded)
        assert torch.equal(sharded.gather(), x)  # nothing was written
    with torch.no_grad():  # as for a leaf: allowed without grad mode
        sharded.add_(1)
        leaf.add_(1)
    assert torch.equal(sharded.gather(), leaf.detach())
    (sharded * sharded).sum().backward()
    assert torch.equal(torch.cat([s.tensor.grad for s in sharded.shards]), 2 * leaf.detach())


def test_a_write_through_a_view_of_a_pmap_result_is_differentiated_as_on_one_device(placement):
    x = torch.arange(1.0, 9.0).reshape(4, 2)
    grads = []
    for devices in (placement[:1], placement):
        a, w = x.clone().requires_grad_(), torch.tensor(3.0, requires_grad=True)
        y = tp.pmap(lambda v: v * 2, devices=devices)(a)
        flat = y.view(-1)
        flat[1:3] = w * 5
        y.t().mul_(torch.tensor([[1.0], [2.0]]))
        ((torch.as_tensor(y) ** 2) * torch.arange(8.0).reshape(4, 2)).sum().add(flat.sum()).backward()
        grads.append((torch.as_tensor(y).detach(), a.grad, w.grad))
    assert isinstance(y, ShardedTensor) == (len(placement) > 1)
    for one, many in zip(*grads):
        assert torch.equal(one, many)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda d: [], "needs at least one shard"),
        (lambda d: [(d[0], torch.tensor(1.0)), (d[-1], torch.tensor(2.0))], "0-d tensors"),
        (
            lambda d: [(d[0], torch.zeros(2)), (d[-1], torch.zeros(2, dtype=torch.int64))],
            "shard 1 has dtype torch.int64, shard 0 has torch.float32",
        ),
        (
            lambda d: [(d[0], torch.zeros(2, 3)), (d[-1], torch.zeros(2, 4))],
            r"shard 1 has shape \(2, 4\), shard 0 has \(2, 3\)",
        ),
        (lambda d: [(d[0], torch.zeros(2, 3)), (d[-1], torch.zeros(2))], "shard 1 has rank 1, shard 0 has 2"),
        (lambda d: [(d[0], torch.zeros(2, 2)), (d[-1], torch.zeros(2, 2).to_sparse())], "layout"),
        (lambda d: [(d[0], torch.zeros(2))], "dim=1 is not a dim"),
        (lambda d: [("cpu:0", torch.zeros(2))], r"shard 0 is \(str, Tensor\)"),
    ],
)
def test_construction_checks_the_shards(placement, make, message):
    dim = 1 if "dim=1" in message else 0
    with pytest.raises((ValueError, TypeError), match=message):
        ShardedTensor(make(placement), dim)


@pytest.mark.parametrize("op", [
    lambda t: t.resize_(8), lambda t: t.t_(), lambda t: t.unsqueeze_(0), lambda t: t.swapdims_(0, 1),
    lambda t: t.view(-1).resize_(3), lambda t: t.as_strided_((2,), (1,)),
])
def test_ops_that_would_change_its_shape_in_place_are_refused(placement, op):
    """resize_ failed deep inside split_with_sizes; t_ on a square one rewrote the shards
    with the transposed values."""
    x = torch.arange(16.0).reshape(4, 4)
    sharded = make_sharded(placement, x, 0, [4] if len(placement) == 1 else [1, 1, 1, 1])
    with pytest.raises(RuntimeError, match="cannot change its shape or strides in place.*st.gather"):
        op(sharded)
    assert torch.equal(sharded.gather(), x) and sharded.shape == (4, 4)
    sharded.resize_(4, 4)  # the same size: nothing changes, as on a tensor


def test_it_saves_and_loads_with_weights_only(placement):
    x = torch.arange(8.0).reshape(4, 2)
    sharded = make_sharded(placement, x, 0, [4] if len(placement) == 1 else [1, 1, 1, 1])
    columns = placement[:2]  # two columns: one or two shards along dim 1
    leaf = make_sharded(columns, x, 1, [2] if len(columns) == 1 else [1, 1]).requires_grad_()
    buffer = io.BytesIO()
    torch.save({"st": sharded, "leaf": leaf, "view": sharded.view(-1)}, buffer)
    buffer.seek(0)
    back = torch.load(buffer, weights_only=True)
    assert isinstance(back["st"], ShardedTensor) and back["st"].devices() == sharded.devices()
    assert torch.equal(back["st"], sharded) and back["st"].shard_dim == 0
    assert back["leaf"].requires_grad and back["leaf"].shard_dim == 1 and torch.equal(back["leaf"].gather().detach(), x)
    assert type(back["view"]) is torch.Tensor and torch.equal(back["view"], x.view(-1))  # a view is saved as its value


def test_a_result_made_under_inference_mode_reads_as_a_tensor(four_devices):
    """``torch.as_tensor`` of a ShardedTensor made under ``inference_mode`` dispatches
    ``aten.to``, whose schema says it may alias: replayed as a view on a meta tensor it
    tried to copy meta data ("Cannot copy out of meta tensor"). One device returns a plain
    tensor there; now every placement reads the same values."""
    x = torch.arange(8.0).reshape(4, 2)
    with torch.inference_mode():
        y = tp.pmap(lambda v: v * 2)(x)
        inside = torch.as_tensor(y).cpu()
    torch.testing.assert_close(inside, x * 2)
    torch.testing.assert_close(torch.as_tensor(y).cpu(), x * 2)


def _user_ops_on_a_result(devices) -> tuple:
    """What a user does with a pmap result: conversions that change nothing (then a write
    into them), a save and load of a result that requires grad, nn.Parameter, deepcopy."""
    import io

    r = tp.pmap(lambda v: v * 1.0, devices=devices)(torch.ones(4, 2))
    for same in (lambda t: t.to(torch.float32), lambda t: t.to("cpu"), lambda t: t.cpu(), lambda t: t.to(t)):
        same(r).mul_(10)
    x = torch.ones(4, 3, requires_grad=True)
    out = tp.pmap(lambda v: v * 2, devices=devices)(x)
    buf = io.BytesIO()
    torch.save(out, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    (loaded * 3).sum().backward()
    param = torch.nn.Parameter(out)
    copied = copy.deepcopy(out.detach().requires_grad_())
    with pytest.raises(RuntimeError, match="deepcopy protocol"):
        copy.deepcopy(out)
    return (torch.as_tensor(r).sum().item(), loaded.is_leaf, loaded.grad.sum().item(),
            isinstance(param, torch.nn.Parameter), param.requires_grad, copied.requires_grad,
            r.to(torch.float64).dtype)


def test_what_users_do_with_a_result_matches_one_device(placement):
    """On several devices a no-op ``.to``/``.cpu()`` gathered a copy, so a write into it
    was lost; a saved result that requires grad loaded as a non-leaf without a gradient;
    ``nn.Parameter(result)`` raised; a deepcopy of a leaf dropped requires_grad."""
    assert _user_ops_on_a_result(placement) == (80000.0, True, 36.0, True, True, True, torch.float64)


ROW_READS = {
    "st[i]": lambda r: r[1],
    "st[i, j]": lambda r: r[2, 1],
    "st[i][j]": lambda r: r[1][0],
    "select along the rows": lambda r: r.select(0, 3),
    "select along the columns": lambda r: r.select(1, 0),
    "movedim": lambda r: r.movedim(0, 1),
    "unsqueeze": lambda r: r.unsqueeze(0),
    "a row's slice": lambda r: r[3][1:],
}
ROW_WRITES = {
    "mul_ by a value that requires grad": lambda v, w: v.mul_(w),
    "copy_ of a value that requires grad": lambda v, w: v.copy_(w * torch.ones(v.shape)),
    "add_ of a constant": lambda v, w: v.add_(10.0),
}


def _write_through_a_read_then_backward(devices, read, write, grad_x=True) -> tuple:
    x = torch.arange(1.0, 9.0).reshape(4, 2).requires_grad_(grad_x)
    w = torch.tensor(3.0, requires_grad=True)
    r = tp.pmap(lambda v: v.exp() * 2, devices=devices)(x)
    ROW_WRITES[write](ROW_READS[read](r), w)
    loss = (torch.as_tensor(r) * torch.arange(8.0).reshape(4, 2)).sum() + w
    loss.backward()
    return torch.as_tensor(r).detach(), x.grad, w.grad


@pytest.mark.parametrize("grad_x", [True, False], ids=["result requires grad", "result without grad"])
@pytest.mark.parametrize("write", sorted(ROW_WRITES))
@pytest.mark.parametrize("read", sorted(ROW_READS))
def test_a_write_through_a_row_or_a_moved_view_is_differentiated_as_on_one_device(devices, read, write, grad_x):
    """``st[i]``, ``select``, ``movedim`` and ``unsqueeze`` of a result handed out detached
    pieces of the shards: a write through one reached the values, but the gradient missed
    it on several devices (the mul_ case: x.grad summed to 60537 against one device's
    61353, and w.grad was None; into a result without grad, w.grad was 1 where one device
    gives 1 plus the write's part). Now they are autograd views of the result, as on one
    device; a row still reads its own shard, without a gather."""
    one = _write_through_a_read_then_backward(devices[:1], read, write, grad_x)
    many = _write_through_a_read_then_backward(devices, read, write, grad_x)
    for a, b in zip(one, many):
        assert (a is None) == (b is None), (read, write)
        if a is not None:
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-4, msg=(read, write))


def test_a_row_of_a_result_that_requires_grad_reads_its_own_shard(devices):
    """The view that makes a write differentiable does not gather: it is read from and
    written into the shard that holds the row, and its device is that shard's."""
    x = torch.arange(1.0, 9.0).reshape(4, 2).requires_grad_()
    r = tp.pmap(lambda v: v * 2, devices=devices)(x)
    row = r[3]
    assert isinstance(row, tp.ShardedView) and row.requires_grad
    assert row.device == r.shards[3].tensor.device
    assert row.local is not None and row.local.shard == 3
    row.mul_(0.5)
    assert torch.equal(r.shards[3].tensor.detach(), x[3:].detach())  # written where it lives


@pytest.mark.parametrize("leaf", [False, True], ids=["result", "leaf"])
def test_a_row_taken_under_no_grad_refuses_a_write_in_grad_mode_as_on_one_device(devices, leaf):
    """torch refuses to write, in grad mode, a view made under no_grad of a tensor that
    requires grad; several devices took such a row as the shard's own and wrote it (into
    a leaf that requires grad too). Under no_grad the write goes through, on both."""
    for placement in (devices[:1], devices):
        w = torch.ones(2, requires_grad=True)
        r = tp.pmap(lambda v: v * w, devices=placement)(torch.arange(8.0).reshape(4, 2))
        if leaf:
            r = r.detach().requires_grad_()
        with torch.no_grad():
            row, column = r[3], r.select(1, 0)
            row.mul_(2)
        if len(placement) > 1:
            assert row.device == r.shards[3].tensor.device  # read from its shard, no gather
        for view in (row, column):
            with pytest.raises(RuntimeError, match="created in no_grad mode"):
                view.mul_(2)
        assert torch.as_tensor(r.detach())[3].tolist() == [12.0, 14.0], placement


def test_a_row_taken_under_no_grad_refuses_a_value_that_requires_grad_as_on_one_device(devices):
    """Of a result without grad too: the write of a value that requires grad, in grad mode,
    through a row made under no_grad (several devices wrote it, unrecorded)."""
    for placement in (devices[:1], devices):
        r = tp.pmap(lambda v: v * 2, devices=placement)(torch.arange(8.0).reshape(4, 2))
        with torch.no_grad():
            row = r[1]
        with pytest.raises(RuntimeError, match="created in no_grad mode"):
            row.copy_(torch.ones(2, requires_grad=True))


def test_iterating_a_result_that_requires_grad_refuses_a_write_as_a_tensor_does(devices):
    """A tensor iterates through unbind's views, which refuse an in-place write (one
    device raised, several wrote and lost the write's gradient)."""
    for placement in (devices[:1], devices):
        r = tp.pmap(lambda v: v * 2, devices=placement)(torch.ones(4, 2, requires_grad=True))
        rows = list(r)
        assert [torch.equal(torch.as_tensor(row), torch.full((2,), 2.0)) for row in rows] == [True] * 4
        with pytest.raises(RuntimeError, match="output of a function that returns multiple views"):
            rows[2].mul_(2)


def _set_data(devices) -> tuple:
    """``r.data = t`` (as a module's conversion or old optimizer code does), then reads."""
    r = tp.pmap(lambda v: v * 2, devices=devices)(torch.ones(4, 2))
    t = torch.arange(8.0).reshape(4, 2)
    r.data = t
    t[0, 0] = 100.0  # the value's memory, where it is already on the shard's device (one process, CPU devices)
    x = torch.ones(4, 2, requires_grad=True)
    s = tp.pmap(lambda v: v * 3, devices=devices)(x)
    s.data = torch.full((4, 2), 5.0)
    (s * s).sum().backward()  # the history stays (d(3x)^2/dx with the value read now), as on a tensor
    if len(devices) > 1:  # a tensor takes another shape; the shards keep theirs, and say so
        with pytest.raises(ValueError, match=r"the value has shape \(2, 2\).*hold a \(4, 2\)"):
            r.data = torch.zeros(2, 2)
    return torch.as_tensor(r).tolist(), torch.as_tensor(s).tolist(), x.grad.tolist(), type(r.data) is type(r)


def test_setting_data_puts_the_value_in_the_shards(placement):
    """``r.data = t`` on several devices set the wrapper's data and left the shards: every
    read still gave the old values (16.0 summed where one device gives 28.0)."""
    got = _set_data(placement)
    assert got[:3] == _set_data(placement[:1])[:3]
    assert got[0][0][0] == 100.0 and got[1] == [[5.0, 5.0]] * 4 and got[2] == [[30.0, 30.0]] * 4


def _row_mul(r, x):
    r[1].mul_(3)


def _whole_mul(r, x):
    r.mul_(3)


def _set_row(r, x):
    r[1] = x[2].sum() * 5


AFTER_THE_FIRST = {"row mul_": _row_mul, "mul_": _whole_mul, "setitem": _set_row}


def _fed_back(devices, after, jit, hook) -> tuple:
    """A result that requires grad, touched (written, hooked) then fed to another pmap."""
    x = torch.arange(1.0, 13.0).reshape(4, 3).requires_grad_()
    r = tp.pmap(lambda v: v * 2, axis_name="i", devices=devices)(x)
    AFTER_THE_FIRST[after](r, x)
    seen = []
    if hook:
        r.register_hook(lambda g: seen.append(torch.as_tensor(g).sum().item()))
        r.retain_grad()
    q = tp.pmap(lambda v: v.exp() / 1e4 + tp.psum(v, "i"), axis_name="i", devices=devices, jit=jit)(r)
    (torch.as_tensor(q) * torch.arange(12.0).reshape(4, 3)).sum().backward()
    return x.grad, seen, torch.as_tensor(r.grad) if hook else None


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("hook", [False, True], ids=["", "hooked"])
@pytest.mark.parametrize("after", sorted(AFTER_THE_FIRST))
def test_a_result_fed_to_another_pmap_keeps_what_autograd_recorded_on_it(devices, after, hook, jit):
    """On several devices the second pmap took each shard's own tensor, skipping what
    autograd had recorded on the ShardedTensor since it was made: the gradient missed a
    write into it (x.grad row 1: 2 where one device gives 6), and its hooks and retain_grad
    never ran. It now takes the shards on the graph through the ShardedTensor."""
    one = _fed_back(devices[:1], after, jit, hook)
    many = _fed_back(devices, after, jit, hook)
    torch.testing.assert_close(many[0], one[0], rtol=1e-5, atol=1e-5)
    assert len(many[1]) == len(one[1]) and many[1] == pytest.approx(one[1], rel=1e-5)
    assert (many[2] is None) == (one[2] is None)
    if one[2] is not None:
        torch.testing.assert_close(many[2], one[2], rtol=1e-5, atol=1e-5)


def _parameter_fed_back(devices) -> tuple:
    """nn.Parameter of a result, fed to a pmap beside an input that requires grad."""
    p = torch.nn.Parameter(tp.pmap(lambda v: v * 1.0, devices=devices)(torch.ones(4, 3)))
    z = torch.ones(4, 3, requires_grad=True)
    tp.pmap(lambda a, b: a * b, devices=devices)(p, z).sum().backward()
    return None if p.grad is None else torch.as_tensor(p.grad).tolist(), z.grad.tolist()


def _written_inside(devices) -> tuple:
    """A pmap that writes its argument, a result that requires grad, in place."""
    x = torch.ones(4, 3, requires_grad=True)
    r = tp.pmap(lambda v: v * 2, devices=devices)(x)
    tp.pmap(lambda v: v.mul_(3), devices=devices)(r)
    (torch.as_tensor(r) * 1.0).sum().backward()
    return torch.as_tensor(r).tolist(), x.grad.tolist()


def test_a_parameter_or_a_write_inside_the_next_pmap_is_differentiated_as_on_one_device(devices):
    """nn.Parameter(result) fed to a pmap got no gradient on several devices (p.grad None,
    silently, beside another input that requires grad); a pmap that wrote into such a
    result in place left the write out of the gradient (x.grad 2 where one device gives 6)."""
    assert _parameter_fed_back(devices) == _parameter_fed_back(devices[:1])
    assert _written_inside(devices) == _written_inside(devices[:1])


def test_a_mesh_result_fed_to_another_mesh_map_keeps_its_write_and_hook(four_devices):
    grids = ([[four_devices[0]]], [four_devices[:2], four_devices[2:]])
    outcomes = []
    for grid in grids:
        x = torch.ones(2, 2, 3, requires_grad=True)
        with tp.Mesh(grid, ("x", "y")):
            r = tp.pmap(tp.pmap(lambda v: v * 2.0, axis_name="y"), axis_name="x")(x)
            r[1].mul_(3)
            seen = []
            r.register_hook(lambda g: seen.append(torch.as_tensor(g).sum().item()))
            q = tp.pmap(tp.pmap(lambda v: tp.psum(v, "y") * 1.0, axis_name="y"), axis_name="x")(r)
        q.sum().backward()
        outcomes.append((x.grad.sum().item(), seen))
    assert outcomes[1] == outcomes[0] == (96.0, [24.0])


VIEW_ARGUMENTS = {
    "r.t()": lambda r: r.t(),
    "r[2:6]": lambda r: r[2:6],
    "r[1]": lambda r: r[1],
    "r.view(-1, 2)": lambda r: r.view(-1, 2),
}


def _view_argument_written(devices, view, requires_grad) -> tuple:
    x = torch.arange(32.0).reshape(8, 4).requires_grad_(requires_grad)
    r = tp.pmap(lambda v: v * 1.0, devices=devices)(x)
    tp.pmap(lambda v: v.mul_(2).add_(1), devices=devices)(VIEW_ARGUMENTS[view](r))
    if requires_grad:
        (torch.as_tensor(r) ** 2).sum().backward()
    return torch.as_tensor(r).tolist(), None if x.grad is None else x.grad.tolist()


@pytest.mark.parametrize("requires_grad", [False, True], ids=["", "requires grad"])
@pytest.mark.parametrize("view", sorted(VIEW_ARGUMENTS))
def test_a_pmap_writing_a_view_of_a_result_writes_the_result(devices, view, requires_grad):
    """A ShardedView argument (``r.t()``, ``r[2:6]``, a row) reached the device threads as
    itself (``.to()`` onto its own device returns it), and their writes through it were
    lost: r summed 0 where one device gives 16. It is now read as its value, and a write
    is written back into the result, recorded by autograd."""
    assert _view_argument_written(devices, view, requires_grad) == _view_argument_written(
        devices[:1], view, requires_grad
    )


def test_a_result_passed_unmapped_is_read_once_and_a_write_into_it_refused(devices):
    """A ShardedTensor passed with ``in_axes=None`` was gathered by every device into a
    copy of its own: a write into it raised nothing on several devices (one device's plain
    tensor raises SharedWrite) and reached nothing. It is gathered once now; reading it is
    differentiable as before."""
    for placement in (devices[:1], devices):
        r = tp.pmap(lambda v: v * 1.0, devices=placement)(torch.zeros(4, 3))
        with pytest.raises(RuntimeError, match="argument .w. .*in_axes None"):
            tp.pmap(lambda v, w: v + w.add_(1), devices=placement, in_axes=(0, None))(torch.zeros(4, 3), r)
    grads = []
    for placement in (devices[:1], devices):
        x = torch.arange(12.0).reshape(4, 3).requires_grad_()
        w = tp.pmap(lambda v: v * 2.0, devices=placement)(x)
        out = tp.pmap(lambda v, w: (v * w).sum(), devices=placement, in_axes=(0, None))(torch.ones(4, 4, 3), w)
        out.sum().backward()
        grads.append(x.grad)
    torch.testing.assert_close(grads[1], grads[0])


#: Two arguments viewing one result, each mapped along the result's rows: in_axes, the views.
ALIASED_ARGUMENTS = {
    "a column twice": ((0, 0), lambda r: (r[:, 0], r[:, 0])),
    "the result and its transpose": ((0, 1), lambda r: (r, r.t())),
    "the result and a column": ((0, 0), lambda r: (r, r[:, 1])),
    "overlapping column windows": ((0, 0), lambda r: (r[:, :2], r[:, 1:])),
}


def _aliased_arguments_written(devices, case, n, requires_grad) -> tuple:
    """A function that writes through its first argument and reads (and writes) the second;
    returns the result, the caller's tensor and the gradients."""
    in_axes, views = ALIASED_ARGUMENTS[case]
    x = torch.arange(n * 3.0).reshape(n, 3).requires_grad_(requires_grad)
    w = torch.tensor(2.0, requires_grad=requires_grad)
    r = tp.pmap(lambda v: v * 1.0, devices=devices)(x)
    out = tp.pmap(lambda a, b: a.mul_(w).sum() * b.add_(1).sum(), devices=devices, in_axes=in_axes)(*views(r))
    if requires_grad:
        (torch.as_tensor(out).sum() + (torch.as_tensor(r) ** 2).sum()).backward()
    grads = None if x.grad is None else (x.grad.tolist(), w.grad.item())
    return torch.as_tensor(out).tolist(), torch.as_tensor(r).tolist(), grads


@pytest.mark.parametrize("requires_grad", [False, True], ids=["", "requires grad"])
@pytest.mark.parametrize("n", [4, 8])
@pytest.mark.parametrize("case", sorted(ALIASED_ARGUMENTS))
def test_arguments_viewing_one_result_share_its_memory_as_on_one_device(devices, case, n, requires_grad):
    """Each view reached the device threads as a copy of its own: a write through one was
    not seen through the other, and one of two writes was lost in the caller's tensor
    (overlapping windows: [[1, 2, 4], ...] where one device gives [[1, 4, 4], ...]). A
    view that is its op on each shard (a column, a transpose) is now taken as a view of the
    device's shard; with grad, of one split of the result shared by both arguments, so
    that autograd sees the write through either. A function that saved what it wrote
    raised "modified by an inplace operation" on several devices at the write-back."""
    want = _aliased_arguments_written(devices[:1], case, n, requires_grad)
    assert _aliased_arguments_written(devices, case, n, requires_grad) == want


def _numpy_conversions(devices) -> list:
    """What numpy makes of a result (and its row), with and without grad."""
    import numpy as np

    def outcome(f) -> str:
        try:
            return type(f()).__name__
        except (RuntimeError, ValueError) as error:
            return f"{type(error).__name__}: {str(error)[:40]}"

    outcomes = []
    for requires_grad in (False, True):
        x = torch.arange(12.0).reshape(4, 3).requires_grad_(requires_grad)
        r = tp.pmap(lambda v: v * 3 + 1, devices=devices)(x)
        for f in (r.numpy, lambda: np.asarray(r), lambda: r[1].numpy(), lambda: np.array(r, copy=False),
                  lambda: np.array(r[1], copy=False), lambda: r.numpy(force=True), r.tolist):
            outcomes.append(outcome(f))
    return outcomes


def test_numpy_refuses_what_it_refuses_on_one_device(devices):
    """``.numpy()`` of a result that requires grad, and ``np.array(r, copy=False)``, raised
    on one device (torch's and numpy's errors) and returned arrays on several."""
    assert _numpy_conversions(devices) == _numpy_conversions(devices[:1])
