"""torchpmap.checkpoint: save and restore a whole training state, in one process and in two.

The core test kills a data-parallel training run (``data_parallel_step`` over a
``ShardedLoader``, AdamW, OneCycleLR, batch norm and dropout) with SIGKILL after a step
that no checkpoint holds, resumes it from the last checkpoint, and finds bitwise the
weights, optimizer state and losses of a run that was never interrupted: in one process
(on the ambient number of CPU devices) and in two gloo processes (this file run as a
program by torchpmap.bench.launch, as torchrun would).
"""
from __future__ import annotations

import contextlib
import copy
import datetime
import itertools
import os
import pickle
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import zipfile
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
    from torchpmap.bench.launch import launch

    started = time.monotonic()
    finished = launch([str(Path(__file__).resolve()), scenario, str(path)], nproc, timeout=90)
    logs = "\n".join(f"--- rank {f.rank} (rc={f.returncode}, {f.seconds:.1f} s)\n{f.output[-3000:]}" for f in finished)
    return finished, logs, time.monotonic() - started


@pytest.mark.slow
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


# --------------------------------------------------------------------------- all or nothing


class _Position:
    """A stateful object with no dry run: its load_state_dict changes it, then may fail."""

    def __init__(self, fail: bool = False):
        self.where, self.fail = [0, 0], fail

    def state_dict(self):
        return {"where": list(self.where)}

    def load_state_dict(self, state):
        self.where[:] = state["where"]  # changed in place before it fails: a half-restored object
        if self.fail:
            raise OSError("the position's source went away (on purpose)")


