"""torchpmap's own batching rules (torchpmap._engines.batching_rules).

The oracle is the op called once per instance, as torch's fallback does: the rules must
give the same bits, forward and backward, for every way the arguments can be batched,
and no "performance drop" warning may remain.
"""
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.func import grad, vmap

import torchpmap as tp
from torchpmap._engines import batching_rules
from torchpmap._state import torch_private as private

FLASH = "aten::_scaled_dot_product_flash_attention_for_cpu"

pytestmark = pytest.mark.skipif(
    not hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"), reason="no CPU flash attention"
)


@pytest.fixture(autouse=True)
def installed():
    batching_rules.install()


def attention(q, k, v, mask=None, causal=False):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)


def loss(q, k, v, mask=None, causal=False):
    return attention(q, k, v, mask, causal).sin().sum()


def no_fallback_warning(fn):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = fn()
    assert not [w for w in seen if "performance drop" in str(w.message)], [str(w.message) for w in seen]
    return out


def test_the_rules_are_registered():
    assert private.has_kernel_for_dispatch_key(FLASH, "FuncTorchBatched")
    assert private.has_kernel_for_dispatch_key(FLASH + "_backward", "FuncTorchBatched")


MASKS = {
    "none": lambda n, b, h, L, s: None,
    "bool, shared, L x S": lambda n, b, h, L, s: torch.rand(L, s) > 0.3,
    "float, shared, B x 1 x L x S": lambda n, b, h, L, s: torch.randn(b, 1, L, s),
    "float, per instance, B x H x L x S": lambda n, b, h, L, s: torch.randn(n, b, h, L, s),
    "bool, per instance, 1 x L x S": lambda n, b, h, L, s: torch.rand(n, 1, L, s) > 0.3,
}


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mask_kind", list(MASKS))
def test_forward_and_gradients_equal_one_call_per_instance(mask_kind, causal):
    if causal and mask_kind != "none":
        pytest.skip("sdpa takes a mask or is_causal, not both")
    torch.manual_seed(0)
    n, b, h, L, s, e = 3, 2, 4, 8, 8, 16
    q, k, v = (torch.randn(n, b, h, L if i == 0 else s, e) for i in range(3))
    mask = MASKS[mask_kind](n, b, h, L, s)
    mask_dim = 0 if mask is not None and mask.shape[0] == n and mask.dim() > 2 and "per instance" in mask_kind else None

    def pick(i):
        return mask if mask_dim is None else mask[i]

    want_out = torch.stack([attention(q[i], k[i], v[i], pick(i), causal) for i in range(n)])
    want_grads = [
        torch.stack(g) for g in zip(*(grad(loss, (0, 1, 2))(q[i], k[i], v[i], pick(i), causal) for i in range(n)))
    ]
    got_out = no_fallback_warning(lambda: vmap(attention, (0, 0, 0, mask_dim, None))(q, k, v, mask, causal))
    got_grads = no_fallback_warning(
        lambda: vmap(grad(loss, (0, 1, 2)), (0, 0, 0, mask_dim, None))(q, k, v, mask, causal)
    )
    assert torch.equal(got_out, want_out)
    for got, want in zip(got_grads, want_grads):
        assert torch.equal(got, want)


def test_unbatched_keys_and_values_broadcast_over_the_instances():
    torch.manual_seed(1)
    q = torch.randn(4, 2, 2, 5, 8)
    k, v = torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    want = torch.stack([attention(q[i], k, v) for i in range(4)])
    assert torch.equal(no_fallback_warning(lambda: vmap(attention, (0, None, None))(q, k, v)), want)


def test_nested_vmaps_and_a_batch_dim_that_is_not_first():
    torch.manual_seed(2)
    q, k, v = (torch.randn(2, 1, 3, 2, 6, 8).movedim(2, 4) for _ in range(3))  # instances at dims 0 and 4
    want = torch.stack(
        [
            torch.stack([attention(q[i, :, :, :, j], k[i, :, :, :, j], v[i, :, :, :, j]) for j in range(3)])
            for i in range(2)
        ]
    )
    got = no_fallback_warning(lambda: vmap(vmap(attention, (3, 3, 3)))(q, k, v))
    assert torch.equal(got, want)


