"""The house has no loops: the import graph of ``torchpmap/`` (every import statement,
module-level or inside a function) has no cycle, and no import runs up the layers.

Layers, top to bottom (a module may import from its own layer or any layer below):

0. front end: the public modules and the call record (``torchpmap``, ``_api``, ``_front``, ...)
1. collectives: ``_collectives``, the math of each collective and its autograd/vmap rules
2. engines: ``_engines.*``
3. devices and mesh: ``_devices``, ``_mesh``, ``_sharded``
4. process state and values: ``_process_group``, ``_context``, ``_config``, ``_axis_env``,
   ``_log``, the private-torch door, ``_compile_guard``, the ``Device`` record, ``_faults``
"""
from __future__ import annotations

import ast
import collections
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1] / "torchpmap"

LAYERS: dict[str, int] = {
    "torchpmap": 0, "torchpmap._api": 0, "torchpmap._front": 0, "torchpmap._tree_prefix": 0,
    "torchpmap.training": 0, "torchpmap.distributed": 0, "torchpmap.data": 0, "torchpmap.checkpoint": 0,
    "torchpmap._launch": 0,
    "torchpmap._collectives": 1,
    "torchpmap._collective_math": 1, "torchpmap._collective_binding": 1, "torchpmap._gradient_mean": 1,
    "torchpmap._devices": 3, "torchpmap._mesh": 3, "torchpmap._sharded": 3,
    "torchpmap._process_group": 4, "torchpmap._context": 4, "torchpmap._config": 4, "torchpmap._axis_env": 4,
    "torchpmap._log": 4, "torchpmap._torch_private": 4,
    "torchpmap._compile_guard": 4, "torchpmap._device_record": 4, "torchpmap._faults": 4, "torchpmap._store": 4,
}


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        if "bench" in rel.parts:  # the benchmark suite sits on top of everything
            continue
        name = ".".join(rel.parts)
        found[name.removesuffix(".__init__")] = path
    return found


def _layer(module: str) -> int:
    if module.startswith("torchpmap._engines"):
        return 2
    return LAYERS[module]


def _imports(modules: dict[str, pathlib.Path]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = collections.defaultdict(set)
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
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
                if target in modules and target != name and not name.startswith(target + "."):
                    graph[name].add(target)
    return graph


def test_every_module_has_a_layer():
    unknown = [m for m in _modules() if not m.startswith("torchpmap._engines") and m not in LAYERS]
    assert not unknown, f"give these modules a layer in tests/test_layers.py: {unknown}"


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
    up = [f"{m} (layer {_layer(m)}) imports {t} (layer {_layer(t)})" for m in sorted(graph) for t in sorted(graph[m]) if _layer(t) < _layer(m)]
    assert not up, "imports running up the layers:\n" + "\n".join(up)