def _training_state(width: int = 3, seed: int = 0) -> dict:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(width, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model(torch.randn(5, width)).sum().backward()
    optimizer.step()
    scheduler.step()
    return {"optimizer": optimizer, "scheduler": scheduler, "model": model, "position": _Position()}


def _snapshot(state: dict) -> dict:
    return {k: copy.deepcopy(v.state_dict()) for k, v in state.items()}


def _assert_unchanged(state: dict, before: dict, generator: torch.Tensor) -> None:
    for k, obj in state.items():
        assert_same(obj.state_dict(), before[k], k)
    assert torch.equal(torch.get_rng_state(), generator), "the generators changed"


def _saved_other_state(path) -> None:
    other = _training_state(seed=1)
    with torch.no_grad():
        for group in other["optimizer"].param_groups:
            group["lr"] = 0.777
    other["position"].where[:] = [7, 7]
    torch.manual_seed(99)  # another generator state in the checkpoint
    checkpoint.save(path, {**other, "step": 7})


@pytest.mark.parametrize("case", ["model_shape", "model_missing_key", "model_dtype_kind", "optimizer_groups", "loader"])
def test_a_refused_load_changes_nothing(tmp_path, case):
    """The optimizer (first in the state) used to be restored before the model's mismatch
    raised: its lr went from 0.1 to the checkpoint's 0.777. Every object is checked first now."""
    path = tmp_path / "ckpt.pt"
    _saved_other_state(path)
    state = _training_state()
    if case == "model_shape":
        state["model"] = nn.Sequential(nn.Linear(2, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
        state["optimizer"] = torch.optim.SGD(state["model"].parameters(), lr=0.1)  # built as for a fresh start
        state["scheduler"] = torch.optim.lr_scheduler.StepLR(state["optimizer"], step_size=1)
        match = r"size mismatch for 0.weight: copying a param with shape torch.Size\(\[4, 3\]\) from checkpoint"
    elif case == "model_missing_key":
        state["model"].register_buffer("extra", torch.zeros(2))
        match = r'Missing key\(s\) in state_dict: "extra"'
    elif case == "model_dtype_kind":
        state["model"][1].running_mean = state["model"][1].running_mean.long()
        match = r"'1.running_mean' is torch.float32 in the checkpoint and torch.int64 here"
    elif case == "optimizer_groups":
        params = list(state["model"].parameters())
        state["optimizer"] = torch.optim.SGD([{"params": params[:2]}, {"params": params[2:]}], lr=0.1)
        state["scheduler"] = torch.optim.lr_scheduler.StepLR(state["optimizer"], step_size=1)
        match = "different number of parameter groups"
    else:  # a loader built for another data order: checked on a copy
        state["data"] = ShardedLoader(dataset(), 32, n=1, seed=5)
        checkpoint.save(
            path, {**torch.load(path)["state"], "data": ShardedLoader(dataset(), 32, n=1, seed=11)}, rng=False
        )
        match = "the saved position belongs to another data order"
    before, generator = _snapshot(state), torch.get_rng_state()
    with pytest.raises(Exception, match=match) as error:
        checkpoint.load(path, state)
    _assert_unchanged(state, before, generator)
    assert f"does not fit what {path} holds under" in str(error.value) and "Nothing was changed" in str(error.value)
    assert "Build it as it was when the checkpoint was saved" in str(error.value)


def test_a_failure_midway_puts_back_every_object_and_the_generators(tmp_path):
    path = tmp_path / "ckpt.pt"
    _saved_other_state(path)
    state = _training_state()
    state["position"].fail = True  # last: the optimizer, scheduler and model are restored before it fails
    before, generator = _snapshot(state), torch.get_rng_state()
    with pytest.raises(OSError, match="went away") as error:
        checkpoint.load(path, state)
    _assert_unchanged(state, before, generator)
    assert "state['position'].load_state_dict failed while restoring" in error.value.__notes__[-1]
    state["position"].fail = False  # and the same load then restores everything
    assert checkpoint.load(path, state)["step"] == 7
    assert state["optimizer"].param_groups[0]["lr"] == 0.777 and state["position"].where == [7, 7]


class Opaque:  # a plain value that weights_only=True does not unpickle
    def __init__(self, n):
        self.n = n


def test_a_checkpoint_holding_other_objects_names_the_path_and_weights_only(tmp_path):
    path = tmp_path / "ckpt.pt"
    checkpoint.save(path, {"step": 1, "opaque": Opaque(3)})
    with pytest.raises(pickle.UnpicklingError) as error:
        checkpoint.load(path)
    message = str(error.value)
    assert message.startswith(f"checkpoint.load: {path} holds objects that weights_only=True does not unpickle"), (
        message
    )
    assert "weights_only=False if you trust where it came from" in message
    assert checkpoint.load(path, weights_only=False)["opaque"].n == 3


def _a_checkpoint(tmp_path) -> bytes:
    path = tmp_path / "good.pt"
    checkpoint.save(path, {"model": nn.Linear(64, 64), "step": 3})
    return path.read_bytes()


@pytest.mark.parametrize(
    "damage, match",
    [
        ("empty", r"is empty \(0 bytes\), so it holds no checkpoint.*Load an earlier checkpoint"),
        (
            "truncated",
            r"is truncated: its \d+ bytes are the beginning of an archive as torch.save writes, whose end .* is "
            r"missing.*copy it again from where it came, or load an earlier checkpoint",
        ),
        (
            "random_bytes",
            r"is not a torchpmap checkpoint: it is not an archive as torch.save writes \(its first bytes are "
            r".*\)\. Check the path",
        ),
        (
            "corrupted_inside",
            r"is damaged: it is an archive as torch.save writes, but torch.load could not read it .*load an "
            r"earlier checkpoint",
        ),
        ("garbled_pickle", r"is damaged: it is an archive as torch.save writes, but torch.load could not read it"),
        ("another_archive", r"is damaged: it is an archive as torch.save writes, but torch.load could not read it"),
    ],
)
def test_a_damaged_file_is_named_with_what_is_wrong_and_what_to_do(tmp_path, damage, match):
    """They used to raise OSError "[Errno 22] Invalid argument" (truncated), a bare EOFError
    (empty), or torch's advice to retry with weights_only=False (random bytes)."""
    good = _a_checkpoint(tmp_path)
    path = tmp_path / "ckpt.pt"
    if damage == "empty":
        path.write_bytes(b"")
    elif damage == "truncated":
        path.write_bytes(good[: len(good) // 2])
    elif damage == "random_bytes":
        path.write_bytes(np.random.default_rng(0).bytes(4096))
    elif damage == "corrupted_inside":  # bytes of the pickle flipped: torch.load fails in its own words
        at = good.index(b"data.pkl") + 100
        path.write_bytes(good[:at] + bytes(b ^ 0xFF for b in good[at : at + 20]) + good[at + 20 :])
    elif damage == "garbled_pickle":  # a whole archive whose pickle is garbled: not "retry with weights_only=False"
        with zipfile.ZipFile(tmp_path / "good.pt") as src, zipfile.ZipFile(path, "w") as dst:
            for info in src.infolist():
                data = src.read(info.filename)
                if info.filename.endswith("data.pkl"):
                    data = data[: len(data) // 2] + np.random.default_rng(0).bytes(50) + data[len(data) // 2 :]
                dst.writestr(info, data)
    else:
        with zipfile.ZipFile(path, "w") as z:
            z.writestr("notes.txt", "not a checkpoint")
    with pytest.raises(ValueError, match=match) as error:
        checkpoint.load(path, {"model": nn.Linear(64, 64)})
    assert str(error.value).startswith(f"checkpoint.load: {path} "), str(error.value)


def _leave_a_temporary_file(path) -> None:
    """A process killed (SIGKILL) in the middle of checkpoint.save(path): its temporary file stays."""
    code = (
        "import os, signal, sys, torch\n"
        "from torchpmap import checkpoint\n"
        "class KilledWhenPickled:\n"
        "    def __reduce__(self):\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        "checkpoint.save(sys.argv[1], {'weights': torch.zeros(1 << 20), 'last': KilledWhenPickled()})\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr


@pytest.mark.parametrize("then", ["save", "load"])
def test_the_temporary_file_of_a_killed_save_is_removed_by_the_next_save_or_load(tmp_path, then):
    path = tmp_path / "ckpt.pt"
    checkpoint.save(path, {"step": 1})
    _leave_a_temporary_file(path)
    stray = [p.name for p in tmp_path.iterdir() if p.name != "ckpt.pt"]
    assert len(stray) == 1 and stray[0].startswith(".ckpt.pt.") and stray[0].endswith(".tmp"), stray
    # kept: a running process' (this one), another machine's (whose processes cannot be seen from here), others'
    host = socket.gethostname()
    kept = [f".ckpt.pt.{host}.{os.getpid()}.0123abcd.tmp", ".ckpt.pt.elsewhere.example.1.0123abcd.tmp",
            ".other.pt.{host}.1.0123abcd.tmp", "notes.txt"]
    for name in kept:
        (tmp_path / name).write_bytes(b"x")
    if then == "save":
        checkpoint.save(path, {"step": 2})
    else:
        assert checkpoint.load(path) == {"step": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["ckpt.pt", *kept])


def test_sharded_tensor_values_round_trip_on_every_placement(tmp_path, four_devices):
    """A pmap result on several devices (a ShardedTensor) used to be saved as one, and
    refused by checkpoint.load ("Unsupported global ShardedTensor"); on one device the same
    code worked. It is saved as the plain tensor it stands for, on every placement."""
    x = torch.arange(24.0).reshape(4, 6)
    mesh = tp.Mesh(np.array(four_devices).reshape(2, 2), ("data", "model"))
    results = []
    for devices in (four_devices[:1], four_devices[:2], four_devices):
        step = tp.pmap(lambda v: (v * 2, tp.psum(v, "i")), "i", devices=devices)
        doubled, summed = step(x)
        model = nn.Linear(6, 1)
        # a ShardedTensor in a state dict
        model.register_buffer("running", tp.pmap(lambda v: v + 1, devices=devices)(x))
        with mesh:
            nested = tp.pmap(tp.pmap(lambda v: v - 1, axis_name="model"), axis_name="data")(x.reshape(2, 2, 6))
        path = tmp_path / f"on{len(devices)}.pt"
        checkpoint.save(path, {"model": model, "values": {"doubled": doubled, "list": [summed, (nested,)]}})
        assert isinstance(doubled, tp.ShardedTensor) == (len(devices) > 1)
        raw = torch.load(path, weights_only=True)  # plain tensors only
        assert (
            type(raw["state"]["values"]["doubled"]) is torch.Tensor
            and type(raw["state"]["model"]["running"]) is torch.Tensor
        )
        fresh = nn.Linear(6, 1)
        fresh.register_buffer("running", torch.zeros(4, 6))
        back = checkpoint.load(path, {"model": fresh})
        assert torch.equal(fresh.running, x + 1)
        results.append(back["values"])
    for other in results[1:]:
        assert_same(other, results[0], "values")
    assert torch.equal(results[0]["doubled"], x * 2) and torch.equal(results[0]["list"][1][0], x.reshape(2, 2, 6) - 1)


def test_a_sharded_steps_emptied_module_is_refused_naming_gather_params(tmp_path):
    """Between the steps of data_parallel_step(shard_params=...) the module's parameters
    are emptied (their values are the step's rows). checkpoint.save wrote those 0-element
    tensors without a word, and checkpoint.load into such a module "succeeded" and
    restored nothing; both now refuse, naming step.gather_params(), after which the
    checkpoint is the whole model and resumes."""
    from torchpmap.training import data_parallel_step, shard

    def make():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    x, y = torch.randn(16, 6), torch.randint(0, 3, (16,))
    model, opt = make()
    step = data_parallel_step(model, F.cross_entropy, opt, shard_params=True)
    step(shard((x, y), n=4))
    path = tmp_path / "ckpt.pt"
    with pytest.raises(ValueError, match=r"module 'model' has parameters .* emptied .*step.gather_params\(\)"):
        checkpoint.save(path, {"model": model})
    assert not path.exists()
    step.gather_params()
    checkpoint.save(path, {"model": model})
    other, other_opt = make()
    other_step = data_parallel_step(other, F.cross_entropy, other_opt, shard_params=True)
    other_step(shard((x, y), n=4))
    with pytest.raises(ValueError, match=r"module 'model' has parameters .* emptied .*step.gather_params\(\)"):
        checkpoint.load(path, {"model": other})
    other_step.gather_params()
    checkpoint.load(path, {"model": other})
    assert all(torch.equal(p, q) for p, q in zip(other.parameters(), model.parameters()))


def test_a_sharded_optimizer_across_processes_is_refused_naming_its_whole_state():
    """Across processes each process' sharded optimizer holds its own rows, and the one
    file rank 0 writes gave every process rank 0's moments (a resumed run 0.026 off, on 2
    processes). checkpoint refuses it there, naming step.optimizer_state_dict(); in one
    process its state is every row and saves as documented."""
    from torchpmap._frontend.sharded_params import steps_sharded_rows
    from torchpmap.checkpoint import _check_not_sharded_step_state
    from torchpmap.training import data_parallel_step, shard

    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    assert not steps_sharded_rows(opt)
    step = data_parallel_step(model, F.cross_entropy, opt, shard_params=True)
    step(shard((torch.randn(16, 6), torch.randint(0, 3, (16,))), n=4))
    assert steps_sharded_rows(opt)
    _check_not_sharded_step_state({"optimizer": opt}, "save", processes=1)
    for what in ("save", "load"):
        with pytest.raises(ValueError, match=r"optimizer 'optimizer' steps the rows .*step.optimizer_state_dict\(\)"):
            _check_not_sharded_step_state({"optimizer": opt}, what, processes=2)


# --------------------------------------------------------------------------- two processes


@pytest.mark.slow
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


@pytest.mark.slow
@pytest.mark.parametrize("scenario, victim", [
    ("save_writer_killed", 0), ("save_other_killed", 1), ("load_killed_rank1", 1), ("load_killed_rank0", 0),
])
def test_a_process_dying_in_save_or_load_makes_the_other_raise_rank_failed(tmp_path, scenario, victim):
    """Rank 1 used to get gloo's "Connection closed by peer" when rank 0 was killed during a
    save (and the 23 MB temporary file stayed for good). Whoever dies, in a save or a load,
    the other raises RankFailed naming it; a load puts the survivor's objects back."""
    path = tmp_path / "ckpt.pt"
    finished, logs, _ = _launch(scenario, path, nproc=2)
    survivor = 1 - victim
    assert finished[victim].returncode == -signal.SIGKILL, logs
    assert finished[survivor].returncode == 0, logs
    res = torch.load(tmp_path / f"rank{survivor}.pt", weights_only=False)
    assert "crashed" not in res, res.get("crashed")
    assert res["error"] == "RankFailed" and res["ranks"] == [victim], (res, logs)
    assert f"checkpoint.{scenario.split('_')[0]} of {path}" in res["message"], res["message"]
    assert res["seconds"] < 15, res
    if scenario.startswith("load"):
        assert res["put_back"], "the survivor's model was left restored from the checkpoint"
    if scenario == "save_other_killed":  # rank 0 finished writing before it found rank 1 dead
        assert torch.load(path, weights_only=False)["state"]["step"] == 2
    if scenario == "save_writer_killed":
        assert any(p.name.endswith(".tmp") for p in tmp_path.iterdir()), "the kill left no temporary file"
        checkpoint.save(path, {"step": 3})  # the next save on this machine removes it
        assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt", "rank1.pt"]


class _KilledWhenPickled:
    """Pickling it kills this process (SIGKILL, as the OOM killer would), in the middle of torch.save."""

    def __reduce__(self):
        os.kill(os.getpid(), signal.SIGKILL)


class _SlowWhenPickled:
    """Pickling it takes 3 s: rank 0 is still writing when rank 1 dies."""

    def __reduce__(self):
        time.sleep(3.0)
        return (int, (0,))


class _KilledWhenRestored:
    """Restoring it kills the process of rank ``rank``."""

    def __init__(self, rank: int):
        self.rank = rank

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        if tp.process_index() == self.rank:
            os.kill(os.getpid(), signal.SIGKILL)


def _fault(fn) -> dict:
    started = time.monotonic()
    try:
        fn()
        out = {"error": None, "message": "", "ranks": []}
    except BaseException as e:  # noqa: BLE001 - reported to the test
        out = {"error": type(e).__name__, "message": str(e), "ranks": list(getattr(e, "ranks", ()))}
    out["seconds"] = time.monotonic() - started
    return out


def scenario_save_writer_killed(path: str) -> dict:
    torch.manual_seed(0)
    state = {"model": nn.Linear(64, 64), "weights": torch.zeros(1 << 20), "last": _KilledWhenPickled()}
    return _fault(lambda: checkpoint.save(path, state))  # only rank 0 pickles the state: it dies writing


def scenario_save_other_killed(path: str) -> dict:
    if tp.process_index() == 1:
        threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
    return _fault(lambda: checkpoint.save(path, {"step": 2, "slow": _SlowWhenPickled()}))


def _load_killed(path: str, victim: int) -> dict:
    torch.manual_seed(0)
    model, victim_state = nn.Linear(4, 2), _KilledWhenRestored(victim)
    checkpoint.save(path, {"model": model, "victim": victim_state})
    with torch.no_grad():
        model.weight.fill_(5.0)  # what a load that changed nothing leaves
    out = _fault(lambda: checkpoint.load(path, {"model": model, "victim": victim_state}))
    out["put_back"] = bool((model.weight == 5.0).all())
    return out


def scenario_load_killed_rank1(path: str) -> dict:
    return _load_killed(path, 1)


def scenario_load_killed_rank0(path: str) -> dict:
    return _load_killed(path, 0)


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
    rank = tp.process_index()
    result = os.path.join(os.path.dirname(path), f"rank{rank}.pt")
    torch.save(out, result + ".part")
    os.replace(result + ".part", result)
    if "killed" in scenario:  # the group is out of step: no shutdown, but rank 0 (the store's host) lingers
        if rank == 0:
            from torchpmap._state.process_group import linger_seconds

            time.sleep(linger_seconds())
        os._exit(0)
    tpd.shutdown()


if __name__ == "__main__":
    main()
