"""torchpmap's batching rules for recurrent networks and for reading a tensor's value.

* ``aten::gru/lstm/rnn_tanh/rnn_relu.input`` (``nn.GRU``, ``nn.LSTM``, ``nn.RNN``): with
  the weights shared by every instance, the instances fold into the op's batch (one
  call); with weights per instance, one call per instance. The oracle is one call per
  instance, and plain PyTorch on the whole batch; values and gradients, the gradient
  taken outside the map (``.backward()``) and inside it (``torch.func.grad``, where grad
  decomposes the op first and an initial state must be batched: see
  ``torchpmap._engines.recurrent``), eager and ``jit=True``, on one device and on 4 CPU
  devices (8 instances: 2 per device, vectorized there too).
* ``bool(t)``/``t.item()``: read once when every instance holds the same value (Hugging
  Face's ``padding_mask.all()``), refused (so one instance at a time) otherwise, never
  baked into a compiled program.
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, stack_module_state

import torchpmap as tp
from torchpmap._engines import batching_rules, recurrent, rnn_weights
from torchpmap.training import data_parallel_step, shard

N, B, T, F_IN, H = 8, 2, 4, 3, 5
KINDS = ["GRU", "LSTM", "RNN"]


@pytest.fixture(autouse=True)
def installed():
    batching_rules.install()


@pytest.fixture
def devices(placement):
    """1 and 4 CPU devices (conftest's ``placement``)."""
    return placement


def quietly(fn):
    """``fn()``, asserting that nothing fell back: no vmap loop, no one-at-a-time run."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = fn()
    bad = [
        str(w.message)
        for w in seen
        if "performance drop" in str(w.message) or issubclass(w.category, tp.VectorizationFallbackWarning)
    ]
    assert not bad, bad
    return out


def here() -> torch.device:
    """The first device maps run on: a CPU one, or CUDA where ``make gpu-check`` runs this
    file (cuDNN's recurrent ops under the rule). Modules and inputs are made there, so
    that the oracles (plain calls) run on the same kernels."""
    return tp.devices()[0].torch_device


def network(kind: str, batch_first: bool, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return getattr(nn, kind)(F_IN, H, num_layers=2, bidirectional=True, batch_first=batch_first).double().to(here())


def inputs(batch_first: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    shape = (N, B, T, F_IN) if batch_first else (N, T, B, F_IN)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(here())


def states(kind: str) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    h = torch.randn(N, 4, B, H, generator=g, dtype=torch.float64).to(here())  # 2 layers x 2 directions
    c = torch.randn(N, 4, B, H, generator=g, dtype=torch.float64).to(here())
    return (h, c) if kind == "LSTM" else h


def summary(result: tuple) -> torch.Tensor:
    """The output and the final state(s), as one tensor (to compare and differentiate)."""
    out, final = result
    finals = final if isinstance(final, tuple) else (final,)
    return torch.cat([out.flatten(), *(f.flatten() for f in finals)])


def one_call_per_instance(m: nn.Module, x: torch.Tensor, hx=None) -> torch.Tensor:
    if hx is None:
        return torch.stack([summary(m(v)) for v in x])
    if isinstance(hx, tuple):
        return torch.stack([summary(m(v, (h, c))) for v, h, c in zip(x, *hx)])
    return torch.stack([summary(m(v, h)) for v, h in zip(x, hx)])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "time_first"])
@pytest.mark.parametrize("with_state", [False, True], ids=["no_state", "state"])
def test_shared_weights_fold_values_and_gradients_outside(kind, batch_first, with_state, devices):
    m, x = network(kind, batch_first), inputs(batch_first)
    hx = states(kind) if with_state else None
    ref = copy.deepcopy(m)
    xs = x.clone().requires_grad_()
    f = tp.pmap((lambda v, h: summary(m(v, h))) if with_state else (lambda v: summary(m(v))))
    got = quietly(lambda: torch.as_tensor(f(xs, hx) if with_state else f(xs)))
    want_x = x.clone().requires_grad_()
    want = one_call_per_instance(ref, want_x, hx)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    (got.sin().sum()).backward()
    (want.sin().sum()).backward()
    for (name, p), q in zip(m.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=lambda s: f"{name}: {s}")
    torch.testing.assert_close(xs.grad, want_x.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind", KINDS)
def test_shared_weights_match_plain_pytorch_on_the_whole_batch(kind):
    m, x = network(kind, True), inputs(True)
    got = quietly(lambda: torch.as_tensor(tp.pmap(lambda v: m(v)[0])(x)))
    torch.testing.assert_close(got, m(x.flatten(0, 1))[0].unflatten(0, (N, B)), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", KINDS)
def test_weights_per_instance_run_one_call_each(kind):
    models = [network(kind, True, seed=i) for i in range(N)]
    params, _ = stack_module_state(models)
    base = copy.deepcopy(models[0]).to("meta")
    x = inputs(True)
    got = quietly(lambda: torch.as_tensor(tp.pmap(lambda p, v: summary(functional_call(base, p, (v,))))(params, x)))
    want = torch.stack([summary(mi(v)) for mi, v in zip(models, x)])
    # on CUDA, each plain module runs cuDNN and the map torch's cells (rnn_weights): float64 rounding apart
    exact = here().type != "cuda"
    torch.testing.assert_close(got, want, rtol=0 if exact else 1e-12, atol=0 if exact else 1e-14)
    # per-instance weight gradients, taken inside the map
    g = tp.pmap(grad(lambda p, v: summary(functional_call(base, p, (v,))).sin().sum()))(params, x)
    for i in (0, N - 1):
        summary(models[i](x[i])).sin().sum().backward()
        for name, p in models[i].named_parameters():
            torch.testing.assert_close(torch.as_tensor(g[name])[i], p.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind", KINDS)
def test_gradient_inside_the_map_with_a_batched_state(kind, devices):
    # grad decomposes the op before vmap sees it: its cells' ops are batched by vmap itself
    m, x, hx = network(kind, True), inputs(True), states(kind)
    params = {k: v.detach() for k, v in m.named_parameters()}

    def loss(p, v, h):
        return summary(functional_call(m, p, (v, h))).sin().sum()

    got = quietly(lambda: tp.pmap(grad(loss), in_axes=(None, 0, 0))(params, x, hx))
    for i in (0, N - 1):
        want = grad(loss)(params, x[i], tuple(h[i] for h in hx) if isinstance(hx, tuple) else hx[i])
        for name in params:
            torch.testing.assert_close(torch.as_tensor(got[name])[i], want[name], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind", KINDS)
def test_jit_folds_and_matches_eager(kind):
    m, x = network(kind, True), inputs(True)[:, :, :2]
    ref = copy.deepcopy(m)
    with warnings.catch_warnings():
        warnings.simplefilter("error", tp.JitFallbackWarning)
        got = torch.as_tensor(tp.pmap(lambda v: summary(m(v)), jit=True, devices=tp.devices()[:1])(x))
    want = one_call_per_instance(ref, x)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    got.sum().backward()
    want.sum().backward()
    for p, q in zip(m.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12)


class Recurrent(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.rnn = getattr(nn, kind)(F_IN, H, num_layers=2, batch_first=True)
        self.head = nn.Linear(H, 2)

    def forward(self, x):
        return self.head(self.rnn(x)[0][:, -1])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_data_parallel_step_vectorizes_without_an_initial_state(kind, jit, devices):
    torch.manual_seed(0)
    model = Recurrent(kind).double()
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(N * B, T, F_IN, generator=g, dtype=torch.float64), torch.randint(0, 2, (N * B,), generator=g)
    step = data_parallel_step(model, nn.functional.cross_entropy, None, devices=devices, jit=jit)
    with warnings.catch_warnings():
        warnings.simplefilter("error", tp.VectorizationFallbackWarning)
        warnings.simplefilter("error", tp.JitFallbackWarning)  # 4 devices: compiled device slices (issue 29)
        loss = step(shard((x, y), n=N))  # a float32 nn.LSTM on CPU: vmap still loops over mkldnn_rnn_layer inside
    losses = [nn.functional.cross_entropy(ref(x[i * B:(i + 1) * B]), y[i * B:(i + 1) * B]) for i in range(N)]
    want = torch.stack(losses).mean()
    want.backward()
    torch.testing.assert_close(loss, want.detach(), rtol=1e-10, atol=1e-12)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-9, atol=1e-12, msg=lambda s: f"{name}: {s}")


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_float32_lstm_step_on_one_device_compiles_and_matches_plain_pytorch(jit):
    # float32 on CPU: oneDNN's mkldnn_rnn_layer, whose backward must run as torch's own
    # kernel (not its differentiable math under torch.func.grad), and which the compiled
    # step traces as the LSTM's cells (AOTAutograd cannot differentiate mkldnn_rnn_layer)
    torch.manual_seed(0)
    model = Recurrent("LSTM").to(here())
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(N * B, T, F_IN, generator=g).to(here()), torch.randint(0, 2, (N * B,), generator=g).to(here())
    step = data_parallel_step(model, nn.functional.cross_entropy, None, devices=tp.devices()[:1], jit=jit)
    with warnings.catch_warnings():
        warnings.simplefilter("error", tp.VectorizationFallbackWarning)
        warnings.simplefilter("error", tp.JitFallbackWarning)
        loss = step(shard((x, y), n=N))
    # cuDNN's RNN takes TF32 products unless told not to (torch.backends.cudnn.allow_tf32); the
    # map's cells are torch's float32 matmuls
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        want = torch.stack(
            [nn.functional.cross_entropy(ref(x[i * B:(i + 1) * B]), y[i * B:(i + 1) * B]) for i in range(N)]
        )
        want.mean().backward()
    # on CUDA, plain PyTorch runs cuDNN's fused kernel and the map the network's cells: float32 rounding apart
    atol = 1e-5 if here().type == "cuda" else 1e-6
    torch.testing.assert_close(loss, want.mean().detach(), rtol=1e-5, atol=atol)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=atol, msg=lambda s: f"{name}: {s}")


@pytest.mark.parametrize("kind", KINDS)
def test_a_step_with_the_gradient_inside_the_map_matches_plain_pytorch(kind):
    # randomness="per_instance" keeps data_parallel_step's grad-inside-the-map path on one
    # device (the path of several devices and processes): on CUDA the parameters are
    # torch.func grad wrappers, which cuDNN cannot take (torchpmap._engines.rnn_weights)
    torch.manual_seed(0)
    model = Recurrent(kind).to(here())
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(N * B, T, F_IN, generator=g).to(here()), torch.randint(0, 2, (N * B,), generator=g).to(here())
    step = data_parallel_step(
        model, nn.functional.cross_entropy, None, devices=tp.devices()[:1], randomness="per_instance"
    )
    loss = step(shard((x, y), n=N))
    # cuDNN's RNN takes TF32 products unless told not to (torch.backends.cudnn.allow_tf32); the
    # map's cells are torch's float32 matmuls
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        want = torch.stack(
            [nn.functional.cross_entropy(ref(x[i * B:(i + 1) * B]), y[i * B:(i + 1) * B]) for i in range(N)]
        )
        want.mean().backward()
    # on CUDA, plain PyTorch runs cuDNN's fused kernel and the map the network's cells: float32 rounding apart
    atol = 1e-5 if here().type == "cuda" else 1e-6
    torch.testing.assert_close(loss, want.mean().detach(), rtol=1e-5, atol=atol)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=atol, msg=lambda s: f"{name}: {s}")


def test_the_weights_a_forward_reads_are_the_ones_functional_call_put_in_place():
    # what decides whether an RNN on CUDA runs without cuDNN (torchpmap._engines.rnn_weights)
    gru = nn.GRU(F_IN, H, batch_first=True)
    seen: list[bool] = []
    gru.register_forward_pre_hook(lambda m, args: seen.append(rnn_weights.wrapped(rnn_weights.weights_in_use(m))))
    params = {k: v.detach() for k, v in gru.named_parameters()}
    x = torch.randn(B, T, F_IN)
    gru(x)
    grad(lambda p: functional_call(gru, p, (x,))[0].sum())(params)
    tp.vmap(lambda p: functional_call(gru, p, (x,))[0])(stack_module_state([gru, gru])[0])
    assert seen == [False, True, True]


@pytest.mark.parametrize("module", [
    nn.LSTM(F_IN, H, num_layers=2, bidirectional=True, proj_size=2), nn.GRU(F_IN, H, batch_first=True), nn.RNN(F_IN, H),
], ids=["lstm_projected", "gru_batch_first", "rnn"])
@pytest.mark.parametrize("batched", [True, False], ids=["batched", "unbatched_input"])
def test_the_supplied_state_is_the_modules_own(module, batched):
    leading = (2, T) if getattr(module, "batch_first", False) else (T, 2)
    x = torch.randn(*leading, F_IN) if batched else torch.randn(T, F_IN)
    state = recurrent.zero_state(module, x)
    torch.testing.assert_close(module(x, state), module(x), rtol=0, atol=0)


@pytest.mark.parametrize("call", ["x", "x, None", "x, hx=None"])
def test_the_state_is_supplied_only_inside_a_map_and_only_when_missing(call):
    gru = nn.GRU(F_IN, H, batch_first=True)
    x = torch.randn(B, T, F_IN)
    args, kwargs = {"x": ((x,), {}), "x, None": ((x, None), {}), "x, hx=None": ((x,), {"hx": None})}[call]
    assert recurrent._supply_zero_state(gru, args, kwargs) is None  # outside a map
    supplied = tp.vmap(lambda v: torch.stack(recurrent._supply_zero_state(gru, (v, *args[1:]), kwargs)[0][1:]))(x[None])
    assert supplied.shape == (1, 1, 1, B, H) and not supplied.any()
    state = torch.ones(1, B, H)
    given = tp.vmap(lambda v: torch.tensor(recurrent._supply_zero_state(gru, (v, state), {}) is None))(x[None])
    assert bool(given.all())


def test_zero_state_hooks_are_gone_after_the_step():
    model = Recurrent("GRU").double()
    step = data_parallel_step(model, nn.functional.cross_entropy, None, devices=tp.devices()[:1])
    step(shard((torch.randn(N * B, T, F_IN, dtype=torch.float64), torch.zeros(N * B, dtype=torch.long)), n=N))
    assert not model.rnn._forward_pre_hooks


# --------------------------------------------------------------------------- reading values


def test_a_value_the_same_on_every_instance_is_read_once():
    f = tp.pmap(lambda v: v * 2 if bool((v > 0).all()) else v.abs() * float(v.new_ones(()).sum()))
    x = torch.rand(N, 3).to(here()) + 0.1
    torch.testing.assert_close(torch.as_tensor(quietly(lambda: f(x))), x * 2)
    torch.testing.assert_close(torch.as_tensor(quietly(lambda: f(-x))), x)


def test_a_value_that_differs_falls_back_to_one_at_a_time():
    x = torch.rand(N, 3).to(here()) + 0.1
    x[3] *= -1
    f = tp.pmap(lambda v: v * 2 if bool((v > 0).all()) else -v)
    with pytest.warns(tp.VectorizationFallbackWarning):
        got = torch.as_tensor(f(x))
    torch.testing.assert_close(got, torch.stack([v * 2 if bool((v > 0).all()) else -v for v in x]))


def test_a_users_own_vmap_still_refuses_a_value_read():
    tp.pmap(lambda v: v * 2 if bool((v > 0).all()) else v)(torch.ones(N, 3))  # the rules are installed
    same = torch.ones(N, 3)  # the same value on every instance: a torchpmap map would read it
    with pytest.raises(RuntimeError, match="It looks like you're"):
        torch.func.vmap(lambda v: v * 2 if bool((v > 0).all()) else v)(same)
    inner = tp.pmap(lambda v: torch.func.vmap(lambda w: w * 2 if bool((w > 0).all()) else w)(v))
    with pytest.warns(tp.VectorizationFallbackWarning), pytest.raises(RuntimeError, match="It looks like you're"):
        inner(torch.ones(N, 2, 3))


def test_values_are_compared_bit_for_bit():
    x = torch.zeros(N, 1)
    x[2] = -0.0  # == 0.0, but Python reads another float
    f = tp.pmap(lambda v: v + torch.copysign(torch.ones(()), torch.tensor(v[0].item())))
    with pytest.warns(tp.VectorizationFallbackWarning):
        got = torch.as_tensor(f(x))
    assert got[2].item() == -1.0 and got[0].item() == 1.0


def test_a_read_value_is_never_baked_into_a_compiled_program():
    f = tp.pmap(lambda v: v * 2 if bool((v > 0).all()) else -v, jit=True, devices=tp.devices()[:1])
    x = torch.rand(N, 3).to(here()) + 0.1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tp.JitFallbackWarning)
        torch.testing.assert_close(torch.as_tensor(f(x)), x * 2)
        torch.testing.assert_close(torch.as_tensor(f(-x)), x)


@pytest.mark.parametrize("model", ["bert", "gpt2"])
def test_hugging_face_models_with_padding_masks_vectorize(model, devices):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    if model == "bert":
        config = transformers.BertConfig(
            vocab_size=30, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
            max_position_embeddings=16, num_labels=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        )
        net = transformers.BertForSequenceClassification(config).double()
    else:
        config = transformers.GPT2Config(
            vocab_size=30, n_positions=16, n_embd=16, n_layer=2, n_head=2,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )
        net = transformers.GPT2LMHeadModel(config).double()
    ref = copy.deepcopy(net)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(1, 30, (N * B, 7), generator=g)
    mask = (torch.arange(7) < torch.randint(3, 7, (N * B,), generator=g)[:, None]).long()  # padding in every shard
    batch = {"input_ids": ids * mask, "attention_mask": mask}
    labels = torch.randint(0, 2, (N * B,), generator=g) if model == "bert" else torch.where(mask.bool(), ids, -100)
    batch["labels"] = labels
    step = data_parallel_step(net, lambda out, b: out.loss, None, model_inputs=lambda b: b, devices=devices)
    loss = quietly(lambda: step(shard(batch, n=N)))
    shards = [{k: v[i * B:(i + 1) * B] for k, v in batch.items()} for i in range(N)]
    want = torch.stack([ref(**s).loss for s in shards]).mean()
    want.backward()
    torch.testing.assert_close(loss, want.detach(), rtol=1e-10, atol=1e-12)
    for (name, p), q in zip(net.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-9, atol=1e-12, msg=lambda s: f"{name}: {s}")


def test_dropout_between_layers_keeps_the_one_at_a_time_path():
    lstm = nn.LSTM(F_IN, H, num_layers=2, dropout=0.5).double().train().to(here())
    with pytest.warns(tp.VectorizationFallbackWarning, match="Batching rule not implemented for aten::lstm"):
        out = torch.as_tensor(tp.pmap(lambda v: lstm(v)[0])(inputs(False)))
    assert out.shape == (N, T, B, H)
