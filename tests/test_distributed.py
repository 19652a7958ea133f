"""Multi-process pmap on torch.distributed (gloo, loopback): results against one process, faults.

Each test launches real processes (tests/_distributed_programs.py) with the environment
torchrun would give them, and compares what every process computed with the same
program run on the whole global data by plain ``torchpmap.pmap`` in this process.
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.utils._pytree as pytree

import torchpmap as tp
from torchpmap.bench.launch import free_port, launch

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


def _run(
    scenario: str,
    nproc: int,
    tmp_path: Path,
    timeout: float = 30.0,
    launch_timeout: float = 120.0,
    env: dict | None = None,
):
    out = tmp_path / scenario
    out.mkdir()
    finished = launch(
        [str(HERE / "_distributed_programs.py"), scenario, str(out)],
        nproc,
        timeout=launch_timeout,
        env={"TEST_TIMEOUT": str(timeout), **(env or {})},
    )
    results = {}
    for f in finished:
        path = out / f"rank{f.rank}.pt"
        results[f.rank] = torch.load(path, weights_only=False) if path.exists() else None
    return finished, results


def _logs(finished) -> str:
    return "\n".join(f"--- rank {f.rank} (rc={f.returncode}, {f.seconds:.1f} s)\n{f.output[-3000:]}" for f in finished)


def _ranks_finished(scenario: str, nproc: int, tmp_path: Path, **options) -> tuple[list[dict], str]:
    """Runs ``scenario`` on ``nproc`` processes; every one must exit cleanly and write its
    results. Returns the results, rank by rank, and the processes' logs."""
    finished, results = _run(scenario, nproc, tmp_path, **options)
    logs = _logs(finished)
    assert all(f.returncode == 0 for f in finished), logs
    per_rank = [results[r] for r in range(nproc)]
    for res in per_rank:
        assert res is not None and "crashed" not in res, (res or {}).get("crashed", logs)
    return per_rank, logs


def _concat(per_rank: list, key: str):
    """The ranks' local outputs of one program, put back together along the mapped axis."""
    leaves = [pytree.tree_flatten(r[key]) for r in per_rank]
    spec = leaves[0][1]
    return pytree.tree_unflatten([torch.cat(parts) for parts in zip(*(parts for parts, _ in leaves))], spec)


def _assert_same(name: str, got, want, bitwise: bool) -> None:
    got_leaves, got_spec = pytree.tree_flatten(got)
    want_leaves, want_spec = pytree.tree_flatten(want)
    assert got_spec == want_spec, name
    for g, w in zip(got_leaves, want_leaves):
        assert g.dtype == w.dtype and g.shape == w.shape, (name, g.dtype, w.dtype, g.shape, w.shape)
        if bitwise:
            assert torch.equal(g, w), f"{name}: not bitwise equal\n{g}\n{w}"
        else:
            # reduced precision: its own tolerances (one instance run alone rounds its product once)
            tol = {} if g.dtype in (torch.bfloat16, torch.float16) else {"rtol": 1e-5, "atol": 1e-6}
            torch.testing.assert_close(g, w, **tol, msg=lambda m: f"{name}: {m}")


@contextlib.contextmanager
def _on_one_device():
    """Runs this process' reference pmaps on one device, also under TORCHPMAP_NUM_CPU_DEVICES=4
    (a torch.func transform around a pmap needs it; the numbers are the same either way)."""
    from torchpmap._placement import devices as _devices

    previous = _devices.current_default()
    _devices.set_current_default((tp.local_devices()[0],))
    try:
        yield
    finally:
        _devices.set_current_default(previous)


@pytest.fixture(scope="module")
def reference():
    # under bitwise placement, as the processes it is compared with bitwise: one device's
    # data_parallel_step otherwise takes the gradient of the mean loss outside the map,
    # equal to the per-instance gradients' mean to rounding only
    previous = tp.config.bitwise_placement
    tp.config.bitwise_placement = True
    try:
        with _on_one_device():
            return progs.reference()
    finally:
        tp.config.bitwise_placement = previous


