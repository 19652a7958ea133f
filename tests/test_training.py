"""Tests for torchpmap.training: the data-parallel helpers and the digits demo."""
from __future__ import annotations

import copy
import gc
import pathlib
import re
import subprocess
import sys
import threading
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchpmap as tp
from torchpmap.training import (
    data_parallel_step,
    prefetch_to_device,
    replicate,
    shard,
    unreplicate,
    unshard,
)

REPO = pathlib.Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------- replicate


def test_replicate_stacks_one_copy_per_instance():
    tree = {"w": torch.arange(6.0).reshape(2, 3), "b": (torch.tensor(1.0), 7, np.array([1, 2]))}
    r = replicate(tree, n=4)
    assert r["w"].shape == (4, 2, 3) and r["b"][0].shape == (4,)
    assert all(torch.equal(r["w"][i], tree["w"]) for i in range(4))
    assert torch.equal(r["b"][1], torch.tensor([7, 7, 7, 7]))
    assert torch.equal(r["b"][2], torch.tensor([[1, 2]] * 4))


def test_replicate_makes_independent_copies():
    w = torch.zeros(3)
    r = replicate(w, n=2)
    r[0].add_(1.0)
    assert torch.equal(r[1], torch.zeros(3)) and torch.equal(w, torch.zeros(3))


def test_replicate_defaults_to_local_device_count():
    assert replicate(torch.zeros(2)).shape == (tp.local_device_count(), 2)


def test_replicate_unreplicate_round_trip():
    tree = {"a": torch.randn(3, 2), "b": [torch.tensor(5), torch.randn(1)]}
    back = unreplicate(replicate(tree, n=3))
    assert back.keys() == tree.keys()
    assert torch.equal(back["a"], tree["a"]) and torch.equal(back["b"][0], tree["b"][0])
    assert torch.equal(back["b"][1], tree["b"][1])


def test_unreplicate_takes_instance_zero():
    assert torch.equal(unreplicate({"x": torch.tensor([[1, 2], [3, 4]])})["x"], torch.tensor([1, 2]))


@pytest.mark.parametrize("n", [0, -1, 2.0, True])
def test_bad_instance_count_is_rejected(n):
    with pytest.raises(ValueError, match="n must be a positive int"):
        replicate(torch.zeros(1), n=n)
    with pytest.raises(ValueError, match="n must be a positive int"):
        shard(torch.zeros(4), n=n)


def test_non_tensor_leaf_names_its_key_path():
    with pytest.raises(TypeError, match=r"tree\['opt'\]\[1\] is a str"):
        replicate({"opt": [torch.zeros(1), "adam"]}, n=2)


def test_unreplicate_of_scalar_names_its_key_path():
    with pytest.raises(ValueError, match=r"tree\['step'\] is a scalar"):
        unreplicate({"w": torch.zeros(2, 3), "step": torch.tensor(3)})


# --------------------------------------------------------------------------- shard


def test_shard_splits_leading_axis_in_order():
    x = torch.arange(24.0).reshape(12, 2)
    y = torch.arange(12)
    sx, sy = shard((x, y), n=3)
    assert sx.shape == (3, 4, 2) and sy.shape == (3, 4)
    for i in range(3):  # instance i holds rows 4i .. 4i+3
        assert torch.equal(sx[i], x[4 * i : 4 * i + 4]) and torch.equal(sy[i], y[4 * i : 4 * i + 4])


def test_shard_accepts_numpy_and_nested_trees():
    out = shard({"img": np.zeros((8, 2, 2), np.float32), "meta": [torch.ones(8)]}, n=2)
    assert isinstance(out["img"], torch.Tensor) and out["img"].shape == (2, 4, 2, 2)
    assert out["meta"][0].shape == (2, 4)


def test_shard_defaults_to_local_device_count():
    n = tp.local_device_count()
    assert shard(torch.zeros(2 * n, 5)).shape == (n, 2, 5)


def test_shard_error_names_key_path_and_sizes():
    batch = {"inputs": torch.zeros(12, 3), "labels": [torch.zeros(12), torch.zeros(10)]}
    with pytest.raises(ValueError) as info:
        shard(batch, n=4)
    message = str(info.value)
    assert "batch['labels'][1]" in message
    assert "10 rows" in message and "n=4" in message and "10 % 4 = 2" in message


def test_shard_refuses_leaves_of_different_batch_sizes_naming_them():
    """Both divisible by n, yet 8 and 12 examples: each leaf used to be split its own way,
    so instance i saw inputs and targets of different examples."""
    batch = {"x": torch.zeros(8, 3), "labels": [torch.zeros(8), torch.zeros(12)]}
    with pytest.raises(ValueError) as info:
        shard(batch, n=4)
    message = str(info.value)
    assert "different batch sizes" in message
    assert (
        "batch['x'] has 8 rows (shape (8, 3))" in message and "batch['labels'][1] has 12 rows (shape (12,))" in message
    )
    with pytest.raises(ValueError, match="different batch sizes"):
        next(iter(prefetch_to_device([batch], n=2)))
    assert shard({"x": torch.zeros(8, 3), "y": np.zeros(8)}, n=4)["y"].shape == (4, 2)  # the same size: fine


def test_shard_of_scalar_names_key_path():
    with pytest.raises(ValueError, match=r"batch\[1\] is a scalar"):
        shard((torch.zeros(4), torch.tensor(1.0)), n=2)


def test_shard_unshard_round_trip():
    batch = {"x": torch.randn(16, 3, 2), "y": torch.arange(16)}
    back = unshard(shard(batch, n=8))
    assert torch.equal(back["x"], batch["x"]) and torch.equal(back["y"], batch["y"])


def test_unshard_needs_two_leading_axes():
    with pytest.raises(ValueError, match=r"tree\['y'\] has shape \(4,\)"):
        unshard({"x": torch.zeros(2, 2), "y": torch.zeros(4)})


