"""The command line: ``python -m torchpmap.bench [--quick] [--only NAME] [--json PATH] [--png PATH]``."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from torchpmap.bench import frameworks, report, suite, timing
from torchpmap.bench.core import COLUMNS, Config
from torchpmap.bench.workloads import WORKLOADS, by_name

QUICK = timing.Plan(reps=7, warmup=2, min_sample_s=0.002, max_total_s=1.5, min_reps=3)
FULL = timing.Plan(reps=41, warmup=5, min_sample_s=0.02, max_total_s=12.0, min_reps=11)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    names = [w.name for w in WORKLOADS]
    parser = argparse.ArgumentParser(
        prog="python -m torchpmap.bench",
        description="Times torchpmap against plain PyTorch and JAX, side by side in one process.",
    )
    parser.add_argument("--quick", action="store_true", help="small sizes and few repetitions (for CI)")
    parser.add_argument(
        "--only",
        action="append",
        choices=names,
        metavar="NAME",
        help=f"run only this workload (repeatable): {', '.join(names)}",
    )
    parser.add_argument(
        "--threads",
        type=int,
        metavar="N",
        help="torch intra-op threads (default: torch's); 1 is steadier on a busy machine",
    )
    parser.add_argument(
        "--no-jax",
        action="store_true",
        help="leave out the JAX columns (on a GPU machine JAX would run on the CPU: no comparison)",
    )
    parser.add_argument(
        "--seconds-per-case",
        type=float,
        metavar="S",
        help="stop starting repetitions of a case after S seconds (at least 5 run); default: the plan's",
    )
    parser.add_argument(
        "--json", default=os.path.join("bench-results", "bench.json"), metavar="PATH", help="where to write the JSON"
    )
    parser.add_argument(
        "--png", default=os.path.join("bench-results", "bench.png"), metavar="PATH", help="where to draw the chart"
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the suite, prints the table, writes the files. Exit status 1 if a column
    failed or disagreed with its reference; timings never fail."""
    frameworks.configure_environment()  # before JAX is imported (the workloads import it lazily)
    args = parse_args(argv)
    if args.no_jax:
        frameworks.disable_jax("left out (--no-jax)")
    if args.threads:
        torch.set_num_threads(args.threads)
    workloads = by_name(args.only) if args.only else WORKLOADS
    cfg = Config(quick=args.quick, device=frameworks.default_device())
    load_before = _load()
    plan = _plan(cfg)
    if args.seconds_per_case is not None:
        plan = dataclasses.replace(plan, max_total_s=args.seconds_per_case, min_reps=min(plan.min_reps, 5))
    rows = suite.run(workloads, cfg, plan, log=_log)
    meta = {**_meta(cfg, argv, plan), "load_average": {"before": load_before, "after": _load()}}
    doc = {"meta": meta, "columns": COLUMNS, "ratio": report.RATIO_NOTE, "rows": rows}
    print(report.format_table(doc))
    report.write_json(doc, args.json)
    print(f"\nJSON written to {args.json}")
    print(report.write_png(doc, args.png))
    return 1 if _failures(rows) else 0


def _load() -> float | None:
    """The 1-minute load average, to tell a busy machine's numbers apart (None if unknown)."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _failures(rows: list[dict[str, Any]]) -> list[str]:
    failed = [f"{r['case']}: {n}" for r in rows for n, c in r["columns"].items() if "error" in c]
    failed += [f"{r['case']}: check" for r in rows if r["check"].get("ok") is False]
    for line in failed:
        _log(f"[bench] FAILED {line}")
    return failed


def _meta(cfg: Config, argv: Sequence[str] | None, plan: timing.Plan) -> dict[str, Any]:
    versions = {"python": platform.python_version(), "torch": torch.__version__, "numpy": np.__version__}
    jax = sys.modules.get("jax")
    if jax is not None:
        versions["jax"] = jax.__version__
    cpu = f"cpu ({platform.processor() or platform.machine()})"
    device = torch.cuda.get_device_name() if cfg.device.type == "cuda" else cpu
    return {
        "mode": "quick" if cfg.quick else "full",
        "command": " ".join(["python -m torchpmap.bench", *(sys.argv[1:] if argv is None else argv)]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": device,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "versions": versions,
        "plan": dataclasses.asdict(plan),
    }


def _plan(cfg: Config) -> timing.Plan:
    return QUICK if cfg.quick else FULL
