"""Checkpoints of a whole training state, in one process and across processes.

:func:`save` writes, and :func:`load` restores, a named collection of training state in
one file:

* objects with ``state_dict()`` / ``load_state_dict()``: the model, the optimizer, the
  learning-rate scheduler, a ``torch.amp.GradScaler``, the data position
  (:class:`torchpmap.data.ShardedLoader`), ...; they are restored in place;
* plain values (the step counter, the best loss so far, a config dict): given back by
  :func:`load`;
* the random number generators of **every** process: torch's CPU generator, the CUDA
  generators when CUDA is present, Python's ``random`` and numpy's global generator.
  Each process gets its own back, so dropout masks (which differ per process and per
  instance, see :func:`torchpmap.training.data_parallel_step`) continue as if the run
  had never stopped.

With several processes (after :func:`torchpmap.distributed.initialize`), the model and
optimizer are replicated (every process holds the same copy, which data-parallel
training keeps in sync), so **rank 0 writes** its copy, with every process' RNG state
gathered to it, and **every rank reads** the file. All processes call :func:`save` and
:func:`load` at the same point of the program: both are collectives of the default
``torch.distributed`` group, synchronized by barriers, and an error in one process (a
full disk, a file that a process cannot see) is raised in all of them instead of
leaving the others waiting. The file is written atomically: to a temporary file in the
same directory, flushed to disk, then renamed over ``path`` (``os.replace``), so a crash
or a kill at any moment leaves either the previous checkpoint or the new one, never a
torn file.

Resuming is bitwise where the computation is deterministic: the same weights as a run
that was never interrupted (tested with a run killed by ``SIGKILL``, in one process and
in two).

Why not ``torch.distributed.checkpoint``: it is made for *sharded* state (FSDP, DTensor,
tensor-parallel meshes), where no process holds everything, and writes a directory of
per-process files plus metadata, with non-tensor values (RNG states, counters) as pickled
side items. Data-parallel state is replicated, so one file written by rank 0 is all it
takes, loads anywhere with a plain ``torch.load`` (any number of processes, or none),
and keeps per-process RNG states explicit. For sharded state, call
``torch.distributed.checkpoint.save`` on the same ``state_dict()`` objects.
"""
from __future__ import annotations

import os
import random
import uuid
from typing import Any, Mapping, Optional

import numpy as np
import torch
import torch.distributed as dist

__all__ = ["save", "load"]

FORMAT = "torchpmap.checkpoint/1"


# --------------------------------------------------------------------------- processes


def _world() -> tuple[int, int]:
    """(rank, number of processes) of the default torch.distributed group; (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


# --------------------------------------------------------------------------- RNG


def _rng_state() -> dict[str, Any]:
    """This process' random number generators, in types that ``torch.load(weights_only=True)`` reads."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: Mapping[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
    if "numpy" in state:
        s = state["numpy"]
        np.random.set_state((s["name"], s["keys"].numpy().astype(np.uint32), s["pos"], s["has_gauss"], s["cached_gaussian"]))
    if "cuda" in state and torch.cuda.is_available():
        saved = list(state["cuda"])
        count = torch.cuda.device_count()
        if len(saved) != count:
            raise ValueError(
                f"checkpoint.load: the checkpoint holds the state of {len(saved)} CUDA generators but this process "
                f"sees {count} CUDA devices; pass rng=False to keep the current generators"
            )
        torch.cuda.set_rng_state_all(saved)


# --------------------------------------------------------------------------- files


def _check_state(state: Any, what: str) -> None:
    if not isinstance(state, Mapping) or not all(isinstance(k, str) for k in state):
        raise TypeError(
            f"checkpoint.{what}: state must be a dict from names (str) to objects with state_dict() (model, "
            f"optimizer, scheduler, loader, ...) or plain values (the step), got {type(state).__name__}"
        )