def test_sharded_batch_feeds_pmap():
    x = torch.arange(8.0)
    per_instance_sum = tp.pmap(lambda s: s.sum(), axis_name="batch")(shard(x, n=4))
    assert torch.equal(per_instance_sum, torch.tensor([1.0, 5.0, 9.0, 13.0]))


# --------------------------------------------------------------------------- prefetch


def _numbered_batches(count, rows=4):
    for i in range(count):
        yield {"x": torch.full((rows, 2), float(i)), "i": torch.arange(rows) + i * rows}


@pytest.mark.parametrize("size", [1, 2, 5])
def test_prefetch_keeps_order_and_shards(size):
    out = list(prefetch_to_device(_numbered_batches(10), size=size, n=2))
    assert len(out) == 10
    for got, want in zip(out, _numbered_batches(10)):
        expected = shard(want, n=2)
        assert torch.equal(got["x"], expected["x"]) and torch.equal(got["i"], expected["i"])


def test_prefetch_moves_to_the_instances_device():
    (x,) = list(prefetch_to_device([torch.zeros(4)], n=2))
    assert x.device == tp.local_devices()[0].torch_device


def test_prefetch_accepts_any_iterable():
    assert [b.shape for b in prefetch_to_device([torch.zeros(6), torch.ones(6)], n=3)] == [(3, 2), (3, 2)]


def _new_prefetch_threads(before):
    return [t for t in threading.enumerate() if t not in before and t.name == "torchpmap-prefetch"]


def test_prefetch_reraises_producer_exception_in_order():
    def source():
        yield torch.zeros(2)
        yield torch.ones(2)
        raise KeyError("boom from the data loader")

    before = set(threading.enumerate())
    it = prefetch_to_device(source(), size=4, n=2)
    assert torch.equal(next(it), torch.zeros(2, 1))
    threads = _new_prefetch_threads(before)
    assert torch.equal(next(it), torch.ones(2, 1))
    with pytest.raises(KeyError, match="boom from the data loader"):
        next(it)
    for t in threads:
        t.join(timeout=30)
        assert not t.is_alive()


def test_prefetch_reports_shard_errors_with_key_path():
    it = prefetch_to_device([(torch.zeros(4), torch.zeros(4)), (torch.zeros(3), torch.zeros(3))], n=2)
    next(it)
    with pytest.raises(ValueError, match=r"batch\[0\] has 3 rows"):
        next(it)


def _counting_source(pulled):
    i = 0
    while True:
        pulled.append(i)
        yield torch.full((2,), float(i))
        i += 1


def test_prefetch_stops_its_thread_on_close():
    pulled: list[int] = []
    before = set(threading.enumerate())
    it = prefetch_to_device(_counting_source(pulled), size=2, n=2)
    got = [next(it)[0, 0].item() for _ in range(3)]
    assert got == [0.0, 1.0, 2.0]
    (thread,) = _new_prefetch_threads(before)
    it.close()
    thread.join(timeout=30)
    assert not thread.is_alive()
    # Bounded read-ahead: 3 consumed, at most `size` queued and one in the producer's hands.
    assert len(pulled) <= 3 + 2 + 1


def test_prefetch_stops_its_thread_after_break():
    pulled: list[int] = []
    before = set(threading.enumerate())
    for batch in prefetch_to_device(_counting_source(pulled), size=3, n=1):
        if batch[0, 0] == 4:
            break
    (thread,) = _new_prefetch_threads(before)
    gc.collect()  # the abandoned generator is closed when collected
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert len(pulled) <= 5 + 3 + 1


def test_prefetch_starts_no_thread_until_iterated():
    before = set(threading.enumerate())
    it = prefetch_to_device(_numbered_batches(2), n=2)
    assert _new_prefetch_threads(before) == []
    assert len(list(it)) == 2


@pytest.mark.parametrize("size", [0, -2, 1.5])
def test_prefetch_rejects_bad_size(size):
    with pytest.raises(ValueError, match="size must be a positive int"):
        prefetch_to_device([], size=size)


# --------------------------------------------------------------------------- data-parallel step


def _mlp(seed=0, dropout=0.0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Dropout(dropout), nn.Linear(16, 3))


def _data(batch=32, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 5, generator=g), torch.randint(0, 3, (batch,), generator=g)


def _reference_steps(model, make_opt, x, y, steps):
    """A plain single-process loop on the whole batch."""
    opt = make_opt(model.parameters())
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _parallel_steps(model, make_opt, x, y, steps, n):
    opt = make_opt(model.parameters())
    step = data_parallel_step(model, F.cross_entropy, opt, axis_name="batch")
    return [step(shard((x, y), n=n)).item() for _ in range(steps)]


def _assert_same_params(a, b, **tol):
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        torch.testing.assert_close(p, q, **tol, msg=lambda m, name=name: f"parameter {name}: {m}")


