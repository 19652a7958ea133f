"""The documentation site: every page's code runs, and the site builds.

1. Every ```python block of every page under ``docs/`` runs. A page's blocks run in
   order, in one namespace (a later block may use what an earlier one defined), in a
   fresh Python process with a timeout, in the repository root, with this process'
   environment (so ``TORCHPMAP_NUM_CPU_DEVICES=4`` reaches the pages too).

   * A ```text block whose info string holds ``title="Output"`` right after a python
     block is that block's expected standard output; it is compared exactly (trailing
     whitespace aside). Other text blocks are not checked.
   * A block preceded by the comment ``<!-- docs-test: skip -->`` is not run, nor is a
     program for torchrun, i.e. a block whose first line is a comment starting with
     ``# torchrun`` (``# torchrun --nproc-per-node=4 prog.py``): both need several
     processes. A page containing ``<!-- docs-test: skip-page -->`` is not run at all.
   * A page whose code imports a ``torchpmap`` submodule that does not exist (yet) is
     skipped, naming the module.

2. ``python -m mkdocs build --strict`` succeeds, into a temporary directory (a few
   seconds; skipped when mkdocs, mkdocs-material or mkdocstrings are not installed:
   ``pip install -e ".[docs]"``).
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGE_TIMEOUT_S = 300
BUILD_TIMEOUT_S = 300

SKIP_BLOCK = "<!-- docs-test: skip -->"
SKIP_PAGE = "<!-- docs-test: skip-page -->"
# Pages in mkdocs.yml's nav that are written together with the code they document.
OWNED_ELSEWHERE = ("multiprocess.md",)

# A fenced block: opening fence (possibly indented, e.g. inside an admonition), info
# string, body, closing fence with the same indentation.
_FENCE = re.compile(
    r"^(?P<indent>[ \t]*)(?P<fence>```+)(?P<info>[^\n`]*)\n(?P<body>.*?)^(?P=indent)(?P=fence)[ \t]*$",
    re.MULTILINE | re.DOTALL,
)
_TORCHRUN = re.compile(r"#\s*torchrun\b")
_SUBMODULE = re.compile(r"^\s*(?:from|import)\s+torchpmap\.(\w+)", re.MULTILINE)
# the imported names: a parenthesized list may span lines, a plain one ends with its line
_FROM_PACKAGE = re.compile(r"^[ \t]*from\s+torchpmap\s+import\s+(?:\(([\w\s,]+)\)|([\w \t,]+))", re.MULTILINE)


@dataclasses.dataclass
class Block:
    line: int  # 1-based line of the first line of code in the page
    code: str
    expected: str | None = None  # the expected stdout, from an Output block


def _language(info: str) -> str:
    words = info.strip().split()
    return words[0].lower() if words else ""


def extract_blocks(text: str) -> list[Block]:
    """The runnable python blocks of a page, with their expected outputs."""
    blocks: list[Block] = []
    previous_end = 0
    last: Block | None = None
    for m in _FENCE.finditer(text):
        lang, info = _language(m["info"]), m["info"]
        between = text[previous_end : m.start()]
        previous_end = m.end()
        if lang == "python":
            code = textwrap.dedent(
                "\n".join(
                    line[len(m["indent"]) :] if line.startswith(m["indent"]) else line
                    for line in m["body"].splitlines()
                )
            )
            if between.rstrip().endswith(SKIP_BLOCK) or _TORCHRUN.match(code.lstrip("\n")):
                last = None
                continue
            last = Block(line=text.count("\n", 0, m.start("body")) + 1, code=code)
            blocks.append(last)
        elif lang == "text" and 'title="Output"' in info:
            if last is None or between.strip():
                raise AssertionError(
                    f"an Output block at line {text.count(chr(10), 0, m.start()) + 1} does not directly follow a "
                    "python block that runs"
                )
            last.expected = textwrap.dedent(m["body"])
            last = None
        else:
            last = None
    return blocks


def _pages() -> list[Path]:
    return sorted(DOCS.rglob("*.md")) if DOCS.is_dir() else []


def _runnable_pages() -> list[Path]:
    """Pages with at least one python block to run (or a malformed one, to report)."""
    pages = []
    for page in _pages():
        try:
            if extract_blocks(page.read_text(encoding="utf-8")):
                pages.append(page)
        except AssertionError:
            pages.append(page)
    return pages


def _missing_modules(code: str) -> list[str]:
    """The ``torchpmap.X`` submodules that ``code`` imports but that do not exist."""
    import torchpmap

    names = set(_SUBMODULE.findall(code))
    for groups in _FROM_PACKAGE.findall(code):
        for name in "".join(groups).split(","):
            name = name.split(" as ")[0].strip()
            if name and not hasattr(torchpmap, name):
                names.add(name)
    return sorted(f"torchpmap.{n}" for n in names if importlib.util.find_spec(f"torchpmap.{n}") is None)


# Runs in the child process: executes the blocks in order in one namespace and reports
# each block's stdout as JSON on the real stdout, after a marker line.
_RUNNER = r"""
import contextlib, io, json, sys, traceback
page, blocks = json.load(open(sys.argv[1], encoding="utf-8"))
namespace = {"__name__": "__main__"}
outputs = []
real_stdout = sys.stdout
for number, block in enumerate(blocks, 1):
    buffer = io.StringIO()
    code = compile("\n" * (block["line"] - 1) + block["code"], page, "exec")
    try:
        with contextlib.redirect_stdout(buffer):
            exec(code, namespace)
    except BaseException:
        real_stdout.write(buffer.getvalue())
        sys.stderr.write(f"\n*** {page}: python block {number} (line {block['line']}) raised:\n")
        traceback.print_exc()
        sys.exit(1)
    outputs.append(buffer.getvalue())
