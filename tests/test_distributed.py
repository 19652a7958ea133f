"""Multi-process pmap on torch.distributed (gloo, loopback): results against one process, faults.

Each test launches real processes (tests/_distributed_programs.py) with the environment
torchrun would give them, and compares what every process computed with the same
program run on the whole global data by plain ``torchpmap.pmap`` in this process.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.utils._pytree as pytree

import torchpmap as tp
from torchpmap._launch import free_port, launch

HERE = Path(__file__).parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
import _distributed_programs as progs  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")

# With one instance per process, forward results of collectives and everything
# differentiated *inside* the pmap run the very same math on the same gathered values as
# one process: bitwise equal. A .backward() through the pmap sums the cotangents of the
# processes in another order. With several instances per process, a reduction (psum,
# pmean) sums each process' instances first and then the processes' sums: equal to one
# process up to rounding, and bitwise the same in every process.
NOT_BITWISE = {"backward_outside", "grad_around"}


def _run(scenario: str, nproc: int, tmp_path: Path, timeout: float = 30.0, launch_timeout: float = 120.0):
    out = tmp_path / scenario
    out.mkdir()
    finished = launch(
        [str(HERE / "_distributed_programs.py"), scenario, str(out)],
        nproc,
        timeout=launch_timeout,
        env={"TEST_TIMEOUT": str(timeout)},
    )
    results = {}
    for f in finished:
        path = out / f"rank{f.rank}.pt"
        results[f.rank] = torch.load(path, weights_only=False) if path.exists() else None
    return finished, results


def _logs(finished) -> str:
    return "\n".join(f"--- rank {f.rank} (rc={f.returncode}, {f.seconds:.1f} s)\n{f.output[-3000:]}" for f in finished)


def _concat(per_rank: list, key: str):
    """The ranks' local outputs of one program, put back together along the mapped axis."""
    leaves = [pytree.tree_flatten(r[key]) for r in per_rank]
    spec = leaves[0][1]
    return pytree.tree_unflatten([torch.cat(parts) for parts in zip(*(l for l, _ in leaves))], spec)


def _assert_same(name: str, got, want, bitwise: bool) -> None:
    got_leaves, got_spec = pytree.tree_flatten(got)
    want_leaves, want_spec = pytree.tree_flatten(want)
    assert got_spec == want_spec, name
    for g, w in zip(got_leaves, want_leaves):
        assert g.dtype == w.dtype and g.shape == w.shape, (name, g.dtype, w.dtype, g.shape, w.shape)
        if bitwise:
            assert torch.equal(g, w), f"{name}: not bitwise equal\n{g}\n{w}"
        else:
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=name)


@contextlib.contextmanager
def _on_one_device():
    """Runs this process' reference pmaps on one device, also under TORCHPMAP_NUM_CPU_DEVICES=4
    (a torch.func transform around a pmap needs it; the numbers are the same either way)."""
    from torchpmap import _devices

    previous = _devices.current_default()
    _devices.set_current_default((tp.local_devices()[0],))
    try:
        yield
    finally:
        _devices.set_current_default(previous)


@pytest.fixture(scope="module")
def reference():
    with _on_one_device():
        return progs.reference()


@pytest.mark.parametrize("nproc", [2, 4])  # 4 processes on 2 cores: 13-20 s, mostly importing torch
def test_collectives_and_training_match_one_process(nproc, tmp_path, reference):
    finished, results = _run("collectives", nproc, tmp_path)
    logs = _logs(finished)
    assert all(f.returncode == 0 for f in finished), logs
    per_rank = [results[r] for r in range(nproc)]
    for r, res in enumerate(per_rank):
        assert res is not None and "crashed" not in res, (res or {}).get("crashed", logs)
        assert res["process_index"] == r and res["process_count"] == nproc and res["is_initialized"]
        assert res["devices"] == [("cpu", 0, k) for k in range(nproc)]
        assert res["local_devices"] == [("cpu", 0, r)]
        # unequal local sizes: the same error everywhere, naming every rank's size
        for how, error in res["size_errors"].items():
            assert error and "rank 0: 1" in error and f"rank {nproc - 1}: {nproc}" in error, (how, error)
        assert torch.equal(res["after_size_error"], torch.full((1,), float(nproc)))
        # a pmean of 6 tensors: one all-gather forward (carrying the size check too), one
        # all-to-all backward (not 6 of each); each process sends its own 6 sums of 3
        # float32 and its local size, however many instances it holds
        assert res["transfers"] == {"all_gather": 1, "all_to_all": 1, "all_gather_bytes": 6 * 3 * 4 + 8}, res["transfers"]
    one_each = nproc == progs.G  # one instance per process
    programs = list(progs.collective_programs(progs.global_data())) + ["backward_outside", "grad_around", "pytree_backward"]
    for name in programs:
        _assert_same(name, _concat(per_rank, name), reference[name], bitwise=one_each and name not in NOT_BITWISE)
    for name in ("replicated", "train_by_hand", "train_with_helper"):
        for res in per_rank:  # the same (replicated) value in every process: bitwise, and that of one process
            _assert_same(name, res[name], per_rank[0][name], bitwise=True)
            _assert_same(name, res[name], reference[name], bitwise=one_each)
    _check_compiled(per_rank, reference)
    if nproc == 4:
        _check_mesh([res["mesh"] for res in per_rank])