# 4 processes on 2 cores: 13-20 s, mostly importing torch. With one instance per process
# the instance runs directly (no vmap): results agree with one process to rounding; with
# TORCHPMAP_BITWISE_PLACEMENT=1 it runs through vmap and they are bitwise. With
# TORCHPMAP_ALL_REDUCE_BYTES=1 every psum/pmean across the processes is an all-reduce
# (by default only those of 1 MiB or more; never with bitwise placement): the same
# comparisons hold, and replicated results are still bitwise the same in every process.
# TORCHPMAP_HEADERS_APART=1: every transfer's headers travel in a collective of their own
# on the host, beside the payload's, as they do for CUDA payloads (read without
# synchronising with the GPU); the same results, one more (small) all-gather per transfer.
@pytest.mark.slow
@pytest.mark.parametrize(
    "nproc, bitwise_placement, all_reduce, headers_apart",
    # the first also in `make test`'s 4-device pass, which leaves out the other slow tests:
    # 2 processes of 4 CPU devices each, the device threads' exchange inside the processes'
    [pytest.param(2, False, False, False, marks=pytest.mark.also_on_four_devices), (4, False, False, False),
     (4, True, False, False), (2, False, True, False), (4, False, True, False), (2, False, False, True),
     (2, False, True, True)],
)
def test_collectives_and_training_match_one_process(nproc, bitwise_placement, all_reduce, headers_apart, tmp_path,
                                                    reference):
    env = {"TORCHPMAP_BITWISE_PLACEMENT": "1" if bitwise_placement else "0"}
    if all_reduce:
        env["TORCHPMAP_ALL_REDUCE_BYTES"] = "1"
    if headers_apart:
        env["TORCHPMAP_HEADERS_APART"] = "1"
    finished, results = _run("collectives", nproc, tmp_path, env=env)
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
        # a pmean of 6 tensors in a repeated step: one all-gather forward, one all-to-all
        # backward (not 6 of each), each led by a 64-byte header (the agreement check, with
        # the local size); each process sends its own 6 sums of 3 float32, however many
        # instances it holds. As all-reduces: a header round, then one all-reduce of the 6
        # sums (one dtype), each way.
        want = {"all_gather": 1, "all_to_all": 1, "all_gather_bytes": 64 + 6 * 3 * 4, "all_reduce": 0}
        if headers_apart:  # the headers' own all-gather each way, beside the payload's
            want = {"all_gather": 3, "all_to_all": 1, "all_gather_bytes": 64 + 6 * 3 * 4 + 64, "all_reduce": 0}
        if all_reduce:  # the headers travel alone either way
            want = {"all_gather": 2, "all_to_all": 0, "all_gather_bytes": 2 * 64, "all_reduce": 2}
        assert res["transfers"] == want, res["transfers"]
        # psum_scatter: one all-to-all of this process' share sums (a reduce-scatter), its
        # 64-byte header in an all-gather of its own (an all-to-all cannot give every
        # process every header); no all-gather of every instance's value
        scatter = res["scatter_transfers"]
        assert (scatter["all_to_all"], scatter["all_reduce"]) == (1, 0), scatter
        assert scatter["all_gather_bytes"] == 64 * scatter["all_gather"] and scatter["all_gather"] >= 1, scatter
    one_each = nproc == progs.G and bitwise_placement  # one instance per process, through vmap
    programs = list(progs.collective_programs(progs.global_data())) + [
        "backward_outside", "grad_around", "pytree_backward", "per_instance_dropout", "under_autocast",
    ]
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


@pytest.mark.slow
@pytest.mark.parametrize("scenario, nproc", [("raise", 2), ("raise", 3), ("raise_jit", 2)])
def test_raise_in_one_rank_names_it_in_the_others(scenario, nproc, tmp_path):
    t = time.monotonic()
    finished, results = _run(scenario, nproc, tmp_path, timeout=30)
    logs = _logs(finished)
    r1 = results[1]
    assert r1["error"] == "ValueError" and "boom on purpose" in r1["message"], logs
    assert "out of step" in r1["after"]
    for r in set(range(nproc)) - {1}:
        res = results[r]
        assert res["error"] == "RankFailed", logs
        assert "rank 1" in res["message"] and "boom on purpose" in res["message"], res["message"]
        assert res["ranks"] == [1]
        assert res["seconds"] < 15, res  # well within the 30 s timeout (typically well under a second)
        assert "out of step" in res["after"]
    assert time.monotonic() - t < 60


@pytest.mark.slow
def test_a_function_vmap_cannot_run_says_why_it_cannot_fall_back_across_processes(tmp_path):
    """In one process such a function runs its instances one at a time; across processes
    (two instances each) vmap's error reached the user bare. It now says why and what to do."""
    finished, results = _run("cannot_vectorize", 2, tmp_path, timeout=30)
    for res in results.values():
        assert res is not None and res["error"] == "RuntimeError", _logs(finished)
        assert any("across processes, a process' instances run vectorized only" in n for n in res["notes"]), res


