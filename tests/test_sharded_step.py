"""data_parallel_step(shard_params=...): ZeRO-3 gives the replicated step's weights, in 1/N the bytes.

Every test of numbers compares with the replicated step on one device (the oracle) and
runs on 1 and on 4 CPU devices (the ``placement`` fixture). The multi-process run is in
tests/test_distributed.py.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from torchpmap.training import data_parallel_step, shard

N = 4  # instances: the data axis


def mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 3))


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(32, 6, generator=g), torch.randn(32, 3, generator=g)


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same_weights(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


OPTIMIZERS = {
    "sgd-momentum-wd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=True),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
    "adam-amsgrad": lambda ps: torch.optim.Adam(ps, lr=0.01, amsgrad=True),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=0.01, momentum=0.5),
}


def train(model, make_opt, steps: int, devices=None, **kw) -> tuple[list[float], dict]:
    x, y = data()
    opt = make_opt(model.parameters())
    step = data_parallel_step(model, F.mse_loss, opt, devices=devices, **kw)
    losses = [step(shard((x, y), N)).item() for _ in range(steps)]
    if kw.get("shard_params"):
        step.gather_params()
    return losses, weights(model)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_weights_after_steps_equal_the_replicated_steps(placement, name):
    oracle_losses, oracle = train(mlp(), OPTIMIZERS[name], 5, devices=placement[:1])
    losses, got = train(mlp(), OPTIMIZERS[name], 5, shard_params=True)
    assert_same_weights(got, oracle)
    assert losses == pytest.approx(oracle_losses, rel=1e-5)


class WithSpare(torch.nn.Module):
    """Batch norm, a frozen layer, and a layer its forward never uses."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.body = torch.nn.Sequential(torch.nn.Linear(6, 8, bias=False), torch.nn.BatchNorm1d(8), torch.nn.Tanh())
        self.frozen = torch.nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.head, self.spare = torch.nn.Linear(8, 3), torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.frozen(self.body(x)))


def metrics_loss(out, y):
    return F.mse_loss(out, y), {"abs": (out - y).abs().mean()}


def test_buffers_aux_frozen_and_unused_parameters_as_the_replicated_step(placement):
    x, y = data()
    runs = {}
    for sharded in (False, True):
        model = WithSpare()
        opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.5)
        step = data_parallel_step(
            model, metrics_loss, opt, has_aux=True, shard_params=sharded,
            devices=None if sharded else placement[:1],
        )
        out = [step(shard((x, y), N)) for _ in range(3)]
        if sharded:
            step.gather_params()
        runs[sharded] = out, weights(model)
    (rep_out, rep), (sh_out, sh) = runs[False], runs[True]
    assert_same_weights(sh, rep)
    assert torch.equal(sh["spare.weight"], WithSpare().spare.weight.detach())  # no gradient: AdamW leaves it
    for (l1, a1), (l2, a2) in zip(rep_out, sh_out):
        torch.testing.assert_close(l2, l1)
        torch.testing.assert_close(a2["abs"], a1["abs"])


def test_optimizer_state_from_replicated_steps_is_split_and_training_goes_on(placement):
    oracle_losses, oracle = train(mlp(), OPTIMIZERS["adamw"], 4, devices=placement[:1])
    x, y = data()
    model = mlp()
    opt = OPTIMIZERS["adamw"](model.parameters())
    first = data_parallel_step(model, F.mse_loss, opt)
    losses = [first(shard((x, y), N)).item() for _ in range(2)]
    second = data_parallel_step(model, F.mse_loss, opt, shard_params="batch")
    losses += [second(shard((x, y), N)).item() for _ in range(2)]
    second.gather_params()
    assert_same_weights(weights(model), oracle)
    assert losses == pytest.approx(oracle_losses, rel=1e-5)


def test_module_is_emptied_and_gather_params_writes_back_values_the_next_step_takes(placement):
    x, y = data()
    model = mlp()
    step = data_parallel_step(model, F.mse_loss, torch.optim.SGD(model.parameters(), lr=0.1), shard_params=True)
    step(shard((x, y), N))
    assert all(p.numel() == 0 for p in model.parameters())
    with pytest.raises(RuntimeError, match=r"step\.gather_params\(\) first"):
        model(x)
    step.gather_params()
    assert [tuple(p.shape) for p in model.parameters()] == [(10, 6), (10,), (3, 10), (3,)]
    model(x)  # usable as it is
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()  # a change the next step must see
    step(shard((x, y), N))
    step.gather_params()
    assert torch.equal(model[2].weight, torch.zeros(3, 10))  # tanh(0) = 0: no gradient reaches it
    assert not torch.equal(model[2].bias, torch.zeros(3))


