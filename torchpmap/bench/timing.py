"""Timing machinery: warm-up, calibration, interleaved repetitions, medians.

The method, in four steps:

1. **Warm-up.** Each callable runs ``warmup`` times before anything is recorded, so
   that JIT compilation (JAX), caches, lazy initialisation and the allocator's first
   requests do not count. The last warm-up calls estimate the cost of one call.
2. **Calibration.** Each callable gets ``calls_per_sample``: enough back-to-back calls
   that one sample lasts at least ``min_sample_s``, far above the clock's resolution
   and the cost of reading it. A sample's value is its duration divided by the number
   of calls. Each callable must wait for its own result (``torch.cuda.synchronize()``,
   ``block_until_ready()``), so a sample measures finished work, not queued work.
3. **Interleaving.** Repetition ``r`` takes one sample of every callable, round-robin,
   in an order rotated by ``r``, and reversed on every other repetition. Slow changes of
   machine state (clock frequency, other load, heat) then reach all columns alike, no
   column is always first, and no column always follows the same one: a column that
   follows one working on the same tensors finds them in cache, one that follows JAX
   does not (in a fixed cyclic order, ``torch.compile`` always followed plain torch on
   the same data and ``pmap(jit=True)`` always followed ``jax.jit(vmap)``, which moved
   row (b)'s ratio by about 3%). This is what makes a ratio between two columns of one
   run meaningful.
4. **Statistics.** Per callable: the median and the inter-quartile range (IQR) of its
   samples, robust to the occasional outlier (a page fault, a scheduler hiccup).
   Between two callables: the median of the per-repetition ratios (a paired estimate:
   both samples of a pair were taken moments apart).

The garbage collector is off while samples are taken, as in :mod:`timeit`. When the
callables are slow, fewer repetitions run: no new repetition starts after
``max_total_s`` (but at least ``min_reps`` run), so a busy machine cannot stretch a run
without bound.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence

Thunk = Callable[[], object]


@dataclasses.dataclass(frozen=True)
class Stats:
    """Median and quartiles of a list of samples.

    Example:
        >>> Stats.of([1.0, 2.0, 3.0, 4.0, 100.0]).median
        3.0
    """

    median: float
    q1: float
    q3: float
    n: int

    @classmethod
    def of(cls, samples: Sequence[float]) -> Stats:
        if len(samples) == 1:
            return cls(samples[0], samples[0], samples[0], 1)
        q1, median, q3 = statistics.quantiles(samples, n=4, method="inclusive")
        return cls(median, q1, q3, len(samples))

    @property
    def iqr(self) -> float:
        return self.q3 - self.q1


@dataclasses.dataclass(frozen=True)
class Plan:
    """How many repetitions and calls a measurement makes."""

    reps: int = 31
    warmup: int = 5
    min_sample_s: float = 0.01
    max_total_s: float = 20.0
    min_reps: int = 5
    max_calls_per_sample: int = 10_000


@dataclasses.dataclass(frozen=True)
class Measurement:
    """Per-call times (seconds) of each callable, one sample per repetition."""

    samples: dict[str, list[float]]
    calls_per_sample: dict[str, int]

    def stats(self, name: str) -> Stats:
        return Stats.of(self.samples[name])

    def ratio(self, num: str, den: str) -> Stats:
        """The paired ratio ``num / den``: its median over the repetitions."""
        return Stats.of([a / b for a, b in zip(self.samples[num], self.samples[den])])


def _time_calls(fn: Thunk, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def _warm_up(fn: Thunk, warmup: int) -> float:
    """Runs ``fn`` ``warmup`` times (at least 2); returns an estimate of one call."""
    times = [_time_calls(fn, 1) for _ in range(max(2, warmup))]
    return statistics.median(times[len(times) // 2 :])


def _calls_for(estimate_s: float, plan: Plan) -> int:
    return max(1, min(plan.max_calls_per_sample, math.ceil(plan.min_sample_s / max(estimate_s, 1e-9))))


def measure(fns: Mapping[str, Thunk], plan: Plan, calls_per_sample: int | None = None) -> Measurement:
    """Times every callable of ``fns`` interleaved, as described in the module docstring.

    With ``calls_per_sample`` given, calibration is skipped and exactly ``plan.reps``
    repetitions run: what processes that must stay in lockstep need.
    """
    names = list(fns)
    estimates = {name: _warm_up(fns[name], plan.warmup) for name in names}
    if calls_per_sample is None:
        calls, budget_s = {name: _calls_for(estimates[name], plan) for name in names}, plan.max_total_s
    else:
        calls, budget_s = dict.fromkeys(names, calls_per_sample), math.inf
    samples: dict[str, list[float]] = {name: [] for name in names}
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        _interleave(fns, calls, samples, plan, budget_s)
    finally:
        if was_enabled:
            gc.enable()
    return Measurement(samples, calls)


def _interleave(
    fns: Mapping[str, Thunk], calls: dict[str, int], samples: dict[str, list[float]], plan: Plan, budget_s: float
) -> None:
    """Round-robin repetitions, each in an order rotated by one and every other one
    reversed, until ``plan.reps`` or the time budget (checked after ``plan.min_reps``)
    runs out."""
    names, start = list(fns), time.perf_counter()
    for r in range(plan.reps):
        if r >= plan.min_reps and time.perf_counter() - start > budget_s:
            break
        first = r % len(names)
        order = names[first:] + names[:first]
        for name in order if r % 2 == 0 else order[::-1]:
            samples[name].append(_time_calls(fns[name], calls[name]))