@pytest.mark.slow
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


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [2, 3])
def test_a_killed_process_is_named_by_every_survivor(nproc, tmp_path):
    finished, results = _run("sigkill", nproc, tmp_path, timeout=20)
    logs = _logs(finished)
    last = nproc - 1
    assert finished[last].returncode == -9, logs  # SIGKILL, as the OOM killer would
    for r in range(last):
        res = results[r]
        assert res is not None and res["error"] == "RankFailed", logs
        assert f"rank {last}" in res["message"] and "died" in res["message"], res["message"]
        assert res["ranks"] == [last] and res["seconds"] < 20 + 1, res  # typically 1-2 s
        assert "out of step" in res["after"], res
        assert finished[r].returncode == 0, logs


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [2, 3])
def test_a_process_sleeping_past_the_timeout_times_out_the_others_within_a_second(nproc, tmp_path):
    timeout = 4.0
    finished, results = _run("sleep", nproc, tmp_path, timeout=timeout)
    logs = _logs(finished)
    last = nproc - 1
    for r in range(last):
        res = results[r]
        assert res is not None and res["error"] == "TimeoutError", logs
        assert timeout - 0.5 < res["seconds"] < timeout + 1, res
        assert f"rank {last} is in pmap call #1, not in a collective" in res["message"], res["message"]
    late = results[last]  # it wakes up, reaches the collective and learns what happened
    assert late is not None and late["error"] in ("RankFailed", "TimeoutError"), logs
    assert all(f.returncode == 0 for f in finished), logs


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [2, 3])
def test_absent_rank_times_out_with_where_everyone_is(nproc, tmp_path):
    finished, results = _run("absent", nproc, tmp_path, timeout=3)
    logs = _logs(finished)
    for r in set(range(nproc)) - {1}:
        res = results[r]
        assert res is not None and res["error"] == "TimeoutError", logs
        assert 2.5 < res["seconds"] < 3 + 1, res  # the 3 s timeout (heartbeats were compared while waiting)
        assert "rank 1 is in pmap call #0, not in a collective" in res["message"], res["message"]


#: For each way to disagree (tests/_distributed_programs.py, _disagreements): what the
#: error must say of the two sides.
DISAGREEMENTS = {
    "dtype": ("psum over axis 'i' on float32[1, 4]", "psum over axis 'i' on int32[1, 4]"),
    "shape_same_bytes": ("on float64[1, 2]", "on float32[1, 4]"),
    "collective": ("psum over axis 'i'", "pmax over axis 'i'"),
    "perm": ("ppermute(perm=((0, 1), (1, ", "ppermute(perm=((1, 0), (2, "),
    "shape_other_bytes": ("on float32[1, 4]", "on float32[1, 8]"),
    "psum_vs_all_gather": ("psum over axis 'i'", "all_gather over axis 'i'"),
    "collective_vs_none": ("psum over axis 'i'", "reached the end of pmap call"),
    "all_gather_axis": ("all_gather over axis 'i'", "all_gather(axis=1) over axis 'i'"),
}


@pytest.mark.slow
@pytest.mark.parametrize("nproc, all_reduce, headers_apart", [(2, False, False), (3, False, False), (3, True, False),
                                                              (3, False, True)])