OPTIMIZERS = {
    "adam": lambda params: torch.optim.Adam(params, lr=0.05),
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=0.2, momentum=0.9),
}


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_data_parallel_step_matches_single_process(optimizer, n):
    x, y = _data()
    reference, parallel = _mlp(), _mlp()
    want = _reference_steps(reference, OPTIMIZERS[optimizer], x, y, steps=6)
    got = _parallel_steps(parallel, OPTIMIZERS[optimizer], x, y, steps=6, n=n)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert want[-1] < want[0]  # the steps did something
    _assert_same_params(parallel, reference, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_data_parallel_step_compiled_matches_single_process(backend):
    x, y = _data()
    reference, parallel = _mlp(), _mlp()
    want = _reference_steps(reference, OPTIMIZERS["adam"], x, y, steps=6)
    opt = OPTIMIZERS["adam"](parallel.parameters())
    step = data_parallel_step(parallel, F.cross_entropy, opt, devices=tp.devices()[:1], jit={"backend": backend})
    got = [step(shard((x, y), n=4)).item() for _ in range(6)]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    _assert_same_params(parallel, reference, rtol=1e-4, atol=1e-5)


def test_data_parallel_step_gradients_are_right_on_every_call():
    """With several devices the instances run in concurrent device threads. functional_call
    swaps tensors into the module it is given: threads sharing the user's module gave wrong
    gradients now and then, and could even leave the module holding a foreign tensor."""
    x, y = _data(batch=512)
    reference = _mlp()
    F.cross_entropy(reference(x), y).backward()
    model = _mlp()
    params_before = list(model.parameters())
    step = data_parallel_step(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.0))
    batch = shard((x, y), n=2 * tp.local_device_count())
    for call in range(100 if tp.local_device_count() > 1 else 5):  # the race needs threads
        step(batch)
        assert all(p is q for p, q in zip(model.parameters(), params_before)), f"call {call}: parameters replaced"
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(
                p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=lambda m, c=call, k=name: f"call {c}, {k}: {m}"
            )


def test_data_parallel_step_keeps_optimizer_state():
    x, y = _data()
    model = _mlp()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    step = data_parallel_step(model, F.cross_entropy, opt)
    step(shard((x, y), n=2))
    step(shard((x, y), n=2))
    state = opt.state[model[0].weight]
    assert state["step"].item() == 2 and state["exp_avg"].shape == model[0].weight.shape


def test_data_parallel_step_replaces_grad_and_returns_detached_loss():
    x, y = _data()
    model = _mlp()
    step = data_parallel_step(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.0))
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e6)  # stale: must be replaced, not accumulated
    loss = step(shard((x, y), n=4))
    assert loss.dim() == 0 and not loss.requires_grad
    reference = _mlp()
    F.cross_entropy(reference(x), y).backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)


def test_frozen_parameters_get_no_gradient():
    x, y = _data()
    model = _mlp()
    model[0].weight.requires_grad_(False)
    frozen = model[0].weight.clone()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    step = data_parallel_step(model, F.cross_entropy, opt)
    step(shard((x, y), n=2))
    assert model[0].weight.grad is None and torch.equal(model[0].weight, frozen)
    assert model[0].bias.grad is not None


class _WithBatchNorm(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(5, 8)
        self.bn = nn.BatchNorm1d(8, momentum=0.1)
        self.out = nn.Linear(8, 3)

    def forward(self, x):
        return self.out(torch.relu(self.bn(self.inp(x))))


def _separate_replicas_step(model, opt, x, y, n):
    """What n separate devices do: each replica runs plain PyTorch on its own shard;
    gradients are averaged; floating buffers averaged; counters taken from replica 0."""
    grads, buffers = [], []
    for xs, ys in zip(*shard((x, y), n=n)):
        replica = copy.deepcopy(model)
        F.cross_entropy(replica(xs), ys).backward()
        grads.append([p.grad for p in replica.parameters()])
        buffers.append(dict(replica.named_buffers()))
    for p, *gs in zip(model.parameters(), *grads):
        p.grad = torch.stack(gs).mean(0)
    with torch.no_grad():
        for name, b in model.named_buffers():
            values = [bufs[name] for bufs in buffers]
            b.copy_(torch.stack(values).mean(0) if b.is_floating_point() else values[0])
    opt.step()


def test_batchnorm_behaves_like_separate_replicas_with_averaged_buffers():
    x, y = _data(batch=24)
    n = 4
    reference, parallel = _WithBatchNorm(), _WithBatchNorm()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.3)
    step = data_parallel_step(parallel, F.cross_entropy, torch.optim.SGD(parallel.parameters(), lr=0.3))
    for _ in range(3):
        _separate_replicas_step(reference, ref_opt, x, y, n)
        step(shard((x, y), n=n))
    _assert_same_params(parallel, reference, rtol=1e-4, atol=1e-5)
    for (name, b), (_, want) in zip(parallel.named_buffers(), reference.named_buffers()):
        torch.testing.assert_close(b, want, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"buffer {name}: {m}")
    assert parallel.bn.num_batches_tracked.item() == 3


def test_batchnorm_running_stats_after_one_step():
    """The documented choice: running mean = full-batch running mean; running variance =
    mean of the per-shard variances (not the full-batch variance, as SyncBatchNorm would)."""
    x, y = _data(batch=24)
    model = _WithBatchNorm()
    with torch.no_grad():
        h = model.inp(x)
    step = data_parallel_step(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.0))
    step(shard((x, y), n=2))
    torch.testing.assert_close(model.bn.running_mean, 0.1 * h.mean(0))
    shard_vars = torch.stack([s.var(0, unbiased=True) for s in shard(h, n=2)])
    torch.testing.assert_close(model.bn.running_var, 0.9 + 0.1 * shard_vars.mean(0))
    assert not torch.allclose(model.bn.running_var, 0.9 + 0.1 * h.var(0, unbiased=True))


def test_batchnorm_eval_mode_uses_and_keeps_running_stats():
    x, y = _data(batch=8)
    model = _WithBatchNorm().eval()
    with torch.no_grad():
        model.bn.running_mean.fill_(0.5)
    step = data_parallel_step(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1))
    reference = copy.deepcopy(model)
    want = F.cross_entropy(reference(x), y)
    got = step(shard((x, y), n=4))
    torch.testing.assert_close(got, want)
    assert torch.equal(model.bn.running_mean, torch.full((8,), 0.5)) and model.bn.num_batches_tracked.item() == 0


