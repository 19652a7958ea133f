"""torchpmap.data.ShardedLoader: sharded global batches from a dataset or a DataLoader.

One process: the batches against a seeded permutation, padding and masks, resuming, the
global RNG left alone, loaders and workers, the errors. Two gloo processes (this file
run as a program by torchpmap.bench.launch, as torchrun would): every rank reads its own
consecutive share of every global batch, each instance the examples it holds in one
process, every rank takes the same number of steps (with a collective
in every step), padding covers every example exactly once, mismatched set-ups raise at
once, and a rank whose data fails makes the other fail fast instead of hanging.
"""
from __future__ import annotations

import datetime
import gc
import itertools
import os
import sys
import threading
import time
import traceback
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, SubsetRandomSampler, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import torchpmap as tp
from torchpmap.data import ShardedLoader
from torchpmap.training import unshard

HERE = Path(__file__).resolve().parent
N, B = 50, 12  # 50 examples in global batches of 12: 4 whole steps, and 2 examples left over


class Indexed(Dataset):
    """Example i is (x = [i, -i], y = i): a batch shows which examples it holds."""

    def __init__(self, size: int = N, fail_at: int | None = None):
        self.size, self.fail_at = size, fail_at

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int):
        if i == self.fail_at:
            raise RuntimeError(f"example {i} is broken on purpose")
        return torch.tensor([float(i), -float(i)]), i


class Augmented(Indexed):
    """A random augmentation per example: which numbers a worker draws shows how it is seeded."""

    def __getitem__(self, i: int):
        return torch.rand(1), i


def permutation(seed: int, epoch: int, size: int = N) -> list[int]:
    """The order of an epoch: DistributedSampler's (and the one-process loader's)."""
    return torch.randperm(size, generator=torch.Generator().manual_seed(seed + epoch)).tolist()


def epoch_of(loader) -> list[list[int]]:
    """The example indices of every step of one epoch, in global batch order."""
    out = []
    for batch in loader:
        (x, y), *_ = batch if loader.mask else (batch,)
        assert x.shape == (loader.n, loader.instance_batch_size, 2) and y.shape == (
            loader.n,
            loader.instance_batch_size,
        )
        assert torch.equal(x[..., 0], y.double().to(x.dtype)) and torch.equal(x[..., 1], -x[..., 0])
        out.append(unshard(y).tolist())
    return out


# --------------------------------------------------------------------------- one process


@pytest.mark.parametrize("n", [None, 1, 2, 12])
def test_steps_are_sharded_slices_of_a_seeded_permutation(n):
    loader = ShardedLoader(Indexed(), B, n=n, seed=3)
    n = tp.local_device_count() if n is None else n
    assert loader.n == n and loader.instance_batch_size == B // n and len(loader) == N // B == 4
    for epoch in range(2):
        assert loader.epoch == epoch
        order = permutation(3, epoch)
        assert epoch_of(loader) == [order[j * B : (j + 1) * B] for j in range(4)]  # 48 of the 50, once each
    assert permutation(3, 0) != permutation(3, 1)  # a new shuffle every epoch
    assert (loader.epoch, loader.step) == (2, 0)


def test_same_seed_same_order_other_seed_other_order():
    first = epoch_of(ShardedLoader(Indexed(), B, n=2, seed=5))
    assert epoch_of(ShardedLoader(Indexed(), B, n=2, seed=5)) == first
    assert epoch_of(ShardedLoader(Indexed(), B, n=2, seed=6)) != first
    loader = ShardedLoader(Indexed(), B, n=2, seed=5)
    loader.set_epoch(1)
    assert epoch_of(loader) == epoch_of(ShardedLoader(Indexed(), B, n=2, seed=6))  # seed + epoch


def test_without_shuffle_the_order_is_the_dataset_order():
    loader = ShardedLoader(Indexed(), B, n=4, shuffle=False)
    assert epoch_of(loader) == [list(range(j * B, (j + 1) * B)) for j in range(4)]
    assert epoch_of(loader) == epoch_of(ShardedLoader(Indexed(), B, n=4, shuffle=False))  # every epoch