def test_processes_that_disagree_at_an_exchange_all_raise_naming_both_sides(nproc, all_reduce, headers_apart, tmp_path):
    """The issue's table of disagreements, eager and compiled, with the last process the odd
    one: every process raises ExchangeMismatch before any payload moves (no garbage, no
    abort), naming what each side called, and the processes stay in step. Also when every
    psum is an all-reduce (its headers then travel in a round of their own), and with the
    headers apart from the payloads (CUDA's protocol)."""
    env = {"TORCHPMAP_ALL_REDUCE_BYTES": "1"} if all_reduce else {}
    if headers_apart:
        env["TORCHPMAP_HEADERS_APART"] = "1"
    finished, results = _run("disagree", nproc, tmp_path, timeout=20, env=env)
    logs = _logs(finished)
    assert all(f.returncode == 0 for f in finished), logs
    last = nproc - 1
    x = sum(torch.arange(4.0).reshape(1, 4) + r for r in range(nproc))  # the psum of every process' x
    expected = dict(DISAGREEMENTS)
    if nproc == 2:
        expected["perm"] = ("ppermute(perm=((0, 1), (1, 0)))", "ppermute(perm=((1, 0), (0, 1)))")
    for r in range(nproc):
        res = results[r]
        assert res is not None and "crashed" not in res, (res or {}).get("crashed", logs)
        for case, (theirs, odd) in expected.items():
            for name in (case, case + "_jit"):
                err = res[name]
                assert err is not None and err["error"] == "ExchangeMismatch", (name, err)
                msg = err["message"]
                others = "processes 0, 1" if nproc == 3 else "process 0"
                assert theirs in msg.split(f"{others} ", 1)[1].split(";")[0], (name, msg)
                assert odd in msg.split(f"process {last} ", 1)[1].split(" (this is rank")[0], (name, msg)
                assert "still in step" in msg and err["ranks"] == [last], (name, msg)
                assert err["seconds"] < 21, (name, err)  # at once, in fact: well within timeout + 1 s
                assert torch.equal(res[name + "_after"], x), name  # and the next call agrees again
        back = res["backward"]
        assert back["error"] == "ExchangeMismatch" and "the gradient of all_gather" in back["message"], back
        assert "the gradient of psum" in back["message"] and torch.equal(res["backward_after"], x)
        step = res["out_of_step"]
        assert step["error"] == "ExchangeMismatch" and "out of step" in step["message"], step
        assert f"process {last} called psum over axis 'i' on float32[1, 4] (exchange 2 of pmap call" in step["message"]
        assert "out of step" in res["after_out_of_step"]["message"], res["after_out_of_step"]


@pytest.mark.slow
def test_an_uncaught_mismatch_ends_every_process_with_an_error_not_an_abort(tmp_path):
    """Payloads of different byte counts used to make gloo abort the process (SIGABRT):
    now every process exits with Python's status 1 and the error in its log."""
    finished, _ = _run("uncaught_mismatch", 2, tmp_path, timeout=20)
    logs = _logs(finished)
    assert [f.returncode for f in finished] == [1, 1], logs
    for f in finished:
        assert "ExchangeMismatch" in f.output and "float32[1, 8]" in f.output, logs
        assert f.seconds < 60, logs


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


# torchrun is `python -m torch.distributed.run`: run as a module, it needs no PATH entry (CI has none)
@pytest.mark.slow
def test_example_under_torchrun(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
        f"--master-port={free_port()}", str(ROOT / "examples" / "multiprocess_data_parallel.py"), "--steps", "30",
    ]
    done = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "matches the single-process step: True" in done.stdout, done.stdout[-3000:]


# data_parallel_step with one instance per process starts its all-reduce bucket by bucket
# inside the backward (as DDP does; torchpmap._collectives.gradient_mean). 2 processes: the sum of two
# partials is the same in any grouping, so the model is bitwise the one that the same
# step written as pmean(grad(...)) trains; 3: each bucket's all-reduce adds in its own
# order (equal to rounding), while every process still holds the same bits.
def events_sizes(events: list) -> list:
    return [int(e.split()[1]) for e in events if e.startswith("all_reduce")]


def _split_steps(events: list) -> list[list]:
    """The events of each step: its gathers, then its all-reduces and "backward done",
    up to the next step's first gather."""
    steps, current = [], []
    for e in events:
        if e == "all_gather" and "backward done" in current:
            steps.append(current)
            current = []
        current.append(e)
    return steps + [current]


