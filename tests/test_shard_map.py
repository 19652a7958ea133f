"""shard_map against jax.shard_map, and against itself on one device and on several.

Each program of JAX's shard_map notebook is written once against a backend (torch or
JAX: the array module, the collectives, shard_map, grad) and run by both, on a (4, 2)
mesh named ("batch", "model"): torchpmap's on 1 CPU device (every position vectorized),
on 2 (an AbstractMesh: 4 positions per device) and on 8 (a Mesh: one device per
position), JAX's with ``Auto`` axes on its 8 host devices. Values and gradients must
agree; so must the placements.
"""
from __future__ import annotations

import functools
import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.func import grad

import torchpmap as tp
from torchpmap import P
from torchpmap._frontend.shard_map import first_axis_devices
from torchpmap._placement import devices as _devices

jax = pytest.importorskip("jax")
jnp = jax.numpy
from jax import lax  # noqa: E402
from jax.sharding import AxisType  # noqa: E402
from jax.sharding import PartitionSpec as JP  # noqa: E402

SHAPE, NAMES = (4, 2), ("batch", "model")


@pytest.fixture
def cpu_devices(monkeypatch):
    """``use(n)``: n CPU devices for this test, whatever TORCHPMAP_NUM_CPU_DEVICES the run uses."""

    def use(n: int) -> list:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        monkeypatch.setenv("TORCHPMAP_NUM_CPU_DEVICES", str(n))
        _devices._local_devices.cache_clear()
        return tp.devices()

    yield use
    monkeypatch.undo()
    _devices._local_devices.cache_clear()


def torch_side() -> SimpleNamespace:
    mesh = tp.make_mesh(SHAPE, NAMES)
    return SimpleNamespace(
        xp=torch, P=P, psum=tp.psum, pmean=tp.pmean, all_gather=tp.all_gather, psum_scatter=tp.psum_scatter,
        ppermute=tp.ppermute, axis_index=tp.axis_index, relu=torch.relu, tanh=torch.tanh, grad=grad, pvary=tp.pvary,
        all_to_all=tp.all_to_all, shard_map=lambda f, **kw: tp.shard_map(f, mesh=mesh, **kw), mesh=mesh,
        gather_is_invariant=True,
    )


def jax_side() -> SimpleNamespace:
    mesh = jax.make_mesh(SHAPE, NAMES, axis_types=(AxisType.Auto,) * len(SHAPE))
    return SimpleNamespace(
        xp=jnp, P=JP, psum=lax.psum, pmean=lax.pmean, all_gather=lax.all_gather, psum_scatter=lax.psum_scatter,
        ppermute=lax.ppermute, axis_index=lax.axis_index, relu=jax.nn.relu, tanh=jnp.tanh, grad=jax.grad,
        pvary=lambda x, axes: lax.pcast(x, axes, to="varying"), all_to_all=lax.all_to_all,
        shard_map=lambda f, **kw: jax.shard_map(f, mesh=mesh, **kw), mesh=mesh, gather_is_invariant=False,
    )


# --------------------------------------------------------------------------- the notebook's programs


def matmul_psum(B, x, w):
    """Contracting over a split dim: each position multiplies its blocks, psum adds them."""
    f = B.shard_map(lambda x, w: B.psum(x @ w, "model"), in_specs=(B.P("batch", "model"), B.P("model", None)),
                    out_specs=B.P("batch", None))
    return f(x, w)


def gathered(B, x, w):
    """all_gather(tiled) makes the blocks whole: the same on every position. torchpmap's
    check counts its result as the same along the axis (what JAX's all_gather_invariant
    does); JAX 0.10's all_gather keeps it varying, so JAX's side runs unchecked."""
    f = B.shard_map(lambda x: B.all_gather(x, "batch", tiled=True) * 2, in_specs=B.P("batch"), out_specs=B.P(),
                    check_vma=B.gather_is_invariant)
    return f(x)


def reduce_scattered(B, x, w):
    """Tensor parallel with the output kept split: psum_scatter(tiled) over the contracted axis."""
    def block(x, w):
        return B.psum_scatter(x @ w, "model", scatter_dimension=1, tiled=True)

    f = B.shard_map(block, in_specs=(B.P("batch", "model"), B.P("model", None)), out_specs=B.P("batch", "model"))
    return f(x, w)


def megatron_mlp(B, x, w1, w2):
    """2-D: batch split over "batch"; W1's columns and W2's rows over "model"."""
    def block(x, w1, w2):
        return B.psum(B.relu(x @ w1) @ w2, "model")

    f = B.shard_map(block, in_specs=(B.P("batch", None), B.P(None, "model"), B.P("model", None)),
                    out_specs=B.P("batch", None))
    return f(x, w1, w2)


def ring(B, x, w):
    """A ring over "batch", and each block's position along both axes."""
    perm = [(j, (j + 1) % SHAPE[0]) for j in range(SHAPE[0])]

    def block(x):
        return B.ppermute(x, "batch", perm) + B.axis_index("model") + 10 * B.axis_index("batch")

    f = B.shard_map(block, in_specs=B.P("batch", "model"), out_specs=B.P("batch", "model"))
    return f(x)


def fsdp_step(B, x, w):
    """FSDP: parameters split along dim 0 over "batch", gathered per layer; the gradient
    of a gathered weight comes back reduce-scattered (all_gather's transpose)."""
    def loss(params, x, y):
        w1 = B.all_gather(params["w1"], "batch", tiled=True)
        w2 = B.all_gather(params["w2"], "batch", tiled=True)
        return B.pmean(((B.tanh(x @ w1) @ w2 - y) ** 2).mean(), "batch")

    def step(params, x, y):
        return loss(params, x, y), B.grad(loss)(params, x, y)

    params = {"w1": w, "w2": w.T * 0.5}  # (4, 8) and (8, 4): dim 0 split over "batch"
    spec = B.P("batch")
    f = B.shard_map(step, in_specs=({"w1": spec, "w2": spec}, spec, spec), out_specs=(B.P(), {"w1": spec, "w2": spec}))
    return f(params, x, x * 0.5 + 1)