def test_pad_repeats_first_examples_and_the_mask_marks_them():
    loader = ShardedLoader(Indexed(), B, n=3, seed=1, last_batch="pad", mask=True)
    assert len(loader) == 5  # ceil(50 / 12)
    order = permutation(1, 0)
    steps, masks = [], []
    for (_x, y), mask in loader:
        assert mask.dtype == torch.bool and mask.shape == y.shape == (3, 4)
        steps.append(unshard(y).tolist())
        masks.append(unshard(mask).tolist())
    assert steps == [(order + order)[j * B : (j + 1) * B] for j in range(5)]  # the last step wraps around
    assert all(all(m) for m in masks[:4]) and masks[4] == [True] * 2 + [False] * 10
    real = [i for s, m in zip(steps, masks) for i, keep in zip(s, m) if keep]
    assert sorted(real) == list(range(N))  # every example exactly once


def test_drop_with_mask_is_all_true():
    masks = [m for _, m in ShardedLoader(Indexed(), B, n=2, mask=True)]
    assert len(masks) == 4 and all(bool(m.all()) for m in masks)


def test_iterating_leaves_the_global_rng_alone():
    before = torch.get_rng_state()
    loader = ShardedLoader(Indexed(), B, n=2, seed=9)
    epoch_of(loader)
    epoch_of(loader)
    assert torch.equal(torch.get_rng_state(), before)


def test_resume_mid_epoch_and_at_the_end_of_an_epoch():
    whole = ShardedLoader(Indexed(), B, n=2, seed=4)
    epochs = [epoch_of(whole), epoch_of(whole)]
    for consumed in range(len(whole) + 1):
        first = ShardedLoader(Indexed(), B, n=2, seed=4)
        head = [unshard(y).tolist() for _, y in itertools.islice(first, consumed)]  # a break after `consumed` steps
        state = first.state_dict()
        assert (state["epoch"], state["step"]) == (0, consumed) and head == epochs[0][:consumed]
        resumed = ShardedLoader(Indexed(), B, n=4, seed=4)  # another instance count may resume it
        resumed.load_state_dict(state)
        assert epoch_of(resumed) == epochs[0][consumed:]  # the rest of epoch 0 (nothing at its end)...
        assert resumed.epoch == 1 and epoch_of(resumed) == epochs[1]  # ...then epoch 1 as in one run


def test_load_state_dict_refuses_another_order_or_position():
    state = ShardedLoader(Indexed(), B, n=2, seed=4).state_dict()
    with pytest.raises(ValueError, match=r"another data order \(seed: saved 4, here 5\)"):
        ShardedLoader(Indexed(), B, n=2, seed=5).load_state_dict(state)
    with pytest.raises(ValueError, match="global_batch_size: saved 12, here 8"):
        ShardedLoader(Indexed(), 8, n=2, seed=4).load_state_dict(state)
    with pytest.raises(ValueError, match="outside an epoch of 4 steps"):
        ShardedLoader(Indexed(), B, n=2, seed=4).load_state_dict({**state, "step": 5})