@pytest.mark.slow
@pytest.mark.parametrize("nproc, headers_apart", [(2, False), (3, False), (2, True)])
def test_gradient_buckets_start_in_the_backward_and_train_the_same_model(nproc, headers_apart, tmp_path):
    env = {"TORCHPMAP_HEADERS_APART": "1"} if headers_apart else {}
    finished, results = _run("gradient_buckets", nproc, tmp_path, env=env)
    logs = _logs(finished)
    assert all(f.returncode == 0 for f in finished), logs
    with _on_one_device():
        reference = progs.train_in_buckets(*progs.bucket_data(nproc))  # one process, all instances
        reference_bf16 = progs.train_in_buckets(*progs.bucket_data(nproc), dtype=torch.bfloat16)
    for r in range(nproc):
        res = results[r]
        assert res is not None and "crashed" not in res, (res or {}).get("crashed", logs)
        # 3 buckets (16 KiB each, the first capped alike) per step, started in the backward
        events = res["events"]
        steps = _split_steps(events)
        assert len(steps) == 4 and all(s.count("backward done") == 1 for s in steps), events
        for step in steps:
            assert [e.startswith("all_reduce") for e in step].count(True) == 3, events
            assert step.index("backward done") >= 2, f"the buckets did not start during the backward: {events}"
        # once the processes have learned the step's transfers, they meet once before the
        # buckets: the loss mean, whose headers also agree on the buckets (no round of its own)
        # (with the headers apart, as for CUDA payloads: their all-gather, then the loss')
        meeting = 2 if headers_apart else 1
        assert steps[-1][:meeting] == ["all_gather"] * meeting and "all_gather" not in steps[-1][meeting:], steps[-1]
        _assert_same(f"rank {r} overlapped vs rank 0", res["overlapped"], results[0]["overlapped"], bitwise=True)
        _assert_same(f"rank {r} vs by hand", res["overlapped"], res["by_hand"], bitwise=nproc == 2)
        _assert_same(f"rank {r} vs one process", res["overlapped"], reference, bitwise=False)
        _assert_same(f"rank {r} bfloat16 vs by hand", res["bfloat16"], res["bfloat16_by_hand"], bitwise=nproc == 2)
        for k, want in reference_bf16.items():  # a weight near 0 after 3 steps: bfloat16's rounding, absolute
            torch.testing.assert_close(res["bfloat16"][k], want, rtol=2e-2, atol=1e-3, msg=lambda m: f"bf16 {k}: {m}")
        # compiled, the same buckets as ops of the program: 3 steps of 3 buckets
        assert res["compiled_all_reduces"] == events_sizes(steps[-1]) * 3, res["compiled_all_reduces"]
        _assert_same(f"rank {r} compiled vs rank 0", res["compiled"], results[0]["compiled"], bitwise=True)
        _assert_same(f"rank {r} compiled vs eager", res["compiled"], res["overlapped"], bitwise=False)
        # the loss and batch-norm statistics: the bits of pmean's (gathered, not all-reduced)
        bn, one_pmean = res["batch_norm"], res["batch_norm_one_pmean"]
        assert "1.running_mean" in bn and bn["1.num_batches_tracked"].item() == 1, sorted(bn)
        for k in ("losses", "1.running_mean", "1.running_var", "1.num_batches_tracked"):
            torch.testing.assert_close(bn[k], one_pmean[k], rtol=0, atol=0, msg=lambda m: f"rank {r} {k}: {m}")
        _assert_same(f"rank {r} batch norm vs rank 0", bn, results[0]["batch_norm"], bitwise=True)
        _assert_same(f"rank {r} batch norm compiled vs eager", res["batch_norm_compiled"], bn, bitwise=False)
        # a weight split across the first bucket (11 of its 64 rows in it): eager and compiled
        # (each of the weight's two row blocks its own product), the model of pmean
        split_sizes = [4 + 4 * 64 + 64 + 11 * 64, 53 * 64, 64 + 64 * 64, 64 + 64 * 16] * 3
        assert res["split_all_reduces"] == split_sizes and res["split_compiled_all_reduces"] == split_sizes, res[
            "split_all_reduces"
        ]
        _assert_same(f"rank {r} split vs by hand", res["split"], res["by_hand"], bitwise=nproc == 2)
        _assert_same(
            f"rank {r} split compiled vs rank 0", res["split_compiled"], results[0]["split_compiled"], bitwise=True
        )
        _assert_same(f"rank {r} split compiled vs eager", res["split_compiled"], res["split"], bitwise=False)
        failure = res["disagree"]
        assert failure and failure["error"] == "ExchangeMismatch", failure
        assert "3 parts" in failure["message"] and "2 parts" in failure["message"], failure["message"]
        assert "still in step" in failure["message"]
        torch.testing.assert_close(res["after"], res["overlapped"]["losses"][:1])


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [2, 3])
def test_a_process_raising_while_its_buckets_travel_is_named_by_every_other(nproc, tmp_path):
    finished, results = _run("raise_in_backward", nproc, tmp_path, timeout=30)
    logs = _logs(finished)
    assert results[1]["error"] == "ValueError" and "boom on purpose" in results[1]["message"], logs
    for r in set(range(nproc)) - {1}:
        res = results[r]
        assert res["error"] == "RankFailed", logs
        assert "rank 1" in res["message"] and "boom on purpose" in res["message"], res["message"]
        assert res["seconds"] < 15, res  # well within the 30 s timeout
        assert "out of step" in res["after"]


