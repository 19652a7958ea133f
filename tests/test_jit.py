"""``pmap(..., jit=True)``: traced once per signature, compiled, and the same numbers as eager.

The differential suite runs every JAX comparison with ``jit`` too (``TORCHPMAP_TEST_JIT=1``,
a pass of ``make test``); this file checks what is particular to the compiled mode: when it
traces again, what it reads at every call, gradients, and where it falls back to eager.
Most tests compile with ``aot_eager`` (the same trace and AOTAutograd, no code generation:
fast); the ``inductor`` tests check real generated code.
"""
from __future__ import annotations

import gc
import warnings

import pytest
import torch

import torchpmap as tp

FAST = {"backend": "aot_eager"}
ONE_DEVICE = tp.devices()[:1]


def jit_pmap(fun, axis_name="i", jit=FAST, **options):
    return tp.pmap(fun, axis_name, jit=jit, devices=options.pop("devices", ONE_DEVICE), **options)


def eager_pmap(fun, axis_name="i", **options):
    return tp.pmap(fun, axis_name, devices=options.pop("devices", ONE_DEVICE), **options)


def counting(fun):
    """``fun`` that counts how often its Python body runs."""

    def wrapped(*args, **kwargs):
        wrapped.runs += 1
        return fun(*args, **kwargs)

    wrapped.runs = 0
    return wrapped


def centred(x):
    return x - tp.pmean(x, "i"), tp.psum(x.sum(), "i")


def test_same_numbers_as_eager_and_python_runs_only_while_tracing():
    fun = counting(centred)
    f = jit_pmap(fun)
    x = torch.randn(4, 3)
    for _ in range(3):
        out = f(x)
    assert fun.runs == 1
    expected = eager_pmap(centred)(x)
    torch.testing.assert_close(out, expected)
    assert f._programs.compiled_count() == 1


def test_a_new_signature_traces_again():
    fun = counting(lambda x, k: x * k + tp.axis_index("i"))
    f = jit_pmap(fun, in_axes=(0, None))
    x = torch.ones(4, 2)
    f(x, 2.0)
    f(x, 2.0)
    assert fun.runs == 1
    torch.testing.assert_close(f(x, 3.0), x * 3 + torch.arange(4.0)[:, None])  # a new Python number
    torch.testing.assert_close(f(torch.ones(4, 5), 2.0), 2 + torch.arange(4.0)[:, None].expand(4, 5))  # shape
    f(x.double(), 2.0)  # dtype
    f(x.requires_grad_(), 2.0)  # requires_grad
    assert fun.runs == 5


