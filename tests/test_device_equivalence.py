"""One device is the oracle: every program here runs on one device and on 2, 4 and 8 CPU
devices in one process, and the results must be the same, bitwise.

The corpus is PyTorch's own state and patterns, the ones a device thread used to lose:
grad and inference modes, autocast, torch function modes (``torch.device``), torch.func
transforms around and inside the pmap, a module shared by every instance through
``functional_call``, batch norm and training steps. (The JAX differential corpus runs on
several devices too: ``make test`` runs ``tests/`` with ``TORCHPMAP_NUM_CPU_DEVICES=4``.)
"""
from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.func import functional_call, grad, jacfwd, jacrev, jvp, vjp, vmap

import torchpmap as tp
from torchpmap._placement import devices as _devices

Program = Callable[[list], Any]  # devices -> a pytree of results


@pytest.fixture
def eight_devices(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("TORCHPMAP_NUM_CPU_DEVICES", "8")
    # a device with one instance runs it through vmap too: bitwise one device's results
    # (the default runs it directly: see test_one_instance_per_device_runs_directly)
    monkeypatch.setattr(tp.config, "bitwise_placement", True)
    _devices._local_devices.cache_clear()
    yield tp.devices()
    monkeypatch.undo()
    _devices._local_devices.cache_clear()


def _data(*shape: int, seed: int = 0, dtype=torch.float64) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


X = _data(8, 3)
M = _data(8, 4, 4, seed=1, dtype=torch.float32)


def _a_piece(out: Any) -> torch.Tensor:
    """What a device computed: the first shard of a result on several devices."""
    return out.shards[0].tensor if isinstance(out, tp.ShardedTensor) else out


def _psum_program(v: torch.Tensor) -> torch.Tensor:
    return tp.psum(torch.sin(v), "i") * v


# --------------------------------------------------------------------------- caller state


def autocast_bf16(devices):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = tp.pmap(lambda a: tp.psum(a @ a, "i"), "i", devices=devices)(M)
    return out, out.dtype


def autocast_cache_off(devices):
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        return tp.pmap(lambda a: a @ a.T, devices=devices)(M)


def autocast_disabled_inside(devices):
    def f(a):
        with torch.autocast("cpu", enabled=False):
            return a @ a

    with torch.autocast("cpu", dtype=torch.bfloat16):
        return tp.pmap(f, devices=devices)(M)


def no_grad(devices):
    w = X.clone().requires_grad_()
    with torch.no_grad():
        out = tp.pmap(lambda a: tp.psum(a * a, "i"), "i", devices=devices)(w)
    return out, out.requires_grad, _a_piece(out).requires_grad


def enable_grad_inside_no_grad(devices):
    w = X.clone().requires_grad_()
    with torch.no_grad():
        with torch.enable_grad():
            out = tp.pmap(lambda a: tp.psum(a * a, "i"), "i", devices=devices)(w)
    (g,) = torch.autograd.grad(out.sum() if isinstance(out, torch.Tensor) else out.gather().sum(), w)
    return g


def inference_mode(devices):
    with torch.inference_mode():
        out = tp.pmap(lambda a: tp.pmean(a, "i") + a, "i", devices=devices)(X)
    return out, _a_piece(out).is_inference()


def device_context_mode(devices):
    # ``with torch.device(...)`` is a torch function mode: factories inside see it
    with torch.device("cpu"):
        out = tp.pmap(lambda a: a + torch.ones(3, dtype=torch.float64).cumsum(0), devices=devices)(X)
    return out


def default_dtype(devices):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        out = tp.pmap(lambda a: a.float() + torch.arange(3.0), devices=devices)(X)
    finally:
        torch.set_default_dtype(previous)
    return out, out.dtype


def deterministic_mode(devices):
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        return tp.pmap(lambda a: tp.psum(a.cumsum(0), "i"), "i", devices=devices)(X)
    finally:
        torch.use_deterministic_algorithms(previous)


# --------------------------------------------------------------------------- torch.func transforms


def grad_around(devices):
    f = tp.pmap(_psum_program, "i", devices=devices)
    return grad(lambda a: f(a).sum())(X)


def vjp_around(devices):
    f = tp.pmap(_psum_program, "i", devices=devices)
    out, pullback = vjp(f, X)
    return out, pullback(torch.ones_like(X))


def jacrev_around(devices):
    return jacrev(tp.pmap(_psum_program, "i", devices=devices))(X)


def jvp_around(devices):
    return jvp(tp.pmap(_psum_program, "i", devices=devices), (X,), (torch.ones_like(X),))


def jacfwd_around(devices):
    return jacfwd(tp.pmap(lambda a: tp.all_gather(a * a, "i"), "i", devices=devices))(X[:, 0])


def vmap_around(devices):
    return vmap(tp.pmap(_psum_program, "i", devices=devices))(_data(2, 8, 3, seed=2))


def grad_of_grad_around(devices):
    f = tp.pmap(lambda a: tp.psum(a**3, "i"), "i", devices=devices)
    return grad(lambda a: grad(lambda b: f(b).sum())(a).sum())(X)


def jvp_inside(devices):
    return tp.pmap(lambda a: jvp(_psum_program, (a,), (torch.ones_like(a),)), "i", devices=devices)(X)


def jacfwd_inside(devices):
    return tp.pmap(lambda a: jacfwd(lambda b: tp.pmean(torch.sin(b), "i") * b)(a), "i", devices=devices)(X)


def hessian_inside(devices):
    return tp.pmap(lambda a: torch.func.hessian(lambda b: (tp.psum(b, "i") * b).sum())(a), "i", devices=devices)(X)


def backward_through_torch_ops(devices):
    w = X.clone().requires_grad_()
    out = tp.pmap(_psum_program, "i", devices=devices)(w)
    (torch.cos(out) * out + out.sum()).sum().backward()
    return w.grad


# --------------------------------------------------------------------------- modules


def _mlp(seed: int = 0, dtype=torch.float64) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(3, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2)).to(dtype)


def shared_module_data_parallel(devices):
    model = _mlp()
    params = {k: v.detach() for k, v in model.named_parameters()}
    xs, ys = _data(8, 5, 3, seed=4), _data(8, 5, 2, seed=5)

    def loss(p, x, y):
        return ((functional_call(model, p, (x,)) - y) ** 2).mean()

    step = tp.pmap(
        lambda p, x, y: tp.pmean(grad(loss)(p, x, y), "b"), "b", in_axes=(None, 0, 0), out_axes=None, devices=devices
    )
    return [step(params, xs, ys) for _ in range(3)]


