"""torchpmap._collectives.gradient_mean: the pmean of a gradient, started bucket by bucket in the backward.

Across processes the buckets are tested in tests/test_distributed.py (they start during
the backward; the trained model is that of pmean). Here: the buckets, and that on one
device and on device threads (where nothing starts early) the result is pmean's, bit
for bit.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.func import grad

import torchpmap as tp
from torchpmap._collectives.gradient_mean import FIRST_BUCKET_BYTES, GradientMean, buckets_of


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 3 << 20), min_size=1, max_size=12), st.integers(1, 4 << 20))
def test_buckets_hold_every_name_once_last_first_and_close_at_their_limit(sizes, limit):
    named = [(f"p{i}", s) for i, s in enumerate(sizes)]
    buckets = buckets_of(named, limit)
    assert [n for b in buckets for n in b] == [n for n, _ in reversed(named)]
    size = dict(named)
    for i, bucket in enumerate(buckets):
        cap = min(FIRST_BUCKET_BYTES, limit) if i == 0 else limit
        held = [sum(size[n] for n in bucket[: k + 1]) for k in range(len(bucket))]
        assert all(h < cap for h in held[:-1]), (bucket, held, cap)  # closes at the first name that reaches it
        if i < len(buckets) - 1:
            assert held[-1] >= cap


def _step(w, b, x):
    mean = GradientMean("i")

    def loss(params):
        p = mean.watch(params)
        return torch.tanh(x @ p["w"] + p["b"]).square().sum()

    grads = grad(loss)({"w": w, "b": b})
    return mean(grads), mean.buckets


@pytest.mark.parametrize("n", [1, 3, 8])
def test_on_one_device_and_device_threads_it_is_pmean_bit_for_bit(n):
    torch.manual_seed(0)
    w, b, x = torch.randn(5, 3), torch.randn(3), torch.randn(n, 4, 5)

    def by_pmean(w, b, x):
        g = grad(lambda p: torch.tanh(x @ p["w"] + p["b"]).square().sum())({"w": w, "b": b})
        return tp.pmean(g, "i")

    got, buckets = tp.pmap(lambda w, b, x: _step(w, b, x), axis_name="i", in_axes=(None, None, 0))(w, b, x)
    want = tp.pmap(by_pmean, axis_name="i", in_axes=(None, None, 0))(w, b, x)
    assert buckets == []  # nothing started early: one device or device threads
    for k in ("w", "b"):
        assert torch.equal(got[k], want[k]), k


def test_it_needs_a_bound_axis():
    with pytest.raises(NameError, match="unbound axis name: 'i'"):
        GradientMean("i")
