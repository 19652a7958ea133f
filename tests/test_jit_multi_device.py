"""``pmap(jit=True)`` on 4 CPU devices in one process: compiled device slices, no fallback.

Each program runs compiled on 4 devices (a ``JitFallbackWarning`` is an error here, and
each test checks that the device slices were compiled), eagerly on 4 devices, and on one
device (the oracle); all three agree (to rounding: inductor fuses and reorders float ops).
The module makes its own 4 CPU devices, so it runs the same in the suite's 1-device and
4-device passes. See :mod:`torchpmap._engines.compiled_devices`.
"""
import os
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import pytest
import torch
from torch.func import grad

import torchpmap as tp

pytestmark = pytest.mark.filterwarnings("error::torchpmap.JitFallbackWarning")


def _compiled_slices(f):
    """How many signatures of ``f`` run through compiled device slices (not eagerly)."""
    return sum(p is not None for p in f._programs.device_slices.values())


def _three(fun, *args, **kw):
    """(compiled on 4 devices, eager on 4 devices, one device), each called twice
    (the second compiled call runs the cached programs)."""
    out = []
    for extra in (dict(jit=True), {}, dict(devices=tp.devices()[:1])):
        f = tp.pmap(fun, **kw, **extra)
        f(*args)
        out.append(torch.as_tensor(f(*args)))
        if "jit" in extra:
            assert _compiled_slices(f) == 1
    return out


PROGRAMS = {
    "psum": lambda v: tp.psum(v * 2, "i").sin(),
    "pmean": lambda v: tp.pmean(v, "i") * v,
    "all_gather": lambda v: tp.all_gather(v, "i").cos(),
    "ppermute": lambda v: tp.ppermute(v.exp(), "i", [(j, (j + 3) % 8) for j in range(8)]),
    "all_to_all": lambda v: tp.all_to_all(v.repeat(4)[:8].reshape(8, 1), "i", 0, 1),
    "axis_index": lambda v: v * tp.axis_index("i"),
}


def _check_placements_agree(fun, x):
    """Compiled on 4 devices == eager on 4 devices == one device."""
    jit, eager, one = _three(fun, x, axis_name="i")
    torch.testing.assert_close(jit, eager)
    torch.testing.assert_close(jit, one)


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_collectives(four_devices, name):
    _check_placements_agree(PROGRAMS[name], torch.randn(8, 3, generator=torch.Generator().manual_seed(0)))


def _shifted_sin(u):
    return tp.ppermute(u.sin(), "i", [(j, (j + 1) % 4) for j in range(4)])


#: One instance per device (no vmap inside a slice), where two programs once fell back:
#: a collective of a constant (fake-tensor mode ran the op for real while tracing) and a
#: Jacobian through ppermute (one slice's trace dropped an exchange whose result it never
#: read, and met the others' next exchange with the wrong values).
ONE_PER_DEVICE = {
    "psum_of_a_constant": lambda v: tp.psum(2.0, "i") + v,
    "jacobians_of_ppermute": lambda v: torch.stack(
        [torch.func.jacrev(_shifted_sin)(v), torch.func.jacfwd(_shifted_sin)(v)]
    ),
}


@pytest.mark.parametrize("name", sorted(ONE_PER_DEVICE))
def test_one_instance_per_device(four_devices, name):
    _check_placements_agree(ONE_PER_DEVICE[name], torch.randn(4, 2, generator=torch.Generator().manual_seed(4)))


def _loss(w, x, y):
    return ((x @ w - y) ** 2).mean()


def test_data_parallel_step(four_devices):
    g = torch.Generator().manual_seed(1)
    w, x, y = torch.randn(3, generator=g), torch.randn(4, 5, 3, generator=g), torch.randn(4, 5, generator=g)
    step = lambda w, x, y: w - 0.1 * tp.pmean(grad(_loss)(w, x, y), "b")  # noqa: E731
    jit, eager, one = _three(step, w, x, y, axis_name="b", in_axes=(None, 0, 0))
    torch.testing.assert_close(jit, eager)
    torch.testing.assert_close(jit, one)