def test_break_stops_the_prefetch_thread():
    loader = ShardedLoader(Indexed(), B, n=2)
    for _ in loader:
        break
    gc.collect()
    deadline = time.monotonic() + 5
    while any(t.name == "torchpmap-prefetch" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not any(t.name == "torchpmap-prefetch" for t in threading.enumerate())
    assert loader.step == 1


def test_from_a_dataloader_takes_its_batch_size_shuffle_and_settings():
    def collate(items):
        return torch.stack([x for x, _ in items]), torch.tensor([i for _, i in items])

    ds = Indexed()
    from_loader = ShardedLoader(DataLoader(ds, batch_size=B, shuffle=True, collate_fn=collate, drop_last=True), n=2)
    assert from_loader.global_batch_size == B and from_loader.shuffle
    assert epoch_of(from_loader) == epoch_of(ShardedLoader(ds, B, n=2, seed=0))
    ordered = ShardedLoader(DataLoader(ds, batch_size=B), n=2, last_batch="drop")
    assert not ordered.shuffle and epoch_of(ordered)[0] == list(range(B))
    # a DDP script's loader: its batch size is per process, its sampler has the seed
    ddp = DataLoader(ds, batch_size=6, sampler=DistributedSampler(ds, num_replicas=1, rank=0, seed=7), drop_last=True)
    assert ShardedLoader(ddp, n=2).global_batch_size == 6
    assert epoch_of(ShardedLoader(ddp, n=2)) == epoch_of(ShardedLoader(ds, 6, n=2, seed=7))


def test_a_dataloader_keeping_its_last_partial_batch_needs_last_batch_chosen():
    """DataLoader's default drop_last=False keeps its last partial batch, which a
    ShardedLoader cannot yield: it dropped the examples silently (16 of 21). Now it asks
    for last_batch when examples are left over; with 'pad' and a mask every example is
    counted once, and a loader whose examples fill whole batches needs nothing."""
    data = TensorDataset(torch.arange(21))
    with pytest.raises(ValueError, match=r"drop_last=False.*global batch of 8.*21 examples leave 5.*last_batch='pad'"):
        ShardedLoader(DataLoader(data, batch_size=8), n=4)
    padded = ShardedLoader(DataLoader(data, batch_size=8), n=4, last_batch="pad", mask=True)
    seen = [i for (x,), mask in padded for i in x[mask].tolist()]
    assert sorted(seen) == list(range(21))
    assert len(ShardedLoader(DataLoader(TensorDataset(torch.arange(24)), batch_size=8), n=4)) == 3


# The suite's conftest imports JAX, whose threads make Python warn at every fork; the
# DataLoader workers forked here run only the dataset and torch's collate, never JAX.
@pytest.mark.filterwarnings("ignore:os.fork\\(\\) was called:RuntimeWarning")
def test_workers_give_the_same_batches_and_seeded_augmentations():
    ds = Indexed()
    assert epoch_of(ShardedLoader(ds, B, n=2, num_workers=2)) == epoch_of(ShardedLoader(ds, B, n=2))

    def draws(seed, epochs=2):
        loader = ShardedLoader(Augmented(), B, n=2, seed=seed, num_workers=2)
        return [[x.flatten().tolist() for x, _ in loader] for _ in range(epochs)]

    first = draws(0)
    assert draws(0) == first  # reproducible augmentations
    assert first[0] != first[1] and draws(1)[0] != first[0]  # but new ones every epoch and seed


def test_feeds_data_parallel_step():
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    step = tp.data_parallel_step(model, torch.nn.functional.mse_loss, torch.optim.SGD(model.parameters(), lr=1e-4))
    loader = ShardedLoader(Indexed(), B, seed=0)  # n = local device count
    losses = [step((x, y.unsqueeze(-1).to(x.dtype))).item() for _ in range(3) for x, y in loader]
    assert len(losses) == 12 and losses[-1] < losses[0]


def test_errors_name_the_sizes_and_the_fix():
    with pytest.raises(ValueError) as e:
        ShardedLoader(Indexed(), 10, n=4)
    assert str(e.value) == (
        "ShardedLoader: global_batch_size=10 does not split evenly over 1 process x 4 local instances = 4 instances "
        "(10 % 4 = 2); every instance must get the same number of examples. Use a global batch size that is a "
        "multiple of 4 (8 or 12, say), or another number of local instances (n=)."
    )
    with pytest.raises(ValueError, match=r"multiple of 4 \(4, say\)"):
        ShardedLoader(Indexed(), 3, n=4)
    with pytest.raises(ValueError, match="global_batch_size must be a positive int, got 0"):
        ShardedLoader(Indexed(), 0)
    with pytest.raises(ValueError, match="holds no whole global batch of 64"):
        ShardedLoader(Indexed(), 64, n=1)
    assert len(ShardedLoader(Indexed(), 64, n=1, last_batch="pad")) == 1
    with pytest.raises(ValueError, match="last_batch must be 'drop' or 'pad'"):
        ShardedLoader(Indexed(), B, last_batch="keep")
    with pytest.raises(TypeError, match="pass global_batch_size="):
        ShardedLoader(Indexed())
    with pytest.raises(TypeError, match="drop_last= is not a DataLoader argument to pass here: pass last_batch="):
        ShardedLoader(Indexed(), B, drop_last=True)

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(10))

    with pytest.raises(TypeError, match="needs a map-style dataset"):
        ShardedLoader(Stream(), 2)
    with pytest.raises(TypeError, match="samples with a SubsetRandomSampler"):
        ShardedLoader(DataLoader(Indexed(), batch_size=4, sampler=SubsetRandomSampler(range(10))))
    with pytest.raises(TypeError, match="set num_workers, collate_fn"):
        ShardedLoader(DataLoader(Indexed(), batch_size=4), num_workers=2)
    with pytest.raises(ValueError, match="num_replicas=2 processes, but this run has 1"):
        ShardedLoader(
            DataLoader(Indexed(), batch_size=4, sampler=DistributedSampler(Indexed(), num_replicas=2, rank=0))
        )
    with pytest.raises(ValueError, match="differs from the loader's global batch of 4"):
        ShardedLoader(DataLoader(Indexed(), batch_size=4), 8)