def scaled_runs(placement, make_opt, **kw) -> list[dict]:
    """The weights after 3 steps under a GradScaler: replicated on one device, then sharded."""
    runs = []
    for sharded in (False, True):
        model = mlp()
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        x, y = data()
        step = data_parallel_step(
            model, F.mse_loss, make_opt(model.parameters()), grad_scaler=scaler, shard_params=sharded,
            devices=None if sharded else placement[:1], **kw,
        )
        for _ in range(3):
            step(shard((x, y), N))
        if sharded:
            step.gather_params()
        runs.append(weights(model))
    return runs


def test_grad_scaler_in_one_process_as_the_replicated_step(placement):
    replicated, sharded = scaled_runs(placement, lambda ps: torch.optim.Adam(ps, lr=0.01))
    assert_same_weights(sharded, replicated)


def plain_clipped_steps(model, make_opt, steps: int, max_norm: float) -> dict:
    """Plain PyTorch: the mean of the shards' losses, backward, clip_grad_norm_, step."""
    x, y = data()
    opt = make_opt(model.parameters())
    for _ in range(steps):
        opt.zero_grad()
        torch.stack([F.mse_loss(model(xs), ys) for xs, ys in zip(x.chunk(N), y.chunk(N))]).mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
    return weights(model)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("sharded", [False, True], ids=["replicated", "sharded"])
def test_max_grad_norm_clips_as_clip_grad_norm_does(placement, sharded, jit):
    # 0.05 is below the gradient's norm at every step here (no clipping would change nothing)
    want = plain_clipped_steps(mlp(), OPTIMIZERS["sgd-momentum-wd"], 4, max_norm=0.05)
    unclipped = plain_clipped_steps(mlp(), OPTIMIZERS["sgd-momentum-wd"], 4, max_norm=1e9)
    _, got = train(mlp(), OPTIMIZERS["sgd-momentum-wd"], 4, shard_params=sharded, max_grad_norm=0.05, jit=jit)
    assert_same_weights(got, want)
    assert any(not torch.allclose(unclipped[k], want[k]) for k in want)


def test_max_grad_norm_under_a_grad_scaler_clips_the_unscaled_gradient(placement):
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.1)  # noqa: E731
    replicated, sharded = scaled_runs(placement, sgd, max_grad_norm=0.05)
    assert_same_weights(replicated, plain_clipped_steps(mlp(), sgd, 3, 0.05))
    assert_same_weights(sharded, replicated)


@pytest.mark.parametrize("value", [0, -1.0, True, "1"])
def test_max_grad_norm_must_be_a_positive_number(value):
    model = mlp()
    with pytest.raises(ValueError, match="max_grad_norm=.* must be a positive number"):
        data_parallel_step(model, F.mse_loss, torch.optim.SGD(model.parameters(), lr=0.1), max_grad_norm=value)


def test_max_grad_norm_without_an_optimizer_names_clip_grad_norm_():
    with pytest.raises(ValueError, match="clip_grad_norm_"):
        data_parallel_step(mlp(), F.mse_loss, None, max_grad_norm=1.0)


