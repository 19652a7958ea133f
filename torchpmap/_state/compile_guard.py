"""Refuses torch.compile where it would silently compute wrong numbers.

Dynamo inlines ``autograd.Function.forward`` and ignores custom ``vmap`` rules
(pytorch#129845), so a compiled map over a collective would return wrong results.
Every pmap/vmap call and every collective checks here first, so dynamo never traces
into the batching rules: under ``torch.compile(fullgraph=True)`` this error is what the
user sees; under plain ``torch.compile`` dynamo turns it into a graph break and runs the
pmap eagerly, with correct numbers (tests/test_compile_guard.py checks both).
``pmap(..., jit=True)`` is the way to compile: see :mod:`torchpmap._engines.compiled`.
"""
from __future__ import annotations

import torch


def refuse_under_compile(what: str) -> None:
    if torch.compiler.is_dynamo_compiling():  # true only inside code dynamo traces, in any thread
        raise NotImplementedError(
            f"torchpmap.{what} cannot run under torch.compile yet: torch.compile ignores the "
            "custom batching rules that implement collectives and would return wrong results. "
            "Use pmap(..., jit=True), which traces the collectives itself and then compiles, or "
            "call the pmapped function outside torch.compile."
        )
