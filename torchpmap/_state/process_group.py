"""The state of a multi-process run, and how its collectives fail instead of hanging.

:mod:`torchpmap.distributed` is the public face; this module holds what the distributed
engine (:mod:`torchpmap._engines.multi_process`) and :mod:`torchpmap._placement.devices` need:

* :func:`active` / :func:`state`: whether torch.distributed runs with more than one
  process, and this process' :class:`ProcessState` (rank, devices, the rendezvous store).
* :func:`wait`: waits for a collective while watching for failures elsewhere.
* Faults. Every process keeps a *heartbeat* in the rendezvous store (a daemon thread
  writes a counter every :func:`heartbeat_interval` seconds). A process whose pmapped
  function raises writes a *failure record* before it re-raises. A process waiting in a
  collective polls for failure records; when the collective errors (gloo reports a
  closed connection when a peer dies) or its deadline passes, it looks at the records
  and the heartbeats to name the rank at fault, records what it found for the others,
  and raises :class:`RankFailed` (or ``TimeoutError`` when every rank is alive but one
  never arrived). After a failure the process group is out of step: later distributed
  pmaps raise at once.
* The job token. All of that lives in the store under ``torchpmap/<token>/``, where the
  token is 16 random hex digits drawn by rank 0 for each process group
  (:func:`agree_on_token`, :func:`_store_token`). A store can outlive a job (torchrun's
  agent keeps its store across restarts; a ``FileStore`` file or a store server can be
  reused), and its keys outlive the group that wrote them: without the token, a failure
  record left by an earlier job (or an earlier ``initialize``) under the same prefix
  would make every collective of the next one raise :class:`RankFailed` at once, and so
  would a record written by anyone who can reach the store under a prefix they can
  guess. The token is no secret (``Store.list_keys`` shows it to anyone who can reach
  the store), so it keeps out stale and blind records, not a deliberate attacker:
  see "Who can reach the store" in ``docs/multiprocess.md``.
"""
from __future__ import annotations

import atexit
import dataclasses
import datetime
import json
import os
import secrets
import threading
import time
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from torchpmap._state import config as _config
from torchpmap._state import torch_private as private
from torchpmap._state.device_record import Device
from torchpmap._state.faults import PeerFailed
from torchpmap._state.log import logger

#: The default of :func:`heartbeat_interval`, in seconds.
DEFAULT_HEARTBEAT_INTERVAL = 0.5


def heartbeat_interval() -> float:
    """Seconds between two heartbeats of a process: ``TORCHPMAP_HEARTBEAT_INTERVAL``, read
    when a process state is made (by :func:`torchpmap.distributed.initialize`, before it
    joins), not at import; a bad value raises a ValueError naming the variable."""
    return _config.seconds("TORCHPMAP_HEARTBEAT_INTERVAL", DEFAULT_HEARTBEAT_INTERVAL)


#: A process whose heartbeat has not moved for this many intervals is taken for dead.
_DEAD_AFTER_BEATS = 3
#: The first wait slice of a collective: the failure records are polled only when a
#: collective takes longer than this, so fast collectives pay nothing for fault checks.
_FIRST_SLICE = 0.05
_MAX_SLICE = 0.2
#: Seconds left to torch's threads (with the GIL) after the default group is destroyed:
#: gloo's workers drop the last collectives' tensors then, and need the GIL for it.
THREADS_SETTLE_SECONDS = 0.01


class RankFailed(PeerFailed):
    """A collective was abandoned because another process failed.

    Attributes:
        ranks: the ranks (in the world group) found at fault.
    """

    def __init__(self, message: str, ranks: Sequence[int] = ()):
        super().__init__(message)
        self.ranks = tuple(ranks)


class _StoreUnreachable(RuntimeError):
    pass