def test_unchanged_float_buffers_stay_bit_identical():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(5, 3)
            # Many of these values are not reproduced exactly by (v + v + v) / 3 in float32.
            self.register_buffer("scale", torch.rand(64, generator=torch.Generator().manual_seed(0)))

        def forward(self, x):
            return self.lin(x * self.scale[:5])

    n = 3 * tp.local_device_count()  # 3 instances per device: 3 * v / 3 is often not v
    x, y = _data(batch=2 * n)
    model = Scaled()
    before = model.scale.clone()
    step = data_parallel_step(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1))
    for _ in range(5):
        step(shard((x, y), n=n))
    assert torch.equal(model.scale, before)


class _DropoutProbe(nn.Module):
    """The loss of one instance with one example is 0 or 2: dropout(1) * weight 1."""

    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.5)
        self.weight = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return self.drop(x) * self.weight


def test_dropout_draws_a_different_mask_per_instance():
    torch.manual_seed(0)
    model = _DropoutProbe()
    step = data_parallel_step(model, lambda out, y: out.sum(), torch.optim.SGD(model.parameters(), lr=0.0))
    batch = (torch.ones(2, 1), torch.zeros(2, 1))  # 2 instances, identical data
    losses = {step(batch).item() for _ in range(40)}
    assert losses <= {0.0, 1.0, 2.0}
    # A mean of 1 needs one instance to keep its unit and the other to drop it: the
    # instances draw different masks (with "same" randomness it would be 0 or 2 only).
    assert 1.0 in losses and len(losses) > 1


def test_dropout_is_off_in_eval_mode():
    model = _DropoutProbe().eval()
    step = data_parallel_step(model, lambda out, y: out.sum(), torch.optim.SGD(model.parameters(), lr=0.0))
    assert {step((torch.ones(4, 1), torch.zeros(4, 1))).item() for _ in range(10)} == {1.0}


def test_dropout_run_is_reproducible_under_manual_seed():
    def run():
        model = _mlp(seed=3, dropout=0.3)
        torch.manual_seed(123)
        x, y = _data()
        return _parallel_steps(model, OPTIMIZERS["adam"], x, y, steps=4, n=4)

    assert run() == run()


# --------------------------------------------------------------------------- the demo


@pytest.mark.slow
def test_train_digits_quick_reaches_95_percent(tmp_path):
    plot = tmp_path / "digits.png"
    result = subprocess.run(
        [sys.executable, str(REPO / "examples" / "train_digits.py"), "--quick", "--plot", str(plot)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    match = re.search(r"held-out accuracy: (\d\.\d+)", result.stdout)
    assert match, result.stdout
    assert float(match.group(1)) >= 0.95, result.stdout
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "samples/s" in result.stdout  # the summary reports throughput
    assert re.search(r"^epoch 1/\d+: loss ", result.stdout, re.M)  # not a terminal: plain lines, no progress bar
    assert "\r" not in result.stderr


# --------------------------------------------------------------------------- the open step


def _step_devices() -> list:
    """One device, and every local device (4 in the multi-device run of the suite)."""
    return [tp.devices()[:1], tp.devices()]


class _TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(3, 4).double(), nn.Linear(2, 4).double()

    def forward(self, x, mask=None, *, extra):
        return self.a(x) * mask + self.b(extra), self.a(x).pow(2).mean()  # (output, auxiliary)


@pytest.mark.parametrize("devices", _step_devices(), ids=["one", "all"])
def test_gradients_only_step_accumulates_like_backward(devices):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1)).double()
    reference = copy.deepcopy(model)
    step = data_parallel_step(model, F.mse_loss, None, devices=devices)
    g = torch.Generator().manual_seed(1)
    micro = [
        (torch.randn(16, 3, generator=g, dtype=torch.float64), torch.randn(16, 1, generator=g, dtype=torch.float64))
        for _ in range(3)
    ]
    losses = [step(shard(b, n=4)) for b in micro]  # accumulation over micro-batches
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)  # the user clips, as with DDP
    for x, y in micro:
        F.mse_loss(reference(x), y).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(norm, ref_norm, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(
        torch.stack(losses), torch.stack([F.mse_loss(reference(x), y) for x, y in micro]).detach()
    )


@pytest.mark.parametrize("devices", _step_devices(), ids=["one", "all"])
def test_dict_inputs_and_a_loss_that_sees_the_batch(devices):
    torch.manual_seed(0)
    model = _TwoInputs()
    reference = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference))
    g = torch.Generator().manual_seed(2)
    batch = {
        "x": torch.randn(16, 3, generator=g, dtype=torch.float64),
        "mask": (torch.rand(16, 1, generator=g) > 0.3).double(),
        "extra": torch.randn(16, 2, generator=g, dtype=torch.float64),
        "y": torch.randn(16, 4, generator=g, dtype=torch.float64),
    }

    def loss_fn(outputs, batch):  # multi-output model, auxiliary loss, the targets from the batch
        out, aux = outputs
        return F.mse_loss(out, batch["y"]) + 0.1 * aux

    inputs = lambda b: {"x": b["x"], "mask": b["mask"], "extra": b["extra"]}  # noqa: E731
    step = data_parallel_step(model, loss_fn, opt, model_inputs=inputs, devices=devices)
    for _ in range(3):
        loss = step(shard(batch, n=4))
        ref_opt.zero_grad()
        # the mean over 4 equal shards of the per-shard loss (the aux term is a per-shard mean too)
        ref = torch.stack(
            [
                loss_fn(reference(**inputs(b)), b)
                for b in [{k: v[4 * i : 4 * i + 4] for k, v in batch.items()} for i in range(4)]
            ]
        ).mean()
        ref.backward()
        ref_opt.step()
        torch.testing.assert_close(loss, ref.detach(), rtol=1e-12, atol=1e-12)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-12)