def fsdp_and_tp(B, x, w):
    """Both on a 2-D mesh: the weight split along dim 0 over ("model", "batch") together,
    gathered over both for the forward; the batch split over "batch"; the loss' gradient
    comes back split as the weight is."""
    def loss(w, x):
        full = B.all_gather(w, ("model", "batch"), tiled=True)
        # the mean over both axes: JAX counts the gathered weight as varying along "model"
        return B.pmean((B.tanh(x @ full) ** 2).mean(), ("batch", "model"))

    f = B.shard_map(lambda w, x: (loss(w, x), B.grad(loss)(w, x)), in_specs=(B.P(("model", "batch")), B.P("batch")),
                    out_specs=(B.P(), B.P(("model", "batch"))))
    return f(w, x)


def invariant_gradients(B, x, w):
    """Gradients of a replicated weight through psums of it (implicitly varied first) and
    of its product with the split batch, varied explicitly: each position's contribution
    counted once."""
    def block(x, w):
        def loss(w):
            return B.psum((w ** 2).sum(), "model") + B.psum((x @ B.pvary(w, "batch")).sum(), "batch")

        return B.grad(loss)(w)

    return B.shard_map(block, in_specs=(B.P("batch", None), B.P()), out_specs=B.P())(x, w)


def implicit_pvary(B, x, w):
    """The same without the pvary: JAX varies the weight where it meets the split batch
    (torchpmap too, see torchpmap._frontend.implicit_pvary). Its invariant uses (the psum
    over "model") add their gradient once, its varying ones the psum of theirs."""
    def block(x, w):
        def loss(w):
            return B.psum((w ** 2).sum(), "model") + B.psum((x @ w).sum(), "batch")

        return B.grad(loss)(w)

    return B.shard_map(block, in_specs=(B.P("batch", None), B.P()), out_specs=B.P())(x, w)


def replicated_step(B, x, w1, w2):
    """A Megatron MLP's gradients taken inside the map, of a loss that varies along
    "batch" (no pmean): each weight is replicated over "batch", so its gradient is the
    sum of the positions' (pvary's transpose), split over "model" as the weight is; x's
    gradient stays per position."""
    def block(x, w1, w2):
        def loss(x, w1, w2):
            return (B.psum(B.tanh(x @ w1) @ w2, "model") ** 2).mean()

        return B.grad(loss, argnums=(0, 1, 2))(x, w1, w2)

    specs = (B.P("batch", None), B.P(None, "model"), B.P("model", None))
    return B.shard_map(block, in_specs=specs, out_specs=specs)(x, w1, w2)


def vjp_inside(B, x, w, ct):
    """A vjp inside the map with a cotangent split like the output: the gradient of the
    weight (replicated over "batch") is summed over "batch"; stacked with an out_spec that
    names "batch", every block is that sum (not one position's part)."""
    def f(x, w):
        return B.psum(x @ w, "model")

    def block(x, w, ct):
        if B.xp is torch:
            _, pullback = torch.func.vjp(f, x, w)
        else:
            _, pullback = jax.vjp(f, x, w)
        return pullback(ct)

    specs = (B.P("batch", "model"), B.P("model", None), B.P("batch", None))
    return B.shard_map(block, in_specs=specs, out_specs=(B.P("batch", "model"), B.P("model", "batch")))(x, w, ct)


def ppermute_across_axes(B, x, w):
    """ppermute over two mesh axes, named in mesh order: the positions are numbered with
    "batch" major, as axis_index of the tuple numbers them (a tuple out of mesh order is
    refused, by JAX too: see the test below)."""
    shift = [(j, (j + 3) % 8) for j in range(8)]

    def block(x):
        me = x + 10 * B.axis_index("batch") + B.axis_index("model")
        return B.ppermute(me, ("batch", "model"), shift) + B.ppermute(me * 2, ("batch", "model"), [(1, 0), (6, 5)])

    return B.shard_map(block, in_specs=B.P("batch", "model"), out_specs=B.P("batch", "model"))(x)


def nonfloat_varying(B, x, w):
    """A replicated weight meeting values that vary along "batch" but are no floats: an
    index (an embedding-style lookup), a mask, the position's index. JAX varies the
    weight there too, so its gradient inside the map sums every position's part. (Until
    2026-11-29 torchpmap looked at float operands only: each position kept its own
    part, and the pmean gave a quarter of JAX's gradient.)"""
    def block(x, w):
        def loss(w):
            picked = w[x.argmax(1)]
            masked = B.xp.where(x > 0, w, 0.0)
            return (picked ** 2).sum() + (masked ** 2).sum() + (w * B.axis_index("batch")).sum()

        return B.pmean(B.grad(loss)(w), "batch")

    return B.shard_map(block, in_specs=(B.P("batch", None), B.P()), out_specs=B.P())(x, w)


def collectives_of_replicated(B, x, w):
    """ppermute, psum_scatter and all_to_all of a replicated weight, differentiated inside
    the map: JAX varies their input first, so the gradient sums every position's part.
    (Until 2026-11-29 torchpmap left the collectives' inputs alone: a quarter of JAX's.)"""
    perm = [(j, (j + 1) % SHAPE[0]) for j in range(SHAPE[0])]

    def block(w):
        def loss(w):
            sent = (B.ppermute(w, "batch", perm) ** 2).sum()
            scattered = (B.psum_scatter(w, "batch", tiled=True) ** 2).sum()
            return sent + scattered + (B.all_to_all(w * 2, "batch", 0, 0, tiled=True) ** 3).sum()

        return B.grad(loss)(w)

    return B.shard_map(block, in_specs=B.P(), out_specs=B.P("batch"))(w)


