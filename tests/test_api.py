"""The public API of pmap/vmap, checked against plain torch loops over the instances.

Runs with one device and with ``TORCHPMAP_NUM_CPU_DEVICES=4``: results are compared
through ``torch.as_tensor`` (a multi-device pmap returns ``tp.ShardedTensor``), and a
torch.func transform around a pmap runs it on one device.
"""
from __future__ import annotations

import collections
import functools
import warnings

import numpy as np
import pytest
import torch

import torchpmap as tp

ONE_DEVICE = tp.devices()[:1]
X4 = torch.arange(4.0)


def t(x) -> torch.Tensor:
    """A pmap result as a plain tensor on the CPU, where the expected values are computed
    (gathers a ShardedTensor; on a CUDA machine the results are on the GPU)."""
    assert isinstance(x, (torch.Tensor, tp.ShardedTensor)), type(x)
    return torch.as_tensor(x).cpu()


def loop(fn, *args, in_axes=None, size=None):
    """``fn`` run once per instance in plain Python, outputs stacked along dim 0."""
    in_axes = in_axes if in_axes is not None else (0,) * len(args)
    size = size or next(a.shape[d] for a, d in zip(args, in_axes) if d is not None)
    outs = [fn(*(a if d is None else a.select(d, k) for a, d in zip(args, in_axes))) for k in range(size)]
    return torch.stack(outs)


def assert_same(got, expected):
    torch.testing.assert_close(t(got), expected)


# --------------------------------------------------------------------------- decorator forms


def test_plain_decorator():
    @tp.pmap
    def double(x):
        return x * 2 + 1

    x = torch.arange(12.0).reshape(4, 3)
    assert_same(double(x), loop(lambda r: r * 2 + 1, x))


def test_partial_decorator_with_axis_name():
    @functools.partial(tp.pmap, axis_name="i")
    def normalize(x):
        return x / tp.psum(x, "i")

    x = torch.tensor([1.0, 3.0, 4.0, 8.0])
    assert_same(normalize(x), x / x.sum())


def test_pmap_without_function_is_a_decorator_factory():
    @tp.pmap(axis_name="i", in_axes=(0, None))
    def scaled_total(x, k):
        return tp.psum(x, "i") * k

    assert_same(scaled_total(X4, torch.tensor(2.0)), torch.full((4,), 12.0))


def test_axis_name_as_second_positional_argument():
    assert_same(tp.pmap(lambda x: tp.pmean(x, "i"), "i")(X4), torch.full((4,), 1.5))


def test_vmap_decorator_forms():
    @functools.partial(tp.vmap, axis_name="b")
    def share(x):
        return x / tp.psum(x, "b")

    assert_same(share(torch.tensor([1.0, 3.0])), torch.tensor([0.25, 0.75]))
    assert_same(tp.vmap(axis_name="b")(lambda x: tp.psum(x, "b"))(X4), torch.full((4,), 6.0))


def test_wrapper_keeps_name_and_doc():
    def documented(x):
        """Doubles x."""
        return 2 * x

    f = tp.pmap(documented, axis_name="i")
    assert f.__name__ == "documented"
    assert f.__doc__ == "Doubles x."
    assert f.__wrapped__ is documented


def test_repr_names_the_transform_the_function_and_the_axis():
    def step(x):
        return x

    r = repr(tp.pmap(step, axis_name="batch"))
    assert "pmap" in r and "step" in r and "'batch'" in r, r
    r = repr(tp.vmap(step, axis_name="b"))
    assert "vmap" in r and "step" in r and "'b'" in r, r


# --------------------------------------------------------------------------- arguments


def test_keyword_arguments_are_mapped_over_axis_0():
    x, y = torch.arange(12.0).reshape(4, 3), torch.arange(8.0).reshape(4, 2)
    out = tp.pmap(lambda x, y: x.sum() * y, in_axes=(1,))(x.T, y=y)
    assert_same(out, loop(lambda a, b: a.sum() * b, x, y))


def test_keyword_pytree_arguments_are_mapped_over_axis_0():
    d = {"a": torch.arange(4.0), "b": torch.ones(4, 2)}
    out = tp.pmap(lambda x, d: x + d["a"] + d["b"].sum())(X4, d=d)
    assert_same(out, X4 + d["a"] + 2)


def test_static_arguments_are_passed_untouched():
    tag = ("scale", 3)
    seen = []

    def f(x, s):
        seen.append(s)
        return x * s[1]

    out = tp.pmap(f, static_broadcasted_argnums=1)(X4, tag)
    assert_same(out, X4 * 3)
    assert seen and all(s is tag for s in seen)