def test_data_parallel_step_says_what_is_wrong():
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got function"):
        data_parallel_step(lambda x: x, F.mse_loss, None)
    model = nn.Linear(2, 1)
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer or None, got str"):
        data_parallel_step(model, F.mse_loss, "sgd")
    step = data_parallel_step(model, F.mse_loss, None)
    with pytest.raises(TypeError, match=r"takes a pair \(inputs, targets\), got a tuple of 3 items.*model_inputs="):
        step((torch.zeros(2, 1, 2), torch.zeros(2, 1, 1), torch.zeros(2)))
    with pytest.raises(TypeError, match=r"takes a pair \(inputs, targets\), got a dict"):
        step({"x": torch.zeros(2, 1, 2)})


# --------------------------------------------------------------------------- mixed precision


def _small_cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Dropout(0.0), nn.Linear(4 * 6 * 6, 3)
    )


def _images(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(16, 1, 8, 8, generator=g), torch.randint(0, 3, (16,), generator=g)


@pytest.mark.parametrize("devices", _step_devices(), ids=["one", "all"])
def test_bf16_autocast_with_batch_norm_matches_plain_pytorch(devices):
    model = _small_cnn()
    reference = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference))
    step = data_parallel_step(model, F.cross_entropy, opt, devices=devices)
    x, y = _images()
    for _ in range(3):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = step(shard((x, y), n=4))
            ref_opt.zero_grad()
            ref = torch.stack(
                [F.cross_entropy(reference(x[4 * i : 4 * i + 4]), y[4 * i : 4 * i + 4]) for i in range(4)]
            ).mean()
        ref.backward()
        ref_opt.step()
        torch.testing.assert_close(loss, ref.detach(), rtol=2e-2, atol=2e-2)  # bfloat16 rounding
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=2e-2, atol=2e-2)


def test_bf16_autocast_gives_the_same_step_on_one_and_on_all_devices(monkeypatch):
    # one instance per device through vmap, as on one device (by default it runs directly,
    # and bfloat16 rounds differently: the test above compares that with plain PyTorch)
    monkeypatch.setattr(tp.config, "bitwise_placement", True)
    results = []
    for devices in _step_devices():
        model = _small_cnn()
        step = data_parallel_step(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1), devices=devices)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            losses = [step(shard(_images(), n=4)) for _ in range(2)]
        results.append((torch.stack(losses), [p.detach().clone() for p in model.parameters()]))
    torch.testing.assert_close(results[0], results[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("devices", _step_devices(), ids=["one", "all"])
def test_fp16_grad_scaler_scales_and_skips_a_step_on_inf(devices):
    model = _small_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1000)
    step = data_parallel_step(model, F.cross_entropy, opt, grad_scaler=scaler, devices=devices)
    x, y = _images()
    with torch.autocast("cpu", dtype=torch.float16):
        first = step(shard((x, y), n=4))
    assert torch.isfinite(first) and scaler.get_scale() == 2.0**8
    before = [p.detach().clone() for p in model.parameters()]
    bad = x.clone()
    bad[0, 0, 0, 0] = float("inf")  # one shard's gradients overflow
    with torch.autocast("cpu", dtype=torch.float16):
        step(shard((bad, y), n=4))
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))  # the step was skipped
    assert scaler.get_scale() == 2.0**7  # and the scale backed off


def test_fp16_grad_scaler_skips_the_same_steps_on_one_and_on_two_devices(monkeypatch):
    """A scale near float16's overflow: the step one device takes, two devices take too
    (and two processes, and shard_params). One device used to fold the instances into one
    product of the mean loss, whose scaled backward stays n times smaller than each
    instance's: it took steps that the other placements skipped, silently."""
    from torchpmap._placement import devices as _devices_module

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("TORCHPMAP_NUM_CPU_DEVICES", "2")
    _devices_module._local_devices.cache_clear()
    try:
        runs = []
        for devices, sharded in ((tp.devices()[:1], False), (tp.devices(), False), (tp.devices()[:1], True)):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            scaler = torch.amp.GradScaler("cpu", init_scale=3e5, growth_interval=1)
            step = data_parallel_step(
                model, F.cross_entropy, opt, grad_scaler=scaler, devices=devices, shard_params=sharded
            )
            g = torch.Generator().manual_seed(1)
            scales = []
            for _ in range(4):
                x, y = torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)
                with torch.autocast("cpu", dtype=torch.float16):
                    step(shard((x, y), n=4))
                scales.append(scaler.get_scale())
            if sharded:
                step.gather_params()
            runs.append((scales, [p.detach().clone() for p in model.parameters()]))
    finally:
        monkeypatch.undo()
        _devices_module._local_devices.cache_clear()
    (one_scales, one_weights), *others = runs
    assert one_scales[0] == 1.5e5  # the first step overflows: skipped, the scale backed off
    for scales, weights in others:
        assert scales == one_scales
        torch.testing.assert_close(weights, one_weights, rtol=1e-3, atol=1e-3)  # float16 rounding