PROGRAMS = {
    "matmul_psum": (matmul_psum, [(8, 4), (4, 3)]),
    "all_gather": (gathered, [(8, 3), (1,)]),
    "reduce_scatter": (reduce_scattered, [(8, 4), (4, 6)]),
    "megatron_mlp": (megatron_mlp, [(8, 4), (4, 6), (6, 4)]),
    "ring": (ring, [(8, 4), (1,)]),
    "fsdp_step": (fsdp_step, [(8, 4), (4, 8)]),
    "fsdp_and_tp": (fsdp_and_tp, [(8, 16), (16, 8)]),
    "invariant_gradients": (invariant_gradients, [(8, 4), (4,)]),
    "implicit_pvary": (implicit_pvary, [(8, 4), (4,)]),
    "replicated_step": (replicated_step, [(8, 4), (4, 6), (6, 4)]),
    "vjp_inside": (vjp_inside, [(8, 4), (4, 3), (8, 3)]),
    "ppermute_across_axes": (ppermute_across_axes, [(8, 4), (1,)]),
    "nonfloat_varying": (nonfloat_varying, [(8, 4), (4,)]),
    "collectives_of_replicated": (collectives_of_replicated, [(1,), (8,)]),
}


def _inputs(shapes: list, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(np.float32) for s in shapes]


@functools.cache
def _jax_result(name: str):
    program, shapes = PROGRAMS[name]
    return jax.tree_util.tree_map(np.asarray, program(jax_side(), *map(jnp.asarray, _inputs(shapes))))


def _assert_close(got, want, what: str) -> None:
    got_leaves = [np.asarray(torch.as_tensor(t).detach()) for t in torch.utils._pytree.tree_leaves(got)]
    want_leaves = jax.tree_util.tree_leaves(want)
    assert len(got_leaves) == len(want_leaves), what
    for g, w in zip(got_leaves, want_leaves):
        assert g.shape == w.shape, (what, g.shape, w.shape)
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-5, err_msg=what)


@pytest.mark.parametrize("n_devices", [1, 2, 8])
@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_the_notebook_programs_give_jax_numbers_on_every_placement(cpu_devices, name, n_devices):
    cpu_devices(n_devices)
    program, shapes = PROGRAMS[name]
    B = torch_side()
    assert isinstance(B.mesh, tp.Mesh if n_devices == 8 else tp.AbstractMesh)
    got = program(B, *map(torch.from_numpy, _inputs(shapes)))
    _assert_close(got, _jax_result(name), f"{name} on {n_devices} devices")


@pytest.mark.parametrize("n_devices", [1, 8])
def test_a_gradient_inside_the_map_through_an_all_gather_of_a_replicated_weight_counts_it_once(cpu_devices, n_devices):
    """all_gather's input is varied first, as JAX varies it, so a replicated weight's
    gradient sums the parts of every gathered copy: the same on every position, that of
    the loss counted once (torchpmap's all_gather result is invariant; JAX's varies, and
    its gradient is the axis size times this one: see docs/shard-map.md). Until
    2026-11-29 position k got only the k-th block's part."""
    cpu_devices(n_devices)
    B = torch_side()
    w, c = torch.arange(2.0), torch.arange(8.0)

    def block(w, c):
        return grad(lambda v: (tp.all_gather(v, "batch", tiled=True) * c).sum())(w)

    got = B.shard_map(block, in_specs=(B.P(), B.P()), out_specs=B.P("batch"))(w, c)
    torch.testing.assert_close(torch.as_tensor(got).cpu(), c.reshape(4, 2).sum(0).repeat(4))
    once = B.shard_map(block, in_specs=(B.P(), B.P()), out_specs=B.P())(w, c)  # invariant: P() takes it
    torch.testing.assert_close(torch.as_tensor(once).cpu(), c.reshape(4, 2).sum(0))


def test_ppermute_over_mesh_axes_out_of_mesh_order_is_refused_as_jax_refuses_it(cpu_devices):
    """JAX's shard_map numbered the positions of ("model", "batch") in mesh order, which
    reads as the tuple's order; JAX 0.11 refuses it (``jax_raise_on_ppermute_sort_diff``),
    and so does torchpmap, on every placement. pmap's own tuples keep the tuple's order."""
    x = torch.randn(8, 4)
    for n in (1, 8):
        cpu_devices(n)
        B = torch_side()
        out_of_order = B.shard_map(lambda x: B.ppermute(x, ("model", "batch"), [(0, 1)]),
                                   in_specs=B.P("batch", "model"), out_specs=B.P("batch", "model"))
        with pytest.raises(ValueError, match=r"out of mesh order.*axis_name=\('batch', 'model'\)"):
            out_of_order(x)
    if hasattr(jax.config, "jax_raise_on_ppermute_sort_diff"):  # JAX 0.11 and later
        J = jax_side()
        with pytest.raises(Exception, match="same order as the axis_names declared on the mesh"):
            J.shard_map(lambda x: J.ppermute(x, ("model", "batch"), [(0, 1)]), in_specs=J.P("batch", "model"),
                        out_specs=J.P("batch", "model"))(jnp.asarray(x.numpy()))
    inner = tp.pmap(lambda x: tp.ppermute(x, ("j", "i"), [(1, 2)]), axis_name="j")  # position j * 2 + i
    got = tp.pmap(inner, axis_name="i")(torch.arange(4.0).reshape(2, 2))
    torch.testing.assert_close(got.cpu(), torch.tensor([[0.0, 2.0], [0.0, 0.0]]))


GRADIENT_PROGRAMS = ["matmul_psum", "reduce_scatter", "megatron_mlp", "all_gather", "ppermute_across_axes"]


@functools.cache
def _jax_gradient(name: str):
    program, shapes = PROGRAMS[name]
    args = list(map(jnp.asarray, _inputs(shapes)))
    weights = jnp.asarray(_inputs([np.shape(program(jax_side(), *args))], seed=1)[0])

    def scalar(*args):
        return (program(jax_side(), *args) * weights).sum()

    return jax.tree_util.tree_map(np.asarray, jax.grad(scalar, argnums=tuple(range(len(args))))(*args)), weights