def _tensor_parallel(devices, sequential: bool):
    """Collectives inside the forward of a module that every instance reparametrizes."""

    class Sharded(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(3, 2, dtype=torch.float64))

        def forward(self, x):
            return tp.psum(x @ self.w, "m")  # a row-parallel layer: partial sums meet

    class Block(torch.nn.Module):  # the collective sits between the layers, in the container's forward
        def __init__(self):
            super().__init__()
            self.first, self.second = torch.nn.Linear(3, 3).double(), torch.nn.Linear(3, 2).double()

        def forward(self, x):
            return self.second(tp.psum(self.first(x), "m"))

    model = Block() if sequential else Sharded()
    names = [k for k, _ in model.named_parameters()]
    params = {k: _data(8, *p.shape, seed=6 + i) for i, (k, p) in enumerate(model.named_parameters())}
    before = dict(model.named_parameters())
    x = _data(4, 3, seed=7)
    f = tp.pmap(lambda p: functional_call(model, p, (x,)) * tp.axis_index("m"), "m", devices=devices)
    out = f(params)
    assert all(p is before[k] for k, p in model.named_parameters()) and names == list(before)  # the module is intact
    return out


def test_a_module_reparametrized_across_a_collective(eight_devices):
    """On one device it works; on several it cannot, and says so (never wrong numbers, never a
    module left holding another thread's tensors)."""
    for sequential in (False, True):
        _tensor_parallel(eight_devices[:1], sequential)
        with pytest.raises(RuntimeError, match="reparametrize one (Sharded|Block) module"):
            _tensor_parallel(eight_devices[:4], sequential)
        _tensor_parallel(eight_devices[:1], sequential)  # and the module is still intact after the error


def batch_norm_training_step(devices):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(3, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 1)
    ).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = tp.training.data_parallel_step(model, torch.nn.functional.mse_loss, opt, devices=devices)
    xs, ys = _data(8, 4, 3, seed=8), _data(8, 4, 1, seed=9)
    losses = [step((xs, ys)) for _ in range(4)]
    return losses, model.state_dict()


def dropout_eval_mode(devices):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1)).double().eval()
    params = dict(model.named_parameters())
    return tp.pmap(lambda x: functional_call(model, params, (x,)), devices=devices)(_data(8, 4, 3, seed=10))


# --------------------------------------------------------------------------- random numbers
# randomness="per_instance": each instance draws from its own stream, so the numbers (and
# everything computed from them) are those of one device on any number of devices.


def per_instance_draws(devices):
    def draws(v):
        return (
            torch.rand(3, dtype=torch.float64), torch.randn(2, 2), torch.randint(0, 100, (4,)), torch.randperm(6),
            torch.rand_like(v), torch.randn_like(v), torch.randint_like(v, 10), torch.normal(v, 0.5),
            torch.normal(0.0, 2.0, (2,)), torch.bernoulli(torch.full((5,), 0.3)), v.clone().uniform_(-1, 1),
            v.clone().normal_(), v.clone().exponential_(), v.clone().bernoulli_(0.5), v.clone().random_(0, 7),
        )

    torch.manual_seed(3)
    return tp.pmap(draws, randomness="per_instance", devices=devices)(X)


def per_instance_dropouts(devices):
    F = torch.nn.functional
    img = _data(8, 2, 3, 4, 4, seed=11)

    def drop(v, x):
        return (
            F.dropout(v, 0.4), F.dropout(v, 0.4, training=False), F.alpha_dropout(v, 0.3, training=True),
            F.dropout2d(x, 0.5), F.dropout1d(x[0], 0.5), F.dropout3d(x, 0.5), F.feature_alpha_dropout(x, 0.2, True),
            F.rrelu(v - 0.5, training=True), F.gumbel_softmax(v, tau=0.5), F.gumbel_softmax(v, hard=True),
        )

    torch.manual_seed(4)
    return tp.pmap(drop, randomness="per_instance", devices=devices)(X, img)


def _dropout_training(devices, randomness: str, seed: int, make_opt, steps: int):
    """A data-parallel training run of a model with dropout: its losses and weights."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(3, 16), torch.nn.Dropout(0.3), torch.nn.ReLU(), torch.nn.Linear(16, 1)
    ).double()
    step = tp.training.data_parallel_step(
        model, torch.nn.functional.mse_loss, make_opt(model.parameters()), devices=devices, randomness=randomness
    )
    xs, ys = _data(8, 4, 3, seed=seed + 7), _data(8, 4, 1, seed=seed + 8)
    losses = [step((xs, ys)) for _ in range(steps)]
    return losses, model.state_dict()


def per_instance_dropout_training(devices):
    """A data-parallel training run with dropout: the same model on every placement."""
    return _dropout_training(devices, "per_instance", 5, lambda ps: torch.optim.Adam(ps, lr=0.01), steps=5)


def per_instance_grad_through_dropout(devices):
    def f(v):
        return torch.func.grad(lambda w: torch.nn.functional.dropout(w * w, 0.5).sum())(v)

    torch.manual_seed(6)
    return tp.pmap(f, randomness="per_instance", devices=devices)(X)


# randomness="same": one draw for all the instances, the draw one device makes from the
# caller's generator; the generator then stands where one device leaves it.


def same_draws_and_the_generator_after(devices):
    def draws(v):
        return v + torch.rand(3, dtype=torch.float64), torch.randn(2), torch.randint(0, 100, (4,)), torch.rand_like(v)

    inner = tp.pmap(lambda v: v * torch.rand(()), axis_name="j", randomness="same")
    torch.manual_seed(7)
    flat = tp.pmap(draws, randomness="same", devices=devices)(X)
    nested = tp.pmap(lambda v: inner(v), axis_name="i", randomness="same", devices=devices)(_data(8, 2, 3, seed=16))
    return flat, nested, torch.rand(3)


def same_dropout_training(devices):
    """Dropout under randomness="same": one mask for every instance, one device's."""
    trained = _dropout_training(devices, "same", 8, lambda ps: torch.optim.SGD(ps, lr=0.05), steps=4)
    return (*trained, torch.rand(2))


# --------------------------------------------------------------------------- in-place writes to inputs
# An instance may write its own slice of a mapped argument (the caller sees the write, as
# with torch.func.vmap): the same on every placement. Each program returns the output and
# the arguments as the caller sees them afterwards.


def _grid(seed: int = 15) -> torch.Tensor:
    return _data(8, 8, seed=seed)