def test_static_arguments_keep_in_axes_indexed_by_original_position():
    x = torch.arange(12.0).reshape(3, 4)  # mapped along axis 1
    y = torch.arange(4.0)  # mapped along axis 0
    c = torch.tensor([1.0, -1.0, 2.0])  # broadcast
    # The entry at the static position (1) is ignored, whatever it is.
    f = tp.pmap(lambda x, n, y, c: (x * c).sum() * n + y, in_axes=(1, 0, 0, None), static_broadcasted_argnums=1)
    assert_same(f(x, 10, y, c), loop(lambda a, b: (a * c).sum() * 10 + b, x, y, in_axes=(1, 0)))


def test_negative_static_argnums_count_from_the_end():
    assert_same(tp.pmap(lambda x, n: x * n, static_broadcasted_argnums=-1)(X4, 5), X4 * 5)


def test_static_string_argument_is_not_converted():
    f = tp.pmap(lambda x, mode: x + (1.0 if mode == "plus" else -1.0), static_broadcasted_argnums=(1,))
    assert_same(f(X4, "plus"), X4 + 1)
    assert_same(f(X4, "minus"), X4 - 1)


def test_numpy_inputs_become_tensors():
    kinds = []

    def f(x, y):
        kinds.append((type(x), type(y)))
        return x * y.sum()

    x, y = np.arange(4.0), np.ones(3)
    out = tp.pmap(f, in_axes=(0, None))(x, y)
    assert kinds and all(issubclass(kx, torch.Tensor) and issubclass(ky, torch.Tensor) for kx, ky in kinds)
    assert t(out).dtype == torch.float64  # numpy's dtype is kept
    assert_same(out, torch.as_tensor(x) * 3.0)


def test_numpy_int_input_keeps_its_dtype():
    out = tp.pmap(lambda x: x * 2)(np.arange(8, dtype=np.int32).reshape(4, 2))
    assert t(out).dtype == torch.int32
    assert t(out).tolist() == (np.arange(8).reshape(4, 2) * 2).tolist()


Pair = collections.namedtuple("Pair", "a b")


def test_namedtuple_in_and_out():
    p = Pair(a=torch.arange(4.0), b=torch.arange(8.0).reshape(4, 2))
    out = tp.pmap(lambda p: Pair(a=p.b * p.a, b=p.a + 1))(p)
    assert type(out) is Pair
    assert_same(out.a, p.b * p.a[:, None])
    assert_same(out.b, p.a + 1)


def test_nested_dict_list_tuple_pytrees_in_and_out():
    tree = {"w": [torch.arange(4.0), (torch.ones(4, 3), torch.arange(8.0).reshape(2, 4))], "k": torch.tensor(2.0)}
    in_axes = ({"w": [0, (0, 1)], "k": None},)

    def f(tree):
        a, (b, c) = tree["w"]
        return {"sum": (a * tree["k"], b.sum() + c.sum()), "list": [c * a]}

    out = tp.pmap(f, in_axes=in_axes)(tree)
    a, (b, c) = tree["w"]
    assert set(out) == {"sum", "list"} and isinstance(out["sum"], tuple) and isinstance(out["list"], list)
    assert_same(out["sum"][0], a * 2)
    assert_same(out["sum"][1], loop(lambda bb, cc: bb.sum() + cc.sum(), b, c, in_axes=(0, 1)))
    assert_same(out["list"][0], loop(lambda cc, aa: cc * aa, c, a, in_axes=(1, 0)))


@pytest.mark.parametrize("jit", [False, True])
def test_dicts_of_tensors_keep_their_keys_whatever_the_order(jit):
    """Dicts of tensors (a model's parameters) take a fast path around pytree: the same
    keys in another insertion order, other keys, non-string keys and mixed values must all
    still reach the function as given, with their own in_axes prefixes."""
    one_device = tp.devices()[:1] if jit else None  # compiled on one device (several run eagerly, with a warning)
    f = tp.pmap(lambda d, x: {k: v * x for k, v in d.items()}, in_axes=(None, 0), jit=jit, devices=one_device)
    x = torch.arange(4.0)
    for d in (
        {"a": torch.tensor(1.0), "b": torch.tensor(10.0)},
        {"b": torch.tensor(10.0), "a": torch.tensor(1.0)},  # same keys, other order
        {"a": torch.tensor(2.0), "c": torch.tensor(3.0)},
        {1: torch.tensor(5.0), "1": torch.tensor(7.0)},  # keys that are no strings: pytree
        {"a": torch.tensor(1.0), "n": 3.0},  # a value that is no tensor: pytree
    ):
        out = f(d, x)
        assert list(out) == list(d)
        for k, v in d.items():
            assert_same(out[k], torch.as_tensor(v) * x)
    # a mapped dict, its keys in two orders, with a per-key prefix
    g = tp.pmap(lambda d: d["m"] - d["s"], in_axes=({"m": 0, "s": None},))
    m, s = torch.arange(4.0), torch.tensor(1.5)
    assert_same(g({"m": m, "s": s}), m - s)
    assert_same(g({"s": s, "m": m}), m - s)


