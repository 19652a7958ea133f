"""The benchmark suite: its quick run, its JSON, its table, and the agreement of every
workload's columns. Timings are never asserted: noise must not fail the build."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest
import torch

from torchpmap.bench import report, suite, timing
from torchpmap.bench.core import COLUMNS, NA, SUBJECT, Case, Config, Impl, Workload, all_close
from torchpmap.bench.workloads import WORKLOADS, by_name, multiprocess

CPU = Config(quick=True, device=torch.device("cpu"))
TINY = timing.Plan(reps=3, warmup=1, min_sample_s=0.0, max_total_s=1.0, min_reps=1)
IN_PROCESS = ["dispatch", "mlp_step", "psum", "scaling", "multidevice"]


# --------------------------------------------------------------------------- the quick run, in a subprocess


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("bench")
    files = ["--json", str(out / "b.json"), "--png", str(out / "b.png")]
    # a smoke run: every workload and column once, with the fewest repetitions that give a
    # median and quartiles (their values are never asserted); the 1-device pass runs it
    cmd = [sys.executable, "-m", "torchpmap.bench", "--quick", "--seconds-per-case", "0.01", *files]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=600, cwd=out)
    doc = json.loads((out / "b.json").read_text()) if (out / "b.json").exists() else None
    return {"proc": proc, "doc": doc, "png": out / "b.png"}


@pytest.mark.slow
@pytest.mark.same_on_every_placement
def test_quick_run_succeeds(quick_run: dict[str, Any]) -> None:
    proc = quick_run["proc"]
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.slow
@pytest.mark.same_on_every_placement
def test_quick_json_has_every_workload_and_column(quick_run: dict[str, Any]) -> None:
    doc = quick_run["doc"]
    assert doc is not None and doc["meta"]["mode"] == "quick"
    assert {w.name for w in WORKLOADS} == {row["workload"] for row in doc["rows"]}
    assert len([r for r in doc["rows"] if r["workload"] == "scaling"]) == 4
    for row in doc["rows"]:
        assert set(row["columns"]) == set(COLUMNS), row["case"]
        for name, cell in row["columns"].items():
            assert "error" not in cell, (row["case"], name, cell)
            if "na" in cell:
                assert isinstance(cell["na"], str) and cell["na"], (row["case"], name)
            else:
                assert 0 < cell["q1_s"] <= cell["median_s"] <= cell["q3_s"], (row["case"], name)
        for ratio in row["ratios"].values():
            assert ratio["median"] > 0


@pytest.mark.slow
@pytest.mark.same_on_every_placement
def test_quick_json_measures_the_core_columns(quick_run: dict[str, Any]) -> None:
    """torchpmap and plain torch always run; JAX runs where it is installed."""
    jax_missing = _jax_missing()
    for row in quick_run["doc"]["rows"]:
        if row["workload"] in ("dispatch", "mlp_step", "psum", "scaling"):
            assert "median_s" in row["columns"][SUBJECT] and "median_s" in row["columns"]["torch"]
            assert "median_s" in row["columns"]["jax.vmap"] or jax_missing
        for name in ("torch.ddp", "torchpmap.1dev"):
            if row["workload"] not in ("distributed", "multidevice"):
                assert row["columns"][name] == {"na": suite.NOT_APPLICABLE}


@pytest.mark.slow
@pytest.mark.same_on_every_placement
def test_quick_json_columns_agree(quick_run: dict[str, Any]) -> None:
    for row in quick_run["doc"]["rows"]:
        measured = [n for n, c in row["columns"].items() if "median_s" in c]
        if measured:
            assert row["check"]["ok"] is True, (row["case"], row["check"])
            assert set(row["check"]["max_abs_diff"]) == set(measured)
        else:
            assert row.get("na"), row  # a whole workload is skipped only with a reason


@pytest.mark.slow
@pytest.mark.same_on_every_placement
def test_quick_run_prints_the_table_and_writes_the_chart(quick_run: dict[str, Any]) -> None:
    stdout = quick_run["proc"].stdout
    for text in ("torchpmap benchmark (quick mode)", "tp/torch", "psum[4 MiB]", "scaling[n=512]", "JSON written"):
        assert text in stdout
    for row in quick_run["doc"]["rows"]:
        assert row["case"] in stdout
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "chart skipped" in stdout
    else:
        assert quick_run["png"].stat().st_size > 0


# --------------------------------------------------------------------------- each workload's columns, in process


def _jax_missing() -> bool:
    try:
        import jax  # noqa: F401
    except ImportError:
        return True
    return False


@pytest.mark.parametrize("name", IN_PROCESS)
def test_workload_columns_agree_with_the_reference(name: str) -> None:
    (workload,) = by_name([name])
    reason = workload.needs()
    if reason is not None:
        pytest.skip(reason)
    for case in workload.build(CPU):
        impls = {n: c for n, c in case.columns.items() if isinstance(c, Impl)}
        assert SUBJECT in impls and case.reference in impls
        expected = impls[case.reference].result(impls[case.reference].call())
        for column, impl in impls.items():
            got = impl.result(impl.call())
            assert all_close(got, expected, case.rtol, case.atol), (case.name, column)


def test_mlp_step_torchpmap_equals_plain_batched_step() -> None:
    (case,) = by_name(["mlp_step"])[0].build(CPU)
    tp, plain = (case.columns[n] for n in (SUBJECT, "torch"))
    assert isinstance(tp, Impl) and isinstance(plain, Impl)
    new_tp, new_plain = tp.result(tp.call()), plain.result(plain.call())
    assert set(new_tp) == {"w1", "b1", "w2", "b2", "w3", "b3"} and new_tp["w1"].shape == (64, 256)
    for key in new_plain:
        torch.testing.assert_close(torch.as_tensor(new_tp[key]), torch.as_tensor(new_plain[key]), rtol=1e-4, atol=1e-5)


def test_psum_equals_torch_sum() -> None:
    (case,) = by_name(["psum"])[0].build(CPU)
    tp, plain = (case.columns[n] for n in (SUBJECT, "torch"))
    assert isinstance(tp, Impl) and isinstance(plain, Impl)
    total = tp.call()
    assert total.shape == (4 * 2**20 // 4 // 8,)
    torch.testing.assert_close(total, plain.call())


def test_jax_pmap_needs_enough_devices() -> None:
    if _jax_missing():
        pytest.skip("jax not installed")
    case = by_name(["scaling"])[0].build(CPU)[-1]
    assert case.name == "scaling[n=512]"
    assert isinstance(case.columns["jax.pmap"], NA) and "512 > " in case.columns["jax.pmap"].reason


@pytest.mark.slow
def test_ddp_column_of_the_distributed_workload() -> None:
    """The multi-process harness works today: its DDP column runs and matches the plain step."""
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed is not available")
    result = multiprocess.run_processes(TINY, ("torch.ddp",))
    assert len(result.samples["torch.ddp"]) == TINY.reps and min(result.samples["torch.ddp"]) > 0
    assert all_close(result.results["torch.ddp"], result.expected, rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------- the machinery


def _case(columns: dict[str, Any]) -> Case:
    return Case("fake", "fake", "call", columns)


def _boom() -> Any:
    raise RuntimeError("boom")


def test_run_case_reports_values_na_errors_and_disagreement() -> None:
    ones = Impl(lambda: torch.ones(3))
    row = suite.run_case(_case({SUBJECT: ones, "torch": ones, "jax.pmap": NA("no jax"), "jax.vmap": Impl(_boom)}), TINY)
    assert row["columns"][SUBJECT]["median_s"] > 0 and row["columns"]["jax.pmap"] == {"na": "no jax"}
    assert "RuntimeError: boom" in row["columns"]["jax.vmap"]["error"]
    assert row["columns"]["torch.ddp"] == {"na": suite.NOT_APPLICABLE}
    assert row["check"]["ok"] is True and set(row["ratios"]) == {"torch"}
    wrong = suite.run_case(_case({SUBJECT: Impl(lambda: torch.zeros(3)), "torch": Impl(lambda: torch.ones(3))}), TINY)
    assert wrong["check"]["ok"] is False and wrong["check"]["max_abs_diff"][SUBJECT] == 1.0


def test_missing_feature_makes_the_whole_workload_na() -> None:
    workload = Workload("future", "needs a feature", lambda cfg: [], lambda: "needs torchpmap.future")
    (row,) = suite.run_workload(workload, CPU, TINY, log=lambda line: None)
    assert row["na"] == "needs torchpmap.future"
    assert all(cell == {"na": "needs torchpmap.future"} for cell in row["columns"].values())
    doc = {"meta": _meta(), "rows": [row]}
    assert "n/a: needs torchpmap.future" in report.format_table(doc)


def test_distributed_workload_reports_its_missing_feature() -> None:
    reason = multiprocess.needs()
    try:
        import torchpmap.distributed  # noqa: F401
    except ImportError:
        assert reason is not None and "torchpmap.distributed" in reason


def test_measure_interleaves_round_robin() -> None:
    order: list[str] = []
    fns = {name: (lambda name=name: order.append(name)) for name in "abc"}
    m = timing.measure(fns, timing.Plan(reps=4, warmup=0), calls_per_sample=1)
    assert order[-12:] == list("abc" "acb" "cab" "cba")  # rotated by one, every other one reversed
    assert all(len(s) == 4 for s in m.samples.values())
    assert m.ratio("a", "b").n == 4
    # no column always follows the same one (it would always find that one's data in cache)
    runs = order[-12:]
    followed = {name: {runs[i - 1] for i in range(1, len(runs)) if runs[i] == name and i % 3} for name in "abc"}
    assert all(len(before) == 2 for before in followed.values()), followed


def test_table_footnotes_reasons() -> None:
    one = Impl(lambda: 1.0)
    row = suite.run_case(_case({SUBJECT: one, "torch": one, "jax.pmap": NA("why not")}), TINY)
    table = report.format_table({"meta": _meta(), "rows": [row]})
    assert "n/a[" in table and "why not" in table and "tp/torch" in table and " ok" in table


def _meta() -> dict[str, Any]:
    return {"mode": "quick", "device": "cpu", "torch_threads": 1, "cpu_count": 1, "versions": {}}


@pytest.mark.slow
def test_sharded_columns_train_the_model_ddp_trains() -> None:
    """The simulated cluster's FSDP columns (torchpmap's shard_params step, FSDP2's
    fully_shard) take the same SGD steps as DDP, on 2 processes over loopback."""
    from torchpmap.bench.ddp import run_ddp_comparison

    result = run_ddp_comparison(
        2, 2, warmup=1, batch_per_process=16, columns=("ddp", "torchpmap.fsdp", "fsdp2"), sizes=(8, 16, 3),
        timeout=120,
    )
    assert set(result["columns"]) == {"ddp", "torchpmap.fsdp", "fsdp2"}
    assert result["max_param_diff"] < 1e-5


@pytest.mark.slow
def test_tensor_parallel_columns_train_the_model_one_process_trains() -> None:
    """The tensor-parallel row: torchpmap's shard_map step (hidden layer split over 2
    processes, the gradient inside the map) and DTensor's parallelize_module take the same
    SGD steps as the whole model in one process."""
    from torchpmap.bench.tensor_parallel import run_tp_comparison

    result = run_tp_comparison(2, 3, warmup=1, batch=16, sizes=(8, 16, 5), timeout=120)
    assert set(result["columns"]) == {"torchpmap.tp", "dtensor.tp", "single"}
    assert all(c["ms"] > 0 for c in result["columns"].values())
    assert result["max_param_diff"] < 1e-5  # every column against the first (torchpmap.tp)
    with pytest.raises(ValueError, match="must divide the hidden size"):
        run_tp_comparison(3, 1, sizes=(8, 16, 5))