def test_grad_around_vmap():
    torch.manual_seed(3)
    q, k, v = (torch.randn(3, 2, 2, 6, 8) for _ in range(3))

    def total(q):
        return vmap(attention, (0, None, None))(q, k[0], v[0]).pow(2).sum()

    want = torch.stack([grad(lambda x: attention(x, k[0], v[0]).pow(2).sum())(q[i]) for i in range(3)])
    assert torch.equal(no_fallback_warning(lambda: grad(total)(q)), want)


def test_dropout_still_draws_per_instance():
    torch.manual_seed(4)
    q, k, v = (torch.randn(3, 2, 2, 6, 8) for _ in range(3))

    def drop(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)

    torch.manual_seed(5)
    got = vmap(drop, randomness="different")(q, k, v)
    assert got.shape == (3, 2, 2, 6, 8) and torch.isfinite(got).all()
    assert not torch.equal(got[0], got[1])  # not one draw folded for all


def test_a_transformer_step_under_pmap_matches_plain_pytorch():
    torch.manual_seed(6)
    layer = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True).double()
    params = {k: p.detach() for k, p in layer.named_parameters()}
    x = torch.randn(4, 3, 5, 16, dtype=torch.float64)  # 4 instances of 3 sequences

    def step(params, x):
        return grad(lambda p: torch.func.functional_call(layer, p, (x,)).pow(2).mean())(params)

    got = no_fallback_warning(lambda: tp.pmap(step, in_axes=(None, 0))(params, x))
    for i in range(4):
        want = step(params, x[i])
        for key in params:
            torch.testing.assert_close(torch.as_tensor(got[key])[i], want[key], rtol=1e-12, atol=1e-14)


# --------------------------------------------------------------------------- the CUDA backwards' rule


def test_the_cuda_attention_backward_rules_are_registered():
    for op in private.cuda_attention_backwards():
        assert private.has_kernel_for_dispatch_key(op.name(), "FuncTorchBatched"), op.name()


@pytest.mark.parametrize("batched", ["all", "query only", "grads and log-sum-exp only"])
def test_the_attention_backward_rule_folds_the_instances_as_one_call_per_instance_would(batched):
    """The rule of the CUDA backwards (whose kernels need a GPU) applied to the CPU flash
    backward, whose arguments carry the same names: folding the instances into the batch
    gives the per-instance calls' results, whichever arguments are batched."""
    (forward, backward) = private.cpu_flash_attention()
    rule = batching_rules._attention_backward(backward)
    g = torch.Generator().manual_seed(3)
    n, b, h, L, e = 3, 2, 2, 5, 4
    q, k, v, grad_out = (torch.randn(n, b, h, L, e, generator=g) for _ in range(4))
    if batched == "query only":
        k, v = k[0], v[0]
    outs, lses = zip(
        *(forward(q[i], k if k.dim() == 4 else k[i], v if v.dim() == 4 else v[i], 0.0, True) for i in range(n))
    )
    out, lse = torch.stack(outs), torch.stack(lses)
    if batched == "grads and log-sum-exp only":
        q = q[0]
    dims = [0, None if q.dim() == 4 else 0, None if k.dim() == 4 else 0, None if v.dim() == 4 else 0, 0, 0]

    def per_instance(i):
        pick = lambda t, d: t if d is None else t[i]  # noqa: E731
        args = [pick(t, d) for t, d in zip((grad_out, q, k, v, out, lse), dims)]
        return backward(*args, 0.0, True, attn_mask=None, scale=None)

    expected = [torch.stack(parts) for parts in zip(*(per_instance(i) for i in range(n)))]
    got = vmap(lambda *ts: rule(*ts, 0.0, True, attn_mask=None, scale=None), in_dims=tuple(dims))(
        grad_out, q, k, v, out, lse
    )
    for a, w in zip(got, expected):
        torch.testing.assert_close(a, w)