def test_backward_through_a_result(four_devices):
    g = torch.Generator().manual_seed(2)
    w, x = torch.randn(3, generator=g), torch.randn(8, 3, generator=g)

    def fwd(w, v):
        h = torch.tanh(v * w)
        shifted = tp.ppermute(h, "b", [(j, (j + 1) % 8) for j in range(8)])
        return tp.psum(h, "b") * tp.all_gather(h.sum(), "b").sum() + shifted

    results = []
    for extra in (dict(jit=True), {}, dict(devices=tp.devices()[:1])):
        f = tp.pmap(fwd, axis_name="b", in_axes=(None, 0), **extra)
        for _ in range(2):  # the second compiled call runs the cached programs
            wr, xr = w.clone().requires_grad_(), x.clone().requires_grad_()
            out = torch.as_tensor(f(wr, xr))
            out.pow(2).sum().backward()
        results.append((out.detach(), wr.grad, xr.grad))
        if "jit" in extra:
            assert _compiled_slices(f) == 1
    for jit, other in ((results[0], results[1]), (results[0], results[2])):
        for a, b in zip(jit, other):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("size", [4, 8])
def test_a_second_derivative_through_a_result_raises_on_every_placement(four_devices, size):
    """One device's compiled program raises AOTAutograd's "does not currently support
    double backward"; the compiled device slices gave the first derivative without a graph,
    so the second came back None (``allow_unused``) or zeros, silently."""
    for placement in (four_devices[:1], four_devices):
        f = tp.pmap(lambda v: tp.psum(v**3, "i") * v, axis_name="i", jit=True, devices=placement)
        x = torch.arange(float(size), requires_grad=True)
        with pytest.raises(RuntimeError, match="does not currently support double backward"):
            (g,) = torch.autograd.grad(torch.as_tensor(f(x)).sum(), x, create_graph=True)
            torch.autograd.grad(g.sum(), x, allow_unused=True)
        (g,) = torch.autograd.grad(torch.as_tensor(f(x)).sum(), x)  # a first derivative, as ever
        assert torch.equal(g, 3 * x.detach() ** 2 * x.detach().sum() + (x.detach() ** 3).sum()), placement


def test_nested_pmap_of_pmap(four_devices):
    xs = torch.randn(4, 2, 3, generator=torch.Generator().manual_seed(3))
    inner = lambda v: tp.psum(v, "j") * tp.axis_index("i") + tp.pmean(v, "i")  # noqa: E731
    jit, eager, one = _three(tp.pmap(inner, axis_name="j"), xs, axis_name="i")
    torch.testing.assert_close(jit, eager)
    torch.testing.assert_close(jit, one)
    both = tp.pmap(tp.pmap(inner, axis_name="j", jit=True), axis_name="i", jit=True)  # traced into the slices
    both(xs)
    torch.testing.assert_close(torch.as_tensor(both(xs)), one)
    assert _compiled_slices(both) == 1


def test_a_jit_pmap_inside_an_eager_one_joins_its_computation():
    """An eager pmap on 4 devices (one instance each: no vmap) around a ``jit=True`` pmap
    whose collective runs over the outer axis: the inner call is part of the outer
    instance's computation, eagerly, as inside any enclosing map. It used to trace on its
    own in each device thread, holding the process' tracing lock while its collective
    waited for the other device threads, which waited for the lock: a hang that no
    collective timeout ended. A fresh process, so that a hang cannot stall the suite."""
    code = (
        "import warnings, torch, torchpmap as tp\n"
        "warnings.simplefilter('error', tp.JitFallbackWarning)\n"
        "inner = lambda v: tp.psum(v, 'i') + tp.psum(v, 'j') * tp.axis_index('i')\n"
        "x = torch.arange(24.0).reshape(4, 2, 3)\n"
        "f = tp.pmap(tp.pmap(inner, axis_name='j', jit=True), axis_name='i')\n"
        "one = tp.pmap(tp.pmap(inner, axis_name='j'), axis_name='i', devices=tp.devices()[:1])\n"
        "torch.testing.assert_close(torch.as_tensor(f(x)), torch.as_tensor(one(x)))\n"
        "print(len(tp.devices()), 'ok')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent), "TORCHPMAP_NUM_CPU_DEVICES": "4",
           "TORCHPMAP_COLLECTIVE_TIMEOUT": "60", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=240)
    assert done.returncode == 0 and done.stdout.split() == ["4", "ok"], (done.stdout, done.stderr[-2000:])


