"""The GPU check's own machinery (``make gpu-check``), on CPU: CI runs the check itself
with ``--quick``; what only a deadline shows is tested here."""
from __future__ import annotations

import time

import pytest

from torchpmap.bench.gpu_check import cli
from torchpmap.bench.gpu_check.outcome import TIMED_OUT
from torchpmap.bench.gpu_check.parts import Context, Part, _pytest


@pytest.mark.same_on_every_placement  # runs no map
def test_a_pytest_part_cut_at_its_deadline_names_the_failures_so_far(tmp_path, monkeypatch):
    """A part still running near its deadline is interrupted first: pytest then writes
    its JUnit file, and the report names each test that had failed (the first GPU run of
    2026-11-30 was killed outright, and its four failures were seen only as ``F``s)."""
    tests = tmp_path / "test_slow.py"
    tests.write_text("import time\n\ndef test_fails():\n    assert 1 == 2\n\n"
                     "def test_hangs():\n    time.sleep(60)\n")
    monkeypatch.setattr(cli, "INTERRUPT_S", 20.0)
    part = Part("slow", "a part that hangs", _pytest((str(tests),), "slow.xml", ()), timeout=25.0, junit="slow.xml")
    running = cli.start_part(part, Context(out=str(tmp_path), quick=False, cuda=False), left=100.0)
    assert isinstance(running, cli.Running)
    started = time.monotonic()
    while not running.poll():
        time.sleep(0.1)
    result = running.result()
    assert time.monotonic() - started < 25.0  # pytest ended when interrupted, before the kill
    assert result.outcome == TIMED_OUT
    failed = [c.name for c in result.findings.checks if not c.ok]
    assert any(name.endswith("::test_fails") for name in failed), failed
    assert any("interrupted 20 s before the deadline" in c.detail for c in result.findings.checks if not c.ok)
