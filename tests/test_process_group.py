"""torchpmap._state.process_group: waiting on a collective, in one process with a fake work."""
from __future__ import annotations

import datetime

import pytest
import torch.distributed as dist

from torchpmap._placement.devices import Device
from torchpmap._state import process_group as pg

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


class _Work:
    """A collective that finishes (or fails) exactly as the first slice of waiting runs out:
    ``wait`` raises the slice's "timed out" although the work is complete by then."""

    def __init__(self, error: str | None = None):
        self.error, self.done, self.waits = error, False, 0

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        self.waits += 1
        if not self.done:
            self.done = True
            raise RuntimeError("Operation timed out!")  # what gloo says when the slice runs out
        if self.error:
            raise RuntimeError(self.error)
        return True

    def is_completed(self) -> bool:
        return self.done


@pytest.fixture
def state(monkeypatch):
    st = pg.ProcessState(
        rank=0, world_size=2, local_rank=0, backend="gloo", timeout=5.0, store=dist.HashStore(),
        store_address="test", local_device=Device("cpu", 0), owns_group=False, exact_devices=False,
    )
    monkeypatch.setattr(pg, "state", lambda: st)
    return st


def test_a_collective_that_completes_as_the_slice_runs_out_is_no_failure(state):
    work = _Work()
    pg.wait(work, "psum over axis 'i'")  # before the fix: "failed with every process alive"
    assert work.waits == 2 and state.poisoned is None


def test_a_collective_that_failed_still_raises(state):
    with pytest.raises(RuntimeError, match="psum over axis 'i'"):
        pg.wait(_Work(error="connection reset by the peer"), "psum over axis 'i'")
    assert state.poisoned  # later distributed pmaps are refused