@dataclasses.dataclass(eq=False)
class ProcessState:
    """This process in a multi-process run."""

    rank: int
    world_size: int
    local_rank: int
    backend: str
    timeout: float
    store: Any  # a torch.distributed Store under this group's prefix (torchpmap/<token>/), or None
    store_address: str
    local_device: Device
    owns_group: bool
    exact_devices: bool  # every rank published its device in the store before initialize returned
    calls: int = 0  # distributed pmap calls entered: the heartbeat publishes it
    waiting_in: str = ""  # the collective waited on now, for diagnoses
    poisoned: str | None = None
    heartbeat: _Heartbeat | None = None
    world_group: Any = None  # the default process group this state belongs to
    token: str = ""  # this group's job token (see the module docstring); empty without a store
    heartbeat_interval: float = DEFAULT_HEARTBEAT_INTERVAL  # seconds between two heartbeats
    _devices: tuple[Device, ...] | None = None

    @property
    def local_devices(self) -> tuple[Device, ...]:
        return (self.local_device,)

    @property
    def devices(self) -> tuple[Device, ...]:
        if self._devices is None:
            self._devices = tuple(self._device_of(r) for r in range(self.world_size))
        return self._devices

    def _device_of(self, r: int) -> Device:
        if r == self.rank:
            return self.local_device
        if self.exact_devices and self.store is not None:
            try:
                platform, index = self.store.get(f"device/{r}").decode().split(":")
                return Device(platform, int(index), r)
            except Exception:  # noqa: BLE001 - fall back to the guess below
                pass
        # Homogeneous processes: the same platform everywhere, local ranks in node order.
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or None
        index = (r % per_node) if (per_node and self.local_device.platform == "cuda") else 0
        return Device(self.local_device.platform, index, r)

    def check_usable(self) -> None:
        if self.poisoned is not None:
            raise RuntimeError(
                f"torchpmap: the processes are out of step since an earlier failure ({self.poisoned}). Collectives "
                "of the processes that went on would no longer match, so distributed pmaps are refused. Restart "
                "the processes (torchrun restarts them with --max-restarts), or call torchpmap.distributed.shutdown() "
                "and initialize() again in every process."
            )


_state: ProcessState | None = None
_lock = threading.RLock()
_generation = 0  # states made so far in this process: the same count in every process


_DIST_AVAILABLE = dist.is_available()


def active() -> bool:
    """True when torch.distributed is initialized with more than one process (or with
    one, under ``TORCHPMAP_SINGLE_PROCESS_GROUP=1``: see :func:`single_process_group`)."""
    return _DIST_AVAILABLE and dist.is_initialized() and (dist.get_world_size() > 1 or SINGLE_PROCESS_GROUP)


#: ``TORCHPMAP_SINGLE_PROCESS_GROUP=1``: a process group of one process is used as one (a
#: testing aid: every exchange then runs through the backend, e.g. NCCL on a machine with
#: one GPU, where NCCL refuses two processes). Off, one process runs as no process group.
SINGLE_PROCESS_GROUP = os.environ.get("TORCHPMAP_SINGLE_PROCESS_GROUP", "") == "1"


def view() -> ProcessState | None:
    """This process' state when :func:`active`, else None (what :mod:`torchpmap._placement.devices` consults)."""
    return state() if active() else None


def state() -> ProcessState:
    """This process' state; created on first use for a process group that was
    initialized without :func:`torchpmap.distributed.initialize`."""
    global _state
    st = _state
    if st is not None and st.world_group is dist.group.WORLD:
        return st
    with _lock:
        if _state is not None and _state.world_group is not dist.group.WORLD:
            uninstall()  # the default group was destroyed (and maybe re-created) by other code
        if _state is None:
            if not active():
                raise RuntimeError("torchpmap: no multi-process run is active (torch.distributed is not initialized)")
            _state = _adopt_existing_group()
        return _state


def _local_device(local_rank: int, rank: int) -> Device:
    if torch.cuda.is_available():
        return Device("cuda", local_rank % torch.cuda.device_count(), rank)
    return Device("cpu", 0, rank)


