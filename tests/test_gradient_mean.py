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


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 3 << 20), st.integers(1, 4096)), min_size=1, max_size=12),
    st.integers(1, 4 << 20),
)
def test_buckets_hold_every_name_once_last_first_and_close_at_their_limit(params, limit):
    named = [(f"p{i}", -(-size // rows) * rows, rows) for i, (size, rows) in enumerate(params)]
    buckets = buckets_of(named, limit)
    pieces = [p for b in buckets for p in b]
    # every parameter once, last first; a split one as consecutive row ranges that cover it
    assert [n for i, n in enumerate(p.name for p in pieces) if i == 0 or pieces[i - 1].name != n] == [
        n for n, *_ in reversed(named)
    ]
    size = {n: s for n, s, _ in named}
    rows = {n: r for n, _, r in named}
    split = [p.name for p in pieces if p.rows is not None]
    assert len(split) in (0, 2) and len(set(split)) <= 1, buckets  # at most one parameter, in two pieces
    if split:
        first, rest = (p for p in pieces if p.rows is not None)
        assert buckets[0][-1] == first and buckets[1] == [rest], buckets  # across the first bucket's end
        assert first.rows[0] == 0 and first.rows[1] == rest.rows[0] and rest.rows[1] == rows[first.name]
        cap = min(FIRST_BUCKET_BYTES, limit)
        before = sum(size[p.name] for p in buckets[0][:-1])
        assert before + size[first.name] > 2 * cap and before < cap  # only a parameter far past the limit
        assert (first.rows[1] - 1) * size[first.name] // rows[first.name] + before < cap or first.rows[1] == 1
    for i, bucket in enumerate(buckets):
        if split and i < 2:
            continue
        cap = min(FIRST_BUCKET_BYTES, limit) if i == 0 else limit
        held = [sum(size[p.name] for p in bucket[: k + 1]) for k in range(len(bucket))]
        assert all(h < cap for h in held[:-1]), (bucket, held, cap)  # closes at the first name that reaches it
        if i < len(buckets) - 1:
            assert held[-1] >= cap
        if i == 0:
            assert held[-1] <= 2 * cap or rows[bucket[-1].name] == 1, bucket  # else it was split


def test_a_parameter_far_bigger_than_the_first_bucket_is_split_across_it():
    # the model of the simulated-cluster bench: its first 1 MiB is the last layer and 245 rows of the middle weight
    sizes = [(n, numel * 4, rows) for n, numel, rows in [
        ("0.weight", 1 << 20, 1024), ("0.bias", 1024, 1024), ("2.weight", 1 << 20, 1024), ("2.bias", 1024, 1024),
        ("4.weight", 10240, 10), ("4.bias", 10, 10)]]
    buckets = buckets_of(sizes, 25 << 20)
    assert [[(p.name, p.rows) for p in b] for b in buckets] == [
        [("4.bias", None), ("4.weight", None), ("2.bias", None), ("2.weight", (0, 245))],
        [("2.weight", (245, 1024))],
        [("0.bias", None), ("0.weight", None)],
    ]
    assert (
        sum(s // r * (p.rows[1] - p.rows[0]) if p.rows else s for p in buckets[0] for n, s, r in sizes if n == p.name)
        <= FIRST_BUCKET_BYTES + 4096
    )


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
