"""The GPU check's report: ``report.json`` (everything) and ``report.md`` (for people)."""
from __future__ import annotations

import json
import os
import xml.etree.ElementTree as ET
from typing import Any, cast

from torchpmap.bench.gpu_check.outcome import PASSED, Check, Findings, PartResult

_MARK = {"passed": "passed", "skipped": "skipped (no CUDA)", "failed": "**FAILED**", "timed out": "**TIMED OUT**",
         "not run": "not run (out of time)"}


def junit_findings(path: str) -> Findings:
    """A pytest JUnit file as findings: one failed check per failed test, the counts as
    measurements."""
    findings = Findings()
    if not os.path.exists(path):
        return findings
    root = ET.parse(path).getroot()
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for suite in root.iter("testsuite"):
        for key in counts:
            counts[key] += int(suite.get(key, 0))
    findings.measurements.update({f"pytest {k}": v for k, v in counts.items()})
    for case in root.iter("testcase"):
        for kind in ("failure", "error"):
            bad = case.find(kind)
            if bad is not None:
                message = (bad.get("message") or bad.text or "").strip().splitlines()
                findings.checks.append(Check(f"{case.get('classname')}::{case.get('name')}", False,
                                             f"{kind}: {' '.join(message[:3])[:600]}"))
    return findings


def _passed(findings: Findings) -> str:
    """The table's "checks passed": the checks, or for a pytest part its tests (skipped
    ones left out)."""
    m = findings.measurements

    def count(key: str) -> int:  # junit_findings stores them as ints
        return int(cast(int, m.get(key, 0)))

    if "pytest tests" in m:
        ran = count("pytest tests") - count("pytest skipped")
        bad = count("pytest failures") + count("pytest errors")
        return f"{ran - bad}/{ran} tests"
    return f"{sum(c.ok for c in findings.checks)}/{len(findings.checks)}"


def write(out: str, meta: dict[str, Any], results: list[PartResult]) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "report.json"), "w") as f:
        json.dump({"meta": meta, "parts": [r.to_json() for r in results]}, f, indent=1)
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write(markdown(meta, results))


def markdown(meta: dict[str, Any], results: list[PartResult]) -> str:
    lines = [
        "# GPU check",
        "",
        f"- date: {meta.get('date')}",
        f"- device: {meta.get('device')}",
        f"- command: `{meta.get('command')}`",
        f"- versions: {meta.get('versions')}",
        f"- total: {meta.get('seconds', 0):.0f} s of a {meta.get('budget', 0):.0f} s budget",
        "",
        "| part | outcome | seconds | checks passed | what |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        mark = _MARK.get(r.outcome, r.outcome)
        lines.append(f"| {r.name} | {mark} | {r.seconds:.0f} | {_passed(r.findings)} | {r.title} |")
    for r in results:
        lines += ["", f"## {r.name}: {_MARK.get(r.outcome, r.outcome)}", "", f"`{r.command}`", ""]
        failed = [c for c in r.findings.checks if not c.ok]
        for c in failed:
            lines.append(f"- **FAILED** {c.name}: {_one_line(c.detail)}")
        for c in r.findings.checks:
            if c.ok:
                lines.append(f"- ok {c.name}{': ' + _one_line(c.detail) if c.detail else ''}")
        for s in r.findings.skipped:
            lines.append(f"- skipped: {s}")
        if r.findings.measurements:
            lines += ["", "| measured | value |", "|---|---|"]
            lines += [f"| {k} | {_one_line(str(v))} |" for k, v in r.findings.measurements.items()]
        if r.outcome != PASSED and r.log_tail:
            lines += ["", "<details><summary>output (end)</summary>", "", "```", r.log_tail.rstrip(), "```",
                      "</details>"]
    return "\n".join(lines) + "\n"


def _one_line(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")
