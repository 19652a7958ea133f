"""torchpmap.checkpoint: save and restore a whole training state, in one process and in two.

The core test kills a data-parallel training run (``data_parallel_step`` over a
``ShardedLoader``, AdamW, OneCycleLR, batch norm and dropout) with SIGKILL after a step
that no checkpoint holds, resumes it from the last checkpoint, and finds bitwise the
weights, optimizer state and losses of a run that was never interrupted: in one process
(on the ambient number of CPU devices) and in two gloo processes (this file run as a
program by torchpmap._frontend.launch, as torchrun would).
"""
from __future__ import annotations

import contextlib
import copy
import itertools
import datetime
import os
import random
import shutil
import signal
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import torchpmap as tp
from torchpmap import checkpoint
from torchpmap.data import ShardedLoader

EPOCHS, EVERY, KILL_AT = 3, 5, 13  # 6 steps per epoch: saved at steps 5, 10, 15; killed after step 13


# --------------------------------------------------------------------------- the training program


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 8, generator=g)
    y = (x @ torch.randn(8, 3, generator=g)).argmax(dim=1)
    return TensorDataset(x, y)


def build(n):
    torch.manual_seed(0)  # the same initial weights in every process
    model = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
    loader = ShardedLoader(dataset(), 32, n=n, seed=11)  # 200 // 32 = 6 steps per epoch
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.05, total_steps=EPOCHS * len(loader))
    return model, optimizer, scheduler, loader, tp.data_parallel_step(model, F.cross_entropy, optimizer)


def train(path: str, *, n=None, kill_at=None, resume=False, rng=True) -> dict:
    """Trains for EPOCHS epochs, saving every EVERY steps; from the checkpoint at ``path`` if ``resume``."""
    model, optimizer, scheduler, loader, step = build(n)
    torch.manual_seed(100 + tp.process_index())  # every process draws its own dropout masks
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "data": loader}
    done, losses = 0, {}
    if resume:
        done = checkpoint.load(path, state, rng=rng)["step"]
    model.train()
    while loader.epoch < EPOCHS:
        for batch in loader:
            losses[done] = step(batch).item()
            scheduler.step()
            done += 1
            if done % EVERY == 0:
                checkpoint.save(path, {**state, "step": done})
            if done == kill_at:
                _die()
    return {
        "model": copy.deepcopy(model.state_dict()),
        "optimizer": copy.deepcopy(optimizer.state_dict()),
        "lr": scheduler.get_last_lr(),
        "losses": losses,
        "steps": done,
    }


def _die() -> None:
    """SIGKILL: no exit handlers, no flushing, nothing written after the last checkpoint."""
    if dist.is_initialized():
        dist.barrier()  # both processes are past every collective of the step
        if dist.get_rank() == 0:
            time.sleep(0.5)  # the store's host goes last
    os.kill(os.getpid(), signal.SIGKILL)


