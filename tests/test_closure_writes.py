"""A failed vectorized attempt's writes into tensors that are not mapped arguments are
undone before the instances run again (torchpmap._engines.closure_writes): every
placement writes as a loop over the instances does."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import torchpmap as tp
from torchpmap._engines import closure_writes


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tp.VectorizationFallbackWarning)
        yield


def _placements():
    """One device, 2 and 4 devices (8 instances: several per device), and debug mode."""
    return [tp.devices()[:1], tp.devices()[:2], tp.devices()[:4], "debug"]


def _called(f, placement, *args, **kw):
    if placement == "debug":
        with tp.disable_vectorization():
            return tp.pmap(f, **kw)(*args)
    return tp.pmap(f, devices=placement, **kw)(*args)


@pytest.mark.parametrize("jit", [False, True])
def test_a_closed_over_batch_norm_counts_each_instance_once(four_devices, jit):
    """BatchNorm counts its batches before ``batch_norm`` refuses its running statistics
    under vmap: the attempt's count stayed (9 batches on one device for 8 instances, 10
    on two devices), where a loop counts 8. Under ``jit=True`` the trace counted too,
    and the eager run after it was not journaled."""
    x = torch.randn(8, 5, 3, generator=torch.Generator().manual_seed(0)) * 2 + 1
    bn = nn.BatchNorm1d(3).train()
    for i in range(8):
        bn(x[i])
    want_mean, want_count = bn.running_mean.clone(), int(bn.num_batches_tracked)
    assert want_count == 8
    for placement in _placements():
        bn.reset_running_stats()
        out = _called(lambda v: bn(v).sum(), placement, x, jit=jit)
        assert int(bn.num_batches_tracked) == want_count, placement
        torch.testing.assert_close(bn.running_mean, want_mean, msg=str(placement))
        assert torch.as_tensor(out).shape == (8,)


def test_a_closed_over_counter_written_before_the_fallback(four_devices):
    """A closed-over tensor written in place, then ``.item()`` of values that differ: the
    attempt's write is undone, and the instances write once each, as a loop does."""
    counter = torch.zeros(())

    def f(x):
        counter.add_(1)
        return x * x.sum().item()

    x = torch.arange(8.0).reshape(8, 1)
    for placement in _placements():
        counter.zero_()
        out = _called(f, placement, x)
        assert float(counter) == 8.0, placement
        torch.testing.assert_close(torch.as_tensor(out), x * x)


@pytest.mark.parametrize("placement", [1, 2, 4])
def test_a_compiled_program_writes_a_closed_over_tensor_as_eager_does(four_devices, placement):
    """A ``jit=True`` trace runs the function's Python on the real closed-over tensors:
    its write stayed, and the compiled program then wrote again (2 on the first call on
    one device, where eager counts 1; 8 on four devices, where eager counts 4)."""
    counts = {}
    for jit in (False, True):
        counter = torch.zeros((), dtype=torch.int64)
        f = tp.pmap(lambda v: (counter.add_(1), v * 2)[1], jit=jit, devices=four_devices[:placement])
        seen = []
        for _ in range(3):
            f(torch.ones(4, 2))
            seen.append(int(counter))
        counts[jit] = seen
    assert counts[True] == counts[False]


def test_writes_are_undone_last_first_and_the_attempts_own_are_not_kept():
    """Two writes into one closed-over tensor come back to its first value; a tensor the
    attempt made itself, and a mapped argument (the rerun guard's), are not copied."""
    state = torch.zeros(3)
    x = torch.ones(4, 3)
    journal = closure_writes.start([x])
    assert journal is not None
    with closure_writes.kept(journal):
        assert closure_writes.start([x]) is None  # a nested attempt's writes are the outer journal's
        state.add_(1)
        state[1:].mul_(5)
        made = torch.zeros(3)
        made.add_(1)
        x.add_(1)
    assert state.tolist() == [1.0, 5.0, 5.0]
    assert len(journal._kept) == 2  # state, its view; not `made`, not x
    journal.undo()
    assert state.tolist() == [0.0, 0.0, 0.0]
    assert x.tolist() == [[2.0] * 3] * 4  # the rerun guard puts arguments back


def test_views_from_list_results_are_not_the_attempts_own():
    """``split`` returns views of its input in a list: a write into one of them writes
    into the closed-over tensor, and is undone."""
    state = torch.zeros(4)
    journal = closure_writes.start([])
    with closure_writes.kept(journal):
        _, second = state.split(2)
        second.add_(1)
    assert state.tolist() == [0.0, 0.0, 1.0, 1.0]
    journal.undo()
    assert state.tolist() == [0.0] * 4


def test_a_function_that_ran_vectorized_runs_without_a_journal(monkeypatch):
    """Only the calls before a first vectorized run pay for the journal."""
    started = []
    real = closure_writes.start
    monkeypatch.setattr(closure_writes, "start", lambda arguments: started.append(1) or real(arguments))
    f = tp.pmap(lambda v: v * 2, devices=tp.devices()[:1])  # vectorized (one instance per device runs directly)
    x = torch.ones(4, 2)
    f(x)
    f(x)
    assert len(started) == 1
