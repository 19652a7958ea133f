"""torchpmap._state.torch_private: every private torch API torchpmap uses, checked on the running torch.

One test per entry, so that on a new torch release the failing test names the entry
(and ``docs/torch-internals.md`` says what that entry is for and what replaces it).
"""
from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import sys
import warnings

import pytest
import torch

from torchpmap._state import torch_private as private

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCE = ROOT / "torchpmap" / "_state" / "torch_private.py"

# the probes and the source scan map nothing: one pass of them is enough
pytestmark = pytest.mark.same_on_every_placement


@pytest.mark.parametrize("name", list(private.ENTRIES))
def test_entry_works_on_this_torch(name):
    private.check(name)


def _docstrings() -> dict[str, str]:
    """Entry name -> its docstring: a def's, or the string right after an assignment."""
    body = ast.parse(SOURCE.read_text()).body
    docs = {}
    for node, following in zip(body, body[1:] + [None]):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            docs[node.name] = ast.get_docstring(node) or ""
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            named = len(targets) == 1 and isinstance(targets[0], ast.Name)
            if named and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant):
                docs[targets[0].id] = str(following.value.value)
    return docs


def test_probes_leave_the_callers_random_stream_where_it_was():
    """The first map of a process runs probes (``changed``); a run resumed from a
    checkpoint must then draw the dropout masks of the run it resumes."""
    torch.manual_seed(7)
    want = torch.rand(4)
    torch.manual_seed(7)
    for name in private.ENTRIES:
        private.changed(name)
    private.check()
    torch.testing.assert_close(torch.rand(4), want, rtol=0, atol=0)


@pytest.mark.parametrize("name", list(private.ENTRIES))
def test_entry_says_what_it_is_for_and_what_replaces_it(name):
    assert hasattr(private, name), f"ENTRIES names {name!r}, which the module does not define"
    doc = " ".join(_docstrings().get(name, "").split())
    assert "For:" in doc, f"{name}: its docstring must say what torchpmap uses it for ('For: ...')"
    assert "Public replacement" in doc, f"{name}: its docstring must name the public replacement, or 'none'"
    assert f"Checked: torch {', '.join(private.CHECKED)}" in doc, (
        f"{name}: its docstring must list the versions checked"
    )


def test_every_entry_is_in_the_docs():
    page = (ROOT / "docs" / "torch-internals.md").read_text()
    missing = [name for name in private.ENTRIES if f"`{name}`" not in page]
    assert not missing, f"docs/torch-internals.md does not list {missing}"


# A private torch API: torch._anything, torch.x._anything, `from torch... import _x`, the
# private modules under a short name, and the private names torchpmap has used outside
# attribute chains.
_PRIVATE = re.compile(
    r"\btorch(\.\w+)*\._[A-Za-z]|\bfrom torch(\.\w+)* import [^#\n]*\b_[A-Za-z]|"
    r"\b(_C|_functorch|_autograd|_pytree|_subclasses|_dynamo|_inductor)\b|\bpytree\.(_[A-Za-z]|SUPPORTED_NODES)|"
    r"\b(_allow_non_fake_inputs|_get_default_store|_make_dual|distributed_c10d)\b"
)

# Call sites in files their owners are changing, still to be switched to the door
# (file -> substrings of the lines): remove a line here when its call site is switched.
_PENDING: dict[str, list[str]] = {}  # call sites not yet switched to the door: none