@pytest.mark.parametrize("size", [4, 8])
def test_random_numbers_compile_drawing_from_each_devices_stream(four_devices, size):
    """Dropout compiles on several devices: each device's program draws from its thread's
    own stream, seeded from the call's one draw of the caller's generator. So a call is
    reproducible with ``torch.manual_seed`` (the first, which traces, too), whatever
    order the device threads run in; each instance gets a mask of its own; and the
    backward uses the mask the forward drew."""

    def f(v):
        return torch.nn.functional.dropout(v, 0.5, training=True) * tp.pmean(v.mean(), "i")

    fun = tp.pmap(f, axis_name="i", jit=True)
    x = torch.ones(size, 400)
    outs = []
    for seed in (0, 0, 1, 0, 0):
        torch.manual_seed(seed)
        outs.append(torch.as_tensor(fun(x)))
    assert _compiled_slices(fun) == 1
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[3]) and torch.equal(outs[0], outs[4])
    assert not torch.equal(outs[0], outs[2])
    kept = outs[0] != 0
    assert 0.4 < kept.float().mean() < 0.6
    assert len({tuple(row.tolist()) for row in kept}) == size  # no two instances share a mask

    dropout = tp.pmap(lambda v: torch.nn.functional.dropout(v, 0.5, training=True), axis_name="i", jit=True)
    for _ in range(2):  # traced, then the cached programs
        xs = torch.ones(size, 400, requires_grad=True)
        y = dropout(xs)
        y.sum().backward()
        torch.testing.assert_close(xs.grad, torch.as_tensor(y).detach(), rtol=0, atol=0)  # 2 where kept, else 0
    assert _compiled_slices(dropout) == 1