@pytest.mark.parametrize("n_devices", [1, 8])
@pytest.mark.parametrize("name", GRADIENT_PROGRAMS)
def test_gradients_around_the_map_are_jax_gradients(cpu_devices, name, n_devices):
    """grad outside, and .backward() through the result: each argument's gradient,
    assembled from its blocks' (all_gather's transpose is psum_scatter, psum's psum)."""
    cpu_devices(n_devices)
    program, shapes = PROGRAMS[name]
    want, weights = _jax_gradient(name)
    weights = torch.from_numpy(np.array(weights))
    args = list(map(torch.from_numpy, _inputs(shapes)))
    B = torch_side()

    def scalar(*args):
        return (torch.as_tensor(program(B, *args)) * weights).sum()

    got = grad(scalar, argnums=tuple(range(len(args))))(*args)
    _assert_close(list(got), list(want), f"grad of {name} on {n_devices} devices")
    leaves = [a.clone().requires_grad_() for a in args]
    scalar(*leaves).backward()
    grads = [torch.zeros_like(a) if a.grad is None else a.grad for a in leaves]  # an unused argument: None
    _assert_close(grads, list(want), f".backward() of {name} on {n_devices} devices")


@pytest.mark.parametrize("n_devices", [1, 4])
def test_jvp_around_the_map_in_debug_mode_is_the_vectorized_jvp(cpu_devices, n_devices):
    """jvp around a shard_map whose collective runs over the mesh's second axis: debug
    mode (positions one at a time, their collectives through the thread exchange) gives
    the vectorized map's tangent, which is the plain math's. The thread exchange's
    gather once took its devices as a tuple argument, which torch.func's generated
    jvp-of-vmap rule flattened into one argument per device and then refused."""
    cpu_devices(n_devices)
    x, w, tangent = map(torch.from_numpy, _inputs([(8, 8), (8, 8), (8, 8)]))
    mesh = tp.make_mesh((2, 4), NAMES)
    axis = NAMES[1]
    f = tp.shard_map(
        lambda w, x: tp.psum(torch.tanh(x @ w), axis),
        mesh=mesh, in_specs=(P(axis, None), P(NAMES[0], axis)), out_specs=P(NAMES[0]),
    )

    def plain(w):  # position (i, j): rows i of x, its columns j with w's rows j; summed over j
        return sum(torch.tanh(x[:, 2 * j:2 * j + 2] @ w[2 * j:2 * j + 2]) for j in range(4))

    _, want = torch.func.jvp(plain, (w,), (tangent,))
    _, vectorized = torch.func.jvp(lambda w: torch.as_tensor(f(w, x)), (w,), (tangent,))
    with tp.disable_vectorization():
        _, debug = torch.func.jvp(lambda w: torch.as_tensor(f(w, x)), (w,), (tangent,))
    torch.testing.assert_close(vectorized, want)
    torch.testing.assert_close(debug, vectorized)


def _where_blocks_run(f):
    """The devices ``f``'s positions ran on (the device each position's thread pins)."""
    seen = set()

    def recording(*blocks):
        seen.update(_devices.current_default() or ())
        return f(*blocks)

    return seen, recording


def test_a_mesh_runs_each_position_on_its_own_device(cpu_devices):
    """Eager, each position of a 2-D Mesh runs on its own device, with check_vma's
    gradients inside and .backward() from outside: one device's numbers. jit=True and a
    transform around the call run the other axes vectorized on the first axis' devices."""
    devs = cpu_devices(4)
    mesh = tp.make_mesh((2, 2), NAMES)
    x, w = map(torch.from_numpy, _inputs([(4, 6), (6, 3)]))

    def program(x, w):  # a replicated weight's gradient inside the map: JAX's implicit pvary
        g = grad(lambda w: tp.psum(x @ w, "model").pow(2).sum())(w)
        return tp.psum(x @ w, "model") * 2, tp.pmean(g, ("batch", "model"))

    specs = dict(in_specs=(P("batch", "model"), P("model", None)), out_specs=(P("batch"), P()))
    one = tp.shard_map(program, mesh=tp.make_mesh((2, 2), NAMES, devices=devs[:1]), **specs)
    seen, recording = _where_blocks_run(program)
    many = tp.shard_map(recording, mesh=mesh, **specs)
    leaves = [w.clone().requires_grad_() for _ in range(2)]
    for got, want in zip(many(x, leaves[0]), one(x, leaves[1])):
        torch.testing.assert_close(torch.as_tensor(got), torch.as_tensor(want))
    assert seen == set(devs)
    torch.as_tensor(many(x, leaves[0])[0]).sum().backward()
    torch.as_tensor(one(x, leaves[1])[0]).sum().backward()
    torch.testing.assert_close(leaves[0].grad, leaves[1].grad)
    seen.clear()
    torch.func.grad(lambda w: torch.as_tensor(many(x, w)[0]).sum())(w)
    assert seen == set(first_axis_devices(mesh))


def test_one_device_is_the_oracle_for_eight(cpu_devices):
    results = {}
    for n in (1, 8):
        cpu_devices(n)
        program, shapes = PROGRAMS["fsdp_step"]
        results[n] = program(torch_side(), *map(torch.from_numpy, _inputs(shapes)))
    for a, b in zip(torch.utils._pytree.tree_leaves(results[1]), torch.utils._pytree.tree_leaves(results[8])):
        torch.testing.assert_close(torch.as_tensor(a), torch.as_tensor(b))