def _adopt_existing_group() -> ProcessState:
    """State for a default process group that someone else initialized."""
    try:
        base = private.default_store()
    except private.TorchPrivateError as error:
        # without the store, faults surface only through the collectives' own errors and timeouts: say so
        warnings.warn(
            f"{error} Without the process group's store, torchpmap's fault watching is off for this run: a failed "
            "or dead rank shows up as the collective's own error or timeout, not as RankFailed naming it. "
            "Initialize through torchpmap.distributed.initialize() to keep it on.",
            private.TorchPrivateWarning,
            stacklevel=3,
        )
        base = None
    from torchpmap._state.config import config

    return _make_state(
        base,
        token=None,
        backend=str(dist.get_backend()),
        timeout=float(config.collective_timeout),
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        owns_group=False,
        exact_devices=False,
    )


# --------------------------------------------------------------------------- the job token

#: Random bytes in a job token: 16 hex digits, so that no two groups draw the same one.
_TOKEN_BYTES = 8


def agree_on_token(backend: str) -> str:
    """A fresh job token for the process group just initialized, the same in every rank.

    A collective: every rank of the default group calls it, right after
    ``init_process_group``. Rank 0 draws the token and broadcasts it over the group itself,
    not through the store, so nothing left in the store (by an earlier job, by an earlier
    ``initialize`` of these processes, or by anyone else) can make the ranks take an old
    token or disagree on it. Each call draws a new one: a second ``initialize`` after
    ``shutdown`` gets its own.
    """
    device = torch.device("cuda" if "nccl" in backend else "xpu" if "xccl" in backend else "cpu")
    raw = secrets.token_bytes(_TOKEN_BYTES) if dist.get_rank() == 0 else bytes(_TOKEN_BYTES)
    tensor = torch.tensor(list(raw), dtype=torch.uint8, device=device)
    dist.broadcast(tensor, src=0)
    return bytes(tensor.cpu().tolist()).hex()


def _store_token(base_store: Any, generation: int) -> str:
    """The job token of a process group that torchpmap did not initialize, agreed through
    the store.

    No collective is possible here: this runs when a process first looks at the group,
    which the others need not do at the same moment. So the first process to get here
    draws the token and the others read it, through one atomic ``compare_set`` on a key
    named by torchrun's restart count and the generation (never blocking, and the same
    token in every process). What this cannot tell is a key left in a store reused from
    an earlier job with the same restart count and generation; torch's own keys go stale
    there too. :func:`torchpmap.distributed.initialize` draws the token in a collective
    (:func:`agree_on_token`) instead.
    """
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    key = f"torchpmap/token/{restart}/{generation}"
    return base_store.compare_set(key, "", secrets.token_hex(_TOKEN_BYTES)).decode()


def _make_state(
    base_store: Any,
    *,
    token: str | None,
    backend: str,
    timeout: float,
    local_rank: int,
    owns_group: bool,
    exact_devices: bool,
) -> ProcessState:
    """This process' state for the default group; ``token`` None agrees on one through
    ``base_store`` (:func:`_store_token`)."""
    global _generation
    interval = heartbeat_interval()  # validated before anything is made
    _generation += 1
    store = None
    if base_store is not None:
        try:
            token = token if token is not None else _store_token(base_store, _generation)
            store = dist.PrefixStore(f"torchpmap/{token}", base_store)  # keys torchpmap/<token>/alive/0, ...
        except RuntimeError as error:  # a store without compare_set, or one that stopped answering
            logger.warning("process group: fault watching is off, the store failed: %s", error)
    rank = dist.get_rank()
    st = ProcessState(
        rank=rank,
        world_size=dist.get_world_size(),
        local_rank=local_rank,
        backend=backend,
        timeout=timeout,
        store=store,
        store_address=f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}",
        local_device=_local_device(local_rank, rank),
        owns_group=owns_group,
        exact_devices=exact_devices,
        world_group=dist.group.WORLD,
        token=token if store is not None and token is not None else "",
        heartbeat_interval=interval,
    )
    if store is not None:
        try:
            store.set(f"device/{rank}", f"{st.local_device.platform}:{st.local_device.id}")
        except Exception:  # noqa: BLE001 - a store that cannot take it: run without heartbeats
            st.store = None
    if st.store is not None:
        st.heartbeat = _Heartbeat(st)
        st.heartbeat.start()
    logger.info(
        "process group: rank %d of %d (local rank %d), backend %s, device %s, store %s, fault watching %s",
        st.rank, st.world_size, st.local_rank, st.backend, st.local_device, st.store_address,
        "on" if st.store is not None else "off",
    )
    return st