@pytest.mark.parametrize("devices", _step_devices(), ids=["one", "all"])
def test_a_parameter_frozen_between_steps_stops_moving_as_in_plain_pytorch(devices):
    """requires_grad_(False) between steps (fine-tuning): plain PyTorch's zero_grad()
    leaves the frozen weight no gradient, so SGD with momentum stops moving it. The step
    left its gradient of the last step in place, and the optimizer applied it again at
    every step (0.2 off after 3 more steps)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    step = data_parallel_step(model, F.cross_entropy, opt, devices=devices)
    g = torch.Generator().manual_seed(1)
    for i in range(5):
        if i == 2:
            model[0].weight.requires_grad_(False)
            reference[0].weight.requires_grad_(False)
        x, y = torch.randn(8, 5, generator=g), torch.randint(0, 3, (8,), generator=g)
        step(shard((x, y), n=4))
        ref_opt.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        ref_opt.step()
    assert model[0].weight.grad is None
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shard_params", [False, True])
def test_a_step_under_inference_mode_is_refused_naming_it(shard_params):
    """The message was "the loss does not depend on any of the model's parameters"."""
    model = torch.nn.Linear(3, 2)
    step = data_parallel_step(model, F.mse_loss, torch.optim.SGD(model.parameters(), lr=0.1), shard_params=shard_params)
    with torch.inference_mode(), pytest.raises(RuntimeError, match=r"called under torch.inference_mode\(\)"):
        step(shard((torch.ones(4, 3), torch.ones(4, 2)), 2))


def test_a_trainable_tensor_outside_the_model_is_refused_and_trains_as_a_model_parameter():
    """A learnable temperature that loss_fn uses, held by the optimizer but not by the
    model, was silently never trained (the step differentiates the model's parameters).
    The step refuses it; registered on the model, it trains as in plain PyTorch."""
    torch.manual_seed(0)
    model = nn.Linear(5, 3)
    temp = nn.Parameter(torch.tensor(1.0))
    x, y = torch.randn(8, 5), torch.randint(0, 3, (8,))
    with pytest.raises(ValueError, match=r"also holds 1 trainable tensor.*not parameters of the model.*never train"):
        data_parallel_step(
            model, lambda out, y: F.cross_entropy(out / temp, y), torch.optim.SGD([*model.parameters(), temp], lr=0.5)
        )
    model.temp = temp
    reference = copy.deepcopy(model)
    step = data_parallel_step(
        model, lambda out, y: F.cross_entropy(out / model.temp, y), torch.optim.SGD(model.parameters(), lr=0.5)
    )
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    for _ in range(3):
        step(shard((x, y), n=4))
        ref_opt.zero_grad()
        F.cross_entropy(reference(x) / reference.temp, y).backward()
        ref_opt.step()
    assert model.temp.item() != 1.0
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_one_device_eager_step_makes_no_per_instance_weight_gradient():
    """On one device the eager step takes the gradient of the mean loss outside the map:
    each weight's gradient is one product over every example, as in plain PyTorch on the
    whole batch, never a stack of one gradient per instance (8 times the weight's memory).
    (Several devices fold the same way; a dispatch mode does not reach their threads.)"""
    from torch.utils._python_dispatch import TorchDispatchMode

    model = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 5))
    weights = {tuple(p.shape) for p in model.parameters() if p.dim() == 2}
    stacked = []

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and t.dim() == 3 and tuple(t.shape[1:]) in weights:
                    stacked.append((str(func), tuple(t.shape)))
            return out

    step = data_parallel_step(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1),
                              devices=tp.devices()[:1])
    x, y = torch.randn(64, 6), torch.randint(0, 5, (64,))
    with Watch():
        step(shard((x, y), n=8))
    assert stacked == []


def test_the_eager_step_on_several_devices_repeats_its_bits(four_devices):
    """On several devices the eager step takes the gradient of the mean loss outside the
    map, and each device's contribution is added in the devices' order: autograd's own
    order followed sequence numbers that each pool thread counts for itself, so the last
    bits changed with which thread ran which device (a resumed run did not repeat the
    run it resumed)."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 6, generator=g), torch.randint(0, 5, (64,), generator=g)

    def run(churn: int, n: int) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 32), nn.BatchNorm1d(32), nn.Tanh(), nn.Linear(32, 5))
        step = data_parallel_step(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.5),
                                  devices=four_devices)
        for i in range(3):
            for j in range(churn * (i + 1)):  # the pool threads count other work in between
                devices = four_devices[: 1 + (i + j) % 4]
                tp.pmap(lambda v: v.sin().cos().exp(), devices=devices)(torch.ones(len(devices) * (j + 1), 3))
            step(shard((x, y), n=n))
        return [p.detach().clone() for p in model.parameters()]

    for n in (4, 8):
        first = run(0, n)
        for churn in (1, 3, 7):
            again = run(churn, n)
            assert all(torch.equal(p, q) for p, q in zip(first, again)), (n, churn)


