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
``torch.distributed`` group, and an error in one process (a full disk, a file that a
process cannot see) is raised in all of them instead of leaving the others waiting. Their
transfers are watched like a pmap's: a process that dies during a save or a load (killed,
out of memory) makes every other one raise :class:`torchpmap.distributed.RankFailed`
naming it, within seconds. The file is written atomically: to a temporary file in the
same directory, flushed to disk, then renamed over ``path`` (``os.replace``), so a crash
or a kill at any moment leaves either the previous checkpoint or the new one, never a
torn file. The temporary file of a process killed during a save is removed by the next
save or load of that path on the same machine (its name holds the machine and the
process id: a process that no longer runs left it).

**All or nothing.** :func:`load` checks every object against the checkpoint before it
changes any: the names, each module's keys, shapes and dtypes through
``load_state_dict`` on a copy whose tensors are on the ``meta`` device (no memory, no
data), each optimizer's parameter groups the same way, each
:class:`torchpmap.data.ShardedLoader`'s data order on a copy, and the generators. If something
still fails while the objects are restored (an object whose ``load_state_dict`` has no
such copy, a device out of memory), the objects restored so far, the failing one and the
generators are put back as they were, from a copy of their ``state_dict()`` taken before,
and the error is raised: the objects are as before the call. Across processes the
processes agree on it: when one fails, or dies, every process puts its objects back.

**Damaged files** are told apart before ``torch.load`` runs: an empty file, a truncated
one (the beginning of an archive as ``torch.save`` writes, whose end is missing) and a
file that is no such archive each raise a ``ValueError`` naming the path, what is wrong
and what to do.

**Sharded training state is refused.** The state of a
``data_parallel_step(shard_params=...)`` is not replicated: between its steps the
module's parameters are emptied (the values are the step's rows: call
``step.gather_params()`` first), and across processes its optimizer holds each process'
own rows (save ``step.optimizer_state_dict()``, the whole state, instead). :func:`save`
and :func:`load` raise, saying so, rather than write or restore the wrong values.

**Values on several devices.** A :class:`torchpmap.ShardedTensor` (a pmap's result on
several devices), anywhere in the state, is saved as the plain tensor it stands for
(gathered): a checkpoint holds plain tensors only, loads with
``torch.load(weights_only=True)``, and is the same whatever placement computed it.

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

import collections
import copy
import io
import itertools
import os
import pickle
import pickletools
import random
import socket
import uuid
import warnings
import zipfile
from collections.abc import Callable, Mapping
from typing import Any, cast

import numpy as np
import torch
import torch.distributed as dist

from torchpmap._frontend.sharded_params import emptied_parameters, steps_sharded_rows
from torchpmap._placement.sharded import ShardedTensor
from torchpmap._state import process_group as _process_group
from torchpmap._state.listing import first_few
from torchpmap._state.log import logger
from torchpmap.data import ShardedLoader

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


def _exchange(mine: str | None, what: str) -> list[str | None]:
    """Every process' ``mine`` (None: nothing to report), in rank order: a collective of the
    default group, watched like a pmap's (a process that fails or dies makes the others raise
    ``RankFailed`` naming it)."""
    received = _process_group.all_gather_bytes(b"" if mine is None else b"!" + mine.encode(), what)
    return [r[1:].decode(errors="replace") if r else None for r in received]


