"""What a part of the GPU check found: checks, measurements and what it skipped.

A part's program (``programs/``) fills a :class:`Findings` and writes it as JSON to the
file named by ``GPU_CHECK_RESULT``; the runner reads it back into a :class:`PartResult`.
"""
from __future__ import annotations

import dataclasses
import json
import os

#: A number or a label.
Scalar = float | int | str | bool | None
#: A measured value: a scalar, or a small table of them.
Value = Scalar | dict[str, Scalar]

#: Where a part's program writes its findings (set by the runner).
RESULT_ENV = "GPU_CHECK_RESULT"


@dataclasses.dataclass
class Check:
    """One verdict: ``name`` passed or not, and why (the numbers, or the error)."""

    name: str
    ok: bool
    detail: str = ""


@dataclasses.dataclass
class Findings:
    """Everything one part's program found."""

    checks: list[Check] = dataclasses.field(default_factory=list)
    measurements: dict[str, Value] = dataclasses.field(default_factory=dict)
    skipped: list[str] = dataclasses.field(default_factory=list)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, doc: dict) -> Findings:
        return cls(
            checks=[Check(**c) for c in doc.get("checks", [])],
            measurements=dict(doc.get("measurements", {})),
            skipped=list(doc.get("skipped", [])),
        )

    def write(self, path: str | None = None) -> None:
        path = path or os.environ.get(RESULT_ENV)
        if path:
            with open(path, "w") as f:
                json.dump(self.to_json(), f, indent=1)


#: A part's outcomes, from best to worst.
PASSED, SKIPPED, FAILED, TIMED_OUT, NOT_RUN = "passed", "skipped", "failed", "timed out", "not run"


@dataclasses.dataclass
class PartResult:
    """A part's outcome as the report shows it.

    Attributes:
        name, title: the part (see :mod:`torchpmap.bench.gpu_check.parts`).
        outcome: :data:`PASSED`, :data:`SKIPPED` (CUDA only, and no CUDA here),
            :data:`FAILED`, :data:`TIMED_OUT` or :data:`NOT_RUN` (the time budget ran out).
        seconds: how long its process ran.
        command: the command line it ran.
        findings: what its program reported.
        returncode: its exit status (None when killed or not run).
        log_tail: the end of its output, kept for parts that did not pass.
    """

    name: str
    title: str
    outcome: str
    seconds: float
    command: str
    findings: Findings
    returncode: int | None = None
    log_tail: str = ""

    def to_json(self) -> dict:
        return dataclasses.asdict(self)
