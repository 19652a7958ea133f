"""Programs that tests/test_store_exposure.py runs in several processes (torchpmap.bench.launch).

Usage: ``python _store_programs.py SCENARIO OUT_DIR``; each rank writes what it saw to
``OUT_DIR/rank<r>.json``.

* ``tokens``: initialize, shutdown, initialize again; records each group's job token
  and that a psum works in the second group.
* ``fail``: rank 1 raises inside a pmap (which writes its failure record), rank 0 then
  gets RankFailed; the job ends without shutdown, as a crashed job does.
* ``ok``: one psum, with rank 0 late by half a second so that rank 1 waits in the
  collective long enough to poll the failure records.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

import torchpmap as tp
import torchpmap.distributed as tpd
from torchpmap._state import process_group as _process_group


def _psum() -> float:
    return float(tp.pmap(lambda v: tp.psum(v, "i"), axis_name="i")(torch.ones(1))[0])


def _raise(v: torch.Tensor) -> torch.Tensor:
    raise ValueError("the first job fails here")


def tokens() -> dict[str, Any]:
    tpd.initialize()
    first = _process_group.state().token
    tpd.shutdown()
    tpd.initialize()
    second = _process_group.state().token
    total = _psum()
    tpd.shutdown()
    return {"tokens": [first, second], "psum": total}


def fail() -> dict[str, Any]:
    tpd.initialize()
    if tp.process_index() == 1:
        try:
            tp.pmap(_raise, axis_name="i")(torch.ones(1))
        except ValueError as error:
            return {"raised": str(error)}
    try:
        return {"psum": _psum()}
    except tpd.RankFailed as error:
        return {"rank_failed": str(error)}


def ok() -> dict[str, Any]:
    tpd.initialize()
    if tp.process_index() == 0:
        time.sleep(0.5)
    try:
        total = _psum()
    except Exception as error:  # noqa: BLE001 - reported to the test
        return {"error": f"{type(error).__name__}: {error}"}
    tpd.shutdown()
    return {"psum": total}


if __name__ == "__main__":
    scenario, out = sys.argv[1], Path(sys.argv[2])
    result = {"tokens": tokens, "fail": fail, "ok": ok}[scenario]()
    (out / f"rank{os.environ['RANK']}.json").write_text(json.dumps(result))  # after shutdown, every process is rank 0