def write_contiguous(devices):
    x = _grid()
    out = tp.pmap(lambda w: w.mul_(2).add_(1) * w, devices=devices)(x)
    return out, x


def write_a_column_view(devices):  # not contiguous, but no two instances share an element
    base = _grid()
    out = tp.pmap(lambda w: w.add_(1).sum(), in_axes=1, devices=devices)(base[:, 2:6])  # columns 2..5
    return out, base


def write_disjoint_views_of_one_tensor(devices):  # both halves of one tensor, each mapped
    base = _data(16, 3, seed=16)
    out = tp.pmap(lambda a, b: a.add_(b), devices=devices)(base[:8], base[8:])
    return out, base


def write_an_input_passed_twice(devices):  # the same tensor, the same axes: instance i sees row i twice
    x = _grid()
    out = tp.pmap(lambda a, b: a.add_(1) * b, devices=devices)(x, x)
    return out, x


PROGRAMS: dict[str, Program] = {
    f.__name__: f
    for f in [
        autocast_bf16, autocast_cache_off, autocast_disabled_inside, no_grad, enable_grad_inside_no_grad,
        inference_mode, device_context_mode, default_dtype, deterministic_mode,
        grad_around, vjp_around, jacrev_around, jvp_around, jacfwd_around, vmap_around,
        grad_of_grad_around, jvp_inside, jacfwd_inside, hessian_inside,
        backward_through_torch_ops,
        shared_module_data_parallel, batch_norm_training_step, dropout_eval_mode,
        per_instance_draws, per_instance_dropouts, per_instance_dropout_training, per_instance_grad_through_dropout,
        same_draws_and_the_generator_after, same_dropout_training,
        write_contiguous, write_a_column_view, write_disjoint_views_of_one_tensor, write_an_input_passed_twice,
    ]
}


#: Programs whose results are gradients through a collective across devices: the forward
#: values of collectives are bitwise those of one device, but a collective's transpose sums
#: the cotangents per device and then across devices, so these agree to rounding only
#: (float64 here: within 1e-12), as the docs say.
ROUNDING = {
    "grad_around", "vjp_around", "backward_through_torch_ops", "enable_grad_inside_no_grad",
    "batch_norm_training_step", "grad_of_grad_around", "jacrev_around", "shared_module_data_parallel",
    "per_instance_dropout_training", "same_dropout_training",
}


def _plain(tree: Any) -> Any:
    """Results as plain CPU tensors (a ShardedTensor gathered), non-tensors unchanged."""
    def leaf(v):
        if isinstance(v, tp.ShardedTensor):
            v = v.gather("cpu")
        return v.detach().cpu() if isinstance(v, torch.Tensor) else v

    return torch.utils._pytree.tree_map(leaf, tree, is_leaf=lambda v: isinstance(v, tp.ShardedTensor))


def assert_same(one: Any, many: Any, where: str, exact: bool = True, rounding: str = "float64") -> None:
    one_leaves, one_spec = torch.utils._pytree.tree_flatten(_plain(one))
    many_leaves, many_spec = torch.utils._pytree.tree_flatten(_plain(many))
    assert one_spec == many_spec, where
    for k, (a, b) in enumerate(zip(one_leaves, many_leaves)):
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and a.shape == b.shape, (where, k, a.dtype, b.dtype, a.shape, b.shape)
            if exact or not a.is_floating_point():
                assert torch.equal(a, b), (where, k, (a - b).abs().max() if a.is_floating_point() else None)
            else:
                tolerance = {"rtol": 1e-12, "atol": 1e-12} if rounding == "float64" else {}  # else: by dtype
                torch.testing.assert_close(b, a, **tolerance, msg=lambda m: f"{where}, result {k}: {m}")
        else:
            assert a == b, (where, k, a, b)


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("name", list(PROGRAMS))
def test_same_answers_on_one_and_on_n_devices(eight_devices, name, n):
    program = PROGRAMS[name]
    one = program(eight_devices[:1])
    assert_same(one, program(eight_devices[:n]), f"{name} on {n} devices", exact=name not in ROUNDING)


#: Arguments whose instances share memory: function, arguments (made fresh per run), in_axes, the argument named.
SHARED_MEMORY = {
    # the example of the issue: each device's slice of an expanded tensor is a view of the same row
    "expanded": (lambda w: w.add_(1), lambda: (torch.zeros(1, 3).expand(8, 3),), 0, "w"),
    "expanded_written_by_copy": (lambda w: w.copy_(torch.ones(3)), lambda: (torch.zeros(3, 1).expand(3, 8).T,), 0, "w"),
    # overlapping windows (row i is elements i..i+2): no stride is 0, torch cannot tell on one device
    "overlapping_views": (lambda w: w.mul_(2), lambda: (torch.arange(10.0).unfold(0, 3, 1)[:8],), 0, "w"),
    # one matrix passed twice, as rows and as columns: instance i writes row i, instance j reads column j
    "passed_twice_as_rows_and_columns": (lambda a, b: a.add_(1) + b, lambda: (lambda m: (m, m))(_grid()), (0, 1), "a"),
    # passed twice, mapped and whole: every instance reads what the others write
    "passed_twice_mapped_and_whole": (
        lambda a, b: a.add_(b.sum()),
        lambda: (lambda m: (m, m))(_grid()),
        (0, None),
        "b",
    ),
    # every instance sees all of an unmapped argument
    "unmapped": (lambda w, x: w.add_(1) + x, lambda: (torch.zeros(3), _data(8, 3)), (None, 0), "w"),
}


# with bitwise placement a device's one instance runs vectorized first: its refusal then falls back to run alone
@pytest.mark.filterwarnings("ignore::torchpmap.VectorizationFallbackWarning")
@pytest.mark.parametrize("bitwise", [True, False])
@pytest.mark.parametrize("case", list(SHARED_MEMORY))
def test_an_in_place_write_to_shared_memory_raises_on_every_placement(eight_devices, monkeypatch, case, bitwise):
    """One device refuses such a write (torch, for an expanded argument) or makes it once (an
    unmapped one); several devices used to write the shared memory once each (4.0 everywhere
    from ``w.add_(1)`` on an expanded zero). Every placement raises now, naming the argument,
    with torch's reason; reading the same arguments works everywhere."""
    monkeypatch.setattr(tp.config, "bitwise_placement", bitwise)
    fun, arguments, in_axes, name = SHARED_MEMORY[case]
    reads = []
    for n in (1, 2, 4, 8):  # vectorized on 1 device, 4 or 2 instances per device, and one per device
        with pytest.raises(RuntimeError) as error:
            tp.pmap(fun, in_axes=in_axes, devices=eight_devices[:n])(*arguments())
        message = str(error.value)
        assert f"pmap: the mapped function wrote in place to the memory of argument {name!r}" in message, (n, message)
        assert "more than one element of the written-to tensor refers to a single memory location" in message, message
        assert "instances share that memory" in message and "x.clone()" in message, message
        reads.append(
            tp.pmap(lambda *a: sum(t.sum() for t in a), in_axes=in_axes, devices=eight_devices[:n])(*arguments())
        )
    for n, read in zip((2, 4, 8), reads[1:]):
        assert_same(reads[0], read, f"{case}: reading on {n} devices", exact=bitwise)