@pytest.mark.slow
def test_shard_map_on_a_process_mesh_gives_one_process_numbers(tmp_path):
    """shard_map over a 2 x 2 mesh of processes (torchpmap.distributed.mesh and a torch
    DeviceMesh): plain tensors that every process holds, DTensors with the specs'
    placements and DTensors that must be redistributed all give the numbers of the same
    programs in one process (the positions vectorized on one device); results are
    DTensors with the out specs' placements; gradients taken inside the map follow
    check_vma (the FSDP step)."""
    results = _shard_map_processes_agree_with_one_device(
        "shard_map", progs.shard_map_programs, ("plain", "dtensor_as_spec", "dtensor_redistributed"), tmp_path
    )
    for res in results.values():
        assert res["placements"] == [("Shard", 0), ("Replicate", None)] and res["local_shape"] == (4, 6), res


def _shard_map_processes_agree_with_one_device(scenario, programs, hows, tmp_path) -> dict:
    """Runs ``scenario`` on a 2 x 2 mesh of processes; each process' ``res[how][name]``
    must equal ``programs(one-device mesh, data)[name]``. Returns every process' results."""
    finished, results = _run(scenario, 4, tmp_path, timeout=60)
    logs = _logs(finished)
    assert all(f.returncode == 0 for f in finished), logs
    one_device = tp.make_mesh(*progs.SHARD_MAP_MESH, devices=tp.local_devices()[:1])
    reference = programs(one_device, progs.shard_map_data())
    for r in range(4):
        res = results[r]
        assert res is not None and "crashed" not in res, (res or {}).get("crashed", logs)
        for how in hows:
            for name, want in reference.items():
                torch.testing.assert_close(
                    res[how][name], want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{how} {name}: {m}"
                )
    return results


@pytest.mark.slow
def test_backward_through_shard_map_results_on_a_process_mesh_gives_one_process_gradients(tmp_path):
    """.backward() from outside through shard_map results on a 2 x 2 mesh of processes
    (tensors every process holds, and DTensors in the specs' placements): each
    argument's gradient equals the one-process gradient, for a result split over "data",
    a replicated one (its cotangent counted once, not once per process) and a weight
    used both invariantly and with the split batch."""
    _shard_map_processes_agree_with_one_device(
        "shard_map_backward", progs.shard_map_backward_programs, ("plain", "dtensor"), tmp_path
    )


# loading in a process without a process group is what this test does on purpose; DCP says so
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_shard_map_results_save_on_two_processes_and_load_on_one(tmp_path):
    """DTensor results of a shard_map (weights split over "data") go through
    torch.distributed.checkpoint: saved by 2 processes, loaded whole by one."""
    import torch.distributed.checkpoint as dcp

    where = tmp_path / "checkpoint"
    finished, results = _run("shard_map_checkpoint", 2, tmp_path, env={"TEST_CHECKPOINT": str(where)})
    assert all(f.returncode == 0 for f in finished), _logs(finished)
    w1 = progs.shard_map_data()["w1"]
    expected = w1 * 2 + torch.arange(2.0).repeat_interleave(2).unsqueeze(1)  # position 0 adds 0, position 1 adds 1
    for r in range(2):
        torch.testing.assert_close(results[r]["local"], expected[2 * r : 2 * r + 2])
    loaded = {"w1": torch.zeros(4, 8)}
    dcp.load(loaded, checkpoint_id=str(where), no_dist=True)
    torch.testing.assert_close(loaded["w1"], expected)


# --------------------------------------------------------------------------- same answers as plain PyTorch (issue 27)