@pytest.mark.parametrize("n_devices", [1, 8])
def test_jit_compiles_the_program(cpu_devices, n_devices):
    cpu_devices(n_devices)
    x, w = map(torch.from_numpy, _inputs([(8, 4), (4, 3)]))
    mesh = tp.make_mesh(SHAPE, NAMES)
    f = tp.shard_map(lambda x, w: tp.psum(x @ w, "model"), mesh=mesh, in_specs=(P("batch", "model"), P("model", None)),
                     out_specs=P("batch", None), jit=True)
    import warnings
    with warnings.catch_warnings():  # 8 devices: the first mesh axis' device threads, each compiled (issue 29)
        warnings.simplefilter("error", tp.JitFallbackWarning)
        out = f(x, w)
    torch.testing.assert_close(torch.as_tensor(out), x @ w, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- results on their devices


@pytest.mark.parametrize("n_devices", [2, 8])
@pytest.mark.parametrize(
    "out_spec, split_dim",
    [(P("batch", "model"), 0), (P(("batch", "model")), 0), (P(None, "batch"), 1), (P(("model", "batch")), None),
     (P("model", None), None)],
    ids=["batch-model", "batch-major", "dim-1", "model-major", "no-batch"],
)
def test_results_stay_on_the_first_axis_devices_where_the_spec_keeps_their_blocks_together(
    cpu_devices, n_devices, out_spec, split_dim
):
    """Each device's blocks are consecutive along the dim that the first mesh axis
    (major) splits: the result is a ShardedTensor split there, on those devices, equal
    to one device's result, differentiable; otherwise (another axis major, or the first
    axis not named) it is gathered."""
    x = torch.arange(32.0).reshape(8, 4)
    spec = P(*out_spec) if len(out_spec) == 2 else P(out_spec[0], None)

    def program(x):  # varies along the axes its spec names (and only those)
        return x * 2 + sum(10.0**k * tp.axis_index(a) for k, a in enumerate(spec.axes()))

    cpu_devices(1)
    one = torch.as_tensor(tp.shard_map(program, mesh=tp.make_mesh(SHAPE, NAMES), in_specs=spec, out_specs=spec)(x))
    cpu_devices(n_devices)
    mesh = tp.make_mesh(SHAPE, NAMES)
    f = tp.shard_map(program, mesh=mesh, in_specs=spec, out_specs=spec)
    leaf = x.clone().requires_grad_()
    got = f(leaf)
    if split_dim is None:
        assert not isinstance(got, tp.ShardedTensor)
    else:
        assert isinstance(got, tp.ShardedTensor) and got.shard_dim == split_dim
        assert got.devices() == list(first_axis_devices(mesh))
    torch.testing.assert_close(torch.as_tensor(got).detach().cpu(), one, rtol=0, atol=0)
    (got * torch.arange(32.0).reshape(8, 4)).sum().backward()
    torch.testing.assert_close(leaf.grad, 2 * torch.arange(32.0).reshape(8, 4))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("n_devices", [2, 8])
def test_a_result_that_stays_on_its_devices_is_taken_there_by_the_next_shard_map(
    cpu_devices, monkeypatch, n_devices, jit
):
    """Layer by layer: a ShardedTensor that one shard_map left on the first axis' devices
    goes into the next one where it is (no shard is copied to another device), with one
    device's values and gradients; one split elsewhere is gathered and split again."""
    from torchpmap._placement import sharded

    x, w1, w2 = torch.randn(8, 6), torch.randn(6, 4), torch.randn(4, 3)

    def network(mesh, x, w1, w2, middle, jit=False):
        first = tp.shard_map(
            lambda x, w: torch.tanh(x @ w), mesh=mesh, in_specs=(P("batch"), P()), out_specs=middle, jit=jit
        )
        second = tp.shard_map(
            lambda h, w: tp.psum(h @ w - h.sum(), "model"), mesh=mesh, in_specs=(P(("batch", "model")), P()),
            out_specs=P("batch"), jit=jit,
        )
        h = first(x, w1)
        return h, second(h, w2)

    # P(('model', 'batch')) interleaves the devices' blocks: that result is gathered, and split again
    middles = {"stays": P("batch"), "gathered": P(("model", "batch"))}
    cpu_devices(1)
    want = {}
    for name, middle in middles.items():
        leaves = [t.clone().requires_grad_() for t in (x, w1, w2)]
        out = torch.as_tensor(network(tp.make_mesh(SHAPE, NAMES), *leaves, middle)[1])
        out.sum().backward()
        want[name] = out.detach(), [t.grad for t in leaves]

    cpu_devices(n_devices)
    mesh = tp.make_mesh(SHAPE, NAMES)
    gathers = []
    concatenated = sharded._concatenated
    monkeypatch.setattr(sharded, "_concatenated", lambda st, device: gathers.append(device) or concatenated(st, device))
    for name, middle in middles.items():
        leaves = [t.clone().requires_grad_() for t in (x, w1, w2)]
        gathers.clear()
        with warnings.catch_warnings():
            warnings.simplefilter("error", tp.JitFallbackWarning)
            h, got = network(mesh, *leaves, middle, jit)
        assert isinstance(h, tp.ShardedTensor) == (name == "stays")
        assert isinstance(got, tp.ShardedTensor) and got.devices() == list(first_axis_devices(mesh))
        assert (gathers == []) == (name == "stays"), gathers
        torch.testing.assert_close(torch.as_tensor(got).detach().cpu(), want[name][0], rtol=1e-6, atol=1e-6)
        arrived = []
        h.register_hook(arrived.append)
        loss = got.sum()  # an op on the whole value: it gathers, as any torch op on a ShardedTensor
        gathers.clear()
        loss.backward()
        if name == "stays":  # the gradient of a result left on its devices stays on them too
            assert isinstance(arrived[0], tp.ShardedTensor) and arrived[0].devices() == h.devices()
            assert gathers == [], gathers
        for leaf, grad_one in zip(leaves, want[name][1]):
            torch.testing.assert_close(leaf.grad, grad_one, rtol=1e-5, atol=1e-5)


CHAIN_SPECS = [P("batch"), P(None, "batch"), P(("batch", "model")), P(("model", "batch")), P("batch", "model"),
               P("model", "batch"), P(), P("model"), P(None, ("batch", "model"))]


@pytest.mark.parametrize("n_devices", [2, 8])
def test_every_pair_of_specs_in_a_chain_gives_one_devices_bits(cpu_devices, n_devices):
    """Two shard_maps in a row, for every pair of 9 specs (results that stay on their
    devices and go into the next map where they are, and those gathered and split again):
    bitwise one device's values (check_vma off, so that every pair runs)."""

    def chain(mesh, s1, s2):
        f1 = tp.shard_map(lambda v: v * 2 + tp.axis_index("batch") * 100 + tp.axis_index("model") * 1000,
                          mesh=mesh, in_specs=s1, out_specs=s1, check_vma=False)
        f2 = tp.shard_map(lambda v: v + tp.axis_index("batch") * 7 + tp.axis_index("model") * 3,
                          mesh=mesh, in_specs=s2, out_specs=s2, check_vma=False)
        return torch.as_tensor(f2(f1(x))).cpu()

    x = torch.arange(16 * 8, dtype=torch.float64).reshape(16, 8)
    cpu_devices(1)
    one_mesh = tp.make_mesh(SHAPE, NAMES)
    want = {(str(a), str(b)): chain(one_mesh, a, b) for a in CHAIN_SPECS for b in CHAIN_SPECS}
    cpu_devices(n_devices)
    mesh = tp.make_mesh(SHAPE, NAMES)
    for a in CHAIN_SPECS:
        for b in CHAIN_SPECS:
            assert torch.equal(chain(mesh, a, b), want[(str(a), str(b))]), (a, b)


# --------------------------------------------------------------------------- check_vma


def test_an_output_that_varies_along_an_axis_its_spec_leaves_out_raises():
    mesh = tp.make_mesh(SHAPE, NAMES, devices=tp.devices()[:1])
    x = torch.randn(8, 4)
    f = tp.shard_map(lambda x: x.sum(0), mesh=mesh, in_specs=P("batch"), out_specs=P())
    with pytest.raises(ValueError, match="varies along a mesh axis that its out_spec leaves out.*check_vma=False"):
        f(x)
    # unchecked: the first position's value, as JAX with check_vma=False
    unchecked = tp.shard_map(lambda x: x.sum(0), mesh=mesh, in_specs=P("batch"), out_specs=P(), check_vma=False)
    torch.testing.assert_close(unchecked(x).cpu(), x[:2].sum(0))
    # psum, pmean and all_gather make it the same along the axis
    for reduce in (lambda v: tp.psum(v, "batch"), lambda v: tp.pmean(v, "batch")):
        tp.shard_map(lambda x: reduce(x.sum(0)), mesh=mesh, in_specs=P("batch"), out_specs=P())(x)
    # replicated inputs are the same along every axis; pvary marks a value as varying
    w = torch.randn(4)
    torch.testing.assert_close(tp.shard_map(lambda w: w * 2, mesh=mesh, in_specs=P(), out_specs=P())(w).cpu(), w * 2)
    with pytest.raises(ValueError, match="varies along a mesh axis"):
        tp.shard_map(lambda w: tp.pvary(w, "model"), mesh=mesh, in_specs=P(), out_specs=P())(w)
    out = tp.shard_map(lambda w: tp.pvary(w, "model"), mesh=mesh, in_specs=P(), out_specs=P("model"))(w)
    torch.testing.assert_close(out.cpu(), torch.cat([w, w]))
    # a gradient inside the map of a replicated weight used with the split batch is JAX's:
    # the weight is varied implicitly where it meets the batch, and pvary's transpose sums
    # the positions' parts, so the gradient is the same on every position, as the weight
    def implicit(x, w):
        return grad(lambda w: tp.psum((x @ w).sum(), "batch"))(w)

    def explicit(x, w):
        return grad(lambda w: tp.psum((x @ tp.pvary(w, "batch")).sum(), "batch"))(w)

    for program in (implicit, explicit):
        summed = tp.shard_map(program, mesh=mesh, in_specs=(P("batch"), P()), out_specs=P())(x, w)
        torch.testing.assert_close(summed.cpu(), x.sum(0))


THREE_D = {
    "all_gather over (y, x)": (lambda C: lambda a: C.all_gather(a, ("y", "x"), tiled=True), ("x", "y"), ()),
    "psum over (y, x)": (lambda C: lambda a: C.psum(a * a, ("y", "x")), ("x", "y"), ()),
    "psum_scatter over (x, y)": (
        lambda C: lambda a: C.psum_scatter(a * a, ("x", "y"), scatter_dimension=1, tiled=True), (), (None, ("x", "y"))),
}


@pytest.mark.parametrize(("name", "check_vma"), [(name, vma) for name in sorted(THREE_D) for vma in (False, True)
                                                 if vma is False or not name.startswith("all_gather")])
def test_backward_through_collectives_over_a_device_axis_and_vectorized_axes(cpu_devices, name, check_vma):
    """A (2, 2, 2) mesh on 8 devices puts "x" on device threads, "y" and "z" vectorized on
    them: a collective over a tuple with "x" in it ran through an autograd node that a
    ``.backward()`` outside the map could not run (refused, where one device and JAX
    compute it). Now 1 and 8 devices give JAX's values and gradients."""
    body, in_axes, out_axes = THREE_D[name]
    names = ("x", "y", "z")
    a = _inputs([(4, 4)])[0]
    weights = _inputs([(16, 4) if name.startswith("all_gather") else (4, 4)], seed=1)[0]
    if name.startswith("psum_scatter"):
        weights = _inputs([(4, 4)], seed=1)[0]
    jmesh = jax.make_mesh((2, 2, 2), names, axis_types=(AxisType.Auto,) * 3)
    jf = jax.shard_map(body(SimpleNamespace(all_gather=lax.all_gather, psum=lax.psum, psum_scatter=lax.psum_scatter)),
                       mesh=jmesh, in_specs=JP(in_axes or None), out_specs=JP(*out_axes), check_vma=check_vma)
    want_out = np.asarray(jf(jnp.asarray(a)))
    weights = weights[: want_out.shape[0], : want_out.shape[1]]
    want_grad = np.asarray(jax.grad(lambda a: (jf(a) * weights).sum())(jnp.asarray(a)))
    for n in (1, 8):
        devices = cpu_devices(n)
        mesh = tp.make_mesh((2, 2, 2), names, devices=devices[:n])
        f = tp.shard_map(body(tp), mesh=mesh, in_specs=P(in_axes or None), out_specs=P(*out_axes), check_vma=check_vma)
        x = torch.from_numpy(a).requires_grad_()
        out = torch.as_tensor(f(x)).cpu()
        (out * torch.from_numpy(weights)).sum().backward()
        np.testing.assert_allclose(out.detach().numpy(), want_out, rtol=2e-5, atol=2e-5, err_msg=f"{name} on {n}")
        np.testing.assert_allclose(x.grad.numpy(), want_grad, rtol=2e-5, atol=2e-5, err_msg=f"{name} on {n}")


def test_pvary_transposes_to_psum():
    """The gradient of a replicated value made varying sums every position's cotangent."""
    mesh = tp.make_mesh(SHAPE, NAMES, devices=tp.devices()[:1])
    w = torch.randn(3)

    def total(w):
        out = tp.shard_map(lambda w: tp.pvary(w, ("batch", "model")) * (tp.axis_index("batch") + 1),
                           mesh=mesh, in_specs=P(), out_specs=P(("batch", "model")))(w)
        return out.sum()

    # positions (b, m) contribute (b + 1) each: 2 * (1 + 2 + 3 + 4) = 20 per element
    torch.testing.assert_close(grad(total)(w), torch.full((3,), 20.0))


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "in_specs, x_shape, match",
    [
        (
            P("batch", None, None),
            (8, 4),
            r"PartitionSpec\('batch', None, None\), with 3 entries, but the tensor has rank 2 \(shape \(8, 4\)\)",
        ),
        (P("depth"), (8, 4), r"names mesh axis 'depth', but the mesh's axes are \('batch', 'model'\)"),
        (P("batch", "batch"), (8, 4), r"names mesh axis 'batch' twice"),
        (P(("batch", "model")), (12, 4), r"dim 0 of argument 0 has size 12.*\('batch', 'model'\).*8 blocks.*Pad"),
        (P(None, "batch"), (8, 6), r"dim 1 of argument 0 has size 6.*'batch': 4"),
    ],
)
def test_bad_specs_are_named_with_sizes_and_a_way_out(in_specs, x_shape, match):
    mesh = tp.make_mesh(SHAPE, NAMES, devices=tp.devices()[:1])
    with pytest.raises((ValueError, TypeError), match=match):
        tp.shard_map(lambda x: x, mesh=mesh, in_specs=in_specs, out_specs=P("batch"))(torch.zeros(x_shape))


