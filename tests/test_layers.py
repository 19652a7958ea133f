"""The house has no loops, and its folders are its layers.

The import graph of ``torchpmap/`` (every import statement, module-level or inside a
function) has no cycle, and no import runs up the layers. A module's layer is the layer of
the folder it sits in; a module may import from its own layer or any layer below:

0. front end: the public modules at the top of the package (``torchpmap``, ``training``,
   ``data``, ``checkpoint``, ``distributed``) and ``_frontend/`` (the signatures of
   ``pmap``/``vmap``, the arguments and outputs of a call, shard_map, pytree prefix matching)
1. collectives: ``_collectives/`` (the public collectives, the math of each collective and
   its autograd/vmap binding)
2. engines: ``_engines/``
3. devices and mesh: ``_placement/`` (devices, meshes, sharded tensors)
4. process state and values: ``_state/`` (the process group and its store, the per-call
   context, config, the axis environment, the logger, the private-torch door, the compile
   guard, the ``Device`` record, faults)

Every private module sits in a layer folder: a private module at the top of the package
(``torchpmap/_x.py``), or a private folder that is not a layer, fails here.
``torchpmap/bench/`` sits on top of everything and is not checked.

A layer folder's ``__init__.py`` holds its docstring and nothing else: every class and
function lives in a module named for what it holds, so that no module imports its own
package for a name (``from torchpmap._engines import MappedCall`` inside ``_engines``, a
loop that Python hides by running the package's ``__init__`` first). The graph counts
such edges, from a module to the package it sits in, as any other.
"""
from __future__ import annotations

import ast
import collections
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1] / "torchpmap"

#: The layer of each folder of ``torchpmap/``; the public modules at the top are layer 0.
FOLDERS: dict[str, int] = {"_frontend": 0, "_collectives": 1, "_engines": 2, "_placement": 3, "_state": 4}
PUBLIC = 0


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        if "bench" in rel.parts:  # the benchmark suite sits on top of everything
            continue
        name = ".".join(rel.parts)
        found[name.removesuffix(".__init__")] = path
    return found


def _layer(module: str) -> int | None:
    """The layer of ``module`` (a dotted name) by where it sits; None where that is no layer."""
    parts = module.split(".")[1:]
    if not parts:
        return PUBLIC  # torchpmap/__init__.py
    if parts[0] in FOLDERS:
        return FOLDERS[parts[0]]
    if len(parts) == 1 and not parts[0].startswith("_"):
        return PUBLIC  # a public module at the top: training, data, checkpoint, distributed
    return None


def _imports(modules: dict[str, pathlib.Path]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = collections.defaultdict(set)
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        graph[name] |= _targets(ast.parse(path.read_text()), name, package, modules)
    return graph


def _targets(tree: ast.Module, name: str, package: str, modules: dict[str, pathlib.Path]) -> set[str]:
    """The modules that ``tree`` (module ``name``, in ``package``) imports, its own package included."""
    found = set()
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        for target in targets:
            while target not in modules and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in modules and target != name:
                found.add(target)
    return found


def test_every_module_has_a_layer():
    unknown = sorted(m for m in _modules() if _layer(m) is None)
    assert not unknown, f"put these modules in a layer folder ({', '.join(FOLDERS)}): {unknown}"


def test_every_private_module_sits_in_a_layer_folder():
    stray = sorted(
        p.name
        for p in ROOT.iterdir()
        if p.name.startswith("_")
        and p.name not in ("__init__.py", "__pycache__")
        and (p.suffix == ".py" or (p.is_dir() and p.name not in FOLDERS))
    )
    assert not stray, f"private modules outside the layer folders ({', '.join(FOLDERS)}): {stray}"
    missing = sorted(f for f in FOLDERS if not (ROOT / f / "__init__.py").is_file())
    assert not missing, f"layer folders that are not packages: {missing}"


def test_layer_packages_hold_no_code():
    """``_frontend/__init__.py`` and the others: a docstring, nothing else."""
    holding = {}
    for folder in FOLDERS:
        body = ast.parse((ROOT / folder / "__init__.py").read_text()).body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            body = body[1:]  # the docstring
        if body:
            holding[folder] = sorted({type(node).__name__ for node in body})
    assert not holding, f"layer packages whose __init__.py holds code (move it to a module of its own): {holding}"


def test_the_graph_sees_imports_of_a_modules_own_package():
    """An import of the package a module sits in is an edge like any other (it used to
    be left out, which hid a loop through ``_engines/__init__.py``)."""
    modules, package = _modules(), "torchpmap._engines"
    probe = ast.parse("from torchpmap._engines import dispatch, MappedCall\nfrom . import vectorized\n")
    found = _targets(probe, f"{package}.probe", package, modules)
    assert found == {f"{package}.dispatch", package, f"{package}.vectorized"}, found


def test_no_import_loops():
    graph = _imports(_modules())
    loops = []
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for t in sorted(graph.get(m, ())):
            if state.get(t) == 1:
                loops.append(" -> ".join(path[path.index(t):] + [t]) if t in path else f"{m} -> {t}")
            elif t not in state:
                visit(t, path + [t])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not loops, "import loops:\n" + "\n".join(loops)


def test_no_import_runs_up_the_layers():
    graph = _imports(_modules())
    layer = {m: _layer(m) for m in _modules()}
    up = [
        f"{m} (layer {layer[m]}) imports {t} (layer {layer[t]})"
        for m in sorted(graph)
        for t in sorted(graph[m])
        if layer[m] is not None and layer[t] is not None and layer[t] < layer[m]
    ]
    assert not up, "imports running up the layers:\n" + "\n".join(up)
