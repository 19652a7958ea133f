"""A module backward hook inside a mapped function is called once per instance on every
placement (torchpmap._engines.instance_autograd): vmap would never call it, so a vectorized
run that meets one runs its instances one at a time, as several devices do."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import torchpmap as tp
from torchpmap._engines import instance_autograd

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
    assert not instance_autograd._handle  # the global pre-hook was removed
    other(torch.randn(5, 3, requires_grad=True)).sum().backward()  # plain PyTorch, outside any map
    assert len(other_seen) == 1


def test_the_fallback_warning_names_the_module_and_the_way_to_stay_vectorized():
    lin, _ = _hooked("full")
    with pytest.warns(tp.VectorizationFallbackWarning, match="Linear module with a backward hook.*torch.no_grad"):
        tp.pmap(_instance_loss(lin), devices=tp.devices()[:1])(torch.randn(4, 5, 3))


# ------------------------------------------------------------------ autograd metadata reads

METADATA_BRANCHES = {
    "requires_grad": lambda v: v * 2 if v.requires_grad else v * 3,
    "is_leaf": lambda v: v * 2 if not v.is_leaf else v * 3,
    "grad_fn": lambda v: v * 2 if (v * 1).grad_fn is not None else v * 3,  # one at a time: no node to give
    "of_an_intermediate": lambda v: (lambda h: h * 2 if h.requires_grad else h * 3)(torch.tanh(v)),
}


@pytest.mark.parametrize("case", list(METADATA_BRANCHES))
def test_a_branch_on_autograd_metadata_goes_the_same_way_on_every_placement_and_every_call(four_devices, case):
    """Under vmap a mapped value's wrapper reported requires_grad=False, is_leaf=True and
    grad_fn=None, where a device's instance holds a slice that requires grad: one device
    took the other branch (gradient 3 instead of 2). Now every placement takes the branch
    of plain PyTorch on a slice, on the first call and on later ones."""
    fun = METADATA_BRANCHES[case]
    x = torch.randn(8, 3, generator=torch.Generator().manual_seed(3), requires_grad=True)
    want_x = x.detach().clone().requires_grad_()
    want = torch.stack([fun(row) for row in want_x])  # each instance's slice, in plain PyTorch
    want.sum().backward()
    for placement in _placements():
        f = _mapped(fun, placement)
        for call in range(2):
            x.grad = None
            with warnings.catch_warnings():
                if case != "grad_fn":  # answered as an instance would: still vectorized
                    warnings.simplefilter("error", tp.VectorizationFallbackWarning)
                out = f(x)
            out.sum().backward()
            torch.testing.assert_close(out, want, msg=f"{placement}, call {call}")
            torch.testing.assert_close(x.grad, want_x.grad, msg=f"{placement}, call {call}")


def test_metadata_of_values_that_need_no_grad_and_under_a_grad_transform_is_left_as_it_is(four_devices):
    """A value that does not require grad reads the same wrapped or not; inside
    torch.func.grad the value is that transform's wrapper, which requires grad everywhere."""
    x = torch.randn(8, 3, generator=torch.Generator().manual_seed(4))
    branch = METADATA_BRANCHES["requires_grad"]
    inner = lambda v: torch.func.grad(lambda u: branch(u).sum())(v)  # noqa: E731
    for placement in _placements():
        torch.testing.assert_close(_mapped(branch, placement)(x), x * 3, msg=str(placement))
        torch.testing.assert_close(_mapped(inner, placement)(x), torch.full_like(x, 2.0), msg=str(placement))


def test_only_a_function_that_read_metadata_keeps_the_mode():
    plain = tp.pmap(lambda v: v * 2, devices=tp.devices()[:1])
    reading = tp.pmap(METADATA_BRANCHES["requires_grad"], devices=tp.devices()[:1])
    x = torch.randn(4, 3, requires_grad=True)
    plain(x), reading(x)
    assert not plain._vmap_fallback.autograd.reads_metadata
    assert reading._vmap_fallback.autograd.reads_metadata