def install(
    *, backend: str, timeout: float, local_rank: int, base_store: Any, token: str, owns_group: bool
) -> ProcessState:
    """Called by ``initialize`` right after it created the default process group and the
    ranks agreed on ``token`` (:func:`agree_on_token`)."""
    global _state
    with _lock:
        _state = _make_state(
            base_store,
            token=token,
            backend=backend,
            timeout=timeout,
            local_rank=local_rank,
            owns_group=owns_group,
            exact_devices=True,
        )
        return _state


def uninstall() -> ProcessState | None:
    """Forgets this process' state (``shutdown``); returns it."""
    global _state
    with _lock:
        st, _state = _state, None
    if st is not None and st.heartbeat is not None:
        st.heartbeat.stop(exited=True)
        # The heartbeat and the state refer to each other: break the cycle, so that the
        # state (and the process group it refers to) goes with its last reference, not at
        # the next garbage collection.
        st.heartbeat = None
    return st


# --------------------------------------------------------------------------- heartbeats


class _Heartbeat(threading.Thread):
    """Writes ``alive/<rank>`` = ``beat|pmap calls|collective waited on`` every interval."""

    def __init__(self, st: ProcessState):
        super().__init__(name=f"torchpmap-heartbeat-{st.rank}", daemon=True)
        self.st, self._stop_event, self.beat = st, threading.Event(), 0

    def run(self) -> None:
        while True:
            self.beat += 1
            try:
                self.st.store.set(f"alive/{self.st.rank}", f"{self.beat}|{self.st.calls}|{self.st.waiting_in}")
            except Exception:  # noqa: BLE001 - the store is gone (shutdown, or its host died): nothing left to tell
                return
            if self._stop_event.wait(self.st.heartbeat_interval):
                return

    def stop(self, exited: bool) -> None:
        self._stop_event.set()
        if self is not threading.current_thread() and self.is_alive():
            # Join before the store goes: a daemon thread still inside a C++ store call when
            # the interpreter finalizes aborts the process ("terminate called without an
            # active exception").
            self.join(timeout=self.st.heartbeat_interval + 5.0)
        if exited and self.st.store is not None:
            try:  # so that the others do not take a finished process for a dead one
                self.st.store.set(f"alive/{self.st.rank}", f"exited|{self.st.calls}|")
            except Exception:  # noqa: BLE001 - the store is gone: the others learn it from the heartbeats
                pass


def linger_seconds() -> float:
    """How long the process hosting the rendezvous store stays after a failure, so that
    the others can still read the failure records instead of losing the store."""
    st = _state
    interval = st.heartbeat_interval if st is not None else heartbeat_interval()
    return _MAX_SLICE + _DEAD_AFTER_BEATS * interval + 0.5


def _hosts_store(st: ProcessState) -> bool:
    return st.rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true"


@atexit.register
def _at_exit() -> None:
    st = _state
    if st is None:
        return
    if st.poisoned is not None and st.store is not None and _hosts_store(st):
        time.sleep(linger_seconds())
    if st.heartbeat is not None:
        st.heartbeat.stop(exited=True)
    if st.owns_group and st.poisoned is None and dist.is_initialized():
        # The program ended without shutdown(), by an uncaught exception say. Left to the
        # interpreter's finalization, gloo's threads may ask for the GIL too late and
        # abort the process ("terminate called without an active exception"; 6 exits in
        # 100 of the uncaught-mismatch test program). Destroying the group is local for
        # gloo. Not after a failure: the collectives in flight would hold it up.
        try:
            destroy_default_group()
        except Exception:  # noqa: BLE001 - the process is exiting anyway
            pass