def _to_bytes(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _from_bytes(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=True)  # what _rng_state makes: plain values and tensors


# --------------------------------------------------------------------------- RNG


def _rng_state() -> dict[str, Any]:
    """This process' random number generators, in types that ``torch.load(weights_only=True)`` reads."""
    name, keys, pos, has_gauss, cached = cast(tuple, np.random.get_state())  # legacy=True: the tuple
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
        np.random.set_state(
            (s["name"], s["keys"].numpy().astype(np.uint32), s["pos"], s["has_gauss"], s["cached_gaussian"])
        )
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


def _check_not_sharded_step_state(state: Mapping[str, Any], what: str, processes: int) -> None:
    """Refuses what a ``data_parallel_step(shard_params=...)`` holds in place of
    replicated state: a module whose parameters it emptied (their values are in the
    step's rows), and, across processes, an optimizer moved onto its rows (each process
    holds other rows: the one file rank 0 writes would give every process rank 0's)."""
    for name, value in state.items():
        if isinstance(value, torch.nn.Module):
            emptied = emptied_parameters(value)
            if emptied:
                shown = first_few([repr(k) for k in emptied])
                raise ValueError(
                    f"checkpoint.{what}: the module {name!r} has parameters that a "
                    "data_parallel_step(shard_params=...) "
                    f"emptied ({shown} have 0 elements: their values are in the step's rows). Call "
                    "step.gather_params() first to write the whole values into the module."
                )
        if isinstance(value, torch.optim.Optimizer) and processes > 1 and steps_sharded_rows(value):
            raise ValueError(
                f"checkpoint.{what}: the optimizer {name!r} steps the rows of a data_parallel_step(shard_params=...), "
                f"and each of the {processes} processes holds other rows, so one file cannot hold its state for every "
                "process. Save step.optimizer_state_dict() (the whole state, every process calls it) in its place, "
                "and restore it with torch.distributed.checkpoint.state_dict.set_optimizer_state_dict into a new "
                "optimizer (see the training loop tutorial)."
            )


def _stateful(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


def _plain(value: Any) -> Any:
    """``value`` with every :class:`ShardedTensor` in it (through dicts, lists and tuples)
    replaced by the plain tensor it stands for; containers without one are kept as they are
    (an ``OrderedDict`` keeps its ``_metadata``, which ``Module.load_state_dict`` reads)."""
    if isinstance(value, ShardedTensor):
        with torch.no_grad():
            plain = value.gather().detach()
        return plain.requires_grad_() if value.requires_grad else plain
    if isinstance(value, dict):
        items = {k: _plain(v) for k, v in value.items()}
        if all(items[k] is value[k] for k in value):
            return value
        out = copy.copy(value)
        for k, v in items.items():
            out[k] = v
        return out
    if isinstance(value, (list, tuple)):
        elems = [_plain(v) for v in value]
        if all(a is b for a, b in zip(elems, value)):
            return value
        if isinstance(value, list):
            return type(value)(elems) if type(value) is not list else elems
        return type(value)(*elems) if hasattr(value, "_fields") else type(value)(elems)
    return value


def _temporary(path: str) -> str:
    """A temporary file beside ``path``, named by this machine and process, so that the
    next save or load on this machine can tell one left by a process that was killed."""
    directory, base = os.path.split(os.path.abspath(path))
    return os.path.join(directory, f".{base}.{socket.gethostname()}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")


def _process_runs(pid: int) -> bool:
    """Whether process ``pid`` of this machine runs (a zombie, killed but not yet reaped, does not)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it runs
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[-1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


def _remove_stale_temporaries(path: str) -> None:
    """Removes the temporary files of saves to ``path`` that processes of this machine left
    when they were killed (a process that no longer runs); leaves every other file alone."""
    directory, base = os.path.split(os.path.abspath(path))
    prefix, host = f".{base}.", socket.gethostname()
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return  # no such directory: the save or load itself says so
    for entry in entries:
        name = entry.name
        if not (name.startswith(prefix) and name.endswith(".tmp")):
            continue
        parts = name[len(prefix) : -len(".tmp")].rsplit(".", 2)
        if len(parts) != 3 or parts[0] != host or not parts[1].isdigit() or len(parts[2]) != 8:
            continue  # another machine's (its processes cannot be seen from here), or not one of ours
        if _process_runs(int(parts[1])):
            continue
        try:
            os.unlink(entry.path)
            logger.info(
                "checkpoint: removed %s, left by process %s (no longer running) in a save of %s",
                entry.path,
                parts[1],
                path,
            )
        except OSError:
            pass


def _write_atomically(payload: Any, path: str) -> None:
    """``torch.save(payload, path)``: into a temporary file beside ``path``, flushed to disk, renamed over it."""
    directory = os.path.dirname(os.path.abspath(path))
    temporary = _temporary(path)
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


_ZIP_START = b"PK\x03\x04"  # how an archive written by torch.save begins


def _pickle_is_whole(path: str) -> bool:
    """Whether the archive's pickle reads from start to end (so that an unpickling error is
    about what it holds, not about damage)."""
    try:
        with zipfile.ZipFile(path) as archive:
            name = next(n for n in archive.namelist() if n.endswith("data.pkl"))
            for _ in pickletools.genops(archive.read(name)):
                pass
        return True
    except Exception:  # noqa: BLE001 -- any failure to read it through is damage
        return False


def _read(path: str, map_location: Any, weights_only: bool) -> dict:
    """The payload of the checkpoint at ``path``; a ValueError naming the damage for a file that is none."""
    try:
        size = os.path.getsize(path)
    except FileNotFoundError:
        raise FileNotFoundError(2, "checkpoint.load: no such file (check the path; every process reads it, so it must "
                                   "be on a file system they all see)", path) from None
    if size == 0:
        raise ValueError(
            f"checkpoint.load: {path} is empty (0 bytes), so it holds no checkpoint. checkpoint.save never leaves an "
            "empty file at its path (it renames a complete temporary file over it): something else created or "
            "truncated it, or a copy of it failed. Load an earlier checkpoint, or copy it again from where it came."
        )
    with open(path, "rb") as f:
        head = f.read(len(_ZIP_START))
    if not zipfile.is_zipfile(path):
        if head == _ZIP_START:
            raise ValueError(
                f"checkpoint.load: {path} is truncated: its {size} bytes are the beginning of an archive as torch.save "
                "writes, whose end (the archive's directory) is missing. checkpoint.save never leaves a partial file "
                "at its path (it renames a complete temporary file over it), so it was cut short by a copy or a "
                "transfer that stopped, or by a full disk: copy it again from where it came, or load an earlier "
                "checkpoint."
            )
        raise ValueError(
            f"checkpoint.load: {path} is not a torchpmap checkpoint: it is not an archive as torch.save writes (its "
            f"first bytes are {head!r}, where a checkpoint starts with {_ZIP_START!r}). Check the path: it names "
            "another file, a file of another program, or one that was overwritten. checkpoint.load reads the files "
            "checkpoint.save writes."
        )
    try:
        payload = torch.load(path, map_location=map_location, weights_only=weights_only)
    except (MemoryError, PermissionError, FileNotFoundError):
        raise
    except Exception as error:
        if weights_only and isinstance(error, pickle.UnpicklingError) and _pickle_is_whole(path):
            first = (str(error).strip().splitlines() or [""])[0]
            raise pickle.UnpicklingError(
                f"checkpoint.load: {path} holds objects that weights_only=True does not unpickle ({first}). Load it "
                "with weights_only=False if you trust where it came from, or save only tensors, numbers, strings and "
                "containers of them (and objects through their state_dict())."
            ) from error
        raise ValueError(
            f"checkpoint.load: {path} is damaged: it is an archive as torch.save writes, but torch.load could not read "
            f"it ({_describe(error).strip().splitlines()[0]}). Its contents were changed after it was written, or "
            "another program wrote it: load an earlier checkpoint."
        ) from error
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        held = f"a dict without the checkpoint format {FORMAT!r}" if isinstance(payload, dict) else None
        held = held or f"a {type(payload).__name__}"
        raise ValueError(
            f"checkpoint.load: {path} is not a checkpoint written by torchpmap.checkpoint.save: torch.load reads it, "
            f"but it holds {held}. Read it with torch.load, or save the training state with checkpoint.save."
        )
    return payload


# --------------------------------------------------------------------------- save / load


def save(path: str | os.PathLike, state: Mapping[str, Any], *, rng: bool = True) -> None:
    """Saves a training state to ``path``: rank 0 writes, atomically.

    ``state`` maps names to objects with ``state_dict()`` (saved through it: ``nn.Module``,
    optimizer, LR scheduler, ``GradScaler``, :class:`torchpmap.data.ShardedLoader`) or to
    plain values (ints, floats, strings, tensors, lists and dicts of them: the step
    counter, say). With ``rng=True`` the random number generators of every process are
    saved too (see the module documentation).

    Across processes every process must call it at the same point: the RNG states are
    gathered to rank 0, rank 0 writes its own copy of the state (which must be the same
    in every process, as data-parallel training keeps it), and an exchange of the outcome
    ends the call in every process only once the file is complete. If rank 0 fails to
    write, every process raises; if a process dies meanwhile, every other one raises
    :class:`torchpmap.distributed.RankFailed` naming it.

    The file is replaced atomically (a temporary file in the same directory, then
    ``os.replace``): a crash leaves the previous checkpoint or the new one. Temporary
    files that killed saves of ``path`` left on this machine are removed first.
    :class:`torchpmap.ShardedTensor` values are saved as the plain tensors they stand for.

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
    _check_not_sharded_step_state(state, "save", processes)
    mine = _rng_state() if rng else None
    gathered: list | None = [mine]
    if processes > 1:  # entering together; rank 0 gets every process' generators
        what = f"checkpoint.save of {path} (every process' random generators to rank 0)"
        received = _process_group.all_gather_bytes(_to_bytes(mine) if rng else b"", what)
        gathered = [_from_bytes(r) for r in received] if rng and rank == 0 else None
    failure: BaseException | None = None
    if rank == 0:
        try:
            _remove_stale_temporaries(path)
            payload = {
                "format": FORMAT,
                "process_count": processes,
                "state": {k: _plain(v.state_dict() if _stateful(v) else v) for k, v in state.items()},
                "stateful": [k for k, v in state.items() if _stateful(v)],
                "rng": gathered if rng else None,
            }
            _write_atomically(payload, path)
        except BaseException as error:
            if processes == 1:
                raise
            failure = error
    if processes > 1:  # leaving together, once the file is complete (or with rank 0's error)
        outcome = _exchange(
            None if failure is None else _describe(failure), f"checkpoint.save of {path} (rank 0 writing it)"
        )[0]
        if failure is not None:
            raise failure
        if outcome is not None:
            raise RuntimeError(f"checkpoint.save: rank 0 could not write {path}: {outcome}")


def load(
    path: str | os.PathLike,
    state: Mapping[str, Any] | None = None,
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

    All or nothing (see the module documentation): every object is checked against the
    checkpoint before any is changed (modules and optimizers through their own
    ``load_state_dict`` on a copy with meta tensors), and a failure while restoring puts
    back the objects and generators restored so far. A damaged file (empty, truncated,
    not a checkpoint) raises a ``ValueError`` naming the path and the damage.

    Across processes every process must call it at the same point (every process reads
    the file and checks its objects, then an exchange of the outcomes; after restoring,
    another): the file must be on a file system every process sees (shared across
    machines), a process that cannot read it makes every process raise, naming it, before
    any changes anything, and a process that dies makes the others raise
    :class:`torchpmap.distributed.RankFailed`, their objects put back. The RNG states of a
    checkpoint saved by another number of processes cannot be matched to this run's:
    that raises, unless ``rng=False``.

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
    _check_not_sharded_step_state(state, "load", processes)
    if processes > 1:
        _exchange(None, f"checkpoint.load of {path} (entering)")
    payload, failure = None, None
    try:
        _remove_stale_temporaries(path)
        payload = _read(path, map_location, weights_only)
        _check_restorable(payload, state, rng, processes, path)
    except BaseException as error:
        if processes == 1:
            raise
        failure = error
    if processes > 1:
        _agree(failure, processes, path, "could not load", "every process reads the checkpoint, so it must be on a "
               "file system they all see")
    payload = cast(dict, payload)  # read, or a failure was raised (by _agree across processes)
    restore = _restore_all_or_nothing(payload, state, rng, rank, path, agree=processes > 1)
    if processes > 1:
        try:  # every process restored its objects, or every process puts them back
            _agree(None, processes, path, "could not restore the objects from",
                   "every process put its objects back as they were before the call")
        except BaseException:
            restore()
            raise
    return {name: state.get(name, value) for name, value in payload["state"].items()}


def _agree(failure: BaseException | None, processes: int, path: str, did: str, why: str) -> None:
    """Every process' outcome; raises in every process, naming the ranks, when one failed."""
    outcomes = _exchange(None if failure is None else _describe(failure), f"checkpoint.load of {path}")
    failed = [(r, told) for r, told in enumerate(outcomes) if told is not None]
    if failed:
        detail = "; ".join(f"rank {r}: {told}" for r, told in failed)
        message = f"checkpoint.load: {len(failed)} of {processes} processes {did} {path} ({detail}); {why}"
        if failure is not None:
            raise RuntimeError(message) from failure
        raise RuntimeError(message)


def _restore_all_or_nothing(
    payload: dict, state: Mapping[str, Any], rng: bool, rank: int, path: str, agree: bool
) -> Callable[[], None]:
    """Restores every object of ``state`` (then the generators) from ``payload``; if one
    fails, puts back those restored so far, the failing one and the generators, then raises
    (across processes, after telling the others, which put theirs back too). Returns what
    puts everything back, for a failure elsewhere after this."""
    saved = payload["state"]
    before = {name: _copy_of_state(obj) for name, obj in state.items()}
    generators = payload.get("rng") if rng else None
    before_rng = _rng_state() if generators is not None else None
    touched: list[str] = []

    def put_back() -> None:
        problems = []
        for name in reversed(touched):
            try:
                state[name].load_state_dict(before[name])
            except BaseException as error:  # noqa: BLE001 -- reported, the others are still put back
                problems.append(f"state[{name!r}]: {_describe(error)}")
        if before_rng is not None:
            _set_rng_state(before_rng)
        if problems:
            raise RuntimeError(f"checkpoint.load: could not put back {'; '.join(problems)}")

    doing = ""
    try:
        for name, obj in state.items():
            touched.append(name)
            doing = f"state[{name!r}].load_state_dict"
            obj.load_state_dict(saved[name])
        if generators is not None:
            doing = "setting the random generators"
            _set_rng_state(generators[rank])
    except BaseException as error:
        where = doing
        try:
            put_back()
        except RuntimeError as also:
            if hasattr(error, "add_note"):  # Python >= 3.11
                error.add_note(str(also))
        if hasattr(error, "add_note"):
            error.add_note(
                f"checkpoint.load: {where} failed while restoring {path}; the objects restored before it, it and the "
                "random generators were put back as they were before the call"
            )
        if agree:  # the others put theirs back too
            _agree(error, _world()[1], path, "could not restore the objects from",
                   "every process put its objects back as they were before the call")
        raise
    return put_back


def _copy_of_state(obj: Any) -> Any:
    """A copy of ``obj.state_dict()`` that later changes to ``obj`` do not reach (its tensors cloned)."""
    current = obj.state_dict()
    try:
        return copy.deepcopy(current)
    except Exception:  # noqa: BLE001 -- a value deepcopy cannot copy: keep what state_dict() gave
        return copy.copy(current)


def _check_restorable(payload: dict, state: Mapping[str, Any], rng: bool, processes: int, path: str) -> None:
    """Everything that could fail, checked before anything is changed: the names, every
    module and optimizer against what the checkpoint holds for it (through its own
    ``load_state_dict``, on a copy whose tensors are on the meta device), the generators."""
    saved = payload["state"]
    missing = [k for k in state if k not in saved]
    if missing:
        raise KeyError(f"checkpoint.load: {path} holds no {', '.join(map(repr, missing))}; it holds {sorted(saved)}")
    for name, obj in state.items():
        if not _stateful(obj):
            raise TypeError(
                f"checkpoint.load: state[{name!r}] is a {type(obj).__name__}, which has no load_state_dict(); pass "
                "only objects to restore in place (plain values such as the step come back in the returned dict)"
            )
    if rng and payload.get("rng") is not None and len(payload["rng"]) != processes:
        raise ValueError(
            f"checkpoint.load: {path} was saved by {len(payload['rng'])} process(es) and this run has {processes}, so "
            "its random number generator states cannot be given back one per process; pass rng=False to restore "
            "the rest and keep this run's generators"
        )
    if rng and payload.get("rng") is not None and "cuda" in payload["rng"][0] and torch.cuda.is_available():
        saved_cuda, count = len(payload["rng"][0]["cuda"]), torch.cuda.device_count()
        if saved_cuda != count:
            raise ValueError(
                f"checkpoint.load: {path} holds the state of {saved_cuda} CUDA generators but this process sees "
                f"{count} CUDA devices; pass rng=False to keep the current generators"
            )
    for name, obj in state.items():
        if isinstance(obj, torch.nn.Module):
            _check_module(obj, saved[name], name, path)
        elif isinstance(obj, torch.optim.Optimizer):
            _check_optimizer(obj, saved[name], name, path)
        elif isinstance(obj, ShardedLoader):  # its load_state_dict only rebinds attributes: a shallow copy is a dry run
            try:
                copy.copy(obj).load_state_dict(saved[name])
            except Exception as error:
                raise _refusal(obj, name, path, f"its load_state_dict refuses it: {_describe(error)}") from error


def _refusal(obj: Any, name: str, path: str, problem: str) -> ValueError:
    return ValueError(
        f"checkpoint.load: state[{name!r}] ({type(obj).__name__}) does not fit what {path} holds under {name!r}: "
        f"{problem}. Nothing was changed (no object, no generator). Build it as it was when the checkpoint was saved "
        "(the same architecture and sizes; an optimizer over the same parameters in the same groups), or pass the "
        "checkpoint you meant."
    )


def _kind(dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "bool"
    if dtype.is_complex:
        return "complex"
    return "floating" if dtype.is_floating_point else "integer"


def _check_module(module: torch.nn.Module, saved: Any, name: str, path: str) -> None:
    """The module's own ``load_state_dict`` on a copy whose tensors are meta (keys and shapes
    as torch checks them, the module's hooks included); dtypes of another kind (an integer
    tensor for a floating one, say), which torch would convert silently, are refused too."""
    if not isinstance(saved, Mapping):
        raise _refusal(module, name, path, f"the checkpoint holds a {type(saved).__name__} there, not a state dict")
    current = module.state_dict()
    kinds = [
        f"{k!r} is {saved[k].dtype} in the checkpoint and {v.dtype} here"
        for k, v in current.items()
        if isinstance(v, torch.Tensor)
        and isinstance(saved.get(k), torch.Tensor)
        and _kind(v.dtype) != _kind(saved[k].dtype)
    ]
    if kinds:
        raise _refusal(module, name, path, "tensors of another kind of dtype: " + "; ".join(kinds))
    try:
        copy_ = _meta_copy(module)
    except Exception:  # noqa: BLE001 -- no copy: compare keys and shapes as strict loading would
        copy_ = None
    if copy_ is None:
        missing = [k for k in current if k not in saved]
        unexpected = [k for k in saved if k not in current]
        shapes = [
            f"{k!r} has shape {tuple(saved[k].shape)} in the checkpoint and {tuple(v.shape)} here"
            for k, v in current.items()
            if isinstance(v, torch.Tensor) and isinstance(saved.get(k), torch.Tensor) and saved[k].shape != v.shape
        ]
        problems = ([f"keys missing from the checkpoint: {missing}"] if missing else []) + (
            [f"keys the module does not have: {unexpected}"] if unexpected else []) + shapes
        if problems:
            raise _refusal(module, name, path, "; ".join(problems))
        return
    try:
        with warnings.catch_warnings():
            # "copying from a non-meta parameter ... to a meta parameter ... is a no-op"
            warnings.simplefilter("ignore")
            copy_.load_state_dict(saved)
    except Exception as error:
        raise _refusal(module, name, path, f"its load_state_dict refuses it: {_describe(error).strip()}") from error


def _meta_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of ``module`` whose parameters and buffers are meta tensors of the same
    shapes and dtypes (no memory, no data): loading a state dict into it checks what loading
    into ``module`` would, and changes nothing."""
    memo: dict[int, Any] = {}
    for t in itertools.chain(module.parameters(), module.buffers()):
        if id(t) in memo:
            continue
        meta = torch.empty_like(t, device="meta")
        memo[id(t)] = (
            torch.nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, torch.nn.Parameter) else meta
        )
    return copy.deepcopy(module, memo)


def _check_optimizer(optimizer: torch.optim.Optimizer, saved: Any, name: str, path: str) -> None:
    """The optimizer's own ``load_state_dict`` on a copy over meta stand-ins of its
    parameters (the number and sizes of the parameter groups, as torch checks them)."""
    if not isinstance(saved, Mapping):
        raise _refusal(optimizer, name, path, f"the checkpoint holds a {type(saved).__name__} there, not a state dict")
    try:
        stand_in = {p: torch.empty_like(p, device="meta") for g in optimizer.param_groups for p in g["params"]}
        dry = object.__new__(type(optimizer))
        dry.__dict__.update(optimizer.__dict__)
        dry.param_groups = [{**g, "params": [stand_in[p] for p in g["params"]]} for g in optimizer.param_groups]
        dry.state = collections.defaultdict(dict)
    except Exception:  # noqa: BLE001 -- an optimizer that cannot be copied so: restored without a dry run
        return
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dry.load_state_dict(cast(dict, saved))
    except Exception as error:
        raise _refusal(optimizer, name, path, f"its load_state_dict refuses it: {_describe(error).strip()}") from error