real_stdout.write("\n@@DOCS-TEST-OUTPUTS@@\n" + json.dumps(outputs))
"""


def _normalize(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.strip("\n").splitlines())


@pytest.mark.parametrize("page", _runnable_pages(), ids=lambda p: str(p.relative_to(DOCS)))
def test_page_code_runs(page: Path, tmp_path: Path) -> None:
    text = page.read_text(encoding="utf-8")
    rel = str(page.relative_to(ROOT))
    if SKIP_PAGE in text:
        pytest.skip(f"{rel} is marked {SKIP_PAGE}")
    blocks = extract_blocks(text)  # AssertionError for an Output block after no python block
    missing = _missing_modules("\n".join(b.code for b in blocks))
    if missing:
        pytest.skip(f"{rel} uses {', '.join(missing)}, which does not exist yet")
    spec = tmp_path / "blocks.json"
    spec.write_text(json.dumps([rel, [dataclasses.asdict(b) for b in blocks]]), encoding="utf-8")
    runner = tmp_path / "run_blocks.py"
    runner.write_text(_RUNNER, encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env.setdefault("MPLBACKEND", "Agg")
    try:
        proc = subprocess.run(
            [sys.executable, str(runner), str(spec)],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=PAGE_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{rel}: its code did not finish within {PAGE_TIMEOUT_S} s\n{e.stdout or ''}\n{e.stderr or ''}")
    if proc.returncode != 0:
        pytest.fail(
            f"{rel}: its code failed (exit {proc.returncode})\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
        )
    marker = "\n@@DOCS-TEST-OUTPUTS@@\n"
    assert marker in proc.stdout, f"{rel}: the runner reported no outputs\n{proc.stdout}\n{proc.stderr}"
    outputs = json.loads(proc.stdout.rsplit(marker, 1)[1])
    for number, (block, out) in enumerate(zip(blocks, outputs), 1):
        if block.expected is not None:
            assert _normalize(out) == _normalize(block.expected), (
                f"{rel}: python block {number} (line {block.line}) printed something other than its Output block\n"
                f"--- printed\n{out}\n--- the page says\n{block.expected}"
            )


def _have_mkdocs() -> str | None:
    for module in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python"):
        try:
            if importlib.util.find_spec(module) is None:
                return module
        except ModuleNotFoundError:
            return module
    return None


def test_mkdocs_build_strict(tmp_path: Path) -> None:
    missing = _have_mkdocs()
    if missing:
        pytest.skip(f"{missing} is not installed (pip install -e '.[docs]')")
    if not (ROOT / "mkdocs.yml").exists():
        pytest.fail("mkdocs.yml is missing")
    for page in OWNED_ELSEWHERE:
        if not (DOCS / page).exists():
            pytest.skip(f"docs/{page} (in the nav; written with torchpmap.distributed) does not exist yet")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=ROOT, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"}, capture_output=True, text=True,
        timeout=BUILD_TIMEOUT_S,
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    assert (tmp_path / "site" / "index.html").exists()