def test_other_misuse_is_named():
    mesh = tp.make_mesh(SHAPE, NAMES, devices=tp.devices()[:1])
    with pytest.raises(TypeError, match="mesh must be a torchpmap.Mesh"):
        tp.shard_map(lambda x: x, mesh="mesh", in_specs=P(), out_specs=P())
    with pytest.raises(
        TypeError, match=r"in_specs\[0\] is 'batch' of type str; the leaves of in_specs are PartitionSpecs"
    ):
        tp.shard_map(lambda x: x, mesh=mesh, in_specs=("batch",), out_specs=P())
    with pytest.raises(TypeError, match="keyword arguments"):
        tp.shard_map(lambda x: x, mesh=mesh, in_specs=P(), out_specs=P())(x=torch.zeros(2))
    with pytest.raises(TypeError, match="is float, not a tensor"):
        tp.shard_map(lambda x: x, mesh=mesh, in_specs=P("batch"), out_specs=P())(1.5)
    with pytest.raises(ValueError, match=r"out_spec of the output at \(the root\) is P.*3 entries.*rank 2"):
        tp.shard_map(lambda x: x, mesh=mesh, in_specs=P("batch"), out_specs=P("batch", None, None))(torch.zeros(8, 2))
    with pytest.raises(TypeError, match="tuple, got the list"):
        P(["batch", "model"])


