"""What the GPU check's programs share: the device, a recorder of verdicts, comparisons,
and a watch for host synchronisations."""
from __future__ import annotations

import contextlib
import os
import sys
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from torchpmap.bench.gpu_check.outcome import Check, Findings, Value

#: Set by the runner for ``--quick``: smaller sizes, fewer variants (CI's short pass).
QUICK = os.environ.get("GPU_CHECK_QUICK") == "1"


def device() -> torch.device:
    """The device a program checks: the first CUDA device, else the CPU."""
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def has_cuda() -> bool:
    return torch.cuda.is_available()


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class Recorder:
    """Collects one program's verdicts; :meth:`case` turns an exception into a failed
    check and goes on with the next case, so that one failure hides nothing else."""

    def __init__(self) -> None:
        self.findings = Findings()

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        self.findings.checks.append(Check(name, bool(ok), detail))
        print(f"[{'ok' if ok else 'FAILED'}] {name}{': ' + detail if detail else ''}", flush=True)
        return bool(ok)

    def measure(self, name: str, value: Value) -> None:
        self.findings.measurements[name] = value
        print(f"[measured] {name} = {value}", flush=True)

    def skip(self, what: str, why: str) -> None:
        self.findings.skipped.append(f"{what}: {why}")
        print(f"[skipped] {what}: {why}", flush=True)

    @contextlib.contextmanager
    def case(self, name: str) -> Iterator[None]:
        """A block whose exception is recorded as the failed check ``name``."""
        try:
            yield
        except Exception as error:  # noqa: BLE001 -- recorded, and the program goes on
            self.check(name, False, describe(error))
            traceback.print_exc()

    def finish(self) -> int:
        """Writes the findings; the exit status: 0 when every check passed."""
        self.findings.write()
        failed = [c.name for c in self.findings.checks if not c.ok]
        print(f"{len(self.findings.checks) - len(failed)} of {len(self.findings.checks)} checks passed", flush=True)
        return 1 if failed else 0


def describe(error: BaseException, limit: int = 1500) -> str:
    """An exception as one readable line: type, message, and where it came from."""
    frames = traceback.extract_tb(error.__traceback__)
    where = next((f for f in reversed(frames) if "torchpmap" in f.filename), frames[-1] if frames else None)
    text = f"{type(error).__name__}: {error}".strip()
    notes = getattr(error, "__notes__", None)
    if notes:
        text += " (" + "; ".join(notes) + ")"
    if where is not None:
        text += f" [at {os.path.relpath(where.filename)}:{where.lineno} in {where.name}]"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def relative_error(got: Any, expected: Any) -> float:
    """``|got - expected| / |expected|``, the norms taken over every leaf of the two trees
    together (in float64): a leaf whose true value is zero (a bias before batch norm) is
    judged against the whole, not against its own rounding noise."""
    xs, ys = _leaves(got), _leaves(expected)
    if len(xs) != len(ys) or any(x.shape != y.shape for x, y in zip(xs, ys, strict=True)):
        return float("inf")
    if not xs:
        return 0.0
    diff = torch.cat([(x - y).flatten() for x, y in zip(xs, ys, strict=True)])
    if not torch.isfinite(diff).all():
        return float("inf")
    scale = torch.cat([y.flatten() for y in ys]).norm().item()
    return diff.norm().item() / (scale if scale > 0 else 1.0)


def _leaves(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, dict):
        return [leaf for k in sorted(tree) for leaf in _leaves(tree[k])]
    if isinstance(tree, (list, tuple)):
        return [leaf for v in tree for leaf in _leaves(v)]
    return [torch.as_tensor(tree).detach().double().cpu()]


def close(rec: Recorder, name: str, got: Any, expected: Any, tolerance: float) -> bool:
    error = relative_error(got, expected)
    return rec.check(name, error <= tolerance, f"relative error {error:.2e} (tolerance {tolerance:.0e})")


# --------------------------------------------------------------------------- host synchronisations


#: How torch's sync debug mode words a synchronisation it saw.
SYNC_WARNING = "called a synchronizing CUDA operation"


@contextlib.contextmanager
def sync_sites(sites: list[str]) -> Iterator[None]:
    """Runs the block under ``torch.cuda.set_sync_debug_mode("warn")`` and appends to
    ``sites`` one line per host synchronisation: where it came from (the innermost
    frames of torchpmap, or of the caller)."""
    if not torch.cuda.is_available():  # a dry run on the CPU: nothing to watch
        yield
        return
    previous = torch.cuda.get_sync_debug_mode()
    shown = warnings.showwarning

    def record(
        message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: str | None = None
    ) -> None:
        if not str(message).startswith(SYNC_WARNING):  # e.g. the mode's own "prototype feature" note
            return shown(message, category, filename, lineno, file, line)
        stack = traceback.extract_stack()[:-1]
        ours = [f for f in stack if "torchpmap" in f.filename and "gpu_check" not in f.filename]
        frames = (ours or stack)[-3:]
        sites.append(f"{str(message).splitlines()[0]} at " + " <- ".join(
            f"{os.path.relpath(f.filename)}:{f.lineno} ({f.name})" for f in reversed(frames)
        ))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(previous)
            warnings.showwarning = shown


@contextlib.contextmanager
def syncs_are_errors() -> Iterator[None]:
    """``torch.cuda.set_sync_debug_mode("error")`` for the block."""
    if not torch.cuda.is_available():  # a dry run on the CPU: nothing to watch
        yield
        return
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def unique(lines: Sequence[str]) -> list[str]:
    return list(dict.fromkeys(lines))


def main_guard(fn: Callable[[], int]) -> None:
    """Runs a program's ``main`` and exits with its status."""
    sys.exit(fn())