# Not slow: the one multi-process test that `make test-quick` keeps (a few seconds), so
# that the quick pass runs the multi-process engine and the exchange between processes.
def test_processes_give_the_answers_of_one_process(tmp_path):
    """Two processes that build their models from different seeds (as the DDP tutorial
    does, relying on DDP's wrap-time copy) train process 0's model, bitwise the same in
    both, the model one process trains on the whole batch; a parameter the loss never
    reaches keeps p.grad None and its value; metrics are averaged over every instance.
    Processes that run different programs with the same shapes raise at their first
    exchange. broadcast, check_same, complex collectives."""
    per_rank, _ = _ranks_finished("same_answers", 2, tmp_path, timeout=60)
    assert not torch.equal(per_rank[0]["initial"]["head.weight"], per_rank[1]["initial"]["head.weight"])
    with _on_one_device():
        reference = {
            "trained": progs.same_answers_reference(seed=100, n=4),
            "bucketed": progs.same_answers_reference(seed=200, n=2),
        }
    for run in ("trained", "bucketed"):
        got = [res[run] for res in per_rank]
        for r in range(2):
            assert got[r]["no_grad"] == ["spare.bias", "spare.weight"], (run, got[r]["no_grad"])
            for k in ("state", "losses", "accuracies"):
                _assert_same(f"{run}: {k} of rank {r} vs rank 0", got[r][k], got[0][k], bitwise=True)
        # untouched by AdamW
        assert torch.equal(got[0]["state"]["spare.weight"], reference[run]["state"]["spare.weight"])
        for k in ("state", "losses", "accuracies"):
            _assert_same(f"{run}: {k} vs one process", got[0][k], reference[run][k], bitwise=False)
    for res in per_rank:
        for case in ("in_axes", "out_axes", "function", "no_collective"):
            err = res[f"differ_{case}"]
            assert err is not None and err["error"] == "ExchangeMismatch", (case, err)
            assert "still in step" in err["message"] and err["ranks"] == [1], (case, err["message"])
            assert torch.equal(res[f"differ_{case}_after"], torch.full((1, 1, 4), 0.0) + torch.arange(4.0) * 2 + 1), (
                case
            )
        message = lambda case: res[f"differ_{case}"]["message"]  # noqa: E731
        assert "in_axes=0," in message("in_axes") and "in_axes=1," in message("in_axes")
        assert "out_axes=0," in message("out_axes") and "out_axes=1," in message("out_axes")
        assert "psum_of'" in message("function") and "psum_too'" in message("function")
        assert "reached the end of pmap call" in message("no_collective") and "in_axes=1," in message("no_collective")
        # process 0's bits in every process: -0.0 and a NaN's payload included
        for k, (dtype, shape, bits) in res["broadcast"].items():
            assert (dtype, shape) == per_rank[0]["broadcast"][k][:2] and torch.equal(
                bits, per_rank[0]["broadcast"][k][2]
            ), k
        assert res["check_same_equal"] is None
        differ = res["check_same_differ"]
        assert differ is not None and differ["path"] == "['b']" and differ["ranks"] == [1], differ
        assert "params['b'] (shape (2,), float32) differs" in differ["message"] and "broadcast" in differ["message"]
    f32 = per_rank[0]["broadcast"]["f32"][2].view(torch.float32)
    assert f32[0].item() == 0.0 and torch.signbit(f32[0]) and f32[1].item() == 1.5 and torch.isnan(f32[2])
    assert per_rank[1]["broadcast"]["flag"][2].tolist() == [1, 1]
    z = torch.stack([(torch.arange(3.0) + 1j * r).to(torch.complex128) for r in range(2)])
    _assert_same("complex all_gather", _concat(per_rank, "complex_all_gather"), z.expand(2, 2, 3), bitwise=True)
    _assert_same("complex ppermute", _concat(per_rank, "complex_ppermute"), z.roll(1, 0), bitwise=True)


@pytest.mark.slow
def test_a_clipped_sharded_step_on_two_processes_clips_by_the_whole_gradients_norm(tmp_path, monkeypatch):
    """max_grad_norm with shard_params across 2 processes: each process holds half of the
    rows, and the norm is the whole gradient's, so the weights are one process' clipped
    replicated step's (and not the unclipped ones)."""
    per_rank, _ = _ranks_finished("sharded_step_clipped", 2, tmp_path, timeout=60)
    with _on_one_device():
        reference = progs.same_answers_reference(seed=100, n=4, clipped=True)
        monkeypatch.setattr(progs, "CLIP", 1e9)  # the same SGD steps, never clipped
        unclipped = progs.same_answers_reference(seed=100, n=4, clipped=True)
    for r in range(2):
        for k in ("state", "losses"):
            _assert_same(f"{k} of rank {r} vs one process", per_rank[r][k], reference[k], bitwise=False)
    assert any(not torch.allclose(reference["state"][k], unclipped["state"][k]) for k in reference["state"])


@pytest.mark.slow
def test_a_sharded_step_under_a_grad_scaler_skips_on_every_process_together(tmp_path):
    """GradScaler with shard_params across 2 processes: an inf that reaches only process
    1's rows of the gradient skips the step on both processes, and both back off the
    scale, as one process' replicated step does; the finite steps train its weights."""
    per_rank, _ = _ranks_finished("sharded_step_scaled", 2, tmp_path, timeout=60)
    with _on_one_device():
        reference = progs.train_scaled(0, 1, shard_params=False, n=4)
    assert reference["scales"] == [1024.0, 1024.0, 512.0, 512.0]  # the third batch is skipped
    assert torch.equal(reference["weights"][2], reference["weights"][1])
    for r in range(2):
        assert per_rank[r]["scales"] == reference["scales"], (r, per_rank[r]["scales"])
        _assert_same(f"weights of rank {r} vs one process", per_rank[r]["weights"], reference["weights"],
                     bitwise=False)