@pytest.mark.parametrize("options", [{}, {"shuffle": False}, {"last_batch": "pad"}, {"n": 1}])
def test_an_empty_dataset_gets_torchpmaps_own_message(options):
    """It used to get the RandomSampler's "num_samples should be a positive integer value"."""
    with pytest.raises(ValueError) as e:
        ShardedLoader(TensorDataset(torch.zeros(0, 3)), B, **options)
    assert str(e.value).startswith(
        "ShardedLoader: the dataset (TensorDataset) is empty: len(dataset) == 0, so there is nothing to load (a "
        f"global batch needs {B} examples)."
    ), str(e.value)
    assert "Check that it found its data" in str(e.value)


def test_a_failing_example_is_raised_in_the_loop():
    loader = ShardedLoader(Indexed(fail_at=30), B, n=2, shuffle=False)
    with pytest.raises(RuntimeError, match="example 30 is broken on purpose"):
        epoch_of(loader)
    assert loader.step == 2  # the steps before the broken batch were handed out


# --------------------------------------------------------------------------- two processes


def _launch(scenario: str, tmp_path: Path, timeout: float = 20.0):
    from torchpmap.bench.launch import launch

    out = tmp_path / scenario
    out.mkdir()
    started = time.monotonic()
    finished = launch(
        [str(Path(__file__).resolve()), scenario, str(out)], 2, timeout=90, env={"TEST_TIMEOUT": str(timeout)}
    )
    logs = "\n".join(f"--- rank {f.rank} (rc={f.returncode}, {f.seconds:.1f} s)\n{f.output[-3000:]}" for f in finished)
    results = []
    for f in finished:
        path = out / f"rank{f.rank}.pt"
        results.append(torch.load(path, weights_only=False) if path.exists() else None)
    return finished, results, logs, time.monotonic() - started


