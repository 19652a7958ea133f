"""Shows a run: a text table, a JSON document and a PNG chart."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

from torchpmap.bench.core import COLUMNS, jit_baseline

Doc = dict[str, Any]
Row = dict[str, Any]
Bar = tuple[float, float, float]  # median, q1, q3
ValueOf = Callable[[Row, str], Bar | None]

#: Always shown; the other columns only when some row measured them.
CORE_COLUMNS = list(COLUMNS)[:4]
RATIO_NOTE = (
    "ratio tp/X = torchpmap time / X time (median over paired repetitions; jit/X the same for torchpmap.jit); "
    "> 1: torchpmap is slower"
)


# --------------------------------------------------------------------------- text


def format_time(seconds: float) -> str:
    """Three significant digits in a fitting unit.

    Example:
        >>> format_time(0.000148), format_time(2.5e-9), format_time(1.5), format_time(0.01234)
        ('148 µs', '2.50 ns', '1.50 s', '12.3 ms')
    """
    for scale, unit in ((1.0, "s"), (1e-3, "ms"), (1e-6, "µs"), (1e-9, "ns")):
        if seconds >= scale or unit == "ns":
            value = seconds / scale
            digits = 0 if value >= 99.95 else 1 if value >= 9.995 else 2
            return f"{value:.{digits}f} {unit}"
    raise AssertionError("unreachable")


def shown_columns(rows: list[Row]) -> list[str]:
    measured = {name for row in rows for name, cell in row["columns"].items() if "median_s" in cell or "error" in cell}
    return [name for name in COLUMNS if name in CORE_COLUMNS or name in measured]


class _Notes:
    """Numbered footnotes for n/a and error cells, one number per distinct text."""

    def __init__(self) -> None:
        self.texts: list[str] = []

    def ref(self, text: str) -> int:
        if text not in self.texts:
            self.texts.append(text)
        return self.texts.index(text) + 1


def _time_cell(cell: dict[str, Any], notes: _Notes) -> str:
    if "median_s" in cell:
        spread = (cell["q3_s"] - cell["q1_s"]) / 2 / cell["median_s"] * 100
        return f"{format_time(cell['median_s'])} ±{spread:.0f}%"
    if "error" in cell:
        return f"ERROR[{notes.ref(cell['error'])}]"
    return f"n/a[{notes.ref(cell['na'])}]"


def _check_cell(check: dict[str, Any]) -> str:
    ok = check.get("ok")
    if ok is None:
        return "-"
    if ok:
        return "ok"
    worst = max(check["max_abs_diff"].values())
    return f"FAIL({worst:.1e})"


def _jit_baselines(rows: list[Row]) -> list[str]:
    """The baselines that some row compares torchpmap.jit with."""
    compared = {name for row in rows for name in row.get("jit_ratios", {})}
    return [name for name in COLUMNS if name in compared and jit_baseline(name)]


def _ratio_cells(ratios: dict[str, Any], names: list[str]) -> list[str]:
    return [f"{ratios[name]['median']:.2f}x" if name in ratios else "-" for name in names]


def _row_cells(row: Row, columns: list[str], jit_baselines: list[str], notes: _Notes) -> list[str]:
    label = [row["case"], row["unit"] or "-"]
    if "na" in row or "error" in row:
        what = "n/a" if "na" in row else "ERROR"
        return label + [f"{what}: {row.get('na') or row.get('error')}"]
    times = [_time_cell(row["columns"][name], notes) for name in columns]
    ratios = _ratio_cells(row["ratios"], columns[1:]) + _ratio_cells(row.get("jit_ratios", {}), jit_baselines)
    return label + times + ratios + [_check_cell(row["check"])]


def format_table(doc: Doc) -> str:
    """The table of medians (± half the IQR, in % of the median), ratios and checks."""
    rows: list[Row] = doc["rows"]
    columns, jit_baselines = shown_columns(rows), _jit_baselines(rows)
    header = ["case", "per"] + columns + [f"tp/{name}" for name in columns[1:]]
    header += [f"jit/{name}" for name in jit_baselines] + ["check"]
    notes = _Notes()
    body = [_row_cells(row, columns, jit_baselines, notes) for row in rows]
    widths = [max([len(header[i])] + [len(r[i]) for r in body if len(r) == len(header)]) for i in range(len(header))]
    lines = [_title(doc), "", _join(header, widths), _join(["-" * w for w in widths], widths)]
    lines += [_join(r, widths) if len(r) == len(header) else _join(r, widths[:2]) for r in body]
    lines += ["", "Times: median per unit ± half the inter-quartile range. " + RATIO_NOTE + "."]
    lines += [f"  [{k}] {text}" for k, text in enumerate(notes.texts, start=1)]
    return "\n".join(lines + _load_warning(doc["meta"]))


def _load_warning(meta: dict[str, Any]) -> list[str]:
    """A warning when other work competed for the CPUs: a load above half the CPUs before
    the run, or above 1.5x the CPUs after it (the run itself keeps the CPUs busy)."""
    load, cpus = meta.get("load_average", {}), meta.get("cpu_count") or 1
    before, after = load.get("before"), load.get("after")
    if (before is None or before <= cpus / 2) and (after is None or after <= 1.5 * cpus):
        return []
    load_text = f"1-min load average {before} before, {after} after, on {cpus} CPUs"
    return [f"WARNING: the machine was busy ({load_text}): the numbers are noisy."]


def _join(cells: list[str], widths: list[int]) -> str:
    """Labels left-aligned, numbers right-aligned; a cell past ``widths`` is appended as is."""
    labels = [cells[0].ljust(widths[0]), cells[1].ljust(widths[1])]
    numbers = [c.rjust(w) for c, w in zip(cells[2:], widths[2:])] + cells[len(widths) :]
    return "  ".join(labels + numbers).rstrip()


def _title(doc: Doc) -> str:
    meta = doc["meta"]
    versions = ", ".join(f"{k} {v}" for k, v in meta["versions"].items())
    return (
        f"torchpmap benchmark ({meta['mode']} mode) on {meta['device']}, {meta['torch_threads']} torch threads, "
        f"{meta['cpu_count']} CPUs; {versions}"
    )


# --------------------------------------------------------------------------- files


def write_json(doc: Doc, path: str) -> None:
    _make_parent(path)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=2, sort_keys=False)
        f.write("\n")


def _make_parent(path: str) -> None:
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)


def write_png(doc: Doc, path: str) -> str:
    """Draws the chart; returns a line saying where, or why it was skipped."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "chart skipped: matplotlib is not installed (pip install matplotlib)"
    rows = [row for row in doc["rows"] if any("median_s" in c for c in row["columns"].values())]
    if not rows:
        return "chart skipped: nothing was measured"
    columns = [name for name in shown_columns(rows) if any("median_s" in r["columns"][name] for r in rows)]
    fig, (times_ax, ratio_ax) = plt.subplots(1, 2, figsize=(14, 0.7 * len(rows) + 2.5), sharey=True)
    _bars(times_ax, rows, columns, _times_of)
    times_ax.invert_yaxis()  # shared with ratio_ax: the first row on top in both
    times_ax.set_xlabel("median time per unit (s, log scale; whiskers: IQR)")
    _bars(ratio_ax, rows, columns[1:], _ratios_of, offset=1)
    ratio_ax.axvline(1.0, color="black", linewidth=0.8)
    ratio_ax.set_xlabel("torchpmap time / column time (log scale; > 1: torchpmap slower)")
    fig.suptitle(_title(doc), fontsize=9)
    fig.tight_layout()
    _make_parent(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"chart written to {path}"


def _times_of(row: Row, name: str) -> Bar | None:
    cell = row["columns"][name]
    return (cell["median_s"], cell["q1_s"], cell["q3_s"]) if "median_s" in cell else None


def _ratios_of(row: Row, name: str) -> Bar | None:
    r = row["ratios"].get(name)
    return (r["median"], r["q1"], r["q3"]) if r else None


def _bars(ax: Any, rows: list[Row], columns: list[str], value_of: ValueOf, offset: int = 0) -> None:
    """Horizontal bars, one group per row, one bar per column, on a log x axis."""
    height = 0.8 / max(1, len(columns))
    for k, name in enumerate(columns):
        found = [(i, value_of(row, name)) for i, row in enumerate(rows)]
        bars = [(i + (k - (len(columns) - 1) / 2) * height, v) for i, v in found if v is not None]
        if not bars:
            continue
        ys, values = zip(*bars)
        mids = [m for m, _, _ in values]
        errors = [[m - lo for m, lo, _ in values], [hi - m for m, _, hi in values]]
        ax.barh(ys, mids, height=height, color=f"C{k + offset}", xerr=errors, capsize=2, label=name)
    ax.set_xscale("log")
    ax.set_yticks(range(len(rows)), [f"{r['case']} (/{r['unit']})" for r in rows])
    ax.legend(fontsize=8, loc="lower right")
