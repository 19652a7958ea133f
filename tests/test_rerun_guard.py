"""What a failed vectorized attempt wrote is undone before the instances run again
(torchpmap._engines.rerun_guard), so that every placement writes once, as a loop does."""
from __future__ import annotations

import warnings

import pytest
import torch

import torchpmap as tp


def _loop(f, *args):
    outs = [f(*(a[i] for a in args)) for i in range(args[0].shape[0])]
    return torch.stack(outs)


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tp.VectorizationFallbackWarning)
        warnings.simplefilter("ignore", tp.JitFallbackWarning)  # a branch on a value is not compiled
        yield


def test_a_write_before_the_fallback_is_made_once(placement):
    """``x.add_(1)`` then ``.item()`` of values that differ: vmap fails after the write,
    and the instances run again one at a time. On one device the caller's tensor got +2."""

    def f(x):
        x.add_(1)
        return x * x.sum().item()

    x, want_x = torch.arange(4.0), torch.arange(4.0)
    want = _loop(f, want_x)
    got = tp.pmap(f)(x)
    torch.testing.assert_close(torch.as_tensor(got).cpu(), want)
    torch.testing.assert_close(x, want_x)


def test_a_write_before_an_error_is_made_once(placement):
    """The re-run that names the failing instance runs the function again too."""

    def f(x):
        x.add_(1)
        if x.sum() > 2:
            raise ValueError("too big")
        return x

    x = torch.arange(4.0)
    with pytest.raises(ValueError, match="too big"):
        tp.pmap(f)(x)
    torch.testing.assert_close(x, torch.arange(4.0) + 1)


def test_a_write_that_cannot_be_undone_stops_the_call():
    """After a vectorized call that wrote nothing, no copy is kept: a later call that
    writes, then fails, raises instead of writing twice, and says what to do."""
    writes = {"now": False}

    def f(x):
        if writes["now"]:
            x.add_(1)
        return x * x.sum().item()

    g = tp.pmap(f, devices=tp.devices()[:1])
    g(torch.ones(4))  # every instance holds the same value: .item() reads it once, vectorized
    writes["now"] = True
    x = torch.arange(4.0)
    with pytest.raises(RuntimeError, match=r"mapped argument 0 \(shape \(4,\)\).*would write it twice"):
        g(x)
    torch.testing.assert_close(x, torch.arange(4.0) + 1)  # written once, by the vectorized run


def test_a_function_that_wrote_in_its_vectorized_run_keeps_its_copies(four_devices):
    """The code's first vectorized run wrote into its argument: later calls keep copies,
    so that one that fails after its write is undone and runs one at a time. On 2 devices
    one slice ran vectorized (both its values positive), and the next call of the same
    code on 1 device raised "that write cannot be undone" where a first call computes."""

    def f(v, w):
        w.add_(1)
        y = v * 2
        if y.sum() > 0:  # differs between the instances of device 0's slice
            y = y + 100
        return y + w

    v = torch.tensor([[1.0, 2.0], [-3.0, -4.0], [5.0, 6.0], [-7.0, 8.0]])
    want = _loop(f, v, torch.zeros(4, 2))
    for placed in (four_devices[:2], four_devices[:1], four_devices[:1]):
        w = torch.zeros(4, 2)
        got = tp.pmap(f, devices=placed)(v, w)
        torch.testing.assert_close(torch.as_tensor(got).cpu(), want)
        torch.testing.assert_close(w, torch.ones(4, 2))
    g = tp.pmap(lambda x: f(x, x), devices=four_devices[:1])
    g(torch.ones(4, 2))  # vectorized, writing
    x = v.clone()
    torch.testing.assert_close(torch.as_tensor(g(x)).cpu(), _loop(lambda a: f(a, a), v.clone()))
    torch.testing.assert_close(x, v + 1)


def test_a_direct_run_is_not_a_vectorized_one(four_devices, monkeypatch):
    """Devices that each run one instance run it without vmap. Such a call used to count
    as the code having run vectorized, so that a later call of the same function on one
    device kept no copy: its failed vectorized attempt (a write, then ``.item()``) could
    not be undone, and it raised where a first call on one device computes."""
    monkeypatch.setattr(tp.config, "bitwise_placement", False)

    def f(a):
        a.add_(1)
        return a * 2 if a.item() > 2 else a

    want = _loop(f, torch.arange(4.0))
    for placed in (four_devices, four_devices[:1]):  # directly (no vmap), then vectorized on one device
        x = torch.arange(4.0)
        got = tp.pmap(f, devices=placed)(x)
        torch.testing.assert_close(torch.as_tensor(got).cpu(), want)
        torch.testing.assert_close(x, torch.arange(4.0) + 1)


@pytest.mark.parametrize("jit", [False, True])
def test_a_same_draw_before_the_fallback_is_plain_pytorchs_draw(placement, jit):
    """``randomness="same"``: every instance draws what plain PyTorch draws. A draw before a
    branch on a value that differs between instances: the vectorized attempt drew from the
    caller's generator, then the instances ran again one at a time and drew the next
    number (0.768 on one device where 4 devices, debug mode and plain PyTorch gave 0.496,
    and every later draw of the caller was shifted). The re-run now starts where the
    attempt started."""

    def f(v):
        a = torch.rand(())
        return v + a if v.sum() > 0 else v - a

    v = torch.tensor([1.0, -3.0, 5.0, -7.0])
    torch.manual_seed(0)
    want = [torch.rand(()) for _ in range(3)]
    g = tp.pmap(f, randomness="same", jit=jit)
    torch.manual_seed(0)
    for k in range(2):
        drawn = (torch.as_tensor(g(v)).cpu() - v).abs()
        torch.testing.assert_close(drawn, want[k].expand(4))
    torch.testing.assert_close(torch.rand(()), want[2])  # the caller's generator where plain PyTorch leaves it
    torch.manual_seed(0)
    with tp.disable_vectorization():
        torch.testing.assert_close((torch.as_tensor(g(v)).cpu() - v).abs(), want[0].expand(4))