def test_dict_outputs_keep_their_keys_and_out_axes():
    x = torch.arange(8.0).reshape(4, 2)
    f = tp.pmap(lambda r: {"b": r, "a": r.sum()}, out_axes={"b": 1, "a": None})
    for _ in range(2):  # the second call reuses the stacking plan of the first
        out = f(x)
        assert list(out) == ["b", "a"]
        assert_same(out["b"], x.T)
        assert_same(out["a"], x[0].sum())
    nested = tp.pmap(lambda r: {"a": {"in": r}, "b": r})(x)  # not a flat dict: pytree
    assert_same(nested["a"]["in"], x)
    assert_same(nested["b"], x)


def test_dict_prefix_with_none_broadcasts_a_subtree():
    d = {"a": torch.arange(4.0), "b": torch.tensor([10.0, 20.0])}
    out = tp.pmap(lambda d: d["a"] * d["b"], in_axes=({"a": 0, "b": None},))(d)
    assert_same(out, d["a"][:, None] * d["b"])


def test_none_leaves_in_outputs_stay_none():
    out = tp.pmap(lambda x: (x, None, {"a": None, "b": x + 1}))(X4)
    assert out[1] is None and out[2]["a"] is None
    assert_same(out[0], X4)
    assert_same(out[2]["b"], X4 + 1)


@pytest.mark.parametrize("const, dtype", [(3, torch.int64), (3.5, torch.float32), (True, torch.bool)])
def test_constant_outputs_are_broadcast(const, dtype):
    out = t(tp.pmap(lambda x: const)(X4))
    assert out.dtype == dtype
    assert out.tolist() == [const] * 4


def test_constant_tensor_output_is_broadcast_along_the_axis():
    out = tp.pmap(lambda x: (x, torch.ones(2)))(X4)
    assert_same(out[1], torch.ones(4, 2))


def test_out_axes_none_returns_instance_0():
    out = tp.pmap(lambda x: x * 10 + 1, out_axes=None)(X4)
    assert isinstance(out, torch.Tensor) and out.shape == ()
    assert out.item() == 1.0  # instance 0's value, unchecked, as in JAX


def test_out_axes_none_on_a_psum():
    total, per = tp.pmap(lambda x: (tp.psum(x, "i"), x), axis_name="i", out_axes=(None, 0))(X4)
    assert total.shape == () and total.item() == 6.0
    assert_same(per, X4)


def test_out_axes_prefix_for_a_dict():
    x = torch.arange(8.0).reshape(4, 2)
    out = tp.pmap(lambda r: {"row": r, "col": r}, out_axes={"row": 0, "col": 1})(x)
    assert_same(out["row"], x)
    assert_same(out["col"], x.T)


def test_negative_in_axes_are_normalized():
    x = torch.arange(40.0).reshape(2, 4, 5)
    assert_same(tp.pmap(lambda r: r * 2, in_axes=-2)(x), t(tp.pmap(lambda r: r * 2, in_axes=1)(x)))
    assert_same(tp.pmap(lambda r: r * 2, in_axes=-2)(x), (x * 2).movedim(1, 0))
    y = x.movedim(1, 2)  # (2, 5, 4)
    assert_same(tp.pmap(lambda r: r.sum(0), in_axes=-1)(y), loop(lambda r: r.sum(0), y, in_axes=(2,)))


def test_negative_out_axes_are_normalized():
    x = torch.arange(12.0).reshape(4, 3)
    out = tp.pmap(lambda r: r + 1, out_axes=-1)(x)
    assert t(out).shape == (3, 4)
    assert_same(out, (x + 1).T)
    assert_same(tp.pmap(lambda r: r.reshape(1, 3), out_axes=-2)(x), (x.reshape(4, 1, 3)).movedim(0, 1))