@pytest.mark.parametrize("where", ["made inside", "the outer slice"])
def test_a_nested_maps_write_into_its_shared_argument_raises_on_every_placement(eight_devices, where):
    """A nested pmap's ``in_axes=None`` argument is shared by its instances as an outermost
    map's is: one device (vectorized) wrote it once per outer instance, a thread per
    instance (several devices, a mesh, debug mode) once per inner instance. Refused on
    every placement; a mesh of 2 x 2 CPU devices too."""

    def inner(v, w):
        w.add_(1)
        return v + w

    def outer(v):
        w = v.clone() if where == "made inside" else v
        return tp.pmap(inner, axis_name="y", in_axes=(0, None))(torch.zeros(2, 3), w)

    mesh = tp.make_mesh((2, 2), ("x", "y"), devices=eight_devices[:4])

    def on_mesh(v):
        w = v.clone() if where == "made inside" else v
        return tp.pmap(inner, axis_name="y", in_axes=(0, None), mesh=mesh)(torch.zeros(2, 3), w)

    runs = {
        "one device": lambda: tp.pmap(outer, axis_name="x", devices=eight_devices[:1])(torch.zeros(2, 3)),
        "two devices": lambda: tp.pmap(outer, axis_name="x", devices=eight_devices[:2])(torch.zeros(2, 3)),
        "a mesh": lambda: tp.pmap(on_mesh, axis_name="x", mesh=mesh)(torch.zeros(2, 3)),
    }
    for run in runs.values():
        for debug in (False, True):
            with tp.disable_vectorization() if debug else contextlib.nullcontext(), warnings.catch_warnings():
                warnings.simplefilter("ignore", tp.VectorizationFallbackWarning)
                with pytest.raises(RuntimeError, match="wrote in place to the memory of argument 'w' .in_axes None"):
                    run()


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.uint64], ids=str)
def test_unsigned_reductions_give_the_same_numbers_eager_and_compiled(eight_devices, dtype):
    """torch has no CPU sum or max kernel for these: the eager engine raised where a
    compiled program (inductor's own loops) and JAX give numbers. They are reduced as
    int64 now: a sum wraps as its own dtype's (4 x 30000 in uint16 is 54464, as JAX's),
    a 64-bit value above int64's range keeps its order."""
    x = torch.tensor([[30000, 1], [30000, 2], [30000, 7], [30000, 3]]).to(dtype)
    big = dtype == torch.uint64
    if big:
        x[0, 1] = torch.tensor(-(2**63) + 5).view(torch.uint64)  # 2**63 + 5
    total0 = {torch.uint16: 54464, torch.uint32: 120000, torch.uint64: 120000}[dtype]
    want = {
        "psum": [total0, 2**63 + 17 if big else 13],
        "pmax": [30000, 2**63 + 5 if big else 7],
        "pmin": [30000, 2 if big else 1],
        "psum_scatter": [total0, 2**63 + 17 if big else 13],
    }
    programs = {
        "psum": lambda v: tp.psum(v, "i"),
        "pmax": lambda v: tp.pmax(v, "i"),
        "pmin": lambda v: tp.pmin(v, "i"),
        "psum_scatter": lambda v: tp.psum_scatter(v.expand(4, 2).contiguous(), "i"),
    }
    for name, fun in programs.items():
        for devices in (eight_devices[:1], eight_devices[:4]):
            for jit in (False, True):
                with warnings.catch_warnings():
                    warnings.simplefilter("error", tp.JitFallbackWarning)
                    got = torch.as_tensor(tp.pmap(fun, "i", devices=devices, jit=jit)(x))
                assert got.dtype == dtype and got[0].tolist() == want[name], (name, len(devices), jit, got)


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.uint64], ids=str)
def test_unsigned_values_move_as_their_signed_bits(eight_devices, dtype):
    """ppermute, and ppermute/all_to_all over a tuple of axes (an all_gather, then an
    index_select), of unsigned integers: torch's CPU index kernels have none of 16 to 64
    bits, so the eager engine raised where a compiled program and JAX give numbers. They
    now move as signed integers (uint64 as the bits of an int64), bit for bit (values
    above the signed range included), the same on every placement, in debug mode and
    compiled. The map objects are reused across placements, as a program reuses them."""
    def unsigned(t: torch.Tensor) -> torch.Tensor:  # int64 -> dtype, bit for bit for uint64
        return t.view(dtype) if dtype == torch.uint64 else t.to(dtype)

    x = torch.arange(8 * 8).reshape(8, 8) * 100
    x[7, 0] = -3 if dtype == torch.uint64 else 2 ** (8 * dtype.itemsize) - 3  # above the signed range
    want_ppermute = torch.zeros(8, 8, dtype=torch.long)
    for src, dst in [(0, 3), (3, 5), (7, 1)]:
        want_ppermute[dst] = x[src]
    want_all_to_all = x.T.contiguous()  # all_to_all(split 0, concat 0) over 8 instances: a transpose
    x, want_ppermute, want_all_to_all = map(unsigned, (x, want_ppermute, want_all_to_all))
    pairs = [(0, 3), (3, 5), (7, 1)]
    programs = {
        "ppermute": (lambda v: tp.ppermute(v, "i", pairs), want_ppermute),
        "ppermute over (i, j)": (lambda v: tp.ppermute(v, ("i", "j"), pairs), want_ppermute),
        "all_to_all over (i, j)": (lambda v: tp.all_to_all(v, ("i", "j"), 0, 0), want_all_to_all),
    }
    for name, (fun, want) in programs.items():
        for devices in (eight_devices[:1], eight_devices[:4]):
            inner = fun if name == "ppermute" else tp.pmap(fun, axis_name="j")
            outer = tp.pmap(inner, "i", devices=devices)
            args = x if name == "ppermute" else x.reshape(4, 2, 8)
            for debug in (False, True):
                with tp.disable_vectorization() if debug else contextlib.nullcontext():
                    got = torch.as_tensor(outer(args)).reshape(8, 8)
                assert got.dtype == dtype and _bits(got).equal(_bits(want)), (name, len(devices), debug, got)
        if name == "ppermute":
            for devices in (eight_devices[:1], eight_devices[:4]):
                with warnings.catch_warnings():
                    warnings.simplefilter("error", tp.JitFallbackWarning)
                    got = torch.as_tensor(tp.pmap(fun, "i", devices=devices, jit=True)(x))
                assert got.dtype == dtype and _bits(got).equal(_bits(want)), (name, len(devices), "jit", got)