@pytest.mark.parametrize("shape", [(3, 2, 2, 5, 4), (3, 5, 4), (3, 2, 5, 4)], ids=["4-D", "2-D", "3-D"])
@pytest.mark.parametrize("jit", [False, True])
def test_attention_gradient_taken_outside_the_map_is_that_of_a_loop(shape, jit):
    """The case that fails on an H100 with the memory-efficient kernel (docs/gpu.md),
    here on the CPU's kernels: values and gradients equal those of a loop over the
    instances, for the kernels' 4-D layout and for other ranks, eager and compiled."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(*shape, generator=g, requires_grad=True) for _ in range(3))
    weights = torch.randn(*shape, generator=g)
    out = tp.pmap(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), jit=jit)(q, k, v)
    (out * weights).sum().backward()
    got = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    want = torch.stack([F.scaled_dot_product_attention(q[i], k[i], v[i], is_causal=True) for i in range(shape[0])])
    (want * weights).sum().backward()
    torch.testing.assert_close(out, want)
    for a, w in zip(got, (q.grad, k.grad, v.grad)):
        torch.testing.assert_close(a, w)


# --------------------------------------------------------------------------- the CUDA forwards' rule

_lib = torch.library.Library("torchpmap_test", "DEF")
_lib.define(
    "attention(Tensor query, Tensor key, Tensor value, Tensor? attn_bias, bool compute_log_sumexp, "
    "float dropout_p=0., bool is_causal=False, *, float? scale=None) -> (Tensor, Tensor, Tensor, Tensor)"
)
_calls = []


def _math_attention(query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, *, scale=None):
    """The memory-efficient forward's contract, in math: output, log-sum-exp (empty unless
    asked), and a scalar random state. Records what it was called with."""
    strides = None if attn_bias is None else attn_bias.stride()
    _calls.append(dict(rows=query.shape[0], lse=compute_log_sumexp, bias_strides=strides))
    scores = query @ key.transpose(-2, -1) * (scale or query.shape[-1] ** -0.5)
    if attn_bias is not None:
        scores = scores + attn_bias
    lse = torch.logsumexp(scores, -1)
    out = torch.softmax(scores, -1) @ value
    if not compute_log_sumexp:
        lse = lse[..., :0]
    return out, lse, torch.tensor(7), torch.tensor(0)


_lib.impl("attention", _math_attention, "CPU")
_FORWARD = torch.ops.torchpmap_test.attention.default
_RULE = batching_rules._attention_forward(_FORWARD)


def test_the_cuda_attention_forward_rules_are_registered():
    for op in private.cuda_attention_forwards():
        assert private.has_kernel_for_dispatch_key(op.name(), "FuncTorchBatched"), op.name()


@pytest.mark.parametrize("batched", ["all", "query only", "key and bias", "bias only"])
def test_the_attention_forward_rule_folds_the_instances_into_one_call(batched):
    """The rule of the CUDA forwards on a math kernel with their arguments: one call with
    the instances folded into the batch gives each instance's own call, whichever
    arguments are batched, and an attention bias reaches the kernel padded to strides of
    16 elements."""
    g = torch.Generator().manual_seed(11)
    n, b, h, length, e = 3, 2, 2, 5, 4
    q, k, v = (torch.randn(n, b, h, length, e, generator=g) for _ in range(3))
    bias = torch.randn(n, 1, h, length, length, generator=g)
    keep = {"all": "qkvb", "query only": "q", "key and bias": "kb", "bias only": "b"}[batched]
    args = [t if name in keep else t[0] for name, t in zip("qkvb", (q, k, v, bias))]
    dims = tuple(0 if name in keep else None for name in "qkvb")
    _calls.clear()
    got = vmap(lambda q, k, v, b: _RULE(q, k, v, b, True, 0.0, False)[:2], in_dims=dims)(*args)
    assert [c["rows"] for c in _calls] == [n * b]
    assert all(s % 16 == 0 for s in _calls[0]["bias_strides"][:-1])
    for i in range(n):
        one = [t[i] if d == 0 else t for t, d in zip(args, dims)]
        want = _math_attention(*one, True)[:2]
        for a, w in zip(got, want):
            torch.testing.assert_close(a[i], w)


def test_the_attention_forward_rule_computes_the_log_sum_exp_for_a_gradient_outside_the_map():
    """The defect the rule exists for: ``F.scaled_dot_product_attention`` under vmap asks
    for no log-sum-exp when the gradient is taken outside the map (the batched wrappers do
    not require grad); the rule asks for it whenever an unwrapped input requires grad."""
    q = torch.randn(3, 2, 2, 5, 4, requires_grad=True)
    _calls.clear()
    _, lse = vmap(lambda q: _RULE(q, q, q, None, False, 0.0, False)[:2])(q)
    assert _calls[-1]["lse"] is True and lse.shape == (3, 2, 2, 5)
    with torch.no_grad():
        _, lse = vmap(lambda q: _RULE(q, q, q, None, False, 0.0, False)[:2])(q)
    assert _calls[-1]["lse"] is False and lse.shape == (3, 2, 2, 0)
    _, lse = vmap(lambda q: _RULE(q, q, q, None, False, 0.0, False)[:2])(q.detach())
    assert _calls[-1]["lse"] is False


@pytest.mark.parametrize("randomness", ["error", "same"])
def test_the_attention_forward_rule_refuses_dropout_as_vmap_does(randomness):
    q = torch.randn(3, 2, 2, 5, 4)
    with pytest.raises(RuntimeError, match="random"):
        vmap(lambda q: _RULE(q, q, q, None, False, 0.5, False)[0], randomness=randomness)(q)


def test_the_attention_forward_rule_folds_dropout_under_different_randomness():
    q = torch.randn(3, 2, 2, 5, 4)
    _calls.clear()
    vmap(lambda q: _RULE(q, q, q, None, False, 0.5, False)[0], randomness="different")(q)
    assert [c["rows"] for c in _calls] == [6]


def test_the_memory_efficient_forward_asks_for_the_log_sum_exp_under_vmap():
    """The registered rule on torch's own memory-efficient kernel (its meta function on
    the CPU; meta tensors cannot enter a pmap): the log-sum-exp is there for a gradient
    outside the map."""
    op = private.cuda_attention_forwards()[0]
    q = torch.empty(4, 2, 2, 8, 16, device="meta", requires_grad=True)
    out, lse = vmap(lambda q: op(q, q, q, None, False, 0.0, True)[:2])(q)
    assert out.shape == (4, 2, 2, 8, 16) and lse.shape[:3] == (4, 2, 2) and lse.shape[3] >= 8


METADATA_WRITES = {
    "resize_": lambda t: t.resize_(2),
    "resize_as_": lambda t: t.resize_as_(torch.zeros(2)),
    "as_strided_": lambda t: t.as_strided_((1,), (1,)),
    "set_": lambda t: t.set_(torch.zeros(2)),
}


@pytest.mark.parametrize("name", sorted(METADATA_WRITES))
def test_metadata_writes_of_a_batched_tensor_run_each_instance_as_alone_on_every_placement(placement, name):
    """vmap's own rule for ``resize_`` resized the tensor holding every instance (instance
    i got instance i - 1's elements); ``resize_as_``, ``as_strided_`` and ``set_`` have no
    rule, and vmap's fallback dropped them (the tensor kept its shape and values). On one
    device (vectorized) that differed from 4 devices (one instance each, run directly).
    Now every placement gives a loop's."""
    write = METADATA_WRITES[name]

    def f(x):
        y = x.clone()
        write(y)
        return y * 10

    x = torch.arange(12.0).reshape(4, 3)
    want = torch.stack([f(row) for row in x])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tp.VectorizationFallbackWarning)
        got = tp.pmap(f)(x)
    torch.testing.assert_close(torch.as_tensor(got).cpu(), want)
    with pytest.raises(RuntimeError, match="of a tensor that differs between the instances"):
        vmap(f)(x)


