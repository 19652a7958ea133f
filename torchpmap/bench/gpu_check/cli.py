"""The command line: ``python -m torchpmap.bench.gpu_check [--quick] [--only PART] [--out DIR] [--budget S]``.

Runs each part (:mod:`torchpmap.bench.gpu_check.parts`) in a process of its own, within
what is left of the time budget, and rewrites the report after every part, so that a run
cut short still leaves what it found. Exit status 0 when every part that could run
passed; CUDA-only parts on a machine without CUDA are skipped and named, not failures.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

import torch

from torchpmap.bench.gpu_check import report
from torchpmap.bench.gpu_check.outcome import (
    FAILED,
    NOT_RUN,
    PASSED,
    RESULT_ENV,
    SKIPPED,
    TIMED_OUT,
    Check,
    Findings,
    PartResult,
)
from torchpmap.bench.gpu_check.parts import PARTS, Context, Part, by_name, command_line

#: The checkout this package runs from: put on PYTHONPATH for every part, and their cwd.
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
#: A part is not started with less than this many seconds of the budget left.
MIN_START_S = 20.0
#: A part still running this many seconds before its deadline is interrupted (SIGINT), then
#: killed at the deadline.
INTERRUPT_S = 15.0


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m torchpmap.bench.gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("GPU_CHECK_OUT") or "gpu-check-results",
                        help="the report folder (default: $GPU_CHECK_OUT, else gpu-check-results/)")
    parser.add_argument("--quick", action="store_true", help="smaller sizes and fewer variants (CI's short pass)")
    parser.add_argument("--only", action="append", metavar="PART",
                        help=f"run only this part: {[p.name for p in PARTS]}")
    parser.add_argument("--jobs", type=int, default=0,
                        help="parts run at once (default 4 with CUDA, else 1); the bench always runs alone")
    parser.add_argument("--budget", type=float, default=float(os.environ.get("GPU_CHECK_BUDGET", 450)),
                        help="seconds for all parts together (default 450: the check ends within 8 minutes)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    ctx = Context(out=out, quick=args.quick, cuda=torch.cuda.is_available())
    parts = by_name(args.only) if args.only else PARTS
    jobs = args.jobs or (4 if ctx.cuda else 1)
    started = time.monotonic()
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python -m torchpmap.bench.gpu_check", *(sys.argv[1:] if argv is None else argv)]),
        "device": "CUDA (see the versions part)" if ctx.cuda else f"cpu ({platform.machine()}), no CUDA",
        "versions": f"python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda})",
        "budget": args.budget,
        "jobs": jobs,
        "quick": args.quick,
        "cuda": ctx.cuda,
    }
    done: dict[str, PartResult] = {}

    def finished(result: PartResult) -> None:
        done[result.name] = result
        print(f"== {time.strftime('%H:%M:%S')} {result.name}: {result.outcome} in {result.seconds:.1f} s", flush=True)
        if result.name == "versions":
            meta["device"] = result.findings.measurements.get("device", meta["device"])
        meta["seconds"] = time.monotonic() - started
        report.write(out, meta, [done[p.name] for p in parts if p.name in done])

    # Parts run `jobs` at a time; a part marked `alone` (the timings) runs with nothing beside it.
    waiting = list(parts)
    running: list[Running] = []
    while waiting or running:
        for r in [r for r in running if r.poll()]:
            running.remove(r)
            finished(r.result())
        left = args.budget - (time.monotonic() - started)
        while waiting and len(running) < jobs and not (running and waiting[0].alone) and \
                not any(r.part.alone for r in running):
            part = waiting.pop(0)
            print(f"== {time.strftime('%H:%M:%S')} gpu-check: {part.name} ({left:.0f} s of the budget left)",
                  flush=True)
            started_part = start_part(part, ctx, left)
            if isinstance(started_part, PartResult):
                finished(started_part)
            else:
                running.append(started_part)
        time.sleep(0.2)
    results = [done[p.name] for p in parts]
    bad = [r.name for r in results if r.outcome in (FAILED, TIMED_OUT, NOT_RUN)]
    print(report.markdown(meta, results).split("\n## ")[0])
    print(f"report: {out}/report.md and report.json")
    if bad:
        print(f"gpu-check: {len(bad)} part(s) did not pass: {', '.join(bad)}", file=sys.stderr)
    return 1 if bad else 0


@dataclasses.dataclass
class Running:
    """A part whose process runs."""

    part: Part
    ctx: Context
    proc: subprocess.Popen
    command: str
    log_path: str
    result_file: str
    start: float
    timeout: float
    returncode: int | None = None
    interrupted: bool = False  # sent SIGINT, INTERRUPT_S before its deadline
    killed: bool = False

    def poll(self) -> bool:
        """True once the process ended (killed at its deadline included)."""
        code = self.proc.poll()
        if code is not None:
            self.returncode = code
            return True
        late = time.monotonic() - self.start - self.timeout
        if late > -INTERRUPT_S and not self.interrupted:
            # Ctrl-C first: pytest then names the failures so far and writes its JUnit file
            os.killpg(self.proc.pid, signal.SIGINT)
            self.interrupted = True
        if late > 0:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the part and whatever it started
            self.proc.wait()
            self.killed = True
            return True
        return False

    def result(self) -> PartResult:
        part, seconds = self.part, time.monotonic() - self.start
        with open(self.log_path, errors="replace") as log:
            tail = log.read()[-6000:]
        findings = _findings(part, self.ctx, self.result_file)
        if self.killed or self.interrupted:
            outcome = TIMED_OUT
            how = "killed at the deadline" if self.killed else f"interrupted {INTERRUPT_S:.0f} s before the deadline"
            findings.checks.append(Check(f"{part.name}: finished within {self.timeout:.0f} s", False, how))
            code = None
        elif self.returncode == 0 and all(c.ok for c in findings.checks):
            outcome, code = PASSED, 0
        else:
            outcome, code = FAILED, self.returncode
            if self.returncode != 0 and all(c.ok for c in findings.checks):
                findings.checks.append(Check(f"{part.name}: exit status", False, f"exit {self.returncode}"))
        return PartResult(part.name, part.title, outcome, seconds, self.command, findings, code, tail)


def start_part(part: Part, ctx: Context, left: float) -> Running | PartResult:
    argv = command_line(part, ctx)
    shown = " ".join(argv[1:])
    if part.cuda_only and not ctx.cuda:
        findings = Findings(skipped=["the whole part: CUDA only, and torch.cuda.is_available() is False"])
        return PartResult(part.name, part.title, SKIPPED, 0.0, shown, findings)
    if left < MIN_START_S:
        return PartResult(part.name, part.title, NOT_RUN, 0.0, shown, Findings())
    result_file = os.path.join(ctx.out, f"{part.name}.json")
    if os.path.exists(result_file):
        os.remove(result_file)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])),
               PYTHONUNBUFFERED="1", **{RESULT_ENV: result_file, "GPU_CHECK_QUICK": "1" if ctx.quick else "0"})
    for key, value in part.env(ctx).items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    log_path = os.path.join(ctx.out, f"{part.name}.log")
    with open(log_path, "w") as log:
        # SIGINT as the default in the part: a job started in the background by a shell (make's halves,
        # `cmd &`) inherits it ignored, and Python then never raises KeyboardInterrupt (see Running.poll)
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=_sigint_default)
    return Running(part, ctx, proc, shown, log_path, result_file, time.monotonic(), min(part.timeout, left - 5))


def _sigint_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _findings(part: Part, ctx: Context, result_file: str) -> Findings:
    if part.junit:
        return report.junit_findings(os.path.join(ctx.out, part.junit))
    if part.name == "bench":
        return _bench_findings(os.path.join(ctx.out, "bench.json"))
    if os.path.exists(result_file):
        with open(result_file) as f:
            return Findings.from_json(json.load(f))
    return Findings()


def _bench_findings(path: str) -> Findings:
    """The bench's rows as measurements: each row's median times and torchpmap's ratios."""
    findings = Findings()
    if not os.path.exists(path):
        return findings
    with open(path) as f:
        doc = json.load(f)
    for row in doc.get("rows", []):
        case = row["case"]
        for column, cell in row.get("columns", {}).items():
            if "median_s" in cell or "median" in cell:
                seconds = cell.get("median_s", cell.get("median"))
                findings.measurements[f"{case}: {column} ({row.get('unit')})"] = f"{seconds * 1e6:.1f} us"
            elif "error" in cell:
                findings.checks.append(Check(f"{case}: {column} runs", False, str(cell["error"])[:600]))
        for key, title in (("ratios", "torchpmap"), ("jit_ratios", "torchpmap.jit")):
            for baseline, stats in row.get(key, {}).items():
                findings.measurements[f"{case}: {title} / {baseline}"] = round(stats["median"], 3)
        ok = row.get("check", {}).get("ok")
        if ok is not None:
            findings.checks.append(Check(f"{case}: every column gives the reference's numbers", bool(ok),
                                         json.dumps(row["check"].get("max_abs_diff", {}))[:400]))
    return findings