def destroy_default_group() -> None:
    """Destroys torch.distributed's default group, then leaves the GIL to gloo's worker
    threads for :data:`THREADS_SETTLE_SECONDS`: they drop the last collectives' tensors
    after the collective completed, and a thread that asks for the GIL while the
    interpreter exits aborts the process ("terminate called without an active exception")."""
    dist.destroy_process_group()
    time.sleep(THREADS_SETTLE_SECONDS)


def _read_alive(st: ProcessState, r: int) -> tuple[str, str, str]:
    key = f"alive/{r}"
    try:
        if not st.store.check([key]):
            return ("none", "?", "")
        beat, calls, what = st.store.get(key).decode().split("|", 2)
        return beat, calls, what
    except Exception as e:
        raise _StoreUnreachable(str(e)) from e


# --------------------------------------------------------------------------- failure records


def _failure_count(st: ProcessState) -> int:
    try:
        return int(st.store.add("failures", 0))
    except Exception as e:
        raise _StoreUnreachable(str(e)) from e


def _read_failures(st: ProcessState) -> list[dict]:
    """The failure records of all ranks, in rank order."""
    records = []
    for r in range(st.world_size):
        key = f"failure/{r}"
        try:
            if st.store.check([key]):
                records.append(json.loads(st.store.get(key).decode()))
        except Exception as e:
            raise _StoreUnreachable(str(e)) from e
    return records


def record_failure(ranks: Sequence[int], reason: str, kind: str = "failure") -> None:
    """Tells the other processes that ``ranks`` failed (the first record of each reporter
    counts). ``kind`` "timeout": they are alive but never arrived (the others then raise
    ``TimeoutError``, not :class:`RankFailed`)."""
    st = _state
    if st is None or st.store is None:
        return
    try:
        key = f"failure/{st.rank}"
        if not st.store.check([key]):
            record = {"ranks": list(ranks), "reason": reason, "reporter": st.rank, "kind": kind}
            st.store.set(key, json.dumps(record))
            st.store.add("failures", 1)
    except Exception:  # noqa: BLE001 - best effort: a store that is gone takes no report
        pass


def report_own_failure(exc: BaseException, what: str) -> None:
    """Called when this process' pmapped function raised ``exc``: records it, poisons."""
    st = _state
    if st is None:
        return
    reason = f"{type(exc).__name__}: {exc}".strip()
    if len(reason) > 500:
        reason = reason[:500] + "..."
    record_failure([st.rank], f"{what} raised {reason}")
    st.poisoned = st.poisoned or f"rank {st.rank} raised {reason}"


def _describe(records: list[dict]) -> tuple[list[int], str]:
    ranks: list[int] = []
    lines = []
    for rec in records:
        for r in rec["ranks"]:
            if r not in ranks:
                ranks.append(r)
        found_by = "" if rec["ranks"] == [rec["reporter"]] else f" (found by rank {rec['reporter']})"
        who = ", ".join(map(str, rec["ranks"]))
        lines.append(f"rank {who}: {rec['reason']}{found_by}")
    return sorted(ranks), "; ".join(lines)


# --------------------------------------------------------------------------- waiting for a collective


