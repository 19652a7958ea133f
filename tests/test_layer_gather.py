"""The sharded step gathers each layer's weights as the layer runs, and lets them go.

Numbers are compared with the replicated step on one device (the oracle), on 1 and on 4
CPU devices (the ``placement`` fixture); what stays gathered is counted at every gather.
The allocator's peak across processes is in tests/test_distributed.py.
"""
from __future__ import annotations

import warnings
import weakref

import pytest
import torch
import torch.nn.functional as F

from torchpmap._frontend import layer_gather, sharded_step
from torchpmap._frontend.flat_shards import FlatLayout
from torchpmap._state.torch_private import functorch_base, pytree
from torchpmap.training import data_parallel_step, shard

N = 4


class Block(torch.nn.Module):
    """A small transformer-like model: a tied embedding and head, attention, a conv with
    batch norm (buffers: its parameters are gathered at the start), dropout. (No bias on
    ``qkv`` nor on ``conv``: the gradient of a key bias, and of a bias batch norm
    follows, is 0 but for rounding, which Adam blows up to ``lr``, differently on every
    placement.)"""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(20, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.qkv = torch.nn.Linear(16, 48, bias=False)
        self.proj = torch.nn.Linear(16, 16)
        self.conv = torch.nn.Conv1d(16, 16, 3, padding=1, bias=False)
        self.bn = torch.nn.BatchNorm1d(16)
        self.drop = torch.nn.Dropout(0.2)
        self.head = torch.nn.Linear(16, 20, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        q, k, v = self.qkv(self.norm(h)).chunk(3, -1)
        h = h + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        h = h + self.bn(self.conv(h.transpose(1, 2))).transpose(1, 2)
        return self.head(self.drop(h)).mean(1)


def tokens() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return torch.randint(0, 20, (16, 6), generator=g), torch.randint(0, 20, (16,), generator=g)


def test_layers_are_pytorchs_own_layers_holding_only_trained_parameters():
    class OwnForward(torch.nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2

    class Uses(torch.nn.Module):  # holds another module's weight as its own parameter
        def __init__(self, w):
            super().__init__()
            self.w = w

    model = torch.nn.ModuleDict({
        "linear": torch.nn.Linear(3, 3),
        "renormed": torch.nn.Embedding(5, 3, max_norm=1.0),
        "sparse": torch.nn.Embedding(5, 3, sparse=True),
        "bn": torch.nn.BatchNorm1d(3),
        "half_frozen": torch.nn.Linear(3, 3),
        "own_forward": OwnForward(3, 3),
        "shared": torch.nn.Linear(3, 3),
        "no_bias": torch.nn.Conv2d(3, 3, 1, bias=False),
        "norm": torch.nn.LayerNorm(3),
    })
    model["half_frozen"].bias.requires_grad_(False)
    model["uses"] = Uses(model["shared"].weight)
    trained = {k: FlatLayout(p.shape, N) for k, p in model.named_parameters() if p.requires_grad}
    assert layer_gather.layers(model, trained) == {
        "linear": {"weight": "linear.weight", "bias": "linear.bias"},
        "no_bias": {"weight": "no_bias.weight"},
        "norm": {"weight": "norm.weight", "bias": "norm.bias"},
    }


def run(
    model: torch.nn.Module, sharded: bool, devices, steps: int = 3, reshard: bool = True
) -> tuple[list[torch.Tensor], dict]:
    """``steps`` training steps, then one in eval mode (no dropout, batch norm's running
    statistics): the step sees a change made to the model between steps."""
    x, y = tokens()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    kw = {"reshard_after_forward": reshard} if sharded else {}
    step = data_parallel_step(
        model, F.cross_entropy, opt, shard_params=sharded, devices=devices, randomness="per_instance", **kw
    )
    torch.manual_seed(7)
    losses = [step(shard((x, y), N)) for _ in range(steps)]
    model.eval()
    losses.append(step(shard((x, y), N)))
    if sharded:
        assert set(step.layers) == ({"embed", "norm", "qkv", "proj", "conv", "head"} if reshard else set())
        step.gather_params()
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("reshard", [True, False], ids=["layer-by-layer", "all-first"])
def test_layer_by_layer_training_gives_the_replicated_steps_weights(placement, reshard):
    """reshard_after_forward=False gathers every parameter before the forward instead."""
    want_losses, want = run(Block(), False, placement[:1])
    losses, got = run(Block(), True, None, reshard=reshard)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
    torch.testing.assert_close(torch.stack(losses), torch.stack(want_losses), rtol=1e-5, atol=1e-6)


def test_a_backward_run_in_a_thread_of_autograds_own_gives_the_same_weights(placement, autograd_device_thread):
    """On CUDA autograd runs a layer's backward in a device thread of its own, where the
    forward's context (its bound axis) is not set: every sharded step raised "unbound axis
    name" on a GPU (``make gpu-check``, 2026-11-30). Here each backward runs in an empty
    context, as there; the backward runs the layer again in its forward's context."""
    want_losses, want = run(Block(), False, placement[:1], steps=2)
    losses, got = run(Block(), True, None, steps=2)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
    torch.testing.assert_close(torch.stack(losses), torch.stack(want_losses), rtol=1e-5, atol=1e-6)


class GatheredAlive:
    """Wraps ``all_gather`` where the sharded step calls it; at every call, the bytes of
    the gathered values (their storages) still alive."""

    def __init__(self, gather):
        self.gather, self.alive, self.most = gather, {}, 0

    def __call__(self, *args, **kwargs):
        out = self.gather(*args, **kwargs)
        for t in pytree.tree_leaves(out):
            storage = functorch_base(t).untyped_storage()
            self.alive[storage.data_ptr()] = (weakref.ref(storage), storage.nbytes())
        self.alive = {k: (r, n) for k, (r, n) in self.alive.items() if r() is not None}
        self.most = max(self.most, sum(n for _, n in self.alive.values()))
        return out


def test_each_device_holds_one_layers_gathered_weights_at_a_time(placement, monkeypatch):
    """Eight 64x64 layers: while the step runs, the gathered weights alive at once are at
    most one layer's per instance (the whole model's were, when every parameter was
    gathered before the forward)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh()) for _ in range(8)))
    x, y = torch.randn(16, 64), torch.randn(16, 64)
    step = data_parallel_step(model, F.mse_loss, torch.optim.SGD(model.parameters(), lr=0.1), shard_params=True)
    step(shard((x, y), N))
    watch = GatheredAlive(layer_gather.all_gather)
    monkeypatch.setattr(layer_gather, "all_gather", watch)
    monkeypatch.setattr(sharded_step, "all_gather", watch)
    step(shard((x, y), N))
    layer = (64 * 64 + 64) * 4
    assert 0 < watch.most <= N * layer, (watch.most, N * layer)


class Penalized(torch.nn.Module):
    """A forward that differentiates through its own layer (an input-gradient penalty,
    ``torch.func.grad`` inside the step): the penalty's gradient goes through the
    layer's backward, which must then be differentiable itself."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(6, 16), torch.nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        slope = torch.func.grad(lambda x: torch.tanh(self.a(x)).sum())(x)
        return self.b(torch.tanh(self.a(x))) + 0.1 * slope.pow(2).sum(-1, keepdim=True)


def test_a_derivative_taken_inside_the_forward_is_differentiated_through_the_layer(placement):
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 6, generator=g), torch.randn(16, 3, generator=g)
    runs = {}
    for sharded in (False, True):
        model = Penalized()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        devices = None if sharded else placement[:1]
        step = data_parallel_step(model, F.mse_loss, opt, shard_params=sharded, devices=devices)
        losses = torch.stack([step(shard((x, y), N)) for _ in range(3)])
        if sharded:
            assert set(step.layers) == {"a", "b"}
            step.gather_params()
        runs[sharded] = losses, {k: v.detach().clone() for k, v in model.state_dict().items()}
    torch.testing.assert_close(runs[True][0], runs[False][0], rtol=1e-5, atol=1e-6)
    for k, want in runs[False][1].items():
        torch.testing.assert_close(runs[True][1][k], want, rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


def test_under_autocast_the_layers_compute_in_bfloat16_as_the_replicated_step(placement):
    """Each layer's backward runs it again under the autocast regions of its forward."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 6, generator=g), torch.randn(16, 3, generator=g)
    runs = {}
    for sharded in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.GELU(), torch.nn.Linear(32, 3))
        step = data_parallel_step(
            model, F.mse_loss, torch.optim.SGD(model.parameters(), lr=0.1), shard_params=sharded,
            devices=None if sharded else placement[:1],
        )
        with torch.autocast("cpu", dtype=torch.bfloat16):
            losses = torch.stack([step(shard((x, y), N)) for _ in range(3)])
        if sharded:
            step.gather_params()
        runs[sharded] = losses, {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert runs[True][0].dtype == runs[False][0].dtype
    torch.testing.assert_close(runs[True][0], runs[False][0], rtol=2e-2, atol=2e-3)  # bfloat16: sums in another order
    for k, want in runs[False][1].items():
        torch.testing.assert_close(runs[True][1][k], want, rtol=2e-2, atol=2e-3, msg=lambda m, k=k: f"{k}: {m}")


class ReadsAWeight(torch.nn.Module):
    """Reads ``b.weight`` outside ``b``'s call (as a head tied by ``F.linear`` does)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(6, 16), torch.nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        return self.b(h) + 0.5 * F.linear(h, self.b.weight)


def direct_reads(kind: str):
    """A model and a loss that read parameters directly: through the model itself, a
    weight decay over ``model.parameters()`` in the loss, the model called again."""
    if kind == "forward":
        return ReadsAWeight(), F.mse_loss
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    if kind == "penalty":
        return model, lambda out, y: F.mse_loss(out, y) + 0.1 * sum(p.pow(2).sum() for p in model.parameters())
    return model, lambda out, y: F.mse_loss(out, y) + 0.1 * model(y[:, :1].expand(-1, 6)).pow(2).mean()


@pytest.mark.parametrize("kind", ["forward", "penalty", "called_again"])
def test_parameters_read_directly_are_gathered_where_read(placement, kind):
    """A layer's weight is in the module only as a placeholder while the step runs:
    code that reads it directly gets it gathered, as the replicated step's swapped-in
    value (it read an emptied parameter: a weight decay of 0, silently)."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 6, generator=g), torch.randn(16, 3, generator=g)
    runs = {}
    for sharded in (False, True):
        model, loss_fn = direct_reads(kind)
        devices = None if sharded else placement[:1]
        step = data_parallel_step(
            model, loss_fn, torch.optim.SGD(model.parameters(), lr=0.1), shard_params=sharded, devices=devices
        )
        runs[sharded] = torch.stack([step(shard((x, y), N)) for _ in range(3)])
        if sharded:
            assert len(step.layers) == 2
    torch.testing.assert_close(runs[True], runs[False], rtol=1e-5, atol=1e-6)


def test_attributes_the_forward_sets_reach_the_users_module(placement):
    """The step runs a shadow of the module; what its forward sets (a count of calls)
    is set on the module after each step, as when the forward ran on it."""

    class Counting(torch.nn.Linear):
        def forward(self, x):  # its own forward: not gathered layer by layer, but shadowed
            self.calls = getattr(self, "calls", 0) + 1
            return super().forward(x)

    torch.manual_seed(0)
    model = torch.nn.Sequential(Counting(6, 3), torch.nn.Linear(3, 3))
    x, y = torch.randn(8, 6), torch.randn(8, 3)
    step = data_parallel_step(
        model, F.mse_loss, torch.optim.SGD(model.parameters(), lr=0.1), shard_params=True, devices=placement[:1]
    )
    for _ in range(2):
        step(shard((x, y), N))
    assert model[0].calls == 2 and set(step.layers) == {"1"}


def test_a_layer_called_with_keywords_and_none_gets_them(placement):
    """Arguments travel through the gathering as they were given: a keyword, a None."""

    class Up(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.up = torch.nn.ConvTranspose1d(2, 2, 3, stride=2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.up(x, output_size=None)[..., :8] + self.up(input=x, output_size=[1, 2, 10])[..., :8]

    x, y = torch.randn(8, 2, 4), torch.randn(8, 2, 8)
    runs = {}
    for sharded in (False, True):
        model = Up()
        step = data_parallel_step(
            model, F.mse_loss, torch.optim.SGD(model.parameters(), lr=0.1), shard_params=sharded,
            devices=None if sharded else placement[:1],
        )
        runs[sharded] = torch.stack([step(shard((x, y), N)) for _ in range(3)])
        if sharded:
            assert set(step.layers) == {"up"}
    torch.testing.assert_close(runs[True], runs[False], rtol=1e-5, atol=1e-6)


def test_reshard_after_forward_without_shard_params_is_refused():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"reshard_after_forward=False is an option of the sharded step.*shard_params"):
        data_parallel_step(model, F.mse_loss, torch.optim.SGD(model.parameters(), lr=0.1), reshard_after_forward=False)


def test_a_loss_calling_a_batch_norm_model_again_updates_the_steps_statistics(placement):
    """Its second call runs on the model itself, whose buffers stand for the instance's
    copies that the step's forward updates (as the replicated step's swapped-in copies)."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 6, generator=g), torch.randn(16, 3, generator=g)
    runs = {}
    for sharded in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 3))

        def loss_fn(out, y, model=model):
            return F.mse_loss(out, y) + 0.1 * model(y[:, :1].expand(-1, 6)).pow(2).mean()

        step = data_parallel_step(
            model, loss_fn, torch.optim.SGD(model.parameters(), lr=0.1), shard_params=sharded,
            devices=None if sharded else placement[:1],
        )
        losses = torch.stack([step(shard((x, y), N)) for _ in range(3)])
        if sharded:
            step.gather_params()
        runs[sharded] = losses, {k: v.detach().clone() for k, v in model.state_dict().items()}
    torch.testing.assert_close(runs[True][0], runs[False][0], rtol=1e-5, atol=1e-6)
    for k, want in runs[False][1].items():
        torch.testing.assert_close(runs[True][1][k], want, rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


class OldWeightNorm(torch.nn.Module):
    """``torch.nn.utils.weight_norm``: a forward pre-hook makes ``weight`` from the
    trained ``weight_g`` and ``weight_v``; the layer is not gathered by itself."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # deprecated for parametrizations.weight_norm
            self.a = torch.nn.utils.weight_norm(torch.nn.Linear(6, 8))
        self.b = torch.nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


class Encoder(torch.nn.Module):
    """A transformer encoder with dropout: attention reads its output projection's
    weight directly (a placeholder gathers it) inside a random op."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        layer = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.1, batch_first=True)
        self.inp, self.o = torch.nn.Linear(6, 8), torch.nn.Linear(8, 3)
        self.enc = torch.nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o(self.enc(self.inp(x).view(-1, 2, 8)).reshape(-1, 8))


# attention's dropout has no per_instance rule: its instances run one at a time, and say so
@pytest.mark.filterwarnings("ignore::torchpmap.VectorizationFallbackWarning")
@pytest.mark.parametrize("make", [OldWeightNorm, Encoder], ids=["old-weight-norm", "encoder-dropout"])
def test_hooks_and_random_ops_around_the_layers_as_the_replicated_step(placement, make):
    """Found by a hunt: the layer under the old weight_norm was gathered by itself (its
    pre-hook's weight never reached the gradient: other weights after 3 steps); dropout
    in attention under per_instance randomness hung (the placeholder's gather ran inside
    the random stream's lock)."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 6, generator=g), torch.randn(16, 3, generator=g)
    runs = {}
    for sharded in (False, True):
        model = make()
        step = data_parallel_step(
            model, F.mse_loss, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), shard_params=sharded,
            devices=None if sharded else placement[:1], randomness="per_instance",
        )
        torch.manual_seed(7)
        losses = torch.stack([step(shard((x, y), N)) for _ in range(3)])
        if sharded:
            assert "a" not in step.layers
            step.gather_params()
        runs[sharded] = losses, {k: v.detach().clone() for k, v in model.state_dict().items()}
    torch.testing.assert_close(runs[True][0], runs[False][0], rtol=1e-5, atol=1e-6)
    for k, want in runs[False][1].items():
        torch.testing.assert_close(runs[True][1][k], want, rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