def test_in_axes_1_maps_columns():
    x = torch.arange(12.0).reshape(3, 4)
    assert_same(tp.pmap(lambda c: c * c.sum(), in_axes=1)(x), loop(lambda c: c * c.sum(), x, in_axes=(1,)))


def test_axis_size_without_mapped_arguments():
    f = tp.pmap(lambda c: c + tp.axis_index("i"), in_axes=None, axis_name="i", axis_size=4)
    assert_same(f(torch.tensor(10.0)), torch.tensor([10.0, 11.0, 12.0, 13.0]))
    g = tp.pmap(lambda: tp.axis_index("i") * tp.axis_size("i"), axis_name="i", axis_size=4)
    assert t(g()).tolist() == [0, 4, 8, 12]


def test_axis_size_that_matches_is_accepted():
    assert_same(tp.pmap(lambda x: x + 1, axis_size=4)(X4), X4 + 1)


def test_more_instances_than_devices():
    n = tp.device_count()
    x = torch.arange(float(8 * n)).reshape(8 * n, 1)
    f = tp.pmap(lambda r: r * tp.axis_size("i") + tp.psum(r, "i"), axis_name="i")
    assert_same(f(x), x * 8 * n + x.sum())


def test_collectives_agree_with_plain_torch():
    x = torch.arange(16.0).reshape(4, 4)

    def f(r):
        return (
            tp.psum(r, "i"),
            tp.pmean(r, "i"),
            tp.pmax(r, "i"),
            tp.all_gather(r, "i"),
            tp.ppermute(r, "i", [(j, (j + 1) % 4) for j in range(4)]),
            tp.all_to_all(r, "i", 0, 0),
            tp.psum_scatter(r, "i"),
            tp.axis_index("i"),
        )

    s, m, mx, g, p, a2a, ps, idx = tp.pmap(f, axis_name="i")(x)
    assert_same(s, x.sum(0).expand(4, 4))
    assert_same(m, x.mean(0).expand(4, 4))
    assert_same(mx, x.amax(0).expand(4, 4))
    assert_same(g, x.expand(4, 4, 4))
    assert_same(p, x.roll(1, 0))
    assert_same(a2a, x.T)
    assert_same(ps, x.sum(0))
    assert t(idx).tolist() == [0, 1, 2, 3]


def test_backward_through_a_pmap_matches_a_loop():
    x = torch.arange(1.0, 5.0, requires_grad=True)
    out = tp.pmap(lambda v: tp.psum(v * v, "i") * v, axis_name="i")(x)
    out.sum().backward()
    xr = x.detach().clone().requires_grad_()
    ((xr * xr).sum() * xr).sum().backward()
    torch.testing.assert_close(x.grad, xr.grad)


def test_result_as_tensor_keeps_the_autograd_graph():
    # torch.as_tensor is how results are compared; on a result that requires grad it must
    # not silently drop the graph (a training loop would then learn nothing).
    x = torch.arange(1.0, 5.0, requires_grad=True)
    out = tp.pmap(lambda v: v * v)(x)
    converted = torch.as_tensor(out)
    assert converted.requires_grad, "torch.as_tensor(pmap result) silently detached it"
    converted.sum().backward()
    torch.testing.assert_close(x.grad, 2 * x.detach())


def test_grad_inside_pmap_with_pmean_is_a_data_parallel_step():
    w, x = torch.tensor(2.0), torch.arange(4.0)
    loss = lambda w, x: ((x * w) ** 2).sum()  # noqa: E731
    step = tp.pmap(lambda w, x: tp.pmean(torch.func.grad(loss)(w, x), "i"), axis_name="i", in_axes=(None, 0))
    per_shard = torch.stack([torch.func.grad(loss)(w, x[k]) for k in range(4)])
    assert_same(step(w, x), per_shard.mean().expand(4))
    assert_same(step(w, x), torch.full((4,), 14.0))  # the reference's number


def test_grad_around_pmap_on_one_device_sums_broadcast_cotangents():
    f = tp.pmap(lambda w, x: ((x * w) ** 2).sum(), in_axes=(None, 0), devices=ONE_DEVICE)
    g = torch.func.grad(lambda w: f(w, torch.arange(4.0)).sum())(torch.tensor(2.0))
    assert g.item() == 56.0  # the reference's number


def test_grad_around_pmap_on_any_number_of_devices():
    f = tp.pmap(lambda v: v * v)
    assert_same(torch.func.grad(lambda x: f(x).sum())(X4), 2 * X4)


