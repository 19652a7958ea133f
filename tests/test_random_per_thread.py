"""torchpmap._engines.random_per_thread: a call's seed is taken from the caller's generator
only where a device thread draws, so a call that draws nothing leaves the caller's stream
as one device leaves it; a call that draws stays reproducible under torch.manual_seed."""
from __future__ import annotations

import pytest
import torch

import torchpmap as tp


def _after(f, devices, jit=False, debug=False, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """The call's result and the caller's next draw, from seed 0."""
    torch.manual_seed(0)
    mapped = tp.pmap(f, axis_name="i", devices=devices, jit=jit, **kwargs)
    if debug:
        with tp.disable_vectorization():
            out = mapped(torch.ones(4, 3))
    else:
        out = mapped(torch.ones(4, 3))
    return torch.as_tensor(out), torch.rand(3)


@pytest.mark.parametrize("jit", [False, True])
def test_a_call_that_draws_nothing_leaves_the_callers_stream_as_one_device_does(four_devices, jit):
    """Every call on several devices drew its seed: after it, the caller's torch.rand gave
    0.0885 where one device gave 0.4963 (the same for debug mode, and with a collective)."""
    for f in (lambda v: v.sin(), lambda v: v * tp.psum(v, "i")):
        want = _after(f, four_devices[:1], jit=jit)
        for devices in (four_devices[:2], four_devices):
            for debug in ((False, True) if not jit else (False,)):
                got = _after(f, devices, jit=jit, debug=debug)
                torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert torch.equal(want[1], (torch.manual_seed(0), torch.rand(3))[1])  # as if no call was made


@pytest.mark.parametrize("jit", [False, True])
def test_a_call_that_draws_is_reproducible_and_the_next_call_draws_anew(four_devices, jit):
    f = tp.pmap(lambda v: torch.nn.functional.dropout(v, 0.5), axis_name="i", devices=four_devices, jit=jit)
    runs = []
    for _ in range(2):
        torch.manual_seed(0)
        runs.append((f(torch.ones(8, 16)), f(torch.ones(8, 16)), torch.rand(3)))
    for a, b in zip(*runs):
        assert torch.equal(torch.as_tensor(a), torch.as_tensor(b))
    first, second, after = runs[0]
    assert not torch.equal(torch.as_tensor(first), torch.as_tensor(second))  # each call its own masks
    assert not torch.equal(after, (torch.manual_seed(0), torch.rand(3))[1])  # the caller's stream moved on
    rows = torch.as_tensor(first)
    assert not torch.equal(rows[0], rows[4])  # each instance its own mask, on every device


def test_the_devices_streams_differ(four_devices):
    torch.manual_seed(0)
    out = torch.as_tensor(tp.pmap(lambda v: torch.rand_like(v), devices=four_devices)(torch.ones(4, 64)))
    assert len({tuple(row.tolist()) for row in out}) == 4