@contextlib.contextmanager
def _like_a_launched_process():
    """This process' torch state as in a launched one (one intra-op thread), restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        torch.set_num_threads(threads)


def assert_same(got, want, where: str = "") -> None:
    """Bitwise equality of nested dicts/lists of tensors and numbers."""
    if isinstance(want, dict):
        assert got.keys() == want.keys(), where
        for k in want:
            assert_same(got[k], want[k], f"{where}[{k!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{where}[{i}]")
    elif isinstance(want, torch.Tensor):
        assert torch.equal(got, want), f"{where}: not bitwise equal\n{got}\n{want}"
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


# --------------------------------------------------------------------------- one process


def _launch(scenario: str, path: Path, nproc: int):
    from torchpmap._frontend.launch import launch

    started = time.monotonic()
    finished = launch([str(Path(__file__).resolve()), scenario, str(path)], nproc, timeout=90)
    logs = "\n".join(f"--- rank {f.rank} (rc={f.returncode}, {f.seconds:.1f} s)\n{f.output[-3000:]}" for f in finished)
    return finished, logs, time.monotonic() - started


def test_killed_run_resumes_to_the_same_weights_in_one_process(tmp_path):
    path = tmp_path / "ckpt.pt"
    finished, logs, seconds = _launch("kill", path, nproc=1)
    assert finished[0].returncode == -signal.SIGKILL, logs
    saved = torch.load(path)
    assert saved["state"]["step"] == 10 and saved["state"]["data"]["epoch"] == 1 and saved["state"]["data"]["step"] == 4
    assert saved["process_count"] == 1 and len(saved["rng"]) == 1
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]  # no temporary file left behind
    at_step_10 = tmp_path / "at_step_10.pt"
    shutil.copy(path, at_step_10)
    with _like_a_launched_process():
        resumed = train(str(path), resume=True)
    with _like_a_launched_process():
        reference = train(str(tmp_path / "reference.pt"))
    assert resumed["steps"] == reference["steps"] == EPOCHS * 6
    assert sorted(resumed["losses"]) == list(range(10, 18))  # steps 11, 12, 13 were lost and redone
    assert_same(resumed["losses"], {k: v for k, v in reference["losses"].items() if k >= 10}, "losses")
    assert_same(resumed["model"], reference["model"], "model")
    assert_same(resumed["optimizer"], reference["optimizer"], "optimizer")
    assert resumed["lr"] == reference["lr"]
    # Without the generators, dropout draws other masks from step 10 on: the RNG state matters.
    with _like_a_launched_process():
        no_rng = train(str(at_step_10), resume=True, rng=False)
    assert not torch.equal(no_rng["model"]["0.weight"], reference["model"]["0.weight"])
    assert seconds < 30, seconds


def test_round_trip_restores_every_object_and_generator(tmp_path):
    path = tmp_path / "state.pt"
    model, optimizer, scheduler, loader, step = build(n=2)
    for batch in itertools.islice(loader, 3):
        step(batch)
        scheduler.step()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    extra = {"best": 0.25, "history": [1, 2, 3], "tensor": torch.arange(3)}
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "data": loader, "scaler": scaler}
    want = {k: copy.deepcopy(v.state_dict()) for k, v in state.items()}
    checkpoint.save(path, {**state, "step": 3, "extra": extra})
    draws = (torch.rand(4), random.random(), np.random.rand(2).tolist())

    fresh_model, fresh_optimizer, fresh_scheduler, fresh_loader, _ = build(n=4)
    fresh = {"model": fresh_model, "optimizer": fresh_optimizer, "scheduler": fresh_scheduler, "data": fresh_loader,
             "scaler": torch.amp.GradScaler("cpu")}
    restored = checkpoint.load(path, fresh)
    for k, obj in fresh.items():
        assert restored[k] is obj
        assert_same(obj.state_dict(), want[k], k)
    assert restored["step"] == 3
    assert_same(restored["extra"], extra, "extra")
    assert (fresh_loader.epoch, fresh_loader.step) == (0, 3)
    assert_same((torch.rand(4), random.random(), np.random.rand(2).tolist()), draws, "generators")
    # rng=False leaves the generators alone
    torch.manual_seed(5)
    expected = torch.rand(2)
    torch.manual_seed(5)
    checkpoint.load(path, rng=False)
    assert torch.equal(torch.rand(2), expected)
    # saved without generators: load changes none
    checkpoint.save(path, {"step": 4}, rng=False)
    torch.manual_seed(5)
    assert checkpoint.load(path) == {"step": 4} and torch.equal(torch.rand(2), expected)


def test_a_failed_save_keeps_the_previous_checkpoint_and_leaves_no_temporary_file(tmp_path):
    path = tmp_path / "ckpt.pt"
    checkpoint.save(path, {"step": 1})
    before = path.read_bytes()
    with pytest.raises(Exception, match="lambda"):
        checkpoint.save(path, {"step": 2, "not_picklable": lambda: None})
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]
    with pytest.raises(FileNotFoundError):
        checkpoint.save(tmp_path / "missing" / "ckpt.pt", {"step": 1})


def test_load_errors_say_what_is_wrong(tmp_path):
    path = tmp_path / "ckpt.pt"
    model = nn.Linear(2, 1)
    checkpoint.save(path, {"model": model, "step": 1})
    with pytest.raises(KeyError, match=r"holds no 'optimizer'; it holds \['model', 'step'\]"):
        checkpoint.load(path, {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)})
    with pytest.raises(TypeError, match=r"state\['step'\] is a int, which has no load_state_dict"):
        checkpoint.load(path, {"step": 0})
    with pytest.raises(TypeError, match="state must be a dict from names"):
        checkpoint.save(path, [model])
    with pytest.raises(FileNotFoundError):
        checkpoint.load(tmp_path / "nothing.pt")
    torch.save({"weights": torch.zeros(2)}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="is not a checkpoint written by torchpmap.checkpoint.save"):
        checkpoint.load(tmp_path / "other.pt")
    # The generators of a 2-process checkpoint cannot be matched to 1 process.
    two = torch.load(path)
    two["rng"], two["process_count"] = two["rng"] * 2, 2
    torch.save(two, path)
    weight = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.zero_()
    with pytest.raises(ValueError, match=r"saved by 2 process\(es\) and this run has 1.*pass rng=False"):
        checkpoint.load(path, {"model": model})
    assert not model.weight.any()  # nothing was changed by the refused load
    assert checkpoint.load(path, {"model": model}, rng=False)["step"] == 1
    assert torch.equal(model.weight, weight)


# --------------------------------------------------------------------------- two processes


def test_killed_run_resumes_to_the_same_weights_in_two_processes(tmp_path):
    path = tmp_path / "ckpt.pt"
    killed, logs, first = _launch("kill_distributed", path, nproc=2)
    assert [f.returncode for f in killed] == [-signal.SIGKILL] * 2, logs
    saved = torch.load(path)
    assert saved["state"]["step"] == 10 and saved["process_count"] == 2
    assert not torch.equal(saved["rng"][0]["torch"], saved["rng"][1]["torch"])  # one generator state per process
    finished, logs, second = _launch("resume_distributed", path, nproc=2)
    assert all(f.returncode == 0 for f in finished), logs
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert all("crashed" not in r for r in results), [r.get("crashed") for r in results]
    for r, res in enumerate(results):
        resumed, reference = res["resumed"], res["reference"]
        assert sorted(resumed["losses"]) == list(range(10, 18))
        assert_same(resumed["losses"], {k: v for k, v in reference["losses"].items() if k >= 10}, f"rank {r} losses")
        assert_same(resumed["model"], reference["model"], f"rank {r} model")
        assert_same(resumed["optimizer"], reference["optimizer"], f"rank {r} optimizer")
        assert "rank 1: FileNotFoundError" in res["unreadable"] and "rank 0" not in res["unreadable"], res["unreadable"]
        assert "rank 0 could not write" in res["unwritable"] or r == 0, res["unwritable"]
        assert "FileNotFoundError" in res["unwritable"], res["unwritable"]
    assert_same(results[1]["resumed"]["model"], results[0]["resumed"]["model"], "replicated")
    assert first + second < 40, (first, second)


def _error(fn) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - reported to the test
        return f"{type(e).__name__}: {e}"
    return "no error"


def scenario_kill(path: str) -> dict:
    train(path, kill_at=KILL_AT)
    return {"error": "not killed"}


def scenario_kill_distributed(path: str) -> dict:
    return scenario_kill(path)  # n = 1 local device per process


def scenario_resume_distributed(path: str) -> dict:
    resumed = train(path, resume=True)
    reference = train(os.path.join(os.path.dirname(path), "reference.pt"))
    rank = tp.process_index()
    # only rank 0 sees the file: every process raises, naming rank 1
    mine = path if rank == 0 else path + ".elsewhere"
    unreadable = _error(lambda: checkpoint.load(mine))
    unwritable = _error(lambda: checkpoint.save(os.path.join(os.path.dirname(path), "no", "dir.pt"), {"step": 1}))
    return {"resumed": resumed, "reference": reference, "unreadable": unreadable, "unwritable": unwritable}


def main() -> None:
    import torchpmap.distributed as tpd

    scenario, path = sys.argv[1], sys.argv[2]
    tpd.initialize(timeout=datetime.timedelta(seconds=30))
    try:
        out = globals()[f"scenario_{scenario}"](path)
    except BaseException:  # noqa: BLE001 - keep the traceback for the test
        out = {"crashed": traceback.format_exc()}
    result = os.path.join(os.path.dirname(path), f"rank{tp.process_index()}.pt")
    torch.save(out, result)
    tpd.shutdown()


if __name__ == "__main__":
    main()