def test_make_mesh():
    mesh = tp.make_mesh((1,), ("x",))
    assert isinstance(mesh, tp.Mesh) and mesh.shape == {"x": 1}
    with pytest.raises(ValueError, match="2 axes but 1 axis names"):
        tp.make_mesh((2, 2), ("x",))
    with pytest.raises(ValueError, match="positive ints"):
        tp.make_mesh((0,), ("x",))
    with pytest.raises(ValueError, match="distinct"):
        tp.make_mesh((2, 2), ("x", "x"))


def test_make_mesh_spreads_the_first_axis_over_fewer_devices(cpu_devices):
    devs = cpu_devices(3)
    with pytest.raises(ValueError, match=r"3 does not divide 4\. Pass devices=torchpmap.devices\(\)\[:2\]"):
        tp.make_mesh((4, 2), NAMES, devices=devs)
    for mesh in (tp.make_mesh((4, 2), NAMES, devices=devs[:2]), tp.make_mesh((4, 2), NAMES)):  # the most that divide 4
        assert isinstance(mesh, tp.AbstractMesh) and mesh.devices == tuple(devs[:2])
    assert tp.make_mesh((3, 4), NAMES).devices == tuple(devs)


def test_shard_map_is_a_decorator():
    mesh = tp.make_mesh(SHAPE, NAMES, devices=tp.devices()[:1])

    @tp.shard_map(mesh=mesh, in_specs=P("batch"), out_specs=P("batch"))
    def double(x):
        return x * 2

    torch.testing.assert_close(torch.as_tensor(double(torch.arange(8.0))).cpu(), torch.arange(8.0) * 2)
    assert double.__name__ == "double"


@pytest.mark.parametrize("spec", [P("batch"), P(None, "model"), P()])
def test_a_write_into_a_block_several_positions_share_is_refused_everywhere(cpu_devices, spec):
    """A block replicated along a mesh axis is written once per position on a device per
    position, once on one device: refused on both, as pmap refuses a write into an
    argument with in_axes None. A block of each position's own is written as it is."""

    def write(x):
        x.add_(1)
        return x * 1

    for n in (1, 4):
        cpu_devices(n)
        mesh = tp.make_mesh((2, 2), NAMES)
        with pytest.raises(RuntimeError, match="wrote in place"):
            tp.shard_map(write, mesh=mesh, in_specs=spec, out_specs=P(), check_vma=False)(torch.zeros(4, 2))
        own = torch.zeros(4, 2)
        tp.shard_map(write, mesh=mesh, in_specs=P("batch", "model"), out_specs=P("batch", "model"))(own)
        assert torch.equal(own, torch.ones(4, 2)), n