# --------------------------------------------------------------------------- randomness


def _draws(randomness, devices=None, n=8):
    # tensors a function creates land where PyTorch puts them (the CPU unless told): on a
    # CUDA device, the draw names the instance's device, as plain PyTorch code would
    f = tp.pmap(lambda x: x + torch.rand(3, device=x.device), randomness=randomness, devices=devices)
    return t(f(torch.zeros(n, 3)))


def test_randomness_different_draws_differ_per_instance():
    out = _draws("different")
    assert len({tuple(row) for row in out.tolist()}) == out.shape[0], out


def test_randomness_different_is_reproducible_under_manual_seed_on_one_device():
    torch.manual_seed(1234)
    a = _draws("different", ONE_DEVICE)
    torch.manual_seed(1234)
    b = _draws("different", ONE_DEVICE)
    torch.manual_seed(4321)
    c = _draws("different", ONE_DEVICE)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert len({tuple(row) for row in a.tolist()}) == a.shape[0]


def test_randomness_different_is_the_default():
    f = tp.pmap(lambda x: x + torch.rand((), device=x.device), devices=ONE_DEVICE)
    out = t(f(torch.zeros(4)))
    assert len(set(out.tolist())) == 4


@pytest.mark.skipif(len({d.platform for d in tp.devices()}) > 1,
                    reason="CUDA and CPU devices together (TORCHPMAP_EXTRA_CPU_DEVICES): their generators differ")
def test_randomness_same_draws_equal_numbers_on_every_instance():
    out = _draws("same")
    assert torch.equal(out, out[0].expand_as(out)), out


def test_randomness_same_on_one_device():
    out = _draws("same", ONE_DEVICE)
    assert torch.equal(out, out[0].expand_as(out)), out


def test_randomness_error_refuses_random_ops():
    with pytest.raises(RuntimeError, match="randomness"):
        tp.pmap(lambda x: x + torch.rand(()), randomness="error")(X4)


def test_vmap_default_randomness_is_error():
    with pytest.raises(RuntimeError, match="randomness"):
        tp.vmap(lambda x: x + torch.rand(()))(X4)
    out = tp.vmap(lambda x: x + torch.rand(()), randomness="different")(torch.zeros(4))
    assert len(set(out.tolist())) == 4


def test_randomness_must_be_known():
    with pytest.raises(ValueError, match="randomness"):
        tp.pmap(lambda x: x, randomness="sometimes")


# --------------------------------------------------------------------------- donation


def test_donate_argnums_accepts_valid_positions_and_computes_the_same():
    x, y = torch.arange(4.0), torch.ones(4)
    out = tp.pmap(lambda x, y: x * 2 + y, donate_argnums=(0,))(x, y)
    assert_same(out, torch.arange(4.0) * 2 + 1)
    assert_same(tp.pmap(lambda x, y: x - y, donate_argnums=1)(x, y), x - y)


@pytest.mark.parametrize("bad", ["0", True, 0.5, [None]])
def test_donate_argnums_must_be_ints(bad):
    with pytest.raises(TypeError, match="donate_argnums"):
        tp.pmap(lambda x: x, donate_argnums=bad)


def test_donate_argnums_cannot_be_static():
    with pytest.raises(ValueError, match="static"):
        tp.pmap(lambda x, n: x * n, static_broadcasted_argnums=(1,), donate_argnums=(0, 1))


# --------------------------------------------------------------------------- methods


class Scaler:
    def __init__(self, k):
        self.k = k

    @functools.partial(tp.pmap, in_axes=(None, 0), axis_name="i")
    def share(self, x):
        return x / tp.psum(x, "i") * self.k

    @functools.partial(tp.pmap, static_broadcasted_argnums=0)
    def scale(self, x):
        return x * self.k

    @tp.pmap
    def mapped_self(self, x):
        return x


def test_pmapped_method_with_self_broadcast():
    x = torch.tensor([1.0, 3.0, 4.0, 8.0])
    assert_same(Scaler(2.0).share(x), x / x.sum() * 2)
    assert_same(Scaler(3.0).share(x), x / x.sum() * 3)


def test_pmapped_method_with_static_self():
    assert_same(Scaler(5.0).scale(X4), X4 * 5)
    assert repr(Scaler.scale).startswith("<pmap")


def test_pmapped_method_with_self_mapped_says_to_broadcast_it():
    # As in JAX: self is positional argument 0 and is mapped by default.
    with pytest.raises(TypeError, match="'self'.*in_axes None"):
        Scaler(1.0).mapped_self(X4)