def test_resize_of_a_tensor_the_same_for_every_instance_stays_vectorized():
    def grow(x):
        buffer = torch.zeros(1)
        buffer.resize_(3)
        return x + buffer.fill_(1.0)

    with warnings.catch_warnings():
        warnings.simplefilter("error", tp.VectorizationFallbackWarning)
        torch.testing.assert_close(tp.pmap(grow, devices=tp.devices()[:1])(torch.zeros(4, 3)), torch.ones(4, 3))


#: (weight per instance, indices per instance, F.embedding's options): the ways vmap's own
#: rule batches the op; the first and the padded per-instance ones gave other gradients
#: than a loop through a ``.backward()`` on one device.
EMBEDDINGS = {
    "shared weight, scale_grad_by_freq": (False, True, dict(scale_grad_by_freq=True)),
    "shared weight, padding_idx": (False, True, dict(padding_idx=1)),
    "shared weight": (False, True, {}),
    "weight per instance, scale_grad_by_freq": (True, True, dict(scale_grad_by_freq=True)),
    "weight per instance, padding_idx": (True, True, dict(padding_idx=1)),
    "weight per instance, padding_idx, scale_grad_by_freq": (True, True, dict(padding_idx=1, scale_grad_by_freq=True)),
    "weight per instance": (True, True, {}),
    "weight per instance, shared indices, scale_grad_by_freq": (True, False, dict(scale_grad_by_freq=True)),
    "weight per instance, shared indices, padding_idx": (True, False, dict(padding_idx=2)),
}