@pytest.mark.parametrize("n_devices", [1, 2, 4])
def test_pmax_refuses_a_tangent_under_no_grad_too(eight_devices, n_devices):
    """pmax has no derivative (JAX's jvp refuses it). Under ``no_grad`` it used to skip its
    guard, and forward mode, which grad mode does not stop, returned amax's tangent
    silently, on every placement. Without a tangent, ``no_grad`` still gives the numbers."""
    x = torch.tensor([[1.0, 5.0], [3.0, 2.0], [0.0, 7.0], [4.0, 4.5]])
    g = tp.pmap(lambda v: tp.pmax(v * v, "i"), axis_name="i", devices=eight_devices[:n_devices])
    with torch.no_grad():
        assert torch.as_tensor(g(x))[0].tolist() == [16.0, 49.0]
        with pytest.raises(NotImplementedError, match="pmax is not differentiable"):
            torch.func.jvp(lambda v: torch.as_tensor(g(v)), (x,), (torch.ones_like(x),))
        with torch.autograd.forward_ad.dual_level():
            with pytest.raises(NotImplementedError, match="pmax is not differentiable"):
                g(torch.autograd.forward_ad.make_dual(x, torch.ones_like(x)))


@pytest.mark.parametrize("n_devices", [1, 2, 4])
def test_forward_mode_inside_the_callers_dual_level(eight_devices, n_devices):
    """A pmap called inside the caller's own ``forward_ad.dual_level()``: on several
    devices the threads opened a second level, which torch refuses ("Nested forward mode
    AD"), and the result, a ShardedTensor, dropped the tangents. Now the threads share the
    caller's level and the tangents are one device's."""
    fwd = torch.autograd.forward_ad
    x, t = _data(4, 3), _data(4, 3, seed=1)
    g = tp.pmap(lambda v: (tp.psum(v * v, "i"), v.sin()), axis_name="i", devices=eight_devices[:n_devices])
    with fwd.dual_level():
        plain = [torch.as_tensor(o) for o in g(x)]
        duals = [fwd.unpack_dual(torch.as_tensor(o)) for o in g(fwd.make_dual(x, t))]
    want = [(2 * x * t).sum(0).expand(4, 3), x.cos() * t]
    torch.testing.assert_close(plain, [(x * x).sum(0).expand(4, 3), x.sin()])
    torch.testing.assert_close([d.primal for d in duals], plain)
    torch.testing.assert_close([d.tangent for d in duals], want)


def test_pmax_of_a_shared_argument_is_a_value_of_its_own(eight_devices):
    """pmax/pmin of an in_axes=None argument returned the argument's memory at its axis'
    level: a write into the result overwrote the caller's tensor silently (axis size 1)
    or was refused as a write into a shared argument (size 4 on one device), where other
    placements return a value of its own, as psum and JAX do."""
    for n in (1, 4):
        for devices in (eight_devices[:1], eight_devices[:4]):
            for reduce in (tp.pmax, tp.pmin):
                w = torch.ones(3)
                f = tp.pmap(lambda a, w: reduce(w, "i").mul_(-1) + a, "i", in_axes=(0, None), devices=devices)
                out = torch.as_tensor(f(torch.zeros(n), w))
                assert torch.equal(out, -torch.ones(n, 3)) and torch.equal(w, torch.ones(3)), (n, len(devices))


#: Float sums whose one-device result depended on how the values lay in memory, or on
#: whether they were the same on every instance (one device multiplied, the others add
#: the copies): each ``(function, in_axes, arguments)``.
FLOAT_SUMS = {
    "psum, instances in the last dim": (lambda v: tp.psum(v, "i"), -1, lambda: (_data(16, 8, dtype=torch.float32),)),
    "pmean, instances in the last dim": (lambda v: tp.pmean(v, "i"), -1, lambda: (_data(16, 8, dtype=torch.float32),)),
    "psum_scatter, instances in the last dim": (
        lambda v: tp.psum_scatter(v, "i", tiled=True), -1, lambda: (_data(16, 8, dtype=torch.float32),)
    ),
    "psum in groups, instances in the last dim": (
        lambda v: tp.psum(v, "i", axis_index_groups=[[0, 1, 2, 3], [4, 5, 6, 7]]), -1,
        lambda: (_data(16, 8, dtype=torch.float32),),
    ),
    "psum of a pmean": (lambda v: tp.psum(tp.pmean(v, "i"), "i"), 0, lambda: (_data(8, 5, dtype=torch.float32),)),
    "pmean of a pmin": (lambda v: tp.pmean(tp.pmin(v, "i"), "i"), 0, lambda: (_data(8, 5, dtype=torch.float32),)),
    "psum of a shared argument": (
        lambda v, w: tp.psum(w * 0.1, "i") + v, (0, None),
        lambda: (_data(8, 5, dtype=torch.float32), _data(5, seed=1, dtype=torch.float32)),
    ),
}


@pytest.mark.parametrize("bitwise", [True, False])
@pytest.mark.parametrize("name", sorted(FLOAT_SUMS))
def test_float_sums_add_in_one_order_on_every_placement(eight_devices, monkeypatch, name, bitwise):
    """The sums above gave 3e-8 to 2.4e-7 other numbers on one device than on 2, 4 and 8
    devices and in debug mode (which agreed with each other). Now every placement adds
    the instances' values in their order, from the same layout."""
    monkeypatch.setattr(tp.config, "bitwise_placement", bitwise)
    fun, in_axes, arguments = FLOAT_SUMS[name]
    one = tp.pmap(fun, "i", in_axes=in_axes, devices=eight_devices[:1])(*arguments())
    for n in (2, 4, 8) if bitwise else (2, 4):
        assert_same(one, tp.pmap(fun, "i", in_axes=in_axes, devices=eight_devices[:n])(*arguments()), f"{name}, {n}")
    with tp.disable_vectorization():
        assert_same(one, tp.pmap(fun, "i", in_axes=in_axes, devices=eight_devices[:1])(*arguments()), f"{name}, debug")


