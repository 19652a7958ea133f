"""Runs workloads: checks each case's columns against its reference, then times them.

The result of a run is a JSON-ready document; :mod:`torchpmap.bench.report` shows it.
A row's times are per ``unit`` (a call's time divided by ``per``), in seconds.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from typing import Any

from torchpmap.bench import timing
from torchpmap.bench.core import (
    COLUMNS,
    JIT,
    NA,
    SUBJECT,
    Case,
    Config,
    Impl,
    Workload,
    all_close,
    jit_baseline,
    max_abs_diff,
)

Row = dict[str, Any]
Log = Callable[[str], None]
NOT_APPLICABLE = "does not apply to this workload"


def run(workloads: list[Workload], cfg: Config, plan: timing.Plan, log: Log) -> list[Row]:
    rows: list[Row] = []
    for workload in workloads:
        log(f"[bench] {workload.name}: {workload.description}")
        start = time.perf_counter()
        rows += run_workload(workload, cfg, plan, log)
        log(f"[bench]   ({time.perf_counter() - start:.1f} s)")
    return rows


def run_workload(workload: Workload, cfg: Config, plan: timing.Plan, log: Log) -> list[Row]:
    reason = workload.needs()
    if reason is not None:
        log(f"[bench]   n/a: {reason}")
        return [_unavailable_row(workload, reason)]
    try:
        cases = workload.build(cfg)
    except Exception as exc:  # noqa: BLE001 - a broken workload is reported, the others still run
        return [_unavailable_row(workload, _describe(exc), error=True)]
    rows = []
    for case in cases:
        log(f"[bench]   {case.name}")
        rows.append(run_case(case, plan))
    return rows


def run_case(case: Case, plan: timing.Plan) -> Row:
    if case.external is not None:
        ext = case.external()
        cells: dict[str, Any] = dict(ext.unavailable)
        results, expected = ext.results, ext.expected
        errors: dict[str, str] = {}
        measured = timing.Measurement(ext.samples, dict.fromkeys(ext.samples, ext.calls_per_sample))
    else:
        cells = {name: cell for name, cell in case.columns.items() if isinstance(cell, NA)}
        impls = {name: cell for name, cell in case.columns.items() if isinstance(cell, Impl)}
        results, errors = _first_results(impls)
        expected = results.get(case.reference)
        measured = timing.measure({name: impls[name].call for name in results}, plan)
    return {
        "workload": case.workload,
        "case": case.name,
        "unit": case.unit,
        "per": case.per,
        "columns": _cells_json(cells, errors, measured, case.per),
        "ratios": _ratios_json(measured),
        "jit_ratios": _ratios_json(measured, JIT, baselines_only=True),
        "check": _check_json(case, results, expected),
    }


def _first_results(impls: dict[str, Impl]) -> tuple[dict[str, Any], dict[str, str]]:
    """Each column's first output (also its first warm-up call), or its error."""
    results, errors = {}, {}
    for name, impl in impls.items():
        try:
            results[name] = impl.result(impl.call())
        except Exception as exc:  # noqa: BLE001 - a failing column is reported in its cell
            errors[name] = _describe(exc)
    return results, errors


def _describe(exc: BaseException) -> str:
    frame = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
    where = f" at {frame.filename}:{frame.lineno}" if frame else ""
    return f"{type(exc).__name__}: {exc}{where}"


def _cells_json(cells: dict[str, NA], errors: dict[str, str], measured: timing.Measurement, per: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in COLUMNS:
        if name in measured.samples:
            stats = measured.stats(name)
            out[name] = {
                "median_s": stats.median / per,
                "q1_s": stats.q1 / per,
                "q3_s": stats.q3 / per,
                "reps": stats.n,
                "calls_per_sample": measured.calls_per_sample[name],
            }
        elif name in errors:
            out[name] = {"error": errors[name]}
        else:
            out[name] = {"na": cells[name].reason if name in cells else NOT_APPLICABLE}
    return out


def _ratios_json(measured: timing.Measurement, subject: str = SUBJECT, baselines_only: bool = False) -> dict[str, Any]:
    """Paired ratios ``subject / X`` for every other measured column X (with
    ``baselines_only``, those of :func:`~torchpmap.bench.core.jit_baseline`)."""
    if subject not in measured.samples:
        return {}
    ratios = {}
    for name in COLUMNS:
        if name != subject and name in measured.samples and (not baselines_only or jit_baseline(name)):
            stats = measured.ratio(subject, name)
            ratios[name] = {"median": stats.median, "q1": stats.q1, "q3": stats.q3}
    return ratios


def _check_json(case: Case, results: dict[str, Any], expected: Any | None) -> dict[str, Any]:
    check: dict[str, Any] = {"reference": case.reference, "rtol": case.rtol, "atol": case.atol}
    if expected is None:
        return {**check, "ok": None, "note": "the reference did not run; nothing to compare"}
    diffs = {name: max_abs_diff(result, expected) for name, result in results.items()}
    ok = all(all_close(result, expected, case.rtol, case.atol) for result in results.values())
    return {**check, "ok": ok, "max_abs_diff": diffs}


def _unavailable_row(workload: Workload, reason: str, error: bool = False) -> Row:
    key = "error" if error else "na"
    return {
        "workload": workload.name,
        "case": workload.name,
        "unit": None,
        "per": 1,
        key: reason,
        "columns": {name: {key: reason} for name in COLUMNS},
        "ratios": {},
        "jit_ratios": {},
        "check": {"ok": None, "note": reason},
    }