def tensor_bytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def test_each_device_holds_a_quarter_of_parameters_gradients_and_adam_state(placement):
    """Measured on 4 CPU devices: the bytes of the trained parameters' pieces, their
    gradients and Adam's state on each device, against what the replicated step holds
    (one whole copy, which every device needs to run it), and the module's own
    parameters (emptied)."""
    if len(placement) < 4:
        pytest.skip("the per-device bytes need 4 devices")
    torch.manual_seed(0)
    make = lambda: torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))  # noqa: E731
    x, y = torch.randn(32, 64), torch.randn(32, 64)
    model = make()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    data_parallel_step(model, F.mse_loss, opt)(shard((x, y), N))
    replicated = sum(tensor_bytes(p, p.grad, *opt.state[p].values()) for p in model.parameters())
    model = make()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    step = data_parallel_step(model, F.mse_loss, opt, shard_params=True)
    step(shard((x, y), N))
    per_device = step.bytes_per_device()
    assert sorted(per_device) == sorted(placement)
    largest_layer = 256 * 64 * 4  # one gathered weight, float32
    for device, held in per_device.items():
        assert held <= replicated / 4 + largest_layer, (device, held, replicated)
    # flat rows, and every size divides by 4: exactly a quarter, but Adam's 4-byte 'step'
    # count, which each of the 4 parameters' pieces has its own of on every device
    counts = 4 * 4
    assert all(held == (replicated - counts) // 4 + counts for held in per_device.values()), per_device
    assert sum(tensor_bytes(p) for p in model.parameters()) == 0  # the module holds nothing whole
    print(f"\nreplicated: {replicated} bytes on every device; sharded: {per_device}")


# --------------------------------------------------------------------------- refusals


def test_refusals_name_the_argument_and_the_fix():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"shard_params='model' names another axis than the step's axis_name='batch'"):
        data_parallel_step(model, F.mse_loss, opt, shard_params="model")
    with pytest.raises(ValueError, match=r"needs an optimizer"):
        data_parallel_step(model, F.mse_loss, None, shard_params=True)
    with pytest.raises(TypeError, match=r"torch\.optim\.lbfgs\.LBFGS, which cannot step on shards.*leave shard_params"):
        data_parallel_step(model, F.mse_loss, torch.optim.LBFGS(model.parameters()), shard_params=True)

    class MyAdam(torch.optim.Adam):
        pass

    with pytest.raises(TypeError, match=r"MyAdam, which cannot step on shards: it subclasses Adam"):
        data_parallel_step(model, F.mse_loss, MyAdam(model.parameters()), shard_params=True)
    x, y = data()
    step = data_parallel_step(model, F.mse_loss, opt, shard_params=True)
    step(shard((x, y), 4))
    with pytest.raises(ValueError, match=r"the batch has 8 instances.*rows for 4.*shard\(batch, n=4\)"):
        step(shard((x, y), 8))


def test_freezing_or_unfreezing_after_the_first_call_is_refused_naming_the_parameters():
    """The step splits the parameters that require grad at its first call. A parameter
    unfrozen later was silently never trained, and one frozen later kept training (the
    replicated step and plain PyTorch stop it): both now raise, naming the parameter."""
    x, y = data()
    for change, match in (
        (lambda m: m[0].weight.requires_grad_(False), r"'0.weight' no longer requires grad"),
        (lambda m: m[2].bias.requires_grad_(True), r"'2.bias' now requires grad"),
    ):
        model = mlp()
        model[2].bias.requires_grad_(False)
        step = data_parallel_step(model, F.mse_loss, torch.optim.SGD(model.parameters(), lr=0.1), shard_params=True)
        step(shard((x, y), N))
        step.gather_params()
        change(model)
        with pytest.raises(ValueError, match=match + r".*build a new optimizer and step"):
            step(shard((x, y), N))