@pytest.mark.slow
def test_a_sharded_steps_checkpoint_from_two_processes_resumes_in_one(tmp_path):
    """The weights and ``step.optimizer_state_dict()`` of a sharded AdamW step on 2
    processes, saved with torch.distributed.checkpoint, load in one process (torch's
    get/set_optimizer_state_dict) and train on as one process' replicated step does."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    from torchpmap.training import data_parallel_step, shard

    where = tmp_path / "checkpoint"
    _ranks_finished("sharded_step_checkpoint", 2, tmp_path, timeout=60, env={"TEST_CHECKPOINT": str(where)})
    x, y = progs.same_answers_data()

    def fresh():
        model = progs.WithSpare(seed=5)  # other weights: the checkpoint must replace them
        return model, torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)

    with _on_one_device():
        ref, ref_opt = fresh()
        ref.load_state_dict(progs.WithSpare(seed=100).state_dict())
        ref_step = data_parallel_step(ref, progs.metrics_loss, ref_opt, has_aux=True)
        for _ in range(3):
            ref_step(shard((x, y), n=4))
        model, opt = fresh()
        loaded = {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)}
        # the template holds state for every parameter (torch initializes it), the checkpoint none
        # for the layer the loss never reaches, as the replicated step's optimizer
        partial = DefaultLoadPlanner(allow_partial_load=True)
        dcp.load(loaded, checkpoint_id=str(where), no_dist=True, planner=partial)
        model.load_state_dict(loaded["model"])
        set_optimizer_state_dict(model, opt, loaded["optim"])
        data_parallel_step(model, progs.metrics_loss, opt, has_aux=True)(shard((x, y), n=4))
    _assert_same("weights resumed in one process vs one process' 3 steps", model.state_dict(), ref.state_dict(),
                 bitwise=False)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the allocator's peak is read from glibc's mallinfo2")
def test_a_sharded_steps_peak_grows_with_depth_by_gradient_rows_only(tmp_path):
    """The allocator's peak in each of 2 processes during one step, for 6 and for 12
    layers of 1 MiB: the sharded step (which gathers each layer as it runs) peaks below
    the replicated step, and 6 more layers raise its peak by about their gradient rows
    (half a layer each, kept until the step ends, and once more as the mean), not by their
    weights: every parameter gathered before the forward raised it by several MiB per
    layer, the replicated step raises it by two."""
    per_rank, _ = _ranks_finished("sharded_step_peak", 2, tmp_path, timeout=120)
    for r, res in enumerate(per_rank):
        peaks, layer = res["peaks"], res["layer"]
        print(f"\nrank {r}: peak MiB during one step", {k: round(v / 2**20, 2) for k, v in peaks.items()})
        for depth in (6, 12):
            assert peaks[(depth, True)] < peaks[(depth, False)], (r, depth, peaks)
        grown = peaks[(12, True)] - peaks[(6, True)]
        assert grown <= 6 * 2 * layer / 2 + layer, (r, grown / layer, peaks)
        assert peaks[(12, True)] <= 8 * layer + 12 * 2 * layer / 2, (r, peaks)


@pytest.mark.slow
def test_sharded_step_on_two_processes_trains_one_process_model(tmp_path):
    """data_parallel_step(shard_params=True) on 2 processes of 2 instances each: the
    weights (gathered after 3 AdamW steps), losses and metrics of the replicated step
    in one process; each process holds 2 of the 4 flat rows of every parameter, of its
    gradient and of AdamW's two moments."""
    per_rank, _ = _ranks_finished("sharded_step", 2, tmp_path, timeout=60)
    with _on_one_device():
        reference = progs.same_answers_reference(seed=100, n=4)
    for r in range(2):
        for k in ("state", "losses", "accuracies"):
            _assert_same(f"{k} of rank {r} vs one process", per_rank[r][k], reference[k], bitwise=False)
    numels = [p.numel() for p in progs.WithSpare(seed=0).parameters()]
    rows = sum(2 * -(-n // 4) for n in numels)  # this process' 2 rows of each, padded
    whole = sum(numels)
    for res in per_rank:  # float32: parameter, gradient, 2 moments; and a 'step' count per parameter
        assert res["bytes"] <= 4 * 4 * rows + 4 * len(numels) < 4 * 4 * whole, (res["bytes"], rows, whole)
