"""data_parallel_step gives plain PyTorch's answer, or refuses (issue 27).

Each test compares the step with what a plain PyTorch loop on the whole batch does (the
mean of equal shards' mean losses is the full batch's mean loss), on 1 and on 4 CPU
devices (the ``placement`` fixture): one device is the oracle. The same cases across 2
processes are in tests/test_distributed.py (scenario ``same_answers``).
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchpmap.training import data_parallel_step, shard


class WithUnusedBranch(nn.Module):
    """A model whose ``spare`` layer the forward never uses (a frozen-by-accident head,
    an auxiliary branch switched off)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body, self.head, self.spare = nn.Linear(5, 8), nn.Linear(8, 3), nn.Linear(8, 3)
        nn.init.constant_(self.spare.weight, 1.0)

    def forward(self, x):
        return self.head(torch.tanh(self.body(x)))


def _data(batch: int = 16):
    g = torch.Generator().manual_seed(1)
    return torch.randn(batch, 5, generator=g), torch.randint(0, 3, (batch,), generator=g)


def _plain_steps(model, make_opt, x, y, steps, loss_fn=F.cross_entropy):
    opt = make_opt(model.parameters())
    for _ in range(steps):
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()


ADAMW = lambda params: torch.optim.AdamW(params, lr=0.05, weight_decay=0.5)  # noqa: E731


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_parameter_the_loss_never_reaches_keeps_grad_none(placement, jit):
    """It used to get p.grad = 0, and AdamW then decayed it: 0.95 after one step where
    plain PyTorch keeps 1.0."""
    x, y = _data()
    plain, parallel = WithUnusedBranch(), WithUnusedBranch()
    _plain_steps(plain, ADAMW, x, y, steps=3)
    step = data_parallel_step(parallel, F.cross_entropy, ADAMW(parallel.parameters()),
                              devices=placement[:1] if jit else None, jit=jit)
    for _ in range(3):
        step(shard((x, y), n=4))
    assert plain.spare.weight.grad is None and parallel.spare.weight.grad is None
    assert torch.equal(parallel.spare.weight, torch.ones(3, 8)) and torch.equal(
        parallel.spare.weight, plain.spare.weight
    )
    for (name, p), q in zip(parallel.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
        assert (p.grad is None) == (q.grad is None), name


def test_without_an_optimizer_an_unreached_parameter_keeps_its_grad(placement):
    """As loss.backward(): the gradients of the reached parameters accumulate, the others
    are left as they were (None, or what the user put there)."""
    x, y = _data()
    plain, parallel = WithUnusedBranch(), WithUnusedBranch()
    for model in (plain, parallel):
        model.spare.bias.grad = torch.full((3,), 7.0)
    step = data_parallel_step(parallel, F.cross_entropy, None)
    for _ in range(2):
        step(shard((x, y), n=4))
        F.cross_entropy(plain(x), y).backward()
    assert parallel.spare.weight.grad is None and torch.equal(parallel.spare.bias.grad, torch.full((3,), 7.0))
    for (name, p), q in zip(parallel.named_parameters(), plain.parameters()):
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("loss_fn", [
    lambda out, y: F.cross_entropy(out.detach(), y),
    lambda out, y: torch.tensor(1.0),
    lambda out, y: (y.float() * 2).mean(),
], ids=["detached", "a-constant", "from-the-targets-only"])
def test_a_loss_that_does_not_depend_on_the_parameters_is_an_error(placement, loss_fn):
    """Plain PyTorch raises at loss.backward(); the step used to do nothing, silently."""
    x, y = _data()
    model = WithUnusedBranch()
    before = copy.deepcopy(model.state_dict())
    step = data_parallel_step(model, loss_fn, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="the loss does not depend on any of the model's parameters"):
        step(shard((x, y), n=4))
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_an_optimizer_holding_none_of_the_models_parameters_is_an_error():
    model, other = WithUnusedBranch(), nn.Linear(5, 3)
    with pytest.raises(
        ValueError, match=r"the optimizer holds none of the model's parameters \(2 tensors of its own, 6 in the model\)"
    ):
        data_parallel_step(model, F.cross_entropy, torch.optim.SGD(other.parameters(), lr=0.1))
    data_parallel_step(model, F.cross_entropy, torch.optim.SGD(model.head.parameters(), lr=0.1))  # some of them: fine


def _metrics_loss(out, y):
    loss = F.cross_entropy(out, y)
    return loss, {
        "accuracy": (out.argmax(-1) == y).float().mean(),
        "per_class": (y.unsqueeze(-1) == torch.arange(3)).sum(0),
    }


def test_has_aux_returns_metrics_averaged_over_every_instance(placement):
    x, y = _data()
    plain, parallel = WithUnusedBranch(), WithUnusedBranch()
    step = data_parallel_step(parallel, _metrics_loss, torch.optim.SGD(parallel.parameters(), lr=0.1), has_aux=True)
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    for _ in range(2):
        loss, aux = step(shard((x, y), n=4))
        shards = [_metrics_loss(plain(xs), ys) for xs, ys in zip(*shard((x, y), n=4))]
        want_loss = torch.stack([loss for loss, _ in shards]).mean()
        opt.zero_grad()
        want_loss.backward()
        opt.step()
        torch.testing.assert_close(loss, want_loss.detach(), rtol=1e-6, atol=1e-7)
        assert not loss.requires_grad and not aux["accuracy"].requires_grad
        torch.testing.assert_close(aux["accuracy"], torch.stack([a["accuracy"] for _, a in shards]).mean())
        # an integer metric's mean is a float, as pmean's (and JAX's) is
        assert aux["per_class"].dtype == torch.float32
        torch.testing.assert_close(aux["per_class"], torch.stack([a["per_class"] for _, a in shards]).float().mean(0))
    for p, q in zip(parallel.parameters(), plain.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_has_aux_says_what_loss_fn_must_return():
    x, y = _data()
    model = WithUnusedBranch()
    step = data_parallel_step(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1), has_aux=True)
    with pytest.raises(TypeError, match=r"has_aux=True\): loss_fn must return a pair \(loss, aux\), got a Tensor"):
        step(shard((x, y), n=4))
    step = data_parallel_step(model, lambda o, t: (F.cross_entropy(o, t), {"n": 3}), None, has_aux=True)
    with pytest.raises(TypeError, match=r"aux\['n'\] is of type int \(3\); aux must be a pytree of tensors"):
        step(shard((x, y), n=4))