def test_no_private_torch_outside_the_door():
    found = []
    for path in sorted((ROOT / "torchpmap").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel == "torchpmap/_state/torch_private.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if _PRIVATE.search(line) and not any(p in line for p in _PENDING.get(rel, ())):
                found.append(f"{rel}:{number}: {line.strip()}")
    assert not found, "private torch outside torchpmap/_state/torch_private.py:\n" + "\n".join(found)


def test_check_names_the_failing_entry(monkeypatch):
    def broken() -> None:
        raise AttributeError("gone")

    monkeypatch.setitem(
        private.ENTRIES, "add_batch_dim", private.Entry("add_batch_dim", "torch._C._functorch._add_batch_dim", broken)
    )
    with pytest.raises(
        private.TorchPrivateError, match=r"torchpmap\._state\.torch_private\.add_batch_dim .*gone"
    ) as info:
        private.check("add_batch_dim", "current_vmap_level")
    assert info.value.entry == "add_batch_dim"


def test_a_missing_api_raises_when_used_not_at_import():
    stand_in = private._bind("vmap_level_of", lambda: torch._C._functorch.no_such_function)
    with pytest.raises(private.TorchPrivateError, match=r"_state\.torch_private\.vmap_level_of is missing"):
        stand_in(torch.ones(1))


# Modules that call sites still to be switched import at ``import torchpmap``: compiled.py
# builds ``_VALUE_DEPENDENT`` at import (-> call private.value_dependent_errors() in
# _fallback_message), which imports symbolic_shapes and with it torch.utils._sympy.
_PENDING_IMPORTS = ["torch.fx.experimental.symbolic_shapes"]


def test_import_loads_no_new_private_torch_module():
    """``import torchpmap`` imports nothing from private torch that ``import torch`` did not."""
    code = (
        "import sys, torch\n"
        f"for m in {_PENDING_IMPORTS!r}: __import__(m)\n"
        "before = set(sys.modules)\n"
        "import torchpmap\n"
        "new = sorted(m for m in set(sys.modules) - before if m.startswith('torch.') and "
        "any(part.startswith('_') for part in m.split('.')[1:]))\n"
        "print(new)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_default_store_failure_warns_that_fault_watching_is_off(monkeypatch):
    import torch.distributed as dist

    from torchpmap._state import process_group as pg

    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed, not yet initialized")

    def gone():
        raise private.TorchPrivateError("default_store", "is missing (probe)")

    monkeypatch.setattr(private, "default_store", gone)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.warns(
            private.TorchPrivateWarning, match=r"_state\.torch_private\.default_store.*fault watching is off"
        ):
            st = pg._adopt_existing_group()
        assert st.store is None
    finally:
        dist.destroy_process_group()


def test_default_store_adopted_when_present():
    import torch.distributed as dist

    from torchpmap._state import process_group as pg

    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed, not yet initialized")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", private.TorchPrivateWarning)
            st = pg._adopt_existing_group()
        try:
            assert st.store is not None  # fault watching is on
        finally:
            if st.heartbeat is not None:
                st.heartbeat.stop(exited=True)
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------- probes at run time (issue 27)

#: The first vectorized pmap of a process, under each transform (one fresh process each):
#: the probe behind torchpmap's batching rules ran in the caller's thread, saw the grad or
#: jvp level wrap its ops, warned that torch had changed and turned the rules off.
_FIRST_PMAP = {
    "grad": "torch.func.grad(lambda v: f(v).sum())(x)",
    "vmap": "torch.func.vmap(f)(torch.ones(2, 4, 3))",
    "jvp": "torch.func.jvp(f, (x,), (x,))",
    "nested_pmaps": "tp.pmap(lambda v: f(v), axis_name='j')(torch.ones(2, 4, 3))",
    "grad_of_nested_pmaps": (
        "torch.func.grad(lambda v: tp.pmap(lambda w: f(w), axis_name='j')(v).sum())(torch.ones(2, 4, 3))"
    ),
}


def _fresh_process(code: str, devices: int) -> subprocess.CompletedProcess:
    env = {**__import__("os").environ, "TORCHPMAP_NUM_CPU_DEVICES": str(devices), "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)


_RULES_ON = (
    "from torchpmap._state import torch_private as p\n"
    "flash = p.cpu_flash_attention()\n"
    "print('rules on:', flash is None or p.has_kernel_for_dispatch_key(flash[0].name(), 'FuncTorchBatched'))\n"
)


@pytest.mark.parametrize("devices", [1, 4])
@pytest.mark.parametrize("case", list(_FIRST_PMAP))
def test_the_first_pmap_under_a_transform_keeps_the_batching_rules_on(case, devices):
    code = (
        "import warnings, torch, torchpmap as tp\n"
        "warnings.simplefilter('error', tp._state.torch_private.TorchPrivateWarning)\n"
        "f = tp.pmap(lambda v: tp.psum(v * v, 'i'), axis_name='i')\n"
        "x = torch.ones(4, 3)\n"
        f"{_FIRST_PMAP[case]}\n" + _RULES_ON
    )
    done = _fresh_process(code, devices)
    assert done.returncode == 0 and "TorchPrivateWarning" not in done.stderr, done.stderr[-3000:]
    assert "rules on: True" in done.stdout, done.stdout + done.stderr[-3000:]


def test_a_probe_that_cannot_run_turns_nothing_off():
    """A probe failing for another reason than torch changing (here: no memory) says
    nothing about torch: the rules stay on, without a warning."""
    code = (
        "import warnings, torch, torchpmap as tp\n"
        "from torchpmap._state import torch_private as p\n"
        "def no_memory():\n"
        "    raise RuntimeError('CUDA out of memory (a probe that could not run)')\n"
        "p.ENTRIES['batching_excluded'] = p.Entry('batching_excluded', 'x', no_memory)\n"
        "warnings.simplefilter('error', p.TorchPrivateWarning)\n"
        "tp.pmap(lambda v: v * 2)(torch.ones(4, 3))\n" + _RULES_ON
    )
    done = _fresh_process(code, 1)
    assert done.returncode == 0 and "rules on: True" in done.stdout, done.stdout + done.stderr[-3000:]


def test_a_probe_that_finds_torch_changed_turns_the_rules_off_and_says_so():
    code = (
        "import warnings, torch, torchpmap as tp\n"
        "from torchpmap._state import torch_private as p\n"
        "def changed():\n"
        "    p._expect(False, 'ops run below the level')\n"
        "p.ENTRIES['batching_excluded'] = p.Entry('batching_excluded', 'x', changed)\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    tp.pmap(lambda v: v * 2)(torch.ones(4, 3))\n"
        "print([str(w.message) for w in caught if issubclass(w.category, p.TorchPrivateWarning)])\n" + _RULES_ON
    )
    done = _fresh_process(code, 1)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "batching_excluded failed its check: AssertionError: ops run below the level" in done.stdout, done.stdout
    assert "rules on: False" in done.stdout, done.stdout


def test_check_runs_every_probe_outside_the_callers_transforms():
    seen = []
    torch.func.grad(lambda v: (seen.append(private.check()), (v * v).sum())[1])(torch.ones(2))
    torch.func.vmap(lambda v: (private.check("batching_excluded", "current_vmap_level"), v)[1])(torch.ones(2, 3))
    assert seen == [None]