@pytest.mark.parametrize("name", sorted(EMBEDDINGS))
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_embedding_gradient_taken_outside_the_map_is_that_of_a_loop(placement, name, jit):
    per_weight, per_index, options = EMBEDDINGS[name]
    g = torch.Generator().manual_seed(0)
    idx = torch.tensor([[1, 1, 2, 3], [1, 4, 4, 4], [0, 0, 0, 1], [2, 2, 2, 2]])
    if not per_index:
        idx = idx[1]
    w = torch.randn(*((4,) if per_weight else ()), 5, 3, generator=g, requires_grad=True)
    scale = torch.arange(1.0, 4.0)

    def one(k):
        return F.embedding(idx[k] if per_index else idx, w[k] if per_weight else w, **options)

    (torch.stack([one(k) for k in range(4)]) * scale).sum().backward()
    want, want_values = w.grad.clone(), torch.stack([one(k) for k in range(4)]).detach()
    w.grad = None
    in_axes = (0 if per_weight else None, 0 if per_index else None)
    f = tp.pmap(lambda wi, ii: F.embedding(ii, wi, **options), in_axes=in_axes, jit=jit)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tp.JitFallbackWarning)  # a lone instance per device compiles nothing
        out = torch.as_tensor(f(w, idx))
    assert torch.equal(out.detach(), want_values)
    (out * scale).sum().backward()
    assert torch.equal(w.grad, want), (w.grad - want).abs().max()


@pytest.mark.parametrize("name", sorted(EMBEDDINGS))
def test_embedding_rule_under_grad_and_nested_vmaps_is_a_loops(name):
    """Inside ``torch.func.grad`` (vmap's rule for the backward) and in a vmap of a vmap."""
    per_weight, per_index, options = EMBEDDINGS[name]
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 5, (2, 3, 4), generator=g)
    w = torch.randn(*((2, 3) if per_weight else ()), 5, 3, generator=g)
    if not per_index:
        idx = idx[0, 0]

    def loss(wi, ii):
        return (F.embedding(ii, wi, **options) * torch.arange(1.0, 4.0)).sum()

    in_dims = (0 if per_weight else None, 0 if per_index else None)
    got = vmap(vmap(grad(loss), in_dims=in_dims), in_dims=in_dims)(w, idx)
    want = torch.stack([
        torch.stack([
            grad(loss)(w[a, b] if per_weight else w, idx[a, b] if per_index else idx) for b in range(3)
        ]) for a in range(2)
    ])
    assert torch.equal(got, want)