@pytest.mark.parametrize("n", [1, 2, 4])
def test_a_value_read_into_python_keeps_what_it_varies_along(cpu_devices, n):
    """``.item()`` of a block's sum: read once where every instance of a vmap holds the
    same value, one position at a time otherwise. A vmap of one (a position in its own
    thread: a mesh position on its device, or an instance run alone) holds the same value
    trivially, so the positions' results are compared across threads, as on one device the
    read is refused where the positions differ. On every placement: an out_spec that leaves
    out an axis the read value varies along is an error, one that names it gives each
    position's value (nested maps inside an instance run alone fall back on their own)."""
    cpu_devices(n)
    mesh = tp.make_mesh((2, 2), ("x", "y"))
    x = torch.arange(8.0).reshape(4, 2)

    def read(a):
        return torch.tensor([a.sum().item()])

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tp.VectorizationFallbackWarning)
        for spec in (P("x"), P("y")):
            got = tp.shard_map(read, mesh=mesh, in_specs=spec, out_specs=spec)(x)
            torch.testing.assert_close(torch.as_tensor(got), torch.tensor([6.0, 22.0]))
            for other in (P(), P("y") if spec == P("x") else P("x")):
                with pytest.raises(ValueError, match="varies along a mesh axis that its out_spec leaves out"):
                    tp.shard_map(read, mesh=mesh, in_specs=spec, out_specs=other)(x)
        same = tp.shard_map(read, mesh=mesh, in_specs=P(), out_specs=P())(x)  # every position reads 28
        torch.testing.assert_close(torch.as_tensor(same), torch.tensor([28.0]))


@pytest.mark.parametrize("jit", [False, True])
def test_shard_map_inside_a_multi_device_pmap_pairs_each_position_with_its_own(four_devices, jit):
    """A shard_map whose positions run in threads inside a pmap on several devices: a
    collective over the pmap's axis from a position met whichever position of the other
    instance came first (one door per pmap slice, shared by its positions), so the sum
    added another position's block, differently from run to run (17 of 20 runs wrong)."""
    x = torch.arange(8.0).reshape(2, 4, 1)
    ring = [(0, 1), (1, 2), (2, 3), (3, 0)]
    mesh = tp.make_mesh((4,), ("a",), devices=four_devices)
    inner = tp.shard_map(lambda v: tp.ppermute(v, "a", ring) + 100 * tp.psum(v, "i"),
                         mesh=mesh, in_specs=tp.P("a"), out_specs=tp.P("a"))
    f = tp.pmap(inner, axis_name="i", devices=four_devices[:2], jit=jit)
    want = torch.roll(x, 1, dims=1) + 100 * x.sum(0, keepdim=True)
    square = tp.make_mesh((2, 2), ("a", "b"), devices=four_devices)
    g = tp.pmap(tp.shard_map(lambda v: tp.psum(tp.psum(v, "b"), "i") + v, mesh=square, in_specs=tp.P("a", "b"),
                             out_specs=tp.P("a", "b")), axis_name="i", devices=four_devices[:2], jit=jit)
    y = torch.arange(8.0).reshape(2, 2, 2)
    for _ in range(8):
        torch.testing.assert_close(torch.as_tensor(f(x)), want, rtol=0, atol=0)
        torch.testing.assert_close(torch.as_tensor(g(y)), y.sum((0, 2), keepdim=True) + y, rtol=0, atol=0)
    xs = x.clone().requires_grad_()
    (torch.as_tensor(f(xs)) * torch.arange(8.0).reshape(2, 4, 1)).sum().backward()
    ws = xs.detach().clone().requires_grad_()
    ((torch.roll(ws, 1, dims=1) + 100 * ws.sum(0, keepdim=True)) * torch.arange(8.0).reshape(2, 4, 1)).sum().backward()
    torch.testing.assert_close(xs.grad, ws.grad)


def test_shard_map_inside_pmap_computes_on_every_placement(placement):
    """Inside a pmap's instance pinned to a device, a shard_map whose mesh has more
    positions than devices named the mesh's devices, which a nested map may not: it
    raised on 1 and 2 devices ("a pmap nested inside a multi-device pmap ... cannot
    take devices=", on one device too) and computed on 4 and 8."""
    x = torch.arange(8.0).reshape(2, 4, 1)
    ring = [(0, 1), (1, 2), (2, 3), (3, 0)]
    mesh = tp.make_mesh((4,), ("a",))
    want = torch.roll(x, 1, dims=1).sum(0, keepdim=True).expand(2, 4, 1)

    def f(v: torch.Tensor) -> torch.Tensor:
        return tp.psum(tp.ppermute(v, "a", ring), "i")

    for inner_jit in (False, True):
        inner = tp.shard_map(f, mesh=mesh, in_specs=tp.P("a"), out_specs=tp.P("a"), jit=inner_jit)
        torch.testing.assert_close(torch.as_tensor(tp.pmap(inner, axis_name="i")(x)), want, rtol=0, atol=0)
    inner = tp.shard_map(lambda v: f(v) * v, mesh=mesh, in_specs=tp.P("a"), out_specs=tp.P("a"))
    got = torch.func.grad(lambda v: torch.as_tensor(tp.pmap(inner, axis_name="i")(v)).sum())(x)
    torch.testing.assert_close(got, torch.func.grad(lambda v: (torch.roll(v, 1, 1).sum(0, keepdim=True) * v).sum())(x))


def test_model_parallel_inference_under_inference_mode(placement):
    """A Megatron-style product under ``torch.inference_mode`` (inference tensors in):
    the replicated weight's version counter was read to refuse writes into it, and every
    placement raised "Inference tensors do not track version counter"."""
    mesh = tp.make_mesh((2, 2), ("data", "model"))
    f = tp.shard_map(
        lambda x, w: tp.psum(x @ w, "model"), mesh=mesh, in_specs=(P("data", "model"), P("model", None)),
        out_specs=P("data"),
    )
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        x, w = torch.randn(8, 6, generator=g), torch.randn(6, 4, generator=g)
        got = torch.as_tensor(f(x, w))
        resharded = torch.as_tensor(tp.shard_map(lambda v: v * 2, mesh=mesh, in_specs=P(None, "data"),
                                                 out_specs=P(None, "data"))(f(x, w)))
    torch.testing.assert_close(got, x @ w)
    torch.testing.assert_close(resharded, 2 * (x @ w))