def test_two_sharded_steps_cannot_share_one_optimizer():
    """A second sharded step found the optimizer holding the first step's pieces and
    trained on silently, its own rows never stepped (losses off the replicated steps')."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = data()
    first = data_parallel_step(model, F.mse_loss, opt, shard_params=True)
    second = data_parallel_step(model, F.l1_loss, opt, shard_params=True)
    first(shard((x, y), N))
    first.gather_params()
    with pytest.raises(ValueError, match=r"already steps the rows of another sharded step.*its own optimizer"):
        second(shard((x, y), N))


def test_a_checkpoint_of_gathered_weights_and_sharded_optimizer_state_resumes_exactly(placement, tmp_path):
    x, y = data()

    def started() -> tuple[torch.nn.Module, torch.optim.Optimizer, object]:
        model = mlp()
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        return model, opt, data_parallel_step(model, F.mse_loss, opt, shard_params=True)

    model, opt, step = started()
    for _ in range(3):
        step(shard((x, y), N))
    step.gather_params()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "ckpt.pt")
    resumed_model, resumed_opt, resumed = started()
    resumed(shard((x, y), N))  # the first call moves the optimizer onto the rows
    resumed.gather_params()
    saved = torch.load(tmp_path / "ckpt.pt")
    resumed_model.load_state_dict(saved["model"])
    resumed_opt.load_state_dict(saved["optimizer"])
    for _ in range(2):
        assert torch.equal(resumed(shard((x, y), N)), step(shard((x, y), N)))
    step.gather_params()
    resumed.gather_params()
    for k, v in model.state_dict().items():
        assert torch.equal(resumed_model.state_dict()[k], v), k


@pytest.mark.parametrize("name", ["adamw", "sgd-momentum-wd"])
def test_the_optimizer_state_comes_back_whole_and_resumes_on_another_split(placement, name):
    """``step.optimizer_state_dict()`` is the replicated step's optimizer state in
    ``get_optimizer_state_dict``'s format; loaded with ``set_optimizer_state_dict`` into a
    new optimizer, a sharded step over another number of instances carries on as the
    replicated step does."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    x, y = data()
    ref = mlp()
    ref_opt = OPTIMIZERS[name](ref.parameters())
    ref_step = data_parallel_step(ref, F.mse_loss, ref_opt, devices=placement[:1])
    for _ in range(2):
        ref_step(shard((x, y), N))
    want = get_optimizer_state_dict(ref, ref_opt)

    model = mlp()
    step = data_parallel_step(model, F.mse_loss, OPTIMIZERS[name](model.parameters()), shard_params=True)
    for _ in range(2):
        step(shard((x, y), N))
    got = step.optimizer_state_dict()
    assert got["param_groups"] == want["param_groups"]
    assert got["state"].keys() == want["state"].keys()
    for k, entries in want["state"].items():
        assert list(got["state"][k]) == list(entries), k
        for key, value in entries.items():
            torch.testing.assert_close(
                got["state"][k][key], value, rtol=1e-5, atol=1e-7, msg=lambda m, k=k, key=key: f"{k}/{key}: {m}"
            )

    # resume: the weights and the whole state into a new model and optimizer, split in 2 rows
    step.gather_params()
    resumed = mlp(seed=9)
    resumed.load_state_dict(model.state_dict())
    opt = OPTIMIZERS[name](resumed.parameters())
    set_optimizer_state_dict(resumed, opt, got)
    again = data_parallel_step(resumed, F.mse_loss, opt, shard_params=True)
    again(shard((x, y), 2))
    ref_step(shard((x, y), N))  # the mean of equal-sized means: the same gradient with 2 or 4 instances
    again.gather_params()
    assert_same_weights(weights(resumed), weights(ref))


def test_per_instance_dropout_gives_the_same_weights_sharded_and_replicated(placement):
    """randomness="per_instance" draws the same numbers on every placement: the sharded
    step's own placement of the rows drew from the caller's generator on several devices
    (a map with randomness "different"), which moved every instance's dropout mask."""
    def dropout_mlp():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Dropout(0.5), torch.nn.Linear(10, 3))

    runs = {}
    for sharded in (False, True):
        torch.manual_seed(123)
        runs[sharded] = train(dropout_mlp(), OPTIMIZERS["adamw"], 3, shard_params=sharded, randomness="per_instance")[1]
    assert_same_weights(runs[True], runs[False])


def test_max_grad_norm_of_a_float64_model_is_computed_in_float64(placement):
    """clip_grad_norm_ keeps a float64 gradient's precision; the sharded step summed the
    rows' squares in float32 (1e-9 off)."""
    sgd = OPTIMIZERS["sgd-momentum-wd"]
    x, y = (t.double() for t in data())
    plain = mlp().double()
    opt = sgd(plain.parameters())
    for _ in range(3):
        opt.zero_grad()
        torch.stack([F.mse_loss(plain(xs), ys) for xs, ys in zip(x.chunk(N), y.chunk(N))]).mean().backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.05)
        opt.step()
    want = weights(plain)
    model = mlp().double()
    step = data_parallel_step(model, F.mse_loss, sgd(model.parameters()), shard_params=True, max_grad_norm=0.05)
    for _ in range(3):
        step(shard((x, y), N))
    step.gather_params()
    for k, v in weights(model).items():
        torch.testing.assert_close(v, want[k], rtol=1e-13, atol=1e-15, msg=lambda m, k=k: f"{k}: {m}")


class _Counting(torch.nn.Module):
    """An MLP with an integer buffer that grows by a count of the shard's values: the
    in-place add of a value that differs between instances cannot run vectorized."""

    def __init__(self):
        super().__init__()
        self.net = mlp()
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.seen += (x[:, 0] > 0).sum()
        return self.net(x)