@pytest.mark.parametrize("randomness", ["same"])  # ("per_instance" refuses jit=True on every placement)
def test_random_numbers_of_other_randomness_run_eagerly_with_a_warning(four_devices, randomness):
    """Under ``"same"`` the numbers are the eager engine's on every placement, which a
    compiled program would not draw."""
    f = tp.pmap(lambda v: v + torch.rand(()), axis_name="i", jit=True, randomness=randomness)
    with pytest.warns(tp.JitFallbackWarning, match=f'draws random numbers .* under randomness="{randomness}"'):
        out = f(torch.zeros(4))
    torch.manual_seed(3)
    eager = torch.as_tensor(tp.pmap(lambda v: v + torch.rand(()), axis_name="i", randomness=randomness)(torch.zeros(4)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one warning per signature
        torch.manual_seed(3)
        out = f(torch.zeros(4))
    torch.testing.assert_close(torch.as_tensor(out), eager, rtol=0, atol=0)


@pytest.mark.parametrize("size", [4, 8])
def test_a_data_assignment_runs_eagerly_with_a_warning(four_devices, size):
    """``t.data = ...`` swaps the tensor behind ``t`` without an op that a trace records:
    compiled, one instance per device returned the old values (``t + 1``). It runs eagerly
    now, with the loop's numbers, on every placement."""

    def f(t):
        t.data = t * 3
        return t + 1

    x = torch.arange(2.0 * size).reshape(size, 2)
    want = torch.stack([f(row.clone()) for row in x])
    for devices in (tp.devices(), tp.devices()[:1]):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # one device: vmap refuses .data, a VectorizationFallbackWarning too
            got = tp.pmap(f, jit=True, devices=devices)(x.clone())
        torch.testing.assert_close(torch.as_tensor(got).cpu(), want)
    if size == 4:  # with 2 instances per device, vmap's own refusal comes first
        with pytest.warns(tp.JitFallbackWarning, match="cannot be traced"):
            tp.pmap(f, jit=True)(x.clone())


LOW_PRECISION = {
    "a round trip through bfloat16": lambda v: v.to(torch.bfloat16).float() * 3,
    "a copy into a bfloat16 buffer": lambda v: torch.empty_like(v, dtype=torch.bfloat16).copy_(v) * 3,
    "bfloat16 arithmetic": lambda v: (v.to(torch.bfloat16) * 1.1 + 0.3).float(),
    "float16 arithmetic": lambda v: (v.half().exp() * v.half()).float(),
}


@pytest.mark.parametrize("name", list(LOW_PRECISION))
def test_low_precision_rounds_the_same_on_every_placement(four_devices, name):
    """One device's compiled program (every instance) and 4 devices' (a slice each) are
    fused differently; inductor's default skipped roundings inside a fused kernel, so they
    disagreed by a bfloat16 ulp or two. Compiled programs round at each cast as eager
    does (torch_private.eager_rounding_options): the same bits on both placements, and
    eager's at the casts."""
    from torchpmap._state import torch_private

    if not torch_private.rounds_round_trips():
        pytest.skip(f"torch {torch.__version__}'s inductor folds a round trip through bfloat16 away, even with "
                    "emulate_precision_casts (see docs/performance.md)")
    fun = LOW_PRECISION[name]
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(7))
    jit, eager, _ = _three(fun, x)
    one = tp.pmap(fun, jit=True, devices=tp.devices()[:1])
    one(x)
    jit_one = torch.as_tensor(one(x))
    assert torch.equal(jit, jit_one), (jit - jit_one).abs().max()
    if "arithmetic" not in name:  # inside a fused kernel arithmetic stays in float32: to rounding
        assert torch.equal(jit, eager), (jit - eager).abs().max()
    else:
        torch.testing.assert_close(jit, eager, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("name", ["add_", "fill_"])
def test_a_write_into_an_expanded_tensor_runs_eagerly(four_devices, name):
    """Fake tensors skip eager's check of a write into memory several elements share. The
    compiled program wrote ``add_``'s sum through the expanded view, where every eager
    placement raises, and ``fill_`` (which eager allows there) compiled to wrong numbers,
    under plain torch.compile too. Such a program runs eagerly now, on every placement:
    eager's error, or eager's numbers."""

    def write(t):
        grown = (t * 1).unsqueeze(0).expand(3, 2)
        return getattr(grown, name)(2.0) + t

    x = torch.arange(8.0).reshape(4, 2)
    for devices in (tp.devices(), tp.devices()[:1]):
        for jit in (True, False):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", tp.JitFallbackWarning)
                if name == "add_":
                    with pytest.raises(RuntimeError, match="more than one element of the written-to tensor"):
                        tp.pmap(write, jit=jit, devices=devices)(x)
                else:
                    got = torch.as_tensor(tp.pmap(write, jit=jit, devices=devices)(x)).cpu()
                    torch.testing.assert_close(got, torch.stack([write(row) for row in x]))
    if name == "fill_":  # a new mapped function: the warning comes once per signature
        with pytest.warns(tp.JitFallbackWarning, match="share memory"):
            tp.pmap(lambda t: write(t), jit=True, devices=tp.devices()[:1])(x)


KERNEL_REFUSALS = {
    "hypot of integers": (lambda t: torch.hypot(t, t), "not implemented for"),
    "a float product written into an int tensor": (
        lambda t: t.mul_(torch.tensor(2.5)), "result type Float can't be cast to the desired output type"
    ),
    "true division in place on integers": (lambda t: t.div_(2), "result type Float can't be cast"),
}


@pytest.mark.parametrize("name", list(KERNEL_REFUSALS))
def test_what_eager_kernels_refuse_is_refused_compiled_too(four_devices, name):
    """Fake tensors compute result dtypes only: the trace accepted kernels eager refuses for
    the dtypes, and one device's compiled program returned truncated numbers (and wrote
    them into the caller's tensor) where every eager placement raised. The trace runs each
    elementwise op on one-element real tensors too: the call runs eagerly and raises
    eager's error, on every placement, and leaves the argument as it was."""
    fun, message = KERNEL_REFUSALS[name]
    for devices in (tp.devices(), tp.devices()[:1]):
        for jit in (True, False):
            x = torch.arange(8, dtype=torch.int32).reshape(4, 2)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", tp.JitFallbackWarning)
                with pytest.raises(RuntimeError, match=message):
                    tp.pmap(fun, jit=jit, devices=devices)(x)
            assert torch.equal(x, torch.arange(8, dtype=torch.int32).reshape(4, 2)), (name, len(devices), jit)


@pytest.mark.parametrize("name", ["t_", "transpose_", "unsqueeze_"])
def test_an_argument_reshaped_in_place_stays_the_callers(four_devices, name):
    """``v.t_()`` changes the instance's view of the argument in eager; the compiled
    program on one device transposed the caller's tensor. Such a program runs eagerly."""
    ops = {"t_": lambda v: v.t_(), "transpose_": lambda v: v.transpose_(0, 1), "unsqueeze_": lambda v: v.unsqueeze_(0)}
    fun = lambda v: ops[name](v) * 2  # noqa: E731
    want = torch.stack([fun(row.clone()) for row in torch.arange(24.0).reshape(4, 2, 3)])
    for devices in (tp.devices()[:1], tp.devices()):
        x = torch.arange(24.0).reshape(4, 2, 3)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", tp.JitFallbackWarning)
            got = torch.as_tensor(tp.pmap(fun, jit=True, devices=devices)(x)).cpu()
        torch.testing.assert_close(got, want)
        assert (tuple(x.shape), x.stride()) == ((4, 2, 3), (6, 3, 1)), (name, len(devices))


def _gathered_shapes(f):
    """The shapes that the first device's slice sends to its exchanges, in the program
    ``f`` compiled last."""
    from torchpmap._engines import thread_ops

    programs = [p for p in f._programs.device_slices.values() if p is not None][-1]
    shapes = []
    for sub in programs.slices[0].module.children():
        for node in getattr(sub, "graph_module", sub).graph.nodes:
            if node.op == "call_function" and node.target is thread_ops.gather_live:
                shapes += [tuple(t.meta["val"].shape) for t in node.args[0]]
    return shapes


@pytest.mark.parametrize("bitwise", [False, True])
def test_a_slice_sends_its_own_sum_unless_placement_must_be_bitwise(four_devices, monkeypatch, bitwise):
    # compiled, a slice of 2 instances sends one partial sum (its products then fold over
    # its samples); under bitwise_placement, both instances' values, as the eager engine
    g = torch.Generator().manual_seed(5)
    w, x, y = torch.randn(3, 2, generator=g), torch.randn(8, 5, 3, generator=g), torch.randn(8, 5, 2, generator=g)
    step = lambda w, x, y: w - 0.1 * tp.pmean(grad(lambda w: ((x @ w - y) ** 2).mean())(w), "b")  # noqa: E731
    f = tp.pmap(step, axis_name="b", in_axes=(None, 0, 0), jit=True)
    monkeypatch.setattr(tp.config, "bitwise_placement", not bitwise)
    f(w, x, y)  # a program of the other setting first: the setting is part of the program's key
    monkeypatch.setattr(tp.config, "bitwise_placement", bitwise)
    got = torch.as_tensor(f(w, x, y))
    assert _compiled_slices(f) == 2
    assert _gathered_shapes(f) == [(2 if bitwise else 1, 3, 2)]
    one = tp.pmap(step, axis_name="b", in_axes=(None, 0, 0), devices=tp.devices()[:1])(w, x, y)
    torch.testing.assert_close(got, one)


MADE_TO_REQUIRE_GRAD = {
    "requires_grad_": lambda v: v.requires_grad_(),  # once a deadlock on several devices: the audit read a
    # view's grad_fn from inside the view ops that reading it runs
    "a leaf made inside": lambda v: v * torch.ones(2, requires_grad=True),
    "a detached copy": lambda v: v.detach().requires_grad_() * 2,
}


@pytest.mark.parametrize("name", sorted(MADE_TO_REQUIRE_GRAD))
@pytest.mark.parametrize("size", [4, 8])
def test_a_tensor_made_to_require_grad_inside_runs_eagerly(four_devices, name, size):
    """A compiled program's results require grad only through its inputs: one that makes
    a tensor require grad itself runs eagerly, where its results require grad, as on
    every eager placement (compiled, one device and four dropped it)."""
    fun = MADE_TO_REQUIRE_GRAD[name]
    x = torch.arange(2.0 * size).reshape(size, 2)
    for devices in (tp.devices(), tp.devices()[:1]):
        with warnings.catch_warnings():  # eagerly, or one at a time (vmap refuses requires_grad_ itself)
            warnings.simplefilter("ignore")
            out = tp.pmap(fun, axis_name="i", devices=devices, jit=True)(x.clone())
            eager = tp.pmap(fun)(x.clone())  # one at a time too, where vmap refused
        assert out.requires_grad
        torch.testing.assert_close(torch.as_tensor(out).detach(), torch.as_tensor(eager).detach())


def test_attention_without_dropout_compiles(four_devices):
    """CPU attention's flash kernel is tagged as drawing random numbers; with ``dropout_p=0``
    it draws none, and each device's slice of a training step compiles (it ran eagerly,
    with a warning)."""
    from torchpmap.training import data_parallel_step, shard

    torch.manual_seed(0)
    attention = torch.nn.MultiheadAttention(8, 2, batch_first=True, dropout=0.0)
    x = torch.randn(8, 5, 8)
    optimizer = torch.optim.SGD(attention.parameters(), lr=0.1)
    step = data_parallel_step(attention, lambda out, v: out[0].pow(2).mean(), optimizer, jit=True,
                              model_inputs=lambda v: {"query": v, "key": v, "value": v, "need_weights": False})
    with warnings.catch_warnings():
        warnings.simplefilter("error", tp.JitFallbackWarning)
        loss = step(shard(x, n=4))
    assert torch.isfinite(torch.as_tensor(loss)).all()


def test_cpu_device_slices_compute_at_once_on_shared_cores(four_devices, monkeypatch):
    """A compiled segment runs with its thread's turn set down, so the CPU devices'
    kernels run at once, each with the caller's intra-op threads shared out (4 devices on
    4 threads: one each; see ``compiled_devices._cores_per_device``); the caller's count,
    and the one a new thread starts with, are the caller's again afterwards."""
    from torchpmap._engines import compiled_devices, thread_ops

    seen = []
    real = compiled_devices._compile_segment

    def spying(options, graph, inputs):
        compiled = real(options, graph, inputs)

        def run(*args):
            baton = thread_ops._live.get().rendezvous.baton
            seen.append((torch.get_num_threads(), baton._holder))
            return compiled(*args)

        return run

    monkeypatch.setattr(compiled_devices, "_compile_segment", spying)
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        f = tp.pmap(lambda v: tp.psum(v.sin(), "i").cos() * v, axis_name="i", jit=True)
        x = torch.randn(8, 3, generator=torch.Generator().manual_seed(0))
        f(x)  # traced, and each segment compiled in its thread's turn
        seen.clear()
        out = f(x)
        assert _compiled_slices(f) == 1 and len(seen) == 8  # 4 devices x 2 segments
        assert seen == [(1, None)] * 8  # one thread each, no thread holding the turn
        assert torch.get_num_threads() == 4
        fresh = []
        t = threading.Thread(target=lambda: fresh.append(torch.get_num_threads()))
        t.start()
        t.join()
        assert fresh == [4]
        torch.testing.assert_close(out, tp.pmap(lambda v: tp.psum(v.sin(), "i").cos() * v, axis_name="i")(x))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("n", [1, 4])
def test_a_layer_unfrozen_after_the_first_call_gets_its_gradient(four_devices, n):
    """A closed-over tensor's ``requires_grad`` decides where the program stops gradients:
    a change traces anew. The device slices were reused as they were, and the unfrozen
    layer's gradient stayed None on several devices."""
    torch.manual_seed(0)
    lin1, lin2 = torch.nn.Linear(3, 3), torch.nn.Linear(3, 1)
    x = torch.randn(4, 5, 3)
    grads = []
    for jit in (False, True):
        lin2.requires_grad_(False)
        lin1.zero_grad(), lin2.zero_grad()
        f = tp.pmap(lambda v: lin2(lin1(v).tanh()).sum(), jit=jit, devices=four_devices[:n])
        f(x).sum().backward()
        lin2.requires_grad_(True)
        f(x).sum().backward()
        grads.append(lin2.weight.grad)
    assert grads[1] is not None
    torch.testing.assert_close(grads[1], grads[0])


@pytest.mark.parametrize("n", [1, 4])
def test_train_and_eval_mode_after_the_first_call(four_devices, n):
    """A module's ``training`` flag is read while the program is traced: ``.eval()``
    after a compiled call traces anew (dropout off, the module's own branch taken)."""

    class Branch(torch.nn.Module):
        def forward(self, v):
            return v * 2 if self.training else v * 3

    dropout, branch = torch.nn.Dropout(0.5), Branch()
    f = tp.pmap(lambda v: branch(dropout(v)), jit=True, devices=four_devices[:n])
    x = torch.ones(4, 64)
    for training in (True, False, True, False):
        dropout.train(training), branch.train(training)
        out = torch.as_tensor(f(x))
        if training:
            assert set(out.unique().tolist()) == {0.0, 4.0}
        else:
            torch.testing.assert_close(out, x * 3)


@pytest.mark.parametrize("n", [1, 4])
def test_an_input_with_the_negative_bit(four_devices, n):
    """Inductor reads a tensor whose negative bit is set (``x.conj().imag``) as if it
    were not (plain torch.compile too): such an input is resolved before the program."""
    y = torch.tensor([[1 + 2j], [3 + 4j], [5 + 6j], [7 + 8j]], dtype=torch.complex64).conj().imag
    assert y.is_neg()
    f = tp.pmap(lambda v, w: v * 2 + w, in_axes=(0, None), jit=True, devices=four_devices[:n])
    torch.testing.assert_close(torch.as_tensor(f(y, y[0])), y * 2 + y[0])