# --------------------------------------------------------------------------- results


def test_multi_device_results_are_sharded_tensors():
    out = tp.pmap(lambda x: x * 2)(torch.arange(8.0).reshape(4, 2))
    if tp.device_count() > 1:
        assert isinstance(out, tp.ShardedTensor)
        assert len(out.devices()) == min(4, tp.device_count())
    else:
        assert isinstance(out, torch.Tensor)
    assert out.shape == (4, 2)
    assert (t(out) == torch.arange(8.0).reshape(4, 2) * 2).all()
    assert out.tolist() == (torch.arange(8.0).reshape(4, 2) * 2).tolist()
    assert out[2].tolist() == [8.0, 10.0]
    assert out[1, 1].item() == 6.0


def test_result_fed_back_into_the_same_pmap():
    f = tp.pmap(lambda x: x + 1)
    out = f(f(torch.arange(8.0).reshape(4, 2)))
    assert_same(out, torch.arange(8.0).reshape(4, 2) + 2)


def test_nested_pmap_matches_plain_sums():
    x = torch.arange(8.0).reshape(2, 4)
    inner = tp.pmap(lambda v: (tp.psum(v, "j"), tp.psum(v, "i"), tp.psum(v, ("i", "j"))), axis_name="j")
    sj, si, sij = tp.pmap(inner, axis_name="i")(x)
    assert_same(sj, x.sum(1, keepdim=True).expand(2, 4))
    assert_same(si, x.sum(0, keepdim=True).expand(2, 4))
    assert_same(sij, torch.full((2, 4), x.sum().item()))


def test_a_first_call_under_inference_mode_does_not_spoil_later_autograd_calls():
    """The axis token is made once per (size, device) and reused; one made under
    inference_mode could not be saved for backward by a later call."""
    f = tp.pmap(lambda x: x[tp.axis_index("i")].sum() * x, axis_name="i", devices=tp.devices()[:1])
    with torch.inference_mode():
        f(torch.ones(5, 5))
    x = torch.ones(5, 5, requires_grad=True)
    f(x).sum().backward()
    assert x.grad is not None


def test_none_under_a_mapped_in_axes_is_an_empty_subtree_as_in_jax(placement):
    """JAX maps ``None`` as a subtree without leaves: an optional argument left out
    (``f(x, mask=None)``), a None in a dict, a None keyword argument. torchpmap refused
    them ("a NoneType, which has no axes") on every placement."""
    import jax
    import jax.numpy as jnp

    def f(x, opt):
        return x * 2 if opt is None else x + opt

    x = torch.arange(4.0)
    got = [
        tp.pmap(f)(x, None),
        tp.pmap(lambda d: d["x"] * 2 if d["m"] is None else d["x"])({"x": x, "m": None}),
        tp.pmap(lambda a, c=None: a * 2 if c is None else a, in_axes=(0,))(x, c=None),
        tp.pmap(f)(x, torch.ones(4)),  # the same function with a tensor there: mapped
    ]
    want = [jax.pmap(f)(jnp.arange(4.0), None)] * 3 + [jax.pmap(f)(jnp.arange(4.0), jnp.ones(4))]
    for g, w in zip(got, want):
        np.testing.assert_allclose(torch.as_tensor(g).cpu().numpy(), np.asarray(w))


FALLS_BACK = {
    "a boolean mask write": lambda x: _mask_write(x),
    "tolist": lambda x: torch.tensor(x.tolist()) * 2,
    ".data": lambda x: x.data * 2,
    "requires_grad_": lambda x: x.clone().requires_grad_() * 2,
}


def _mask_write(x):
    t = x.clone()
    t[t > 1] = 0.0
    return t


@pytest.mark.parametrize("name", sorted(FALLS_BACK))
def test_what_vmap_refuses_but_an_instance_alone_runs_falls_back_on_every_placement(placement, name):
    """vmap refuses value-shaped indexing, reading an instance's memory, ``.data`` and
    ``requires_grad_()``; each instance run alone (a device running one) computes them.
    One device raised where 4 devices gave a result: it now runs them one at a time."""
    f = FALLS_BACK[name]
    x = torch.arange(4.0).reshape(4, 1) - 1
    want = torch.stack([f(row) for row in x])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tp.VectorizationFallbackWarning)
        got = tp.pmap(f)(x)
    torch.testing.assert_close(torch.as_tensor(got).detach().cpu(), want.detach())