@pytest.mark.filterwarnings("ignore::torchpmap.VectorizationFallbackWarning")
def test_instances_run_one_at_a_time_on_several_devices_give_the_replicated_steps_weights(four_devices):
    """With two instances per device run one at a time, the gradients came back as one
    piece per instance, and the sharded step raised "the gradient of 'net.0.weight' came
    back in 4 pieces, not 2". They are joined per device now."""
    torch.manual_seed(0)
    start = _Counting()
    oracle_losses, oracle = train(
        copy.deepcopy(start), lambda ps: torch.optim.SGD(ps, lr=0.1), 3, devices=four_devices[:1]
    )
    for placement in (four_devices[:2], four_devices):
        losses, got = train(
            copy.deepcopy(start), lambda ps: torch.optim.SGD(ps, lr=0.1), 3, devices=placement, shard_params=True
        )
        torch.testing.assert_close(losses, oracle_losses, rtol=1e-5, atol=1e-6)
        assert_same_weights(got, oracle)


def test_eval_after_a_compiled_step_turns_dropout_off(placement):
    """The sharded step runs the model through shadow modules made at every call; a
    ``jit=True`` trace recorded the shadows' train/eval mode, which ``model.eval()`` never
    changes: the compiled step kept drawing dropout masks after it."""
    losses = {}
    for jit in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Dropout(0.5), torch.nn.Linear(32, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        step = data_parallel_step(model, lambda out, y: (out.squeeze(-1) - y).pow(2).mean(), optimizer,
                                  jit=jit, devices=placement, shard_params=True)
        x = torch.randn(32, 8, generator=torch.Generator().manual_seed(1))
        batch = shard((x, x.sum(1)), n=4)
        step(batch)
        model.eval()
        losses[jit] = [float(torch.as_tensor(step(batch)).mean()) for _ in range(2)]
    assert losses[False][0] == losses[False][1]  # no dropout: the same loss twice
    assert losses[True] == pytest.approx(losses[False], rel=1e-5)


def test_a_frozen_parameters_stale_gradient_is_not_applied_again(placement):
    """A parameter frozen after a plain step keeps that step's ``.grad``: the replicated
    step clears it (as zero_grad() does); the sharded step left it, and every
    optimizer.step() applied it again (the frozen layer moved by 0.034 in 3 SGD steps)."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 5, generator=g), torch.randint(0, 3, (8,), generator=g)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    F.cross_entropy(model(x), y).backward()
    optimizer.step()
    model[0].requires_grad_(False)
    before = copy.deepcopy(model[0].state_dict())
    step = data_parallel_step(model, F.cross_entropy, optimizer, shard_params=True)
    for _ in range(3):
        step(shard((x, y), n=4))
    step.gather_params()
    for k, v in model[0].state_dict().items():
        assert torch.equal(v, before[k]), k


@pytest.mark.parametrize("optimizer", ["Adagrad", "ASGD", "NAdam"])
def test_a_scalar_parameters_existing_optimizer_state_is_split_as_the_replicated_step_steps(placement, optimizer):
    """A 0-dim parameter (a logit scale) whose optimizer already holds state (Adagrad from
    its construction; after replicated steps): the state's scalars (``step``, ASGD's
    ``eta`` and ``mu``, NAdam's ``mu_product``) have the parameter's shape ``()`` and were
    split like it, one row per instance, and ``optimizer.step()`` raised "a Tensor with 4
    elements cannot be converted to Scalar" where a device held several instances."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 5, generator=g), torch.randint(0, 3, (8,), generator=g)

    class Scaled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(5, 3)
            self.logit_scale = torch.nn.Parameter(torch.tensor(1.5))

        def forward(self, v: torch.Tensor) -> torch.Tensor:
            return self.a(v) * self.logit_scale

    results = []
    for sharded in (False, True):
        torch.manual_seed(0)
        model = Scaled()
        opt = getattr(torch.optim, optimizer)(model.parameters(), lr=0.1)
        data_parallel_step(model, F.cross_entropy, opt)(shard((x, y), n=4))  # the state exists now
        step = data_parallel_step(model, F.cross_entropy, opt, shard_params=sharded)
        for _ in range(2):
            step(shard((x, y), n=4))
        if sharded:
            step.gather_params()
        results.append({k: v.detach().clone() for k, v in model.named_parameters()})
    torch.testing.assert_close(results[1], results[0])
