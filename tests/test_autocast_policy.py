"""Autocast inside a map casts as plain PyTorch does (``torchpmap._engines.autocast_policy``).

The oracle for every op of the policy table: the same op called on each instance's slice,
under the same autocast, without any map. The map must give its dtype, and its values to
the rounding of the reduced dtype (vmap computes ``F.linear``'s bias add apart from the
product: one more rounding), on 1 and on 4 CPU devices, vectorized and one instance at a
time; where the device is CUDA (``make gpu-check``), with CUDA's autocast lists.
"""
from __future__ import annotations

import copy
import sys
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchpmap as tp
from torchpmap._engines import autocast_policy

N = 3
LOW = torch.bfloat16


def here() -> torch.device:
    return tp.devices()[0].torch_device


def _r(*shape: int, positive: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(N, *shape, generator=g)
    return (x.abs() + 0.1 if positive else x).to(here())


def _w(*shape: int) -> torch.Tensor:
    """A weight, made inside the mapped function: deterministic, not drawn (a draw inside
    a map follows the map's randomness rules)."""
    n = 1
    for d in shape:
        n *= d
    return ((torch.arange(n, device=here()) * 0.7 + len(shape)).sin() * 0.5).reshape(shape)


def _long(*shape: int, high: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, high, (N, *shape), generator=g).to(here())


def _low(x: torch.Tensor) -> torch.Tensor:
    return x.to(LOW)


# aten op -> (function of one instance's slices, the stacked inputs): every entry of the policy table
CASES: dict[str, Callable[[], tuple[Callable[..., torch.Tensor], list[torch.Tensor]]]] = {
    "aten::linear": lambda: ((lambda x: F.linear(x, _w(6, 5), _w(6))), [_r(2, 5)]),
    "aten::conv1d": lambda: ((lambda x: F.conv1d(x, _w(4, 3, 3), _w(4))), [_r(2, 3, 8)]),
    "aten::conv2d": lambda: ((lambda x: F.conv2d(x, _w(4, 3, 3, 3), _w(4), padding=1)), [_r(2, 3, 6, 6)]),
    "aten::conv3d": lambda: ((lambda x: F.conv3d(x, _w(2, 3, 2, 2, 2), _w(2))), [_r(1, 3, 4, 4, 4)]),
    "aten::conv_transpose1d": lambda: ((lambda x: F.conv_transpose1d(x, _w(3, 4, 3), _w(4))), [_r(2, 3, 8)]),
    "aten::conv_transpose2d.input": lambda: (
        (lambda x: F.conv_transpose2d(x, _w(3, 4, 3, 3), _w(4))), [_r(2, 3, 5, 5)]),
    "aten::conv_transpose3d.input": lambda: (
        (lambda x: F.conv_transpose3d(x, _w(3, 2, 2, 2, 2), _w(2))), [_r(1, 3, 3, 3, 3)]),
    "aten::conv_tbc": lambda: ((lambda x: torch.conv_tbc(x, _w(3, 4, 5), _w(5))), [_r(6, 2, 4)]),
    "aten::matmul": lambda: ((lambda x: x @ _w(5, 6)), [_r(2, 5)]),
    "aten::mm": lambda: ((lambda x: torch.mm(x, _w(5, 6))), [_r(2, 5)]),
    "aten::bmm": lambda: ((lambda x: torch.bmm(x, x.transpose(1, 2))), [_r(2, 3, 5)]),
    "aten::mv": lambda: ((lambda x: torch.mv(_w(4, 5), x)), [_r(5)]),
    "aten::addmm": lambda: ((lambda x: torch.addmm(_w(6), x, _w(5, 6))), [_r(2, 5)]),
    "aten::addbmm": lambda: ((lambda x: torch.addbmm(_w(3, 3), x, x.transpose(1, 2))), [_r(2, 3, 5)]),
    "aten::baddbmm": lambda: ((lambda x: torch.baddbmm(_w(3, 3), x, x.transpose(1, 2))), [_r(2, 3, 5)]),
    "aten::addmv": lambda: ((lambda x: torch.addmv(_w(4), _w(4, 5), x)), [_r(5)]),
    "aten::addr": lambda: ((lambda x: torch.addr(_w(5, 5), x, x)), [_r(5)]),
    "aten::einsum": lambda: ((lambda x: torch.einsum("ij,kj->ik", x, _w(6, 5))), [_r(2, 5)]),
    "aten::prelu": lambda: ((lambda x: F.prelu(x, _w(1).abs())), [_r(2, 5)]),
    "aten::scaled_dot_product_attention": lambda: ((lambda q: F.scaled_dot_product_attention(q, q, q)), [_r(2, 4, 8)]),
    "aten::linalg_vecdot": lambda: ((lambda x: torch.linalg.vecdot(x, _w(5))), [_r(2, 5)]),
    "aten::chain_matmul": lambda: ((lambda x: torch.chain_matmul(x, _w(5, 4), _w(4, 3))), [_r(2, 5)]),
    "aten::linalg_multi_dot": lambda: ((lambda x: torch.linalg.multi_dot([x, _w(5, 4), _w(4, 3)])), [_r(2, 5)]),
    "aten::cross_entropy_loss": lambda: ((lambda x, y: F.cross_entropy(_low(x), y)), [_r(4, 5), _long(4, high=5)]),
    "aten::nll_loss": lambda: ((lambda x, y: F.nll_loss(_low(x), y)), [_r(4, 5), _long(4, high=5)]),
    "aten::binary_cross_entropy_with_logits": lambda: (
        (lambda x: F.binary_cross_entropy_with_logits(_low(x), torch.ones_like(x))), [_r(2, 5)]),
    "aten::mse_loss": lambda: ((lambda x: F.mse_loss(_low(x), _low(x) * 0.5)), [_r(2, 5)]),
    "aten::l1_loss": lambda: ((lambda x: F.l1_loss(_low(x), _low(x) * 0.5)), [_r(2, 5)]),
    "aten::smooth_l1_loss": lambda: ((lambda x: F.smooth_l1_loss(_low(x), _low(x) * 0.5)), [_r(2, 5)]),
    "aten::huber_loss": lambda: ((lambda x: F.huber_loss(_low(x), _low(x) * 0.5)), [_r(2, 5)]),
    "aten::kl_div": lambda: (
        (lambda x: F.kl_div(_low(x).log_softmax(-1), _low(x).softmax(-1), reduction="batchmean")), [_r(2, 5)]),
    "aten::margin_ranking_loss": lambda: (
        (lambda x: F.margin_ranking_loss(_low(x[0]), _low(x[1]), torch.ones_like(x[0]))), [_r(2, 5)]),
    "aten::soft_margin_loss": lambda: ((lambda x: F.soft_margin_loss(_low(x), torch.ones_like(x))), [_r(2, 5)]),
    "aten::poisson_nll_loss": lambda: ((lambda x: F.poisson_nll_loss(_low(x), x.abs())), [_r(2, 5)]),
    "aten::cosine_embedding_loss": lambda: (
        (lambda x: F.cosine_embedding_loss(_low(x), _low(x).flip(0), torch.ones(2, device=x.device))), [_r(2, 5)]),
    "aten::hinge_embedding_loss": lambda: ((lambda x: F.hinge_embedding_loss(_low(x), torch.ones_like(x))), [_r(2, 5)]),
    "aten::multi_margin_loss": lambda: ((lambda x, y: F.multi_margin_loss(_low(x), y)), [_r(4, 5), _long(4, high=5)]),
    "aten::multilabel_margin_loss": lambda: (
        (lambda x, y: F.multilabel_margin_loss(_low(x), y)), [_r(4, 5), _long(4, 5, high=5)]),
    "aten::cdist": lambda: ((lambda x: torch.cdist(_low(x), _low(x))), [_r(3, 5)]),
    "aten::dist": lambda: ((lambda x: torch.dist(_low(x), _low(x) * 0.5)), [_r(3, 5)]),
    "aten::pdist": lambda: ((lambda x: F.pdist(_low(x))), [_r(3, 5)]),
    "aten::cosine_similarity": lambda: ((lambda x: F.cosine_similarity(_low(x), _low(x).flip(0))), [_r(3, 5)]),
    "aten::group_norm": lambda: ((lambda x: F.group_norm(_low(x), 1, _w(3), _w(3))), [_r(2, 3, 4)]),
    "aten::layer_norm": lambda: ((lambda x: F.layer_norm(_low(x), (5,), _w(5), _w(5))), [_r(2, 5)]),
    "aten::logsumexp": lambda: ((lambda x: torch.logsumexp(_low(x), -1)), [_r(2, 5)]),
    "aten::softmax.int": lambda: ((lambda x: F.softmax(_low(x), -1)), [_r(2, 5)]),
    "aten::log_softmax.int": lambda: ((lambda x: F.log_softmax(_low(x), -1)), [_r(2, 5)]),
}

# Normalizations whose vmap rules promote a reduced input with float32 weights (batching_fixes).
NORMALIZATIONS: dict[str, Callable[[], tuple[Callable[..., torch.Tensor], list[torch.Tensor]]]] = {
    "batch_norm": lambda: (
        (lambda x: F.batch_norm(_low(x), _w(3) * 0, _w(3).abs() + 1, _w(3), _w(3))), [_r(2, 3, 4)]),
    "batch_norm_training": lambda: ((lambda x: F.batch_norm(_low(x), None, None, _w(3), _w(3), True)), [_r(2, 3, 4)]),
    "instance_norm": lambda: ((lambda x: F.instance_norm(_low(x), weight=_w(3), bias=_w(3))), [_r(2, 3, 4)]),
}


def _autocast() -> torch.autocast:
    return torch.autocast(here().type, dtype=LOW)


def _per_instance(f: Callable[..., torch.Tensor], inputs: list[torch.Tensor]) -> torch.Tensor:
    try:
        with _autocast():
            return torch.stack([f(*(x[i] for x in inputs)) for i in range(N)])
    except (NotImplementedError, RuntimeError) as refused:  # pdist of bfloat16 on CPU (no cast there)
        pytest.skip(f"plain PyTorch refuses it on {here()}: {refused}")


def _compare(got: torch.Tensor, want: torch.Tensor) -> None:
    # one rounding of the reduced dtype apart at most (2**-8 relative for bfloat16, 2**-11 float16)
    torch.testing.assert_close(got, want, rtol=2**-6, atol=2**-6)


def test_every_op_of_the_table_has_a_case():
    assert {op.aten for op in autocast_policy.POLICIES.values()} == set(CASES)


@pytest.fixture(params=[torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def low(request, monkeypatch):
    """The reduced dtype of autocast and of the cases' reduced inputs."""
    monkeypatch.setattr(sys.modules[__name__], "LOW", request.param)
    return request.param


@pytest.mark.parametrize("case", sorted({**CASES, **NORMALIZATIONS}))
def test_a_map_under_autocast_gives_plain_pytorchs_dtype_and_values(case, low, placement):
    _check_case(case)


@pytest.mark.skipif(tp.devices()[0].platform != "cuda", reason="CUDA's autocast lists: run by make gpu-check")
@pytest.mark.parametrize("case", sorted({**CASES, **NORMALIZATIONS}))
def test_on_cuda_a_map_under_autocast_gives_plain_pytorchs_dtype_and_values(case):
    _check_case(case)


def _check_case(case: str) -> None:
    f, inputs = {**CASES, **NORMALIZATIONS}[case]()
    want = _per_instance(f, inputs)
    with _autocast():
        got = torch.as_tensor(tp.pmap(f)(*inputs))
    assert got.dtype == want.dtype, f"{case}: {got.dtype} under the map, {want.dtype} in plain PyTorch"
    _compare(got.cpu(), want.cpu())


@pytest.mark.parametrize("case", ["aten::linear", "aten::conv2d", "aten::cross_entropy_loss"])
def test_one_instance_at_a_time_agrees(case):
    f, inputs = CASES[case]()
    with _autocast():
        vectorized = torch.as_tensor(tp.pmap(f)(*inputs))
        with tp.disable_vectorization():
            looped = torch.as_tensor(tp.pmap(f)(*inputs))
    assert vectorized.dtype == looped.dtype
    _compare(vectorized, looped)


def test_gradients_through_the_casts_are_plain_pytorchs(placement):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(64, 5))
    model = model.to(here()).eval()  # batch norm's running statistics are read, not written, under the map
    ref = copy.deepcopy(model)
    x, y = _r(2, 3, 4, 4), _long(2, high=5)
    with _autocast():
        losses = tp.pmap(lambda v, t: F.cross_entropy(model(v), t))(x, y)
        want = torch.stack([F.cross_entropy(ref(x[i]), y[i]) for i in range(N)])
    losses = torch.as_tensor(losses)
    assert losses.dtype == want.dtype == torch.float32
    losses.sum().backward()
    want.sum().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert p.grad is not None and p.grad.dtype == q.grad.dtype
        torch.testing.assert_close(p.grad, q.grad, rtol=2**-5, atol=2**-5, msg=lambda s: f"{name}: {s}")


def test_a_dtype_given_to_softmax_is_kept():
    x = _r(2, 5)
    with _autocast():
        got = torch.as_tensor(tp.pmap(lambda v: F.softmax(_low(v), -1, dtype=torch.float64))(x))
    assert got.dtype == torch.float64


def test_without_autocast_nothing_is_cast():
    f, inputs = CASES["aten::linear"]()
    got = torch.as_tensor(tp.pmap(f)(*inputs))
    assert got.dtype == torch.float32


@pytest.mark.parametrize("case", ["aten::linear", "aten::conv2d", "aten::cross_entropy_loss", "batch_norm"])
def test_a_compiled_map_casts_as_plain_pytorch(case, placement):
    # jit=True traces under the same corrections (on 4 devices: each device's slice)
    f, inputs = {**CASES, **NORMALIZATIONS}[case]()
    want = _per_instance(f, inputs)
    with _autocast(), warnings.catch_warnings():
        warnings.simplefilter("error", tp.JitFallbackWarning)
        compiled = torch.as_tensor(tp.pmap(f, jit=True)(*inputs))
    assert compiled.dtype == want.dtype
    _compare(compiled.cpu(), want.cpu())


def _inside(f: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def with_autocast_inside(*args: torch.Tensor) -> torch.Tensor:
        with _autocast():
            return f(*args)

    return with_autocast_inside


@pytest.mark.parametrize("case", ["aten::linear", "aten::conv2d", "aten::cross_entropy_loss", "batch_norm"])
def test_autocast_entered_inside_the_mapped_function_casts_as_plain_pytorch(case, placement):
    f, inputs = {**CASES, **NORMALIZATIONS}[case]()
    want = _per_instance(f, inputs)
    got = torch.as_tensor(tp.pmap(_inside(f))(*inputs))
    assert got.dtype == want.dtype, f"{case}: {got.dtype} under the map, {want.dtype} in plain PyTorch"
    _compare(got.cpu(), want.cpu())
    with warnings.catch_warnings():
        warnings.simplefilter("error", tp.JitFallbackWarning)
        compiled = torch.as_tensor(tp.pmap(_inside(f), jit=True)(*inputs))
    assert compiled.dtype == want.dtype


def test_autocast_switched_off_inside_a_map_under_autocast_is_off():
    f, inputs = CASES["aten::linear"]()

    def off_inside(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(here().type, enabled=False):
            return f(x)

    with _autocast():
        got = torch.as_tensor(tp.pmap(off_inside)(*inputs))
    assert got.dtype == torch.float32


def test_an_autocast_decorator_reentered_by_every_instance():
    f, inputs = CASES["aten::linear"]()
    decorated = torch.autocast(here().type, dtype=LOW)(f)  # one autocast object, entered at every call
    want = _per_instance(f, inputs)
    with tp.disable_vectorization():
        looped = torch.as_tensor(tp.pmap(decorated)(*inputs))
    got = torch.as_tensor(tp.pmap(decorated)(*inputs))
    assert got.dtype == looped.dtype == want.dtype
    _compare(got, want)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_an_autocast_region_the_function_enters_holds_under_the_callers(jit, placement):
    """The caller's bfloat16 autocast around a map whose function turns autocast off for a
    product, or enters a float16 one: plain PyTorch's dtypes and values. Compiled, the
    program's own ops were cast again by the caller's autocast (bfloat16, 0.006 off)."""
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(3, 2, generator=g).to(here()), torch.randn(N, 5, 3, generator=g).to(here())

    def regions(w: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.autocast(here().type, enabled=False):
            off = v @ w
        with torch.autocast(here().type, dtype=torch.float16):
            half = v @ w
        return off, half

    with torch.autocast(here().type, dtype=torch.bfloat16):
        per_instance = [regions(w, x[i]) for i in range(N)]
        with warnings.catch_warnings():
            warnings.simplefilter("error", tp.JitFallbackWarning)
            got = [torch.as_tensor(t) for t in tp.pmap(regions, in_axes=(None, 0), jit=jit)(w, x)]
    want = [torch.stack(t) for t in zip(*per_instance)]  # (autocast's cat refuses float16 under bfloat16)
    for g_, w_ in zip(got, want):
        assert g_.dtype == w_.dtype
        _compare(g_.cpu(), w_.cpu())


@pytest.mark.parametrize("how", ["eager", "debug", "jit"])
def test_a_result_in_another_reduced_dtype_comes_back_as_it_is(how, placement):
    """Under a bfloat16 autocast, a function that returns float16: debug mode on one device
    put the instances' results together with autocast's ``cat``, which raised."""
    f = tp.pmap(lambda v: v.half(), jit=how == "jit")
    x = _r(N, 3)
    with torch.autocast(here().type, dtype=torch.bfloat16):
        if how == "debug":
            with tp.disable_vectorization():
                got = torch.as_tensor(f(x))
        else:
            got = torch.as_tensor(f(x))
    assert got.dtype == torch.float16
    assert torch.equal(got.cpu(), x.half().cpu())