@pytest.mark.parametrize("placement", ["1", "2", "4", "debug"])
@pytest.mark.parametrize("reduce", [tp.pmax, tp.pmin])
def test_pmax_of_a_value_the_same_everywhere_is_not_differentiable_on_any_placement(eight_devices, placement, reduce):
    """A ``.backward()`` through ``pmax(pmean(v))`` gave a gradient on one device (pmax of
    a value that is the same on every instance skipped the refusal), where every other
    placement and JAX refuse it."""
    x = torch.tensor([1.0, 2.0, 3.0, 4.0], requires_grad=True)
    devices = eight_devices[: 1 if placement == "debug" else int(placement)]
    f = tp.pmap(lambda v: reduce(tp.pmean(v, "i"), "i"), "i", devices=devices)
    with tp.disable_vectorization() if placement == "debug" else contextlib.nullcontext():
        with pytest.raises(NotImplementedError, match="is not differentiable"):
            torch.as_tensor(f(x)).sum().backward()


def test_pshuffle_takes_its_permutation_from_an_iterator():
    """A generator as perm was used up by the check and gave an empty permutation: zeros."""
    x = torch.arange(1.0, 5.0)
    f = tp.pmap(lambda v: tp.pshuffle(v, "i", (p for p in [3, 2, 1, 0])), axis_name="i")
    assert torch.as_tensor(f(x)).tolist() == [4.0, 3.0, 2.0, 1.0]


def test_pvary_gradient_inside_the_map_is_one_devices_or_refused(eight_devices, monkeypatch):
    """The gradient of pvary(w) inside the map is the psum of the instances' cotangents
    for a w the same on every instance: one device's numbers. An instance run without a
    vmap level (one per device, by default) cannot tell whether w was the same, and gave
    each instance its own cotangent, silently; it now refuses, naming the way out
    (bitwise_placement runs it through vmap: one device's numbers again)."""
    x, w = torch.arange(1.0, 9.0).reshape(4, 2), torch.tensor([2.0, -1.0])
    f = lambda a: torch.func.grad(lambda b: (tp.pvary(b, "i") * a).sum())(w)  # noqa: E731
    want = torch.tensor([16.0, 20.0]).expand(4, 2)
    for devices in (eight_devices[:1], eight_devices[:2], eight_devices[:4]):  # bitwise: through vmap
        assert torch.equal(torch.as_tensor(tp.pmap(f, "i", devices=devices)(x)), want)
    monkeypatch.setattr(tp.config, "bitwise_placement", False)
    with pytest.raises(NotImplementedError, match=r"gradient of pvary over axis 'i'.*bitwise_placement = True"):
        tp.pmap(f, "i", devices=eight_devices[:4])(x)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """An unsigned tensor's bits as the signed integers of its width (torch compares those)."""
    return t.view({torch.uint16: torch.int16, torch.uint32: torch.int32, torch.uint64: torch.int64}[t.dtype])


def _sparse(layout=torch.sparse_coo) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Sparse CSR tensor support is in beta state"
        return _data(8, 3, seed=17).relu().to_sparse(layout=layout)


def _nested(layout=torch.strided) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the prototype warning of strided nested tensors
        return torch.nested.nested_tensor([_data(k % 3 + 1, seed=k) for k in range(8)], layout=layout)


#: Sparse and nested tensors pmap cannot map or return on every placement: function, arguments, in_axes, message.
REFUSED_KINDS = {
    "mapped_sparse_coo": (
        lambda v: v * 2,
        lambda: (_sparse(),),
        0,
        r"argument 'v' is mapped along axis 0, but it is a sparse_coo tensor",
    ),
    "mapped_sparse_csr": (
        lambda v: v * 2,
        lambda: (_sparse(torch.sparse_csr),),
        0,
        r"argument 'v' is mapped .* a sparse_csr tensor",
    ),
    "mapped_nested": (
        lambda v: v * 2,
        lambda: (_nested(),),
        0,
        r"argument 'v' is mapped along axis 0, but it is a nested tensor \(layout torch.strided\)",
    ),
    "mapped_jagged": (
        lambda v: v * 2,
        lambda: (_nested(torch.jagged),),
        0,
        r"argument 'v' is mapped .* a nested tensor \(layout torch.jagged\)",
    ),
    "returned_sparse": (
        lambda s, x: (x, s * 2),
        lambda: (_sparse(), X),
        (None, 0),
        r"returned output leaf 1 at \[1\], but it is a sparse_coo tensor",
    ),
    "returned_nested": (
        lambda n, x: n,
        lambda: (_nested(), X),
        (None, 0),
        r"returned output leaf 0, but it is a nested tensor",
    ),
}


def test_sparse_and_nested_tensors_are_refused_alike_on_every_placement_unless_passed_whole(eight_devices):
    """Mapped sparse COO tensors used to work on one device and fail on four (aten::as_strided on
    SparseCPU); nested ones failed with "Internal error ... Please file an issue". Mapped or
    returned, they are refused on every placement; passed whole (in_axes None), they work on
    every placement, with the answers of one device."""
    for case, (fun, arguments, in_axes, match) in REFUSED_KINDS.items():
        for n in (1, 2, 4, 8):
            with pytest.raises(TypeError, match=match) as error:
                tp.pmap(fun, in_axes=in_axes, devices=eight_devices[:n])(*arguments())
            assert "dense (strided) tensors only" in str(error.value) and "to_dense()" in str(error.value), (case, n)
    sparse, nested = _sparse(), _nested()

    def whole(devices):
        f = lambda s, n, x: (s @ x, n.to_padded_tensor(0.0)[:, 0].sum() * x)  # noqa: E731
        return tp.pmap(f, in_axes=(None, None, 0), devices=devices)(sparse, nested, X)

    one = whole(eight_devices[:1])
    for n in (2, 4, 8):
        assert_same(one, whole(eight_devices[:n]), f"sparse and nested, whole, on {n} devices")


def test_per_instance_streams_are_those_of_the_debug_mode(eight_devices):
    """One instance per thread, without a vmap level: the same numbers again."""
    vectorized = per_instance_dropouts(eight_devices[:1]), per_instance_draws(eight_devices[:1])
    with tp.disable_vectorization():
        debug = per_instance_dropouts(eight_devices[:1]), per_instance_draws(eight_devices[:1])
    assert_same(vectorized, debug, "per_instance in the debug mode")