def wait(work: Any, what: str, host: bool = False) -> None:
    """Waits for the collective ``work`` (``what`` describes it), watching for failures.

    Raises :class:`RankFailed` when another process failed or died, ``TimeoutError``
    when the deadline passed with every process alive. ``host``: the collective moves CPU
    tensors (a CPU backend beside NCCL), so the wait is a host wait, watched as gloo's.
    """
    st = state()
    if (not host and "nccl" in st.backend and st.local_device.platform == "cuda") or st.store is None:
        # NCCL: work.wait() only orders the current stream after the collective; faults
        # surface through NCCL's watchdog and the process group's timeout.
        try:
            work.wait()
        except Exception as e:
            raise _fail(st, _diagnose(st, what, cause=e, waited=None)) from e
        return
    st.waiting_in = what
    started = time.monotonic()
    deadline = started + st.timeout
    slice_s = _FIRST_SLICE
    # The heartbeats a dead-or-alive verdict compares, read one verdict window before the
    # deadline, so that a timeout is reported at the deadline rather than a window later.
    snapshot: _Heartbeats | None = None
    try:
        while True:
            try:
                work.wait(datetime.timedelta(seconds=slice_s))
                return
            except RuntimeError:
                if work.is_completed():  # finished as our slice ran out, or failed: ask it once more
                    try:
                        work.wait(datetime.timedelta(seconds=slice_s))  # returns at once, or raises its own error
                        return
                    except RuntimeError as e:
                        waited = time.monotonic() - started
                        raise _fail(st, _diagnose(st, what, cause=e, waited=waited, snapshot=snapshot)) from e
            try:
                failed = _failure_count(st) > 0
            except _StoreUnreachable as e:
                raise _fail(st, _store_lost(st, what, e)) from None
            if failed:
                raise _fail(st, _diagnose(st, what, cause=None, waited=time.monotonic() - started))
            now = time.monotonic()
            if now >= deadline:
                raise _fail(
                    st, _diagnose(st, what, cause=None, waited=now - started, timed_out=True, snapshot=snapshot)
                )
            if snapshot is None and now >= deadline - _verdict_window(st):
                try:
                    snapshot = _Heartbeats.read(st)
                except _StoreUnreachable as e:
                    raise _fail(st, _store_lost(st, what, e)) from None
            slice_s = min(slice_s * 2, _MAX_SLICE, max(0.01, deadline - now))
    finally:
        st.waiting_in = ""


# torch >= 2.10 names the flat all-gather all_gather_single (all_gather_into_tensor is deprecated there)
_all_gather_flat: Any = getattr(dist, "all_gather_single", None) if _DIST_AVAILABLE else None
if _DIST_AVAILABLE and _all_gather_flat is None:
    _all_gather_flat = dist.all_gather_into_tensor


def all_gather_bytes(data: bytes, what: str) -> list[bytes]:
    """Every process' ``data``, in rank order, through the default group: two transfers
    (the lengths, then the bytes), each waited on by :func:`wait`, so that a process that
    fails or dies makes the others raise :class:`RankFailed` naming it instead of the
    backend's own error ("Connection closed by peer"), and a process that never comes
    ``TimeoutError``. For the collectives outside a pmap that must fail like those inside
    one (:mod:`torchpmap.checkpoint`)."""
    st = state()
    st.check_usable()
    backend = str(dist.get_backend())
    on_host = "gloo" in backend and (":" not in backend or "cpu:gloo" in backend)  # gloo moves CPU tensors
    device = torch.device("cpu") if on_host else st.local_device.torch_device
    mine = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)
    length = torch.tensor([mine.numel()], dtype=torch.int64, device=device)
    lengths = length.new_empty(st.world_size)
    wait(_all_gather_flat(lengths, length, async_op=True), what, host=on_host)
    longest = int(lengths.max())
    padded = torch.zeros(max(longest, 1), dtype=torch.uint8, device=device)
    padded[: mine.numel()] = mine.to(device)
    received = padded.new_empty(st.world_size * padded.numel())
    wait(_all_gather_flat(received, padded, async_op=True), what, host=on_host)
    rows = received.view(st.world_size, -1).cpu()
    return [rows[r, : int(n)].numpy().tobytes() for r, n in enumerate(lengths.tolist())]


def _fail(st: ProcessState, exc: BaseException) -> BaseException:
    if st.poisoned is None:
        st.poisoned = str(exc).removeprefix("torchpmap: ")
    return exc


def _store_lost(st: ProcessState, what: str, e: BaseException) -> RankFailed:
    return RankFailed(
        f"torchpmap: {what} was abandoned on rank {st.rank}: the rendezvous store at {st.store_address} stopped "
        f"answering ({e}). It is hosted by rank 0 (or by torchrun's agent on the first node), so rank 0 or its "
        "node has exited or died (after a failure elsewhere, rank 0 may have gone first: see its log).",
        ranks=(0,),
    )