def test_a_loss_that_calls_the_model_again_is_differentiated_through_both_calls(placement):
    """A loss_fn with a term of its own through the model (a consistency term): plain
    PyTorch differentiates both calls; the second call ran outside the step's tensors and
    its gradient was lost without an error. Replicated and sharded, 1 and 4 devices."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)

    def make():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))

    def loss_for(model):
        return lambda out, batch: F.cross_entropy(out, batch[1]) + model(batch[0] * 2).pow(2).mean()

    plain = make()
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        torch.stack([loss_for(plain)(plain(xs), (xs, ys)) for xs, ys in zip(x.chunk(4), y.chunk(4))]).mean().backward()
        opt.step()
    for sharded in (False, True):
        model = make()
        step = data_parallel_step(model, loss_for(model), torch.optim.SGD(model.parameters(), lr=0.1),
                                  model_inputs=lambda batch: batch[0], shard_params=sharded)
        for _ in range(2):
            step(shard((x, y), n=4))
        if sharded:
            step.gather_params()
        for p, q in zip(model.parameters(), plain.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_a_module_used_twice_keeps_its_parameter_and_trains_as_plain_pytorch(placement):
    """One nn.Linear at two places of a Sequential: torch.func.functional_call left it
    holding the tensor swapped in for the step, so the optimizer stepped a parameter the
    model no longer used (found by a hunt: other losses from the third step on).
    Replicated and sharded, 1 and 4 devices."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 6, generator=g), torch.randn(16, 3, generator=g)

    def make():
        torch.manual_seed(0)
        twice = torch.nn.Linear(6, 6)
        return torch.nn.Sequential(twice, torch.nn.Tanh(), twice, torch.nn.Tanh(), torch.nn.Linear(6, 3))

    plain = make()
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    want = []
    for _ in range(4):
        opt.zero_grad()
        loss = torch.stack([F.mse_loss(plain(xs), ys) for xs, ys in zip(x.chunk(4), y.chunk(4))]).mean()
        loss.backward()
        opt.step()
        want.append(loss.detach())
    for sharded in (False, True):
        model = make()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        step = data_parallel_step(model, F.mse_loss, opt, shard_params=sharded)
        losses = torch.stack([step(shard((x, y), n=4)) for _ in range(4)])
        torch.testing.assert_close(losses, torch.stack(want), rtol=1e-5, atol=1e-6)
        if sharded:
            step.gather_params()
        else:
            assert model[0].weight is opt.param_groups[0]["params"][0]
        for p, q in zip(model.parameters(), plain.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_an_embedding_that_scales_by_frequency_counts_each_instances_indices(jit, placement):
    """``nn.Embedding(scale_grad_by_freq=True)`` divides each row's gradient by how often
    its index occurs in the batch: in each instance's batch, as each DDP rank counts. One
    device used to fold the instances into one backward over every sample, which counted
    the other instances' occurrences too (0.35 off the other placements)."""
    torch.manual_seed(0)
    model = nn.Embedding(6, 3, scale_grad_by_freq=True).double()
    w = torch.randn(6, 3, dtype=torch.float64)
    loss_fn = lambda out, t: (out * w[t]).sum() / t.numel()  # noqa: E731
    t = torch.tensor([[1, 1, 2], [1, 3, 3], [1, 2, 2], [4, 4, 4], [1, 1, 1], [5, 2, 1], [3, 3, 1], [2, 2, 2]])
    shards = t.reshape(4, 2, 3)
    ref = copy.deepcopy(model)
    want = sum(torch.autograd.grad(loss_fn(ref(s), s), ref.weight)[0] for s in shards) / len(shards)
    step = data_parallel_step(model, loss_fn, None, model_inputs=lambda s: s, jit=jit)
    step(shards)
    torch.testing.assert_close(model.weight.grad, want)


# vmap cannot run embedding_renorm_ on a weight the instances share: one at a time, then refused
@pytest.mark.filterwarnings("ignore::torchpmap.VectorizationFallbackWarning")
@pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")
def test_a_forward_that_writes_its_parameters_is_refused_naming_the_parameter(placement):
    """nn.Embedding(max_norm=...) renormalizes the rows it looks up in place: every
    instance of the step shares the model's weight, so the write is refused on every
    placement, with a note that says which parameter and what to do in a step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4, max_norm=1.0), nn.Flatten(), nn.Linear(12, 2))
    with torch.no_grad():
        model[0].weight.mul_(5)
    step = data_parallel_step(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1))
    t, y = torch.tensor([[1, 2, 3], [1, 1, 1], [4, 5, 6], [1, 7, 8]]), torch.tensor([0, 1, 0, 1])
    written = r"wrote in place to the memory of argument 'params' at \['0.weight'\]"
    with pytest.raises(RuntimeError, match=written) as err:
        step(shard((t, y), n=4))
    if sys.version_info >= (3, 11):  # exception notes
        note = "\n".join(getattr(err.value, "__notes__", []))
        assert "data_parallel_step" in note and "trained parameter ['0.weight']" in note and "outside the step" in note


@pytest.mark.parametrize(
    "register",
    [
        lambda m: m[2].register_full_backward_hook(lambda module, grad_in, grad_out: None),
        lambda m: m[2].register_full_backward_pre_hook(lambda module, grad_out: None),
        lambda m: m.register_full_backward_hook(lambda module, grad_in, grad_out: None),
        lambda m: nn.modules.module.register_module_full_backward_hook(lambda module, grad_in, grad_out: None),
    ],
    ids=["full", "pre", "on_the_model", "every_module"],
)
def test_a_backward_hook_is_refused_on_every_placement_and_the_step_runs_once_it_is_removed(placement, register):
    """torch.func runs no module backward hook: on one device the step ignored it (plain
    PyTorch calls it once a step), on 4 devices torch raised about setup_context. Now every
    placement, replicated or sharded, names the module and the fix, and trains once the
    hook is removed (a hook registered after the first step is seen too)."""
    g = torch.Generator().manual_seed(0)
    batch = shard((torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)), n=4)
    for sharded in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
        step = data_parallel_step(model, F.mse_loss, torch.optim.SGD(model.parameters(), lr=0.1), shard_params=sharded)
        first = step(batch)
        handle = register(model)
        try:
            with pytest.raises(NotImplementedError, match=r"backward (pre-)?hook.*torch\.func.*remove") as info:
                step(batch)
        finally:
            handle.remove()
        if "every module" not in str(info.value):
            assert "'2' (Linear)" in str(info.value) or "the model (Sequential)" in str(info.value)
        assert torch.isfinite(first) and torch.isfinite(step(batch))


def test_activation_checkpointing_trains_in_one_process_and_is_refused_clearly_where_torch_func_takes_the_grads(
    placement,
):
    """``torch.utils.checkpoint(use_reentrant=False)`` sets saved tensor hooks, which
    torch.func.grad refuses: the steps that take each instance's gradient with it
    (shard_params, several processes) raised torch's own message, naming neither the step
    nor a way out. The replicated step in one process takes the gradient of the mean loss
    with plain autograd, where checkpointing works (its instances one at a time where vmap
    would run them: vmap refuses saved tensor hooks too): it trains as plain PyTorch does,
    on one device and on several."""

    class Checkpointed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner, self.head = nn.Linear(4, 8), nn.Linear(8, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            hidden = torch.utils.checkpoint.checkpoint(lambda t: torch.tanh(self.inner(t)), x, use_reentrant=False)
            return self.head(hidden)

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)
    for sharded in (False, True):
        torch.manual_seed(0)
        model = Checkpointed()
        plain = copy.deepcopy(model)
        step = data_parallel_step(model, F.mse_loss, torch.optim.SGD(model.parameters(), lr=0.1), shard_params=sharded)
        if not sharded:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                loss = step(shard((x, y), n=4))
            # vmap refuses checkpointing (each torch its way); a device holding one instance runs it without vmap
            fell_back = [w for w in caught if issubclass(w.category, tp.VectorizationFallbackWarning)]
            assert bool(fell_back) == (len(placement) == 1)
            want = F.mse_loss(plain(x), y)
            want.backward()
            torch.testing.assert_close(loss, want.detach())
            with torch.no_grad():
                for p in plain.parameters():
                    p -= 0.1 * p.grad
            torch.testing.assert_close(dict(model.named_parameters()), dict(plain.named_parameters()))
            continue
        with pytest.raises(NotImplementedError, match=r"saved tensor hooks.*with shard_params.*in one process"):
            step(shard((x, y), n=4))


class _RunningMax(nn.Module):
    """A linear layer that keeps the largest output it has seen in a buffer, as a
    quantization observer keeps ``max_val``, starting at ``start``."""

    def __init__(self, start: float):
        super().__init__()
        self.lin = nn.Linear(3, 1)
        self.register_buffer("seen", torch.tensor(start))
        self.register_buffer("untouched", torch.tensor([1.0 / 3.0, -7.25e-9]))

    def forward(self, x):
        out = self.lin(x)
        self.seen.copy_(torch.maximum(self.seen, out.detach().max()))
        return out


@pytest.mark.parametrize("shard_params", [False, True], ids=["replicated", "sharded"])
@pytest.mark.parametrize("start", [float("-inf"), -1e9], ids=["-inf", "-1e9"])
def test_a_buffer_becomes_the_mean_of_the_instances_values_from_any_start(placement, start, shard_params):
    """The step wrote ``old + mean(new - old)``: NaN from ``-inf`` (-inf + inf), and 0.0
    from ``-1e9`` (rounding), on every placement. Now the mean of the instances' values,
    where any of them changed the buffer; a buffer none changed keeps its bits."""
    torch.manual_seed(0)
    x, y = torch.randn(4, 5, 3), torch.randn(4, 5, 1)
    for jit in (False, True):
        model = _RunningMax(start)
        with torch.no_grad():
            want = torch.stack([model.lin(x[i]).max() for i in range(4)]).mean()
        untouched = model.untouched.clone()
        step = data_parallel_step(model, F.mse_loss, torch.optim.SGD(model.parameters(), lr=0.1),
                                  shard_params=shard_params, jit=jit)
        step((x, y))
        torch.testing.assert_close(model.seen, want, msg=f"jit={jit}")
        assert torch.equal(model.untouched, untouched)


def test_a_loss_of_several_numbers_is_refused_on_every_placement_and_one_number_is_taken(placement):
    """One device took the mean of a loss of several numbers (``torch.stack([ce, penalty])``
    trained on their mean, not their sum) where several devices raised. A loss of one
    number in any shape is what ``loss.backward()`` takes: it trains as the scalar."""
    x, y = torch.randn(4, 2, 3), torch.randn(4, 2, 1)
    for shard_params in (False, True):
        model = nn.Linear(3, 1)
        step = data_parallel_step(model, lambda out, t: torch.stack([F.mse_loss(out, t), out.abs().mean()]),
                                  torch.optim.SGD(model.parameters(), lr=0.1), shard_params=shard_params)
        with pytest.raises(ValueError, match=r"loss_fn must return a scalar tensor .* shape \(2,\)"):
            step((x, y))
    trained = []
    for reshape in ((), (1, 1)):
        torch.manual_seed(1)
        model = nn.Linear(3, 1)
        step = data_parallel_step(model, lambda out, t, r=reshape: F.mse_loss(out, t).reshape(r),
                                  torch.optim.SGD(model.parameters(), lr=0.1))
        trained.append((step((x, y)), model.weight.detach().clone()))
    torch.testing.assert_close(trained[0], trained[1], rtol=0, atol=0)


def test_sparse_embedding_gradients_stay_sparse_in_one_process_and_are_refused_where_torch_func_takes_them(
    four_devices,
):
    """In one process the replicated step takes its gradient by plain autograd, and an
    embedding's stays sparse (SGD steps it), on one device and on several; the sharded
    step takes each instance's gradient under torch.func, and raised torch's "reshape is
    not implemented for sparse tensors", naming nothing."""
    torch.manual_seed(0)
    x, y = torch.randint(0, 10, (8, 3)), torch.randint(0, 2, (8,))

    def model() -> nn.Module:
        torch.manual_seed(1)
        return nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Flatten(), nn.Linear(12, 2))

    dense = model()
    dense[0].sparse = False
    plain = torch.optim.SGD(dense.parameters(), lr=0.1)
    F.cross_entropy(dense(x), y).backward()
    plain.step()
    for devices in (four_devices[:1], four_devices[:2], four_devices):
        m = model()
        step = data_parallel_step(m, F.cross_entropy, torch.optim.SGD(m.parameters(), lr=0.1), devices=devices)
        step(shard((x, y), n=4))
        for p, q in zip(m.parameters(), dense.parameters()):
            torch.testing.assert_close(p, q)
    for devices in (four_devices[:1], four_devices):
        m = model()
        step = data_parallel_step(
            m, F.cross_entropy, torch.optim.SGD(m.parameters(), lr=0.1), devices=devices, shard_params=True
        )
        with pytest.raises(NotImplementedError, match=r"embedding\(s\) \['0'\] make sparse gradients.*sparse=False"):
            step(shard((x, y), n=4))