def test_per_instance_streams_differ_between_instances_and_calls(eight_devices):
    f = tp.pmap(lambda v: torch.rand(4), randomness="per_instance", devices=eight_devices[:2])
    torch.manual_seed(0)
    first, second = _plain(f(X)), _plain(f(X))
    assert len({tuple(r.tolist()) for r in torch.cat([first, second])}) == 16  # no two rows alike
    torch.manual_seed(0)
    assert torch.equal(_plain(f(X)), first)  # reproducible under torch.manual_seed


def test_a_pmap_nested_in_a_per_instance_pmap(eight_devices):
    inner = tp.pmap(lambda w: w * 2, axis_name="j")
    f = tp.pmap(lambda v: inner(v.reshape(3, 1)).sum() + torch.rand(()), randomness="per_instance",
                devices=eight_devices[:1])
    g = tp.pmap(lambda v: inner(v.reshape(3, 1)).sum() + torch.rand(()), randomness="per_instance",
                devices=eight_devices[:4])
    torch.manual_seed(1)
    one = f(X)
    torch.manual_seed(1)
    assert_same(one, g(X), "a nested pmap")


@pytest.mark.parametrize("case, match", [
    (lambda v: torch.rand(3, generator=torch.Generator()), "generator="),
    (lambda v: torch.vmap(lambda w: torch.rand(()) * w, randomness="different")(v), "nested in the mapped function"),
    (lambda v: torch.multinomial(v.abs() + 0.1, 2), "torch.multinomial"),
    (lambda v: torch.poisson(v.abs()), "torch.poisson"),
    # samplers vmap cannot batch: one device fell back to one instance at a time, devices of one
    # instance ran them directly, each with the thread's own stream (numbers that followed the placement)
    (lambda v: torch.distributions.Gamma(v.abs() + 0.5, 1.0).sample(), "torch._standard_gamma"),
    (lambda v: torch.distributions.Beta(v.abs() + 0.5, 2.0).sample(), "torch._sample_dirichlet"),
    (lambda v: torch.binomial(v.abs().round() + 2, torch.full_like(v, 0.5)), "torch.binomial"),
])
def test_what_per_instance_refuses_is_named(eight_devices, case, match):
    for devices in (eight_devices[:1], eight_devices[:2], eight_devices):
        with pytest.raises(NotImplementedError, match=match):
            tp.pmap(case, randomness="per_instance", devices=devices)(X)


def test_per_instance_with_jit_is_refused_when_the_pmap_is_made():
    with pytest.raises(NotImplementedError, match="jit=True with randomness='per_instance'"):
        tp.pmap(lambda v: v, randomness="per_instance", jit=True)


def test_a_fallback_draws_what_one_instance_per_device_draws(eight_devices):
    """``randomness="per_instance"``: a function that vmap cannot run (``.item()`` of
    values that differ) falls back after its vectorized attempt drew the call's seed. The
    re-run draws from the same seed, so its first call gives what 8 devices (one instance
    each, never vectorized) and ``disable_vectorization()`` give; it drew the next seed
    before, and other numbers."""

    def f(v):
        if v.sum().item() > -100:
            return v + torch.rand(3, dtype=v.dtype)
        return v

    x = _data(8, 3, seed=15)
    results = []
    for devices in (eight_devices[:1], eight_devices[:4], eight_devices, None):
        torch.manual_seed(4)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", tp.VectorizationFallbackWarning)
            if devices is None:
                with tp.disable_vectorization():
                    results.append(torch.as_tensor(tp.pmap(f, randomness="per_instance", devices=eight_devices[:1])(x)))
            else:
                results.append(torch.as_tensor(tp.pmap(f, randomness="per_instance", devices=devices)(x)).cpu())
    for got, where in zip(results[1:], ("4 devices", "8 devices", "disable_vectorization()")):
        assert_same(results[0], got, f"the first call's draws, 1 device and {where}")


def test_random_ops_torch_draws_in_cpp_under_per_instance(eight_devices, monkeypatch):
    """Random ops the streams cannot rebuild: in a vectorized instance they hit the vmap
    level's "error" randomness instead of drawing placement-dependent numbers, and the
    instances then run one at a time, each drawing from its own stream: the same numbers
    on every placement, on the first call (whose failed attempt had drawn the call's seed
    already) and after. nn.LSTM (no batching rule: its instances run one per thread)
    draws its dropout from each instance's own stream too."""
    q = _data(8, 2, 4, 3, seed=14)
    sdpa = lambda v: torch.nn.functional.scaled_dot_product_attention(v, v, v, dropout_p=0.5)  # noqa: E731
    results = []
    # 8 devices: one instance each, run directly (the default) and through a vmap of one
    # (bitwise_placement), whose failure is vmap's too: the instance then runs alone
    for devices, bitwise in ((eight_devices[:1], True), (eight_devices[:4], True), (eight_devices, False),
                             (eight_devices, True)):
        monkeypatch.setattr(tp.config, "bitwise_placement", bitwise)
        torch.manual_seed(3)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", tp.VectorizationFallbackWarning)
            f = tp.pmap(sdpa, randomness="per_instance", devices=devices)
            results.append(torch.cat([torch.as_tensor(f(q)).cpu(), torch.as_tensor(f(q)).cpu()]))
    monkeypatch.setattr(tp.config, "bitwise_placement", True)
    assert_same(*results[:2], "sdpa's dropout, 1 and 4 devices")
    assert_same(results[0], results[2], "sdpa's dropout, 1 and 8 devices")
    assert_same(results[0], results[3], "sdpa's dropout, 1 and 8 devices under bitwise_placement")
    lstm = torch.nn.LSTM(3, 4, num_layers=2, dropout=0.5).double().train()
    f = lambda v: lstm(v.reshape(1, 1, 3))[0]  # noqa: E731
    results = []
    for devices in (eight_devices[:1], eight_devices[:4]):
        torch.manual_seed(2)
        with pytest.warns(tp.VectorizationFallbackWarning):
            results.append(tp.pmap(f, randomness="per_instance", devices=devices)(X))
    assert_same(*results, "nn.LSTM's dropout")


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_one_instance_per_device_runs_directly(eight_devices, monkeypatch, name):
    """By default a device holding one instance runs it without vmap (plain PyTorch speed,
    every op): results agree with one device to rounding (float32: torch's default
    tolerances; float64: 1e-12), and random streams stay bitwise."""
    monkeypatch.setattr(tp.config, "bitwise_placement", False)
    program = PROGRAMS[name]
    one = program(eight_devices[:1])
    assert_same(one, program(eight_devices[:8]), f"{name} directly on 8 devices", exact=False, rounding="dtype")