def _verdict_window(st: ProcessState) -> float:
    """Seconds over which a heartbeat that has not moved means a dead (or hung) process."""
    return _DEAD_AFTER_BEATS * st.heartbeat_interval


@dataclasses.dataclass(frozen=True)
class _Heartbeats:
    """The other processes' heartbeat records (beat, pmap calls, collective waited in), and when they were read."""

    at: float
    alive: dict[int, tuple[str, str, str]]

    @classmethod
    def read(cls, st: ProcessState) -> _Heartbeats:
        return cls(time.monotonic(), {r: _read_alive(st, r) for r in range(st.world_size) if r != st.rank})


def _diagnose(
    st: ProcessState,
    what: str,
    *,
    cause: BaseException | None,
    waited: float | None,
    timed_out: bool = False,
    snapshot: _Heartbeats | None = None,
) -> BaseException:
    """Why ``what`` did not complete: names the failed ranks from the records and heartbeats."""
    where = f"{what} on rank {st.rank} (pmap call #{st.calls})"
    if waited is not None and waited >= 0.9 * st.timeout:
        timed_out = True  # the backend's own timeout (the same value) fired first
    if st.store is None:
        if cause is not None:
            return RuntimeError(f"torchpmap: {where} failed: {cause}")
        return TimeoutError(f"torchpmap: {where} timed out")
    try:
        records = _read_failures(st)
        if not records:
            # Nobody recorded a failure (yet): look for dead processes by their heartbeats.
            if snapshot is None:
                snapshot = _Heartbeats.read(st)
            before = snapshot.alive
            end = snapshot.at + _verdict_window(st)
            while not records and time.monotonic() < end:
                time.sleep(min(st.heartbeat_interval / 2, max(0.0, end - time.monotonic())))
                records = _read_failures(st)
            if not records:
                after = {r: _read_alive(st, r) for r in before}
                exited = [r for r, a in after.items() if a[0] == "exited"]
                dead = [r for r in before if before[r][0] == after[r][0] and after[r][0] != "exited"]
                if dead or exited:
                    parts = []
                    if dead:
                        parts.append("the process died or hangs (its heartbeat stopped)")
                    if exited:
                        parts.append("the process already left the run (it finished or shut down)")
                    record_failure(dead + exited, "; ".join(parts))
                    records = _read_failures(st)
                else:
                    progress = "; ".join(
                        f"rank {r} is in pmap call #{a[1]}"
                        + (f", waiting in {a[2]}" if a[2] else ", not in a collective")
                        for r, a in sorted(after.items())
                    )
                    if timed_out:
                        # name the processes that are not in any collective: they never arrived
                        late = [r for r, a in sorted(after.items()) if not a[2]]
                        if late:
                            where_late = "; ".join(
                                f"rank {r} is in pmap call #{after[r][1]}, not in a collective" for r in late
                            )
                            record_failure(
                                late, f"{where_late}: it did not reach {what} within the {st.timeout:g} s timeout",
                                kind="timeout",
                            )
                        else:
                            record_failure([st.rank], f"{where} timed out after {waited:.1f} s", kind="timeout")
                        return TimeoutError(
                            f"torchpmap: {where} waited {waited:.1f} s (the timeout) for the other processes. Every "
                            f"process is alive: {progress}. A process that stopped calling the same pmaps in the "
                            "same order (a rank-dependent branch, or an exception caught outside a pmap) leaves the "
                            "others waiting. Pass a longer timeout to torchpmap.distributed.initialize() if they are "
                            "just slow."
                        )
                    record_failure([st.rank], f"{where} failed: {cause}")
                    return RuntimeError(f"torchpmap: {where} failed with every process alive ({progress}): {cause}")
    except _StoreUnreachable as e:
        return _store_lost(st, what, e)
    ranks, described = _describe(records)
    if records and all(rec.get("kind") == "timeout" for rec in records):  # alive but absent: not a failure
        return TimeoutError(f"torchpmap: {where} was abandoned because {described}")
    return RankFailed(f"torchpmap: {where} was abandoned because {described}", ranks=ranks)