def _check_compiled(per_rank: list, reference: dict) -> None:
    """pmap(jit=True) across processes: every program compiled (no fallback, see
    progs.compiled_programs) and matches the eager one-process results; replicated
    results are bitwise the same in every process."""
    for name in sorted(progs.COMPILED):
        if name in ("train_by_hand", "train_with_helper"):
            for res in per_rank:
                _assert_same(f"jit {name}", res["compiled"][name], per_rank[0]["compiled"][name], bitwise=True)
                _assert_same(f"jit {name}", res["compiled"][name], reference[name], bitwise=False)
        else:
            got = _concat([res["compiled"] for res in per_rank], name)
            _assert_same(f"jit {name}", got, reference[name], bitwise=False)


def _check_mesh(per_rank: list) -> None:
    with _on_one_device():
        want = progs.mesh_reference()
    a, b = progs.MESH_LOCAL
    x = progs.mesh_global()
    for r, res in enumerate(per_rank):
        i, j = res["coords"]
        assert (i, j) == (r // 2, r % 2), res["repr"]  # row-major layout
        block = lambda t: t[i * a : (i + 1) * a, j * b : (j + 1) * b]  # noqa: E731
        # two instances per process along "data": its reductions sum them first (see NOT_BITWISE)
        _assert_same(f"mesh rank {r}", res["result"], pytree.tree_map(block, want), bitwise=False)
        _assert_same(f"mesh rank {r}, pmap(mesh=)", res["explicit"], res["result"], bitwise=True)
        # d/dx of sum over all instances of psum(x^2, model) + sum_data(x): 2 * x * model size + data size
        expected = 2 * block(x) * progs.MESH_SHAPE[1] + progs.MESH_SHAPE[0] * a
        torch.testing.assert_close(res["block_grad"], expected)


@pytest.mark.parametrize("scenario", ["raise", "raise_jit"])
def test_raise_in_one_rank_names_it_in_the_others(scenario, tmp_path):
    t = time.monotonic()
    finished, results = _run(scenario, 2, tmp_path, timeout=30)
    logs = _logs(finished)
    r0, r1 = results[0], results[1]
    assert r1["error"] == "ValueError" and "boom on purpose" in r1["message"], logs
    assert r0["error"] == "RankFailed", logs
    assert "rank 1" in r0["message"] and "boom on purpose" in r0["message"], r0["message"]
    assert r0["ranks"] == [1]
    assert r0["seconds"] < 15, r0  # well within the 30 s timeout (typically well under a second)
    assert "out of step" in r0["after"] and "out of step" in r1["after"]
    assert time.monotonic() - t < 60


@pytest.mark.parametrize("scenario", ["die", "die_jit"])
def test_dead_rank_is_named_and_nobody_hangs(scenario, tmp_path):
    finished, results = _run(scenario, 2, tmp_path, timeout=30)
    logs = _logs(finished)
    assert finished[1].returncode == 17, logs
    r0 = results[0]
    assert r0 is not None and r0["error"] == "RankFailed", logs
    assert "rank 1" in r0["message"] and "died" in r0["message"], r0["message"]
    assert r0["ranks"] == [1] and r0["seconds"] < 15, r0  # typically 2 s (heartbeats are checked)
    assert finished[0].returncode == 0, logs


def test_absent_rank_times_out_with_where_everyone_is(tmp_path):
    finished, results = _run("absent", 2, tmp_path, timeout=3)
    logs = _logs(finished)
    r0 = results[0]
    assert r0 is not None and r0["error"] == "TimeoutError", logs
    assert 2.5 < r0["seconds"] < 12, r0  # the 3 s timeout, then about 1.5 s of heartbeat checks
    assert "rank 1 is in pmap call #0, not in a collective" in r0["message"], r0["message"]


def test_single_process_initialize_is_a_quiet_noop(monkeypatch):
    import torchpmap.distributed as tpd

    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    tpd.initialize()
    monkeypatch.setenv("WORLD_SIZE", "1")
    tpd.initialize()
    assert not tpd.is_initialized() and tp.process_count() == 1 and tp.process_index() == 0
    assert tp.devices() == tp.local_devices()
    tpd.shutdown()
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="RANK, MASTER_ADDR, MASTER_PORT are not set"):
        tpd.initialize()
    with pytest.raises(RuntimeError, match="no multi-process run is active"):
        tpd.mesh((1,), ("data",))


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun is not on PATH")
def test_example_under_torchrun(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
        f"--master-port={free_port()}", str(ROOT / "examples" / "multiprocess_data_parallel.py"), "--steps", "30",
    ]
    done = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "matches the single-process step: True" in done.stdout, done.stdout[-3000:]