@pytest.mark.slow
def test_two_processes_read_their_shares_and_end_epochs_together(tmp_path):
    finished, results, logs, seconds = _launch("shares", tmp_path)
    assert all(f.returncode == 0 for f in finished) and all(r is not None and "crashed" not in r for r in results), (
        [r.get("crashed") for r in results if r], logs)
    r0, r1 = results
    reference = ShardedLoader(Indexed(), B, n=4, seed=3)  # one process, the same global batches
    for epoch in range(2):
        whole = epoch_of(reference)
        for res in (r0, r1):
            assert res["drop"]["len"] == 4 and len(res["drop"]["steps"][epoch]) == 4  # equal step counts
        for j, want in enumerate(whole):
            mine = [res["drop"]["steps"][epoch][j] for res in (r0, r1)]
            # each rank holds its consecutive share of the global batch: the instances hold one process' examples
            assert mine[0] == want[: B // 2] and mine[1] == want[B // 2 :], (epoch, j)
            assert [res["drop"]["psum"][epoch][j] for res in (r0, r1)] == [[B, sum(want)]] * 2
        for res in (r0, r1):  # the DDP-style loader gives the same
            assert res["ddp_loader"][epoch] == res["drop"]["steps"][epoch]
    assert r0["drop"]["steps"][0] != r0["drop"]["steps"][1]  # a new shuffle every epoch, shared by the ranks
    for epoch in range(2):
        pad = [res["pad"] for res in (r0, r1)]
        assert pad[0]["len"] == pad[1]["len"] == 5 and all(len(p["steps"][epoch]) == 5 for p in pad)
        real = [
            i
            for p in pad
            for step, mask in zip(p["steps"][epoch], p["masks"][epoch])
            for i, keep in zip(step, mask)
            if keep
        ]
        assert sorted(real) == list(range(N))  # every example once, over both ranks
        assert [p["psum"][epoch][-1][0] for p in pad] == [N - 4 * B] * 2  # the last step's real examples
    assert r0["default_n"] == r1["default_n"] == [1, 6]  # one local device per process
    for res in (r0, r1):
        assert "2 processes x 2 local instances = 4 instances (10 % 4 = 2)" in res["split_error"]
        assert "disagree on dataset_size (dataset_size: rank 0: 50, rank 1: 49)" in res["mismatch"], res["mismatch"]
    assert seconds < 45, seconds


@pytest.mark.slow
def test_a_rank_whose_data_fails_is_named_and_nobody_hangs(tmp_path):
    finished, results, logs, seconds = _launch("data_error", tmp_path)
    r0, r1 = results
    assert r1 is not None and "example 31 is broken on purpose" in r1["error"], logs
    assert r0 is not None and r0["error"].startswith("RankFailed") and "rank 1" in r0["error"], (r0, logs)
    assert r0["seconds"] < 15, r0  # not the 20 s timeout
    assert seconds < 45, seconds


# The programs the two processes run.


def _count(mask, y):
    return tp.psum(mask.sum(), "batch"), tp.psum((y * mask).sum(), "batch")


def _run_epochs(loader, epochs: int = 2) -> dict:
    p_count = tp.pmap(_count, axis_name="batch")
    out = {"len": len(loader), "steps": [], "masks": [], "psum": []}
    for _ in range(epochs):
        steps, masks, sums = [], [], []
        for (_x, y), mask in loader:
            steps.append(unshard(y).tolist())
            masks.append(unshard(mask).tolist())
            total, weighted = p_count(mask, y)  # a collective every step: a rank with more steps would wait here
            sums.append([int(total[0]), int(weighted[0])])
        out["steps"].append(steps)
        out["masks"].append(masks)
        out["psum"].append(sums)
    return out


def _error(fn) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - reported to the test
        return f"{type(e).__name__}: {e}"
    return "no error"


def scenario_shares(rank: int) -> dict:
    ds = Indexed()
    out = {
        "drop": _run_epochs(ShardedLoader(ds, B, n=2, seed=3, mask=True)),
        "pad": _run_epochs(ShardedLoader(ds, B, n=2, seed=3, last_batch="pad", mask=True)),
    }
    sampler = DistributedSampler(ds, seed=3, drop_last=True)
    ddp = ShardedLoader(DataLoader(ds, batch_size=B // 2, sampler=sampler), n=2, last_batch="drop")
    out["ddp_loader"] = [[unshard(y).tolist() for _, y in ddp] for _ in range(2)]
    out["default_n"] = list(next(iter(ShardedLoader(ds, B)))[1].shape)
    out["split_error"] = _error(lambda: ShardedLoader(ds, 10, n=2))
    out["mismatch"] = _error(lambda: ShardedLoader(Indexed(N if rank == 0 else N - 1), B, n=2))
    return out


def scenario_data_error(rank: int) -> dict:
    """Rank 1's dataset raises at one example (in its prefetch thread); rank 0 waits for it in a collective."""
    # without shuffling rank 1 reads examples 6-11 of each step's 12: 31 is in its third step
    loader = ShardedLoader(Indexed(fail_at=31 if rank == 1 else None), B, n=2, shuffle=False)
    p_sum = tp.pmap(lambda y: tp.psum(y.sum(), "batch"), axis_name="batch")
    started = time.monotonic()
    try:
        for _ in range(2):
            for _, y in loader:
                p_sum(y)
        return {"error": None}
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}", "seconds": time.monotonic() - started}


def main() -> None:
    import torchpmap.distributed as tpd

    scenario, outdir = sys.argv[1], sys.argv[2]
    tpd.initialize(timeout=datetime.timedelta(seconds=float(os.environ.get("TEST_TIMEOUT", "20"))))
    rank = tp.process_index()
    try:
        out = globals()[f"scenario_{scenario}"](rank)
    except BaseException:  # noqa: BLE001 - keep the traceback for the test
        out = {"crashed": traceback.format_exc()}
    path = os.path.join(outdir, f"rank{rank}.pt")
    torch.save(out, path + ".tmp")
    os.replace(path + ".tmp", path)
    sys.stdout.flush()
    if scenario == "data_error":  # the group is out of step: leave without its collectives
        if rank == 0:
            from torchpmap._state.process_group import linger_seconds

            time.sleep(linger_seconds())
        os._exit(0)
    tpd.shutdown()


if __name__ == "__main__":
    main()