def test_autocast_is_part_of_the_signature():
    """A trace bakes in autocast's casts: a call outside the autocast region that traced
    must not reuse its program (it returned bfloat16 there before this was keyed)."""
    w = torch.randn(8, 8)
    fun = counting(lambda v: v @ w)
    f = jit_pmap(fun)
    x = torch.randn(4, 8, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert f(x).dtype == torch.bfloat16
    out = f(x)
    assert out.dtype == torch.float32 and fun.runs == 2
    torch.testing.assert_close(out, x @ w)


def test_the_default_dtype_is_part_of_the_signature():
    f = jit_pmap(lambda v: v.sum() + torch.tensor(0.5))  # a tensor created inside, of the default dtype
    x = torch.ones(4, 3, dtype=torch.float16)
    assert f(x).dtype == torch.float32
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert f(x).dtype == torch.float64
    finally:
        torch.set_default_dtype(previous)


def test_static_arguments_are_part_of_the_signature():
    fun = counting(lambda x, power: tp.psum(x**power, "i"))
    f = tp.pmap(fun, "i", static_broadcasted_argnums=1, jit=FAST, devices=ONE_DEVICE)
    x = torch.arange(4.0)
    torch.testing.assert_close(f(x, 2), torch.full((4,), 14.0))
    torch.testing.assert_close(f(x, 3), torch.full((4,), 36.0))
    torch.testing.assert_close(f(x, 2), torch.full((4,), 14.0))
    assert fun.runs == 2


def test_pytree_outputs_with_none_and_out_axes_survive_cached_calls():
    def fun(d):
        return {"sum": tp.psum(d["a"], "i"), "nothing": None, "pair": (d["b"] * 2, d["a"].sum())}

    f = jit_pmap(fun, out_axes={"sum": None, "nothing": 0, "pair": (1, 0)})
    d = {"a": torch.randn(4, 3), "b": torch.randn(4, 2)}
    first, second = f(d), f(d)
    expected = eager_pmap(fun, out_axes={"sum": None, "nothing": 0, "pair": (1, 0)})(d)
    for out in (first, second):
        assert out["nothing"] is None
        torch.testing.assert_close(out, expected)
        assert out["pair"][0].shape == (2, 4)


def test_closed_over_tensors_are_read_at_every_call():
    w = torch.ones(3)
    f = jit_pmap(lambda x: tp.psum(x * w, "i"))
    x = torch.ones(4, 3)
    torch.testing.assert_close(f(x), torch.full((4, 3), 4.0))
    w.mul_(10)  # an in-place update, as an optimizer step makes
    torch.testing.assert_close(f(x), torch.full((4, 3), 40.0))


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8])
def test_a_psum_of_one_byte_per_instance_wraps_as_eager_on_every_placement(placement, dtype):
    """inductor's sum of a 1-D byte tensor of 8 or more is wrong (``torch.compile(lambda t:
    t.sum(0, dtype=torch.uint8))`` of ``arange(16) * 30`` gives 64, not 16; torch 2.13), and
    ``jit=True`` compiled such a sum for one byte per instance: 64 on one device, 40 on
    8, 16 eagerly and in JAX. Bytes are now summed as int64 and wrapped back."""
    x = (torch.arange(16) * 30 - (100 if dtype == torch.int8 else 0)).to(dtype)
    want = x.sum(0, dtype=dtype)

    def f(v):
        return tp.psum(v, "i"), tp.pmean(v, "i")

    for jit in (False, True):
        total, mean = tp.pmap(f, "i", jit=jit)(x)
        torch.testing.assert_close(torch.as_tensor(total).cpu(), want.expand(16), msg=f"jit={jit}")
        torch.testing.assert_close(torch.as_tensor(mean).cpu(), (want.float() / 16).expand(16), msg=f"jit={jit}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_float_sums_round_once_as_on_one_device_on_every_placement(placement, dtype):
    """torch sums half floats in float32 and rounds once: one device's psum of 6e4, 6e4,
    -6e4, -6e4 in float16 is 0. A slice's partial sum rounded to float16 is inf, and the
    total NaN: that was ``jit=True`` on several devices (and several processes), and a
    grouped psum compiled anywhere (inductor's scatter_add rounds every addition). In
    bfloat16, partial sums rounded on their own changed the total's last bits."""
    if dtype == torch.float16:
        x = torch.tensor([[6e4, 0.5], [6e4, 1e-3], [-6e4, 3.0], [-6e4, 1e-3]] * 2, dtype=dtype)
    else:  # bfloat16 has float32's range: its partial sums round differently (-18.5 and -18.75)
        x = torch.tensor([-56.75, 0.373046875, -0.890625, -1.5078125, 37.0, 1.453125, 0.94140625, 0.7734375])
        x = torch.stack([x, x.flip(0)], 1).to(dtype)
    total = x.float().sum(0).to(dtype)  # 0 and the small ones' sum, rounded once
    halves = x.float().view(2, 4, 2).sum(1).to(dtype)

    def f(v):
        return (
            tp.psum(v, "i"),
            tp.pmean(v, "i"),
            tp.psum(v, "i", axis_index_groups=[[0, 1, 2, 3], [4, 5, 6, 7]]),
            tp.psum_scatter(v.expand(8, 2), "i"),
        )

    for jit in (False, True):
        summed, mean, grouped, scattered = (torch.as_tensor(t).cpu() for t in tp.pmap(f, "i", jit=jit)(x))
        assert summed.dtype == dtype and scattered.dtype == dtype, (summed.dtype, scattered.dtype)
        torch.testing.assert_close(summed, total.expand(8, 2), rtol=0, atol=0, msg=f"jit={jit}")
        torch.testing.assert_close(mean, (total / 8).expand(8, 2), rtol=0, atol=0, msg=f"jit={jit}")
        torch.testing.assert_close(grouped, halves.repeat_interleave(4, 0), rtol=0, atol=0, msg=f"jit={jit}")
        torch.testing.assert_close(scattered, total.expand(8, 2), rtol=0, atol=0, msg=f"jit={jit}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_float_sums_over_a_tuple_of_axes_round_once(placement, dtype):
    """Over a tuple of axes the sum was taken one axis at a time, each axis' total rounded:
    psum over ("x", "y") of [[6e4, -6e4], [6e4, -6e4]] in float16 overflowed to nan where
    ("y", "x") gave 0; in bfloat16 the total was a unit in the last place off."""
    if dtype == torch.float16:
        v = torch.tensor([[6e4, -6e4], [6e4, -6e4]], dtype=dtype)
    else:
        v = torch.tensor([[-56.75, 37.0], [0.373046875, -0.890625]]).to(dtype)
    total = v.float().sum().to(dtype)
    mesh = tp.make_mesh((2, 2), ("x", "y"))  # over the placement's devices
    for jit in (False, True):
        for axes in (("x", "y"), ("y", "x")):
            for reduce, want in ((tp.psum, total), (tp.pmean, (total / 4))):
                f = tp.shard_map(lambda a: reduce(a, axes), mesh=mesh, in_specs=tp.P("x", "y"), out_specs=tp.P(),
                                 jit=jit)
                got = torch.as_tensor(f(v)).cpu().reshape(())
                torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"{axes} {reduce.__name__} jit={jit}")
        nested = tp.pmap(tp.pmap(lambda a: tp.psum(a, ("i", "j")), axis_name="j"), axis_name="i", jit=jit)
        torch.testing.assert_close(torch.as_tensor(nested(v)).cpu(), total.expand(2, 2), rtol=0, atol=0)


def test_backward_outside_reaches_arguments_and_closed_over_parameters():
    w = torch.randn(3, 2, requires_grad=True)
    x = torch.randn(4, 5, 3, requires_grad=True)

    def fun(x):
        y = torch.tanh(x @ w)
        return y / tp.psum(y.abs().sum(), "i")

    grads = {}
    for name, mapped in (("jit", jit_pmap(fun)), ("eager", eager_pmap(fun))):
        mapped(x).pow(2).sum().backward()
        grads[name] = (x.grad.clone(), w.grad.clone())
        x.grad = w.grad = None
    torch.testing.assert_close(grads["jit"], grads["eager"])


def test_forward_mode_tangents_in_the_callers_dual_level_run_eagerly(placement):
    """A compiled program carries no forward-mode tangent: inside the caller's
    ``forward_ad.dual_level()`` the tangent of the result (of an argument's, of a
    closed-over tensor's) was None, silently, on every placement. Now the call runs
    eagerly, with a JitFallbackWarning, and gives eager's tangents (JAX's: 2 x sum)."""
    import torch.autograd.forward_ad as fwAD

    x, t = torch.arange(4.0), torch.ones(4)
    with fwAD.dual_level():
        w = fwAD.make_dual(torch.tensor(3.0), torch.tensor(1.0))
        f = jit_pmap(lambda v: tp.psum(v * v, "i") * w, jit=True, devices=placement)
        with pytest.warns(tp.JitFallbackWarning, match="dual_level"):
            got = fwAD.unpack_dual(f(fwAD.make_dual(x, t)))
    torch.testing.assert_close(got.primal, torch.full((4,), 42.0))
    torch.testing.assert_close(got.tangent, torch.full((4,), 2 * 6.0 * 3 + 14.0))


def test_grad_inside_the_map_and_data_parallel_update():
    w = torch.randn(3, 2)
    x, y = torch.randn(4, 8, 3), torch.randn(4, 8, 2)

    def step(w, x, y):
        g = torch.func.grad(lambda w: ((x @ w - y) ** 2).mean())(w)
        return w - 0.1 * tp.pmean(g, "i")

    expected = eager_pmap(step, in_axes=(None, 0, 0), out_axes=None)(w, x, y)
    torch.testing.assert_close(jit_pmap(step, in_axes=(None, 0, 0), out_axes=None)(w, x, y), expected)


def test_random_numbers_are_drawn_at_every_call_and_differ_per_instance():
    f = jit_pmap(lambda x: x + torch.rand(()), randomness="different")
    x = torch.zeros(4)
    a, b = f(x), f(x)
    assert len(set(a.tolist())) == 4
    assert not torch.equal(a, b)
    with pytest.warns(tp.JitFallbackWarning, match='randomness="same"'):  # torch's generator's numbers: eager
        same = jit_pmap(lambda x: x + torch.rand(()), randomness="same")(x)
    assert len(set(same.tolist())) == 1


def test_a_value_dependent_branch_runs_eagerly_with_a_warning():
    flag = torch.tensor(1.0)
    f = jit_pmap(lambda x: x * 2 if flag > 0 else x * 3)
    x = torch.ones(4)
    with pytest.warns(tp.JitFallbackWarning, match="depends on the value of a tensor"):
        torch.testing.assert_close(f(x), x * 2)
    flag.fill_(-1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one warning per signature; the branch is taken anew
        torch.testing.assert_close(f(x), x * 3)


def test_user_errors_come_from_the_eager_run():
    f = jit_pmap(lambda x: x @ torch.ones(5))
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied|size mismatch|must match"):
        f(torch.ones(4, 3))


def test_vmap_out_axes_none_check_still_applies():
    f = tp.vmap(lambda x: x * 2, axis_name="i", out_axes=None, jit=FAST)
    with pytest.raises(ValueError, match="out_axes=None"):
        f(torch.arange(3.0))


def test_inside_a_transform_the_call_runs_as_part_of_it():
    fun = counting(lambda x: tp.psum(x**2, "i"))
    f = jit_pmap(fun)
    x = torch.arange(4.0)
    g = torch.func.grad(lambda x: f(x).sum())(x)
    torch.testing.assert_close(g, 8 * x)  # d/dx_j of sum_i psum(x^2) = 4 * 2 x_j
    inner = tp.pmap(fun, "i", jit=FAST)  # nested: runs where its enclosing instance runs
    outer = tp.pmap(lambda row: inner(row), "outer", devices=ONE_DEVICE)(torch.ones(2, 4))
    torch.testing.assert_close(outer, torch.full((2, 4), 4.0))
    assert len(f._programs) == len(inner._programs) == 0  # nothing was traced


@pytest.mark.skipif(tp.device_count() < 2, reason="needs TORCHPMAP_NUM_CPU_DEVICES >= 2")
def test_several_devices_compile_without_a_warning():
    f = tp.pmap(centred, "i", jit=True, devices=tp.devices()[:2])  # inductor: other options stay on one device
    x = torch.randn(4, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", tp.JitFallbackWarning)  # compiled per device thread (issue 29)
        out = f(x)
    torch.testing.assert_close(out[0].gather(), eager_pmap(centred)(x)[0])


@pytest.mark.parametrize("bad", ["yes", 1, ["backend"]])
def test_jit_option_is_checked(bad):
    with pytest.raises(TypeError, match="jit must be True, False or a dict"):
        tp.pmap(centred, "i", jit=bad)


# --------------------------------------------------------------------------- inductor


def test_inductor_mlp_step_matches_eager():
    torch.manual_seed(0)
    params = {"w1": torch.randn(16, 32) / 4, "b1": torch.zeros(32), "w2": torch.randn(32, 4) / 6, "b2": torch.zeros(4)}
    x, y = torch.randn(4, 8, 16), torch.randint(0, 4, (4, 8))

    def loss(p, x, y):
        h = torch.relu(x @ p["w1"] + p["b1"])
        return torch.nn.functional.cross_entropy(h @ p["w2"] + p["b2"], y)

    def step(p, x, y):
        g = tp.pmean(torch.func.grad(loss)(p, x, y), "i")
        return {k: p[k] - 0.1 * g[k] for k in p}

    options = dict(in_axes=(None, 0, 0), out_axes=None)
    compiled = tp.pmap(step, "i", jit=True, devices=ONE_DEVICE, **options)
    expected = eager_pmap(step, **options)(params, x, y)
    torch.testing.assert_close(compiled(params, x, y), expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(compiled(params, x, y), expected, rtol=1e-5, atol=1e-6)


def test_inductor_backward_outside():
    x = torch.randn(8, 6, requires_grad=True)
    f = tp.pmap(lambda v: torch.sin(v) * tp.pmax(v.detach(), "i"), "i", jit=True, devices=ONE_DEVICE)
    f(x).sum().backward()
    torch.testing.assert_close(x.grad, torch.cos(x.detach()) * x.detach().amax(0))


# --------------------------------------------------------------------------- aliasing and strides


def _aliasing_calls(fun, jit, first_twice):
    """``fun(a, b)`` called with one tensor for both and with two tensors, in either order;
    the results and the final input values."""
    x, y = torch.ones(4, 3), torch.full((4, 3), 5.0)
    f = jit_pmap(fun, jit=jit) if jit is not None else eager_pmap(fun)
    calls = [(x, x), (x, y)] if first_twice else [(x, y), (x, x)]
    return [f(*args).clone() for args in calls], x


@pytest.mark.parametrize("first_twice", [True, False], ids=["twice-first", "twice-second"])
@pytest.mark.parametrize("jit", [FAST, True], ids=["aot_eager", "inductor"])
@pytest.mark.parametrize(
    "fun",
    [lambda a, b: a * 2 + b, lambda a, b: a.add_(1) * 2 + b],
    ids=["reads", "writes-an-input"],
)
def test_one_tensor_for_two_arguments(fun, jit, first_twice):
    """A program traced with one tensor for two arguments is not a program for that
    tensor only: called then with two tensors, it reads both (and the other way round)."""
    expected, x_expected = _aliasing_calls(fun, None, first_twice)
    got, x_got = _aliasing_calls(fun, jit, first_twice)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(x_got, x_expected)


def test_inductor_compiles_a_program_that_reads_its_inputs_without_dynamo():
    """jit=True compiles with inductor alone (the jit cache's signature does Dynamo's
    guards' work); a program that writes into an input, or other torch.compile options,
    go through torch.compile."""

    def compiled_by_dynamo(f, *args):
        f(*args)
        (program,) = f._programs._programs.values()
        return program.graph_forward is not None

    x = torch.ones(4, 3)
    assert not compiled_by_dynamo(jit_pmap(lambda a: a * 2, jit=True), x)
    assert compiled_by_dynamo(jit_pmap(lambda a: a.mul_(2), jit=True), x.clone())
    assert compiled_by_dynamo(jit_pmap(lambda a: a * 2, jit=FAST), x)


@pytest.mark.filterwarnings("error::torchpmap.JitFallbackWarning")
def test_inductor_compiles_closed_over_and_created_constants():
    """Tensors the function closes over, and tensors it creates from Python values, become
    inputs of the compiled graph (a graph whose first op read one of them was left
    malformed, which only a compiler that takes the graph as it is noticed)."""
    w, steps = torch.randn(3), torch.arange(4)
    f = jit_pmap(lambda v: (steps, torch.tensor(3.0).expand(3) * v + w), jit=True)
    x = torch.randn(4, 3)
    got_steps, got = f(x)
    torch.testing.assert_close(got, 3.0 * x + w)
    torch.testing.assert_close(got_steps, steps.expand(4, 4))


def test_inductor_traces_again_for_other_strides():
    f = jit_pmap(lambda a, b: a @ b, jit=True)
    a, b = torch.randn(4, 3, 3), torch.randn(4, 3, 3)
    torch.testing.assert_close(f(a, b), a @ b)
    torch.testing.assert_close(f(a.transpose(1, 2), b), a.transpose(1, 2) @ b)  # same shape, other strides
    torch.testing.assert_close(f(a, b.transpose(1, 2)), a @ b.transpose(1, 2))
    torch.testing.assert_close(f(a + 1, b), (a + 1) @ b)  # the first program again
    assert len(f._programs) == 3


class _Unhashable:
    __hash__ = None  # type: ignore[assignment]

    def __init__(self, k: float):
        self.k = k


def test_unhashable_arguments_are_baked_in_by_identity():
    f = jit_pmap(lambda x, s: x * s.k, in_axes=(0, None))
    x = torch.ones(2)
    first = _Unhashable(2.0)
    torch.testing.assert_close(f(x, first), x * 2)
    address = id(first)
    del first
    gc.collect()
    # a new object at the freed one's address must not reuse the program that baked in k=2
    candidates = [_Unhashable(3.0) for _ in range(1000)]
    reused = next((c for c in candidates if id(c) == address), candidates[0])
    torch.testing.assert_close(f(x, reused), x * 3)


# --------------------------------------------------------------------------- where gradients stop
# A compiled program is differentiated by AOTAutograd from its traced ops; eager autograd
# skips some of them (detach, no_grad, a custom Function's forward). The graph must stop
# the gradient at the same places, or the call runs eagerly: never other numbers.


def _gradients(fun, x, params=(), jit=False):
    """The gradients of ``sum(pmap(fun)(x))`` for ``x`` and ``params``, and the JitFallbackWarnings."""
    mapped = jit_pmap(fun, jit=jit) if jit else eager_pmap(fun)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = mapped(x)
        sum(o.sum() for o in (out if isinstance(out, tuple) else (out,))).backward()
    grads = [t.grad for t in (x, *params)]
    for t in (x, *params):
        t.grad = None
    return grads, [w for w in caught if issubclass(w.category, tp.JitFallbackWarning)], mapped


def _compiled_gradients_match_eager(fun, x, params=()):
    expected, _, _ = _gradients(fun, x, params)
    got, fallbacks, mapped = _gradients(fun, x, params, jit=FAST)
    assert not fallbacks, [str(w.message) for w in fallbacks]
    assert mapped._programs.compiled_count() == 1
    torch.testing.assert_close(got, expected)
    return got


_w = torch.randn(3, requires_grad=True)


@pytest.mark.parametrize(
    "fun",
    [
        pytest.param(lambda v: torch.sin(v) * tp.pmax(v.detach(), "i"), id="pmax-of-detached"),  # issue #11
        pytest.param(lambda v: v * v.detach() + v[:1].detach().exp(), id="batched"),
        pytest.param(lambda v: (v * _w.detach()).sin() + v * _w, id="closed-over"),
        pytest.param(lambda v: torch.func.grad(lambda u: (u * u.detach()).sum())(v) * v, id="inside-grad"),
    ],
)
def test_detach_stops_the_gradient(fun):
    """torch 2.14's make_fx records detach as alias unless given a decomposition table;
    AOTAutograd then differentiated through it (6 of 48 gradients wrong in issue #11)."""
    x = torch.randn(8, 3, requires_grad=True)
    _compiled_gradients_match_eager(fun, x, [_w])


def _no_grad_block(v):
    with torch.no_grad():
        scale = tp.pmax(v, "i") * (v * _w).sum()
    return torch.sin(v) * scale + v * _w


def _grad_disabled(v):
    with torch.set_grad_enabled(False):
        square = v * v
    return v * square, square  # an output that does not require grad


def _no_grad_inside_grad(v):
    def loss(u):
        with torch.no_grad():
            k = u * 2
        return (u * k).sum()

    return torch.func.grad(loss)(v) * v


@pytest.mark.parametrize("fun", [_no_grad_block, _grad_disabled, _no_grad_inside_grad])
def test_no_grad_blocks_stop_the_gradient(fun):
    x = torch.randn(4, 3, requires_grad=True)
    grads = _compiled_gradients_match_eager(fun, x, [_w])
    assert grads[0].abs().sum() > 0


@pytest.mark.parametrize(
    "fun",
    [
        pytest.param(lambda v: v * v.conj(), id="conj-view"),  # |v|^2: eager's gradient is 2v, the graph gave v
        pytest.param(lambda v: v * v.conj() + v * v, id="conj-view-and-square"),
        pytest.param(lambda v: (v.conj() * tp.psum(v, "i")).exp(), id="conj-psum"),
        pytest.param(lambda v: torch.view_as_real(v.conj() * 2j).sin(), id="conj-as-real"),
    ],
)
def test_tensors_made_below_autograd_keep_their_gradient(fun):
    """A complex conjugate view is copied below autograd for the kernel that reads it;
    the copy does not require grad, though autograd recorded the op. The audit stopped
    the gradient at it, and compiled gradients were wrong (half of eager's for
    ``v * v.conj()``) on every placement, silently."""
    x = torch.complex(*torch.randn(2, 4, 3, generator=torch.Generator().manual_seed(5))).requires_grad_()
    real = lambda t: torch.view_as_real(t).sum(-1) if t.is_complex() else t  # noqa: E731 - the loss is real
    grads = _compiled_gradients_match_eager(lambda v: real(fun(v)), x)
    assert grads[0].abs().sum() > 0


def test_a_no_grad_output_does_not_require_grad():
    def fun(v):
        with torch.no_grad():
            return v * 2

    x = torch.randn(4, 3, requires_grad=True)
    out = jit_pmap(fun)(x)
    assert not out.requires_grad
    torch.testing.assert_close(out, 2 * x.detach())


class _StraightThrough(torch.autograd.Function):
    """round() forward, identity-times-ten backward: not the derivative of its forward."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x):
        return torch.round(x * 3)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad):
        return grad * 10


class _Passthrough(_StraightThrough):
    """Returns its input itself (autograd wraps it in a view with the custom backward)."""

    @staticmethod
    def forward(x):
        return x


@pytest.mark.parametrize(
    "fun",
    [
        pytest.param(lambda v: _StraightThrough.apply(v) * v, id="straight-through"),
        pytest.param(lambda v: _Passthrough.apply(v), id="returns-its-input"),
        pytest.param(lambda v: torch.func.grad(lambda u: _StraightThrough.apply(u).sin().sum())(v) * v, id="in-grad"),
    ],
)
def test_a_custom_autograd_function_runs_eagerly_with_a_warning(fun):
    x = torch.randn(4, 3, requires_grad=True)
    expected, _, _ = _gradients(fun, x)
    got, fallbacks, mapped = _gradients(fun, x, jit=FAST)
    assert len(fallbacks) == 1 and "custom torch.autograd.Function" in str(fallbacks[0].message)
    assert mapped._programs.compiled_count() == 0
    torch.testing.assert_close(got, expected)


def test_a_custom_autograd_function_compiles_when_no_gradient_is_needed():
    def fun(v):
        return _StraightThrough.apply(v) * v + torch.func.grad(lambda u: _StraightThrough.apply(u).sum())(v)

    x = torch.randn(4, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", tp.JitFallbackWarning)
        torch.testing.assert_close(jit_pmap(fun)(x), eager_pmap(fun)(x))


def test_pmax_differentiated_raises_as_in_eager():
    """pmax refuses its gradient through a custom Function: the call runs eagerly, so that
    .backward() raises the same error instead of returning amax's gradient."""
    x = torch.randn(4, 3, requires_grad=True)
    with pytest.warns(tp.JitFallbackWarning, match="custom torch.autograd.Function"):
        out = jit_pmap(lambda v: torch.sin(v) * tp.pmax(v, "i"))(x)
    with pytest.raises(NotImplementedError, match="pmax is not differentiable"):
        out.sum().backward()


def test_an_in_place_update_without_grad_runs_eagerly():
    def fun(v):
        u = v * 2
        with torch.no_grad():
            u.mul_(3)  # eager: the gradient of u stays 2, the graph's would be 6
        return u.sin()

    x = torch.randn(4, 3, requires_grad=True)
    expected, _, _ = _gradients(fun, x)
    got, fallbacks, _ = _gradients(fun, x, jit=FAST)
    assert len(fallbacks) == 1 and "in place with grad mode off" in str(fallbacks[0].message)
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("jit", [FAST, True], ids=["aot_eager", "inductor"])
@pytest.mark.parametrize(
    "change",
    [
        lambda m: m.double(),  # dtype, through .data: the same parameter object
        lambda m: setattr(m.weight, "data", torch.randn(5, 3)),  # shape: 5 outputs
        lambda m: setattr(m.weight, "data", torch.randn(3, 3).t()),  # strides
    ],
    ids=["dtype", "shape", "strides"],
)
def test_a_closed_over_parameter_changed_in_place_traces_again(jit, change):
    """A module's parameters change dtype or shape in place (``module.double()`` assigns
    ``.data``): the program traced for the old ones is not run on the new ones."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(3, 3, bias=False)
    fun = counting(lambda v: layer(v.to(layer.weight.dtype)) * 2)
    f = jit_pmap(fun, jit=jit)
    x = torch.randn(4, 3)
    f(x)
    change(layer)
    torch.testing.assert_close(f(x), eager_pmap(fun)(x))
    assert fun.runs == 3  # traced twice, then run eagerly once


def test_a_closed_over_tensor_that_starts_requiring_grad_traces_again():
    """Where the graph stops gradients depends on which closed-over tensors require grad."""
    w = torch.randn(3)

    def fun(v):
        with torch.no_grad():
            k = (v * w).sum()
        return v * w + k * w

    fun = counting(fun)
    f = jit_pmap(fun)
    x = torch.randn(4, 3)
    f(x)
    w.requires_grad_()
    f(x).sum().backward()
    traces = fun.runs
    compiled_grad, w.grad = w.grad, None
    eager_pmap(fun)(x).sum().backward()
    torch.testing.assert_close(compiled_grad, w.grad)
    assert traces == 2


def test_randomness_same_draws_torchs_numbers_eagerly_with_a_warning():
    """``randomness="same"`` promises the numbers of torch's generator, as one device draws
    them eagerly: a compiled program draws from a stream of its own (it did, on one
    device, while several devices ran eagerly), so the program runs eagerly."""
    f = tp.pmap(lambda v: v + torch.randn(3), axis_name="i", randomness="same", jit=True, devices=tp.devices()[:1])
    torch.manual_seed(1)
    want = torch.randn(3)
    torch.manual_seed(1)
    with pytest.warns(tp.JitFallbackWarning, match='randomness="same"'):
        got = torch.as_tensor(f(torch.zeros(4, 3)))
    assert torch.equal(got, want.expand(4, 3))


def test_a_change_to_the_model_after_the_first_call_is_traced_anew(placement):
    """A compiled program keeps what the modules' Python state was when it was traced:
    only train/eval was checked, so a new dropout rate, an attribute the forward reads
    (a temperature) or a forward hook added after the first call were silently ignored
    (jit=True: loss 1.0530 for 1.0020 after dropout p 0.5 -> 0)."""
    import torch.nn.functional as F
    from torch import nn

    class Tempered(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Dropout(0.5), nn.Linear(8, 3))
            self.temperature = 1.0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.body(x) / self.temperature

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 5, generator=g), torch.randint(0, 3, (8,), generator=g)
    losses = {}
    for jit in (False, True):
        torch.manual_seed(0)
        model = Tempered()
        step = tp.data_parallel_step(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1), jit=jit)
        step(tp.shard((x, y), n=4))
        model.body[2].p = 0.0
        no_dropout = step(tp.shard((x, y), n=4))
        model.temperature = 4.0
        tempered = step(tp.shard((x, y), n=4))
        model.body[1].register_forward_hook(lambda m, args, out: out * 3)
        hooked = step(tp.shard((x, y), n=4))
        losses[jit] = (no_dropout, tempered, hooked, [p.detach().clone() for p in model.parameters()])
    for eager, compiled in zip(losses[False][:3], losses[True][:3]):
        torch.testing.assert_close(compiled, eager)
    for eager, compiled in zip(losses[False][3], losses[True][3]):
        torch.testing.assert_close(compiled, eager)


def test_a_constant_made_inside_jacfwd_gives_values_not_meta_tensors(four_devices):
    """Traced, a tensor made inside ``torch.func.jacfwd`` (its zero tangent) moved to the
    meta device: one device's compiled program returned a meta tensor, which no read
    could use (``torch.compile`` refuses the program). Such a program runs eagerly now,
    with a JitFallbackWarning, and gives eager's numbers on every placement."""
    from torch.func import jacfwd

    def f(v, w):
        return jacfwd(lambda w: (torch.outer(v, w) * torch.arange(4.0)[:, None]).sum())(w)

    x, w = torch.arange(16.0).reshape(4, 4), torch.tensor([1.0, 2.0])
    want = tp.pmap(f, in_axes=(0, None), devices=four_devices[:1])(x, w)
    for placement in (four_devices[:1], four_devices):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", tp.JitFallbackWarning)
            got = tp.pmap(f, in_axes=(0, None), devices=placement, jit=True)(x, w)
        assert got.device.type == "cpu"
        torch.testing.assert_close(torch.as_tensor(got), want)