def _stateful(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


def _write_atomically(payload: Any, path: str) -> None:
    """``torch.save(payload, path)``: into a temporary file beside ``path``, flushed to disk, renamed over it."""
    directory = os.path.dirname(os.path.abspath(path))
    temporary = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(temporary, "xb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        try:
            os.unlink(temporary)
        except OSError:
            pass
        raise
    try:  # make the rename itself durable
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:  # not every platform or file system can sync a directory
        pass


# --------------------------------------------------------------------------- save / load


def save(path: str | os.PathLike, state: Mapping[str, Any], *, rng: bool = True) -> None:
    """Saves a training state to ``path``: rank 0 writes, atomically.

    ``state`` maps names to objects with ``state_dict()`` (saved through it: ``nn.Module``,
    optimizer, LR scheduler, ``GradScaler``, :class:`torchpmap.data.ShardedLoader`) or to
    plain values (ints, floats, strings, tensors, lists and dicts of them: the step
    counter, say). With ``rng=True`` the random number generators of every process are
    saved too (see the module documentation).

    Across processes every process must call it at the same point: the RNG states are
    gathered to rank 0 (``torch.distributed.gather_object``), rank 0 writes its own copy
    of the state (which must be the same in every process, as data-parallel training
    keeps it), and a broadcast of the outcome ends the call in every process only once
    the file is complete. If rank 0 fails to write, every process raises.

    The file is replaced atomically (a temporary file in the same directory, then
    ``os.replace``): a crash leaves the previous checkpoint or the new one.

    Args:
        path: the file to write; its directory must exist.
        state: the names and objects/values to save.
        rng: also save every process' random number generators.

    Example:
        >>> import os, tempfile, torch
        >>> from torchpmap import checkpoint
        >>> model = torch.nn.Linear(2, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        >>> path = os.path.join(tempfile.mkdtemp(), "ckpt.pt")
        >>> checkpoint.save(path, {"model": model, "optimizer": opt, "step": 10})
        >>> sorted(torch.load(path)["state"])
        ['model', 'optimizer', 'step']
    """
    _check_state(state, "save")
    path = os.fspath(path)
    rank, processes = _world()
    mine = _rng_state() if rng else None
    gathered: Optional[list] = [mine]
    if processes > 1:  # entering together; rank 0 gets every process' generators
        if rng:
            gathered = [None] * processes if rank == 0 else None
            dist.gather_object(mine, gathered, dst=0)
        else:
            dist.barrier()
    failure: Optional[BaseException] = None
    if rank == 0:
        try:
            payload = {
                "format": FORMAT,
                "process_count": processes,
                "state": {k: (v.state_dict() if _stateful(v) else v) for k, v in state.items()},
                "stateful": [k for k, v in state.items() if _stateful(v)],
                "rng": gathered if rng else None,
            }
            _write_atomically(payload, path)
        except BaseException as error:  # noqa: BLE001 -- told to every process, then raised
            if processes == 1:
                raise
            failure = error
    if processes > 1:  # leaving together, once the file is complete (or with rank 0's error)
        outcome = [None if failure is None else _describe(failure)]
        dist.broadcast_object_list(outcome, src=0)
        if failure is not None:
            raise failure
        if outcome[0] is not None:
            raise RuntimeError(f"checkpoint.save: rank 0 could not write {path}: {outcome[0]}")


def load(
    path: str | os.PathLike,
    state: Optional[Mapping[str, Any]] = None,
    *,
    rng: bool = True,
    map_location: Any = "cpu",
    weights_only: bool = True,
) -> dict[str, Any]:
    """Restores a training state saved by :func:`save`; every process reads the file.

    Every object in ``state`` gets its saved ``state_dict`` through
    ``load_state_dict`` (in place: pass the model, optimizer, scheduler, loader built
    as for a fresh start). With ``rng=True`` this process' random number generators are
    set to those it had at the save (a checkpoint saved with ``rng=False`` holds none,
    and they are left alone).

    Across processes every process must call it at the same point (a barrier, then
    every process reads the file, then an ``all_gather_object`` of the outcome): the
    file must be on a file system every process sees (shared across machines), and a
    process that cannot read it makes every process raise, naming it. The RNG states
    of a checkpoint saved by another number of processes cannot be matched to this
    run's: that raises, unless ``rng=False``.

    Args:
        path: the checkpoint file.
        state: names -> objects to restore in place (keys saved as objects or as plain
            values may both be left out: they come back in the returned dict).
        rng: restore this process' random number generators.
        map_location: passed to ``torch.load`` (default: tensors on the CPU;
            ``load_state_dict`` moves them to where the model and optimizer are).
        weights_only: passed to ``torch.load``: only tensors, numbers, strings and
            containers of them are unpickled (what model, optimizer, scheduler and
            loader states hold); pass False for a checkpoint with other objects in it,
            from a source you trust.

    Returns:
        Every saved name: the restored object for those in ``state``, the saved value
        (or state dict) for the others.

    Example:
        >>> import os, tempfile, torch
        >>> from torchpmap import checkpoint
        >>> model = torch.nn.Linear(2, 1)
        >>> path = os.path.join(tempfile.mkdtemp(), "ckpt.pt")
        >>> checkpoint.save(path, {"model": model, "step": 10})
        >>> expected = torch.rand(3)                    # what the generator draws after the save
        >>> fresh = torch.nn.Linear(2, 1)
        >>> restored = checkpoint.load(path, {"model": fresh})
        >>> restored["step"], torch.equal(fresh.weight, model.weight)
        (10, True)
        >>> torch.equal(torch.rand(3), expected)        # the generator is back where it was
        True
    """
    if state is None:
        state = {}
    _check_state(state, "load")
    path = os.fspath(path)
    rank, processes = _world()
    if processes > 1:
        dist.barrier()
    payload, failure = None, None
    try:
        payload = torch.load(path, map_location=map_location, weights_only=weights_only)
        if not isinstance(payload, dict) or payload.get("format") != FORMAT:
            raise ValueError(f"{path} is not a checkpoint written by torchpmap.checkpoint.save")
        _check_restorable(payload, state, rng, processes, path)
    except BaseException as error:  # noqa: BLE001 -- told to every process, then raised
        if processes == 1:
            raise
        failure = error
    if processes > 1:
        outcomes: list[Any] = [None] * processes
        dist.all_gather_object(outcomes, None if failure is None else _describe(failure))
        failed = [(r, why) for r, why in enumerate(outcomes) if why is not None]
        if failed:
            detail = "; ".join(f"rank {r}: {why}" for r, why in failed)
            message = (
                f"checkpoint.load: {len(failed)} of {processes} processes could not load {path} ({detail}); every "
                "process reads the checkpoint, so it must be on a file system they all see"
            )
            if failure is not None:
                raise RuntimeError(message) from failure
            raise RuntimeError(message)
    saved = payload["state"]
    for name, obj in state.items():
        obj.load_state_dict(saved[name])
    if rng and payload.get("rng") is not None:
        _set_rng_state(payload["rng"][rank])
    return {name: state.get(name, value) for name, value in saved.items()}


def _check_restorable(payload: dict, state: Mapping[str, Any], rng: bool, processes: int, path: str) -> None:
    """Everything that could fail, checked before anything is changed."""
    saved = payload["state"]
    missing = [k for k in state if k not in saved]
    if missing:
        raise KeyError(f"checkpoint.load: {path} holds no {', '.join(map(repr, missing))}; it holds {sorted(saved)}")
    for name, obj in state.items():
        if not _stateful(obj):
            raise TypeError(
                f"checkpoint.load: state[{name!r}] is a {type(obj).__name__}, which has no load_state_dict(); pass only "
                "objects to restore in place (plain values such as the step come back in the returned dict)"
            )
    if rng and payload.get("rng") is not None and len(payload["rng"]) != processes:
        raise ValueError(
            f"checkpoint.load: {path} was saved by {len(payload['rng'])} process(es) and this run has {processes}, so "
            "its random number generator states cannot be given back one per process; pass rng=False to restore "
            "the rest and keep this run's generators"
        )