def test_a_function_vmap_cannot_run_runs_directly_on_one_instance_per_device(eight_devices, monkeypatch):
    monkeypatch.setattr(tp.config, "bitwise_placement", False)
    f = lambda v: tp.psum(v * 2 if v.sum().item() > 0 else -v, "i")  # noqa: E731 - .item(): no vmap
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no VectorizationFallbackWarning: nothing was vectorized
        direct = tp.pmap(f, "i", devices=eight_devices)(X)
    with pytest.warns(tp.VectorizationFallbackWarning):
        one = tp.pmap(f, "i", devices=eight_devices[:1])(X)
    assert_same(one, direct, ".item() on 8 devices")


# --------------------------------------------------------------------------- torchpmap's own state


def test_a_mesh_entered_in_one_thread_is_not_seen_by_another(eight_devices):
    mesh = tp.Mesh([eight_devices[:2]], ("x", "y"))
    entered, done = threading.Event(), threading.Event()

    def hold():
        with mesh:
            entered.set()
            done.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        entered.wait(10)
        out = tp.pmap(lambda v: tp.axis_index("i") + 0 * v, "i")(torch.zeros(4))
        assert [str(d) for d in out.devices()] == [str(d) for d in eight_devices[:4]]  # not the mesh's 2
        tp.pmap(lambda v: v, devices=eight_devices[2:4])(torch.zeros(2))  # no spurious mesh error
    finally:
        done.set()
        holder.join()


def test_mesh_contexts_nest_and_restore_on_error(eight_devices):
    outer, inner = tp.Mesh([eight_devices[:2]], ("a", "b")), tp.Mesh([eight_devices[:4]], ("c", "d"))
    with outer:
        with pytest.raises(KeyError):
            with inner:
                assert tp._placement.mesh.current() is inner
                raise KeyError("boom")
        assert tp._placement.mesh.current() is outer
        with outer:  # re-entrant
            assert tp._placement.mesh.current() is outer
        assert tp._placement.mesh.current() is outer
    assert tp._placement.mesh.current() is None


def test_debug_mode_is_per_thread_and_overlapping_contexts_restore(eight_devices):
    inside, release = threading.Event(), threading.Event()

    def where(v):  # the thread an instance runs in: the caller's when vectorized on one device
        where.threads.add(threading.current_thread().name)
        return v

    def debug_thread():
        with tp.disable_vectorization():
            inside.set()
            release.wait(10)

    t = threading.Thread(target=debug_thread)
    t.start()
    try:
        inside.wait(10)
        assert not tp._state.config.vectorization_disabled()  # another thread's block does not leak here
        where.threads = set()
        tp.pmap(where, devices=eight_devices[:1])(torch.ones(2))
        assert where.threads == {threading.current_thread().name}
        with tp.disable_vectorization():
            with tp.disable_vectorization():  # nested: re-entrant
                assert tp._state.config.vectorization_disabled()
            where.threads = set()
            tp.pmap(where, devices=eight_devices[:1])(torch.ones(2))
            assert where.threads == {"torchpmap-device"}  # one instance thread at a time
    finally:
        release.set()
        t.join()
    assert not tp._state.config.vectorization_disabled()


def test_a_collective_inside_no_grad_inside_the_function(eight_devices):
    def f(v):
        with torch.no_grad():
            s = tp.psum(v, "i")
        return v * s

    w = X.clone().requires_grad_()
    grads = []
    for devices in (eight_devices[:1], eight_devices[:4]):
        w.grad = None
        out = tp.pmap(f, "i", devices=devices)(w)
        out.sum().backward()
        grads.append(w.grad.clone())
    assert torch.equal(grads[0], grads[1])  # no gradient flows through the collective: bitwise


def test_grad_enabled_inside_a_function_called_under_no_grad(eight_devices):
    """``with torch.enable_grad():`` inside the function, the caller under ``no_grad``
    (computing forces in an evaluation loop): ``torch.vmap``'s result is differentiable
    back to the argument. One device's result required grad but ``.backward()`` left
    ``x.grad`` None (its view of the argument had no ``grad_fn``); on several devices it
    did not require grad. Also a ShardedTensor argument and a psum."""

    def f(x):
        with torch.enable_grad():
            return x * tp.psum(x, "i")

    x0 = X.clone()
    grads = []
    for devices in (eight_devices[:1], eight_devices[:2], eight_devices[:4]):
        x = x0.clone().requires_grad_()
        resplit = tp.pmap(lambda v: v * 1, devices=devices[::-1])(x)  # a ShardedTensor on 2 and 4
        with torch.no_grad():
            y = tp.pmap(f, "i", devices=devices)(x)
            z = tp.pmap(f, "i", devices=devices)(resplit)
        assert y.requires_grad and z.requires_grad
        (torch.as_tensor(y).sum() + torch.as_tensor(z).sum()).backward()
        grads.append(x.grad)
    x = x0.clone().requires_grad_()
    (2 * (x * x.sum(0)).sum()).backward()  # plain autograd, the same math twice
    for g in grads:
        torch.testing.assert_close(g, x.grad)


def test_device_threads_use_the_callers_intra_op_thread_count(eight_devices):
    """OpenMP keeps the thread count per thread: a pooled device thread made earlier must
    not keep its old count (reductions would round differently from call to call)."""
    seen = []
    f = tp.pmap(lambda v: v + len(seen.append(torch.get_num_threads()) or ()), devices=eight_devices[:4])
    f(torch.zeros(4))  # the pool's workers exist now, with the default count
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        seen.clear()
        f(torch.zeros(4))
        assert seen == [1] * 4
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("axis_name", [None, "i"])
def test_an_axis_of_size_zero_is_empty_on_every_placement(eight_devices, axis_name):
    """No instance: vectorized, compiled and on several devices the result is empty, of
    the shape vmap works out; one at a time (debug mode) divided by the number of
    devices it was given (none) and raised ZeroDivisionError."""
    fun = (lambda t: t + 1) if axis_name is None else (lambda t: t + tp.psum(t, axis_name))
    x = torch.zeros(0, 3)
    results = [tp.pmap(fun, axis_name, devices=devices)(x) for devices in (eight_devices[:1], eight_devices)]
    with tp.disable_vectorization():
        results.append(tp.pmap(fun, axis_name, devices=eight_devices[:1])(x))
    for got in results:
        assert torch.as_tensor(got).shape == (0, 3)
