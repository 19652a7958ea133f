"""A module backward hook inside a mapped function is called once per instance on every
placement (torchpmap._engines.backward_hooks): vmap would never call it, so a vectorized
run that meets one runs its instances one at a time, as several devices do."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import torchpmap as tp
from torchpmap._engines import backward_hooks

pytestmark = pytest.mark.same_on_every_placement  # every test pins its devices


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tp.VectorizationFallbackWarning)
        # torch's own, about the old register_backward_hook on a forward of several autograd nodes
        warnings.filterwarnings("ignore", "Using a non-full backward hook", FutureWarning)
        yield


def _placements():
    """One device (the oracle), 2 and 4 devices (8 instances: several per device), and debug mode."""
    return [tp.devices()[:1], tp.devices()[:2], tp.devices()[:4], "debug"]


def _mapped(f, placement):
    if placement == "debug":
        def debug(*args):
            with tp.disable_vectorization():
                return tp.pmap(f)(*args)
        return debug
    return tp.pmap(f, devices=placement)


def _hooked(register: str) -> tuple[nn.Linear, list[float]]:
    """A Linear whose hook records the sum of the gradient of its output."""
    lin = nn.Linear(3, 2)
    lin.load_state_dict({"weight": torch.arange(6.0).reshape(2, 3) / 6, "bias": torch.tensor([0.5, -0.5])})
    seen: list[float] = []
    if register == "full":
        lin.register_full_backward_hook(lambda m, grad_in, grad_out: seen.append(round(float(grad_out[0].sum()), 4)))
    elif register == "pre":
        lin.register_full_backward_pre_hook(lambda m, grad_out: seen.append(round(float(grad_out[0].sum()), 4)))
    else:  # the old form (torch warns that it is deprecated: see _quiet)
        lin.register_backward_hook(lambda m, grad_in, grad_out: seen.append(round(float(grad_out[0].sum()), 4)))
    return lin, seen


def _instance_loss(lin: nn.Linear):
    return lambda v: (lin(v) ** 2).sum()  # each instance's output gradient differs


@pytest.mark.parametrize("register", ["full", "pre", "old"])
def test_a_hook_is_called_once_per_instance_with_its_gradient_on_every_placement(four_devices, register):
    x = torch.randn(8, 5, 3, generator=torch.Generator().manual_seed(0), requires_grad=True)
    results = {}
    for placement in _placements():
        lin, seen = _hooked(register)
        x.grad = None
        _mapped(_instance_loss(lin), placement)(x).sum().backward()
        results[str(placement)] = (sorted(seen), lin.weight.grad.clone(), x.grad.clone())
    oracle_seen, *oracle_grads = results[str(tp.devices()[:1])]
    assert len(oracle_seen) == 8  # once per instance, where vmap called it never
    for where, (seen, *grads) in results.items():
        assert seen == oracle_seen, where
        torch.testing.assert_close(grads, oracle_grads, msg=where)


def test_a_hook_added_after_the_first_call_is_called_too(four_devices):
    x = torch.randn(8, 5, 3, generator=torch.Generator().manual_seed(1), requires_grad=True)
    for placement in _placements():
        lin = nn.Linear(3, 2)
        f = _mapped(_instance_loss(lin), placement)
        f(x).sum().backward()  # vectorized where it can be: no hook yet
        seen: list[int] = []
        handle = lin.register_full_backward_hook(lambda *args: seen.append(1))
        f(x).sum().backward()
        assert len(seen) == 8, placement
        handle.remove()


def test_a_global_backward_hook_added_after_the_first_call_is_called_too(four_devices):
    x = torch.randn(8, 5, 3, generator=torch.Generator().manual_seed(2), requires_grad=True)
    for placement in _placements():
        lin = nn.Linear(3, 2)
        f = _mapped(_instance_loss(lin), placement)
        f(x).sum().backward()
        seen: list[int] = []
        handle = torch.nn.modules.module.register_module_full_backward_hook(lambda *args: seen.append(1))
        try:
            f(x).sum().backward()
        finally:
            handle.remove()
        assert len(seen) == 8, placement


def test_a_hooked_module_called_without_grad_stays_vectorized():
    lin, _ = _hooked("full")
    with warnings.catch_warnings():
        warnings.simplefilter("error", tp.VectorizationFallbackWarning)
        with torch.no_grad():
            out = tp.pmap(lin, devices=tp.devices()[:1])(torch.randn(4, 3))
    assert out.shape == (4, 2)


def test_the_watch_is_gone_after_a_call_and_plain_module_calls_run_their_hooks_once():
    lin, seen = _hooked("full")
    other, other_seen = _hooked("full")
    tp.pmap(_instance_loss(lin), devices=tp.devices()[:1])(torch.randn(4, 5, 3, requires_grad=True)).sum().backward()
    assert len(seen) == 4
    assert not backward_hooks._handle  # the global pre-hook was removed
    other(torch.randn(5, 3, requires_grad=True)).sum().backward()  # plain PyTorch, outside any map
    assert len(other_seen) == 1


def test_the_fallback_warning_names_the_module_and_the_way_to_stay_vectorized():
    lin, _ = _hooked("full")
    with pytest.warns(tp.VectorizationFallbackWarning, match="Linear module with a backward hook.*torch.no_grad"):
        tp.pmap(_instance_loss(lin), devices=tp.devices()[:1])(torch.randn(4, 5, 3))
