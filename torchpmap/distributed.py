"""Multi-process and multi-node ``pmap`` on ``torch.distributed``.

Every process runs the same program (multi-controller, as JAX's multi-host pmap). Launch
it with ``torchrun``; call :func:`initialize` once at the start; then a pmapped function
called in a process receives that process' **local portion** of the mapped axis and
returns its local portion of the result, as plain tensors. Collectives (``psum``,
``all_gather``, ``ppermute``, ...) run over the **global** axis, across processes::

    # torchrun --nproc-per-node=2 train.py
    import torch, torchpmap
    import torchpmap.distributed as tpd

    tpd.initialize()                          # joins the process group torchrun set up
    rank, n = torchpmap.process_index(), torchpmap.process_count()
    x_local = torch.arange(4.)[rank * 2 : rank * 2 + 2]   # this process' 2 instances of 4
    total = torchpmap.pmap(lambda x: torchpmap.psum(x, "i"), axis_name="i")(x_local)
    # total == tensor([6., 6.]) in both processes; axis_index("i") gives 0, 1 in rank 0
    # and 2, 3 in rank 1.
    tpd.shutdown()

**Layout.** With ``n_local`` instances per process (every process must pass the same
number: a differing count is an error naming each rank's size), the global axis has
``n_local * process_count()`` instances and process ``r`` holds instances
``r * n_local .. (r + 1) * n_local - 1``. Forward results are bitwise those of one
process running the whole axis (each collective gathers every process' values and runs
the same math). Gradients flow across processes: ``.backward()`` on each process' local
loss yields, in every process, its part of the gradient of the sum of all processes'
losses, with the same conventions as on one process (the transpose of ``psum`` is
``psum``, of ``all_gather`` is ``psum_scatter``, ...). A data-parallel step is written
exactly as for one process (``pmean`` of the gradients over the batch axis), see
``examples/multiprocess_data_parallel.py``.

**Devices.** After :func:`initialize`, :func:`torchpmap.devices` lists one device per
process (``Device(platform, id, process_index)``, in rank order),
:func:`torchpmap.local_devices` this process' own (``cuda:LOCAL_RANK``, or the CPU),
:func:`torchpmap.process_index` / :func:`torchpmap.process_count` are the rank and the
world size. A nested pmap (over a name that is no mesh axis) runs within the process.

**Meshes.** :func:`mesh` arranges the processes in a named grid on top of
``torch.distributed.device_mesh.init_device_mesh``. Inside ``with mesh:``, a pmap over a
mesh axis exchanges only within that axis' process group, so nested pmaps over
``("data", "model")`` give data and model parallelism. Processes are laid out in
row-major order: with ``mesh((2, 2), ("data", "model"))``, rank ``r`` sits at
``data = r // 2``, ``model = r % 2``, and each process holds its own block of the
global ``(data, model, ...)`` array::

    # torchrun --nproc-per-node=4 prog.py
    m = tpd.mesh((2, 2), ("data", "model"))
    i, j = m.coordinate("data"), m.coordinate("model")
    block = x_global[i : i + 1, j : j + 1]          # this process' instance of each axis
    with m:
        f = torchpmap.pmap(torchpmap.pmap(g, axis_name="model"), axis_name="data")
        out = f(block)     # psum(., "model") sums over the 2 processes of this row

**Faults.** A process whose pmapped function raises, or that dies, makes the others
fail with :class:`RankFailed` naming its rank (and the exception it raised) instead of
hanging, within seconds and at most within the ``timeout`` given to :func:`initialize`.
A process waiting in a collective watches failure records and heartbeats kept in the
rendezvous store; with gloo a peer's death also surfaces at once as a closed connection.
If every process is alive but one never reaches the collective (a rank-dependent
branch), the others raise ``TimeoutError`` after ``timeout``, saying where each process
is. After a failure the processes are out of step and later distributed pmaps raise
at once: restart the job (``torchrun --max-restarts``). With NCCL, faults are left to
NCCL's own watchdog and the process group timeout.

**Disagreements.** Processes that reach an exchange with different collectives,
parameters, shapes or dtypes, or from pmaps of different functions, ``in_axes``,
``out_axes`` or axis names, all raise :class:`ExchangeMismatch`, naming what each one
called, before any payload is used (different numbers of local instances raise
:class:`SizeMismatch`). Every transfer carries a small header that every process checks.

**Replicated values.** A value passed with ``in_axes=None`` reaches every instance of a
process as it is: across processes nothing is copied, so each process must pass the same
value (DDP's wrap-time copy has no counterpart in ``pmap`` itself). :func:`broadcast`
gives every process process 0's values (``torch.distributed.broadcast(t, src=0)`` for a
pytree; ``data_parallel_step`` calls it on its model at its first step, as
``DistributedDataParallel`` does when it wraps one), and :func:`check_same` checks that
the processes hold the same values, naming the first leaf that differs (one small
all-gather of checksums: call it after setting up, or in a debug run).

``torch.func`` transforms work inside the pmapped function and around the pmap
(``torch.func.grad`` of a function that calls a distributed pmap, ``vmap`` of it), since
each process runs its slice in its own thread of control.

What is not supported across processes: ``devices=`` (each process runs its instances
on its local device), a ``torchpmap.Mesh`` built by hand from the global devices (use
:func:`mesh`), the debug mode ``config.disable_vectorization`` (ignored), and random
numbers that match a single-process run (each process draws from its own generator).

Example (in a single process everything is local and :func:`initialize` does nothing):
    >>> import torchpmap, torchpmap.distributed as tpd
    >>> tpd.initialize()          # no torchrun environment: a quiet no-op
    >>> torchpmap.process_index(), torchpmap.process_count(), tpd.is_initialized()
    (0, 1, False)
    >>> tpd.shutdown()            # nothing to shut down: also a no-op
"""
from __future__ import annotations

import datetime
import hashlib
import math
import os
from collections.abc import Hashable, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist

from torchpmap._placement.devices import Device, devices, local_devices, process_count, process_index
from torchpmap._placement.mesh import ProcessMesh
from torchpmap._state import process_group as _pg
from torchpmap._state import store as _store
from torchpmap._state.config import TIMEOUT_MAX
from torchpmap._state.faults import ExchangeMismatch, SizeMismatch
from torchpmap._state.process_group import RankFailed

__all__ = [
    "initialize",
    "shutdown",
    "is_initialized",
    "mesh",
    "broadcast",
    "check_same",
    "ReplicasDiffer",
    "ProcessMesh",
    "RankFailed",
    "ExchangeMismatch",
    "SizeMismatch",
    "Device",
    "devices",
    "local_devices",
    "process_index",
    "process_count",
]

_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def initialize(backend: str | None = None, timeout: datetime.timedelta = datetime.timedelta(minutes=5)) -> None:
    """Joins the process group described by the ``torchrun`` environment.

    Reads ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``
    (what ``torchrun`` sets), initializes ``torch.distributed``'s default process group
    and starts the fault watch (see the module documentation). Call it in every process,
    before the first pmap.

    * Without that environment, or with ``WORLD_SIZE=1``, it returns quietly: the
      program runs as a single process.
    * It is idempotent: a second call (or a call after someone else initialized the
      default process group) changes nothing.

    Args:
        backend: ``"nccl"`` or ``"gloo"``; default NCCL when this process has a CUDA
            device (it then uses ``cuda:LOCAL_RANK``), else gloo.
        timeout: how long joining and every collective may wait for the other
            processes before raising. Failures of other processes are reported much
            sooner (seconds); this bounds the wait for a process that is alive but
            never arrives.

    Example:
        >>> import torchpmap.distributed as tpd
        >>> tpd.initialize(timeout=datetime.timedelta(seconds=30))  # single process: nothing to do
        >>> tpd.is_initialized()
        False
    """
    if not isinstance(timeout, datetime.timedelta):
        raise TypeError(f"initialize: timeout must be a datetime.timedelta, got {timeout!r}")
    if not 0 < timeout.total_seconds() < TIMEOUT_MAX:
        raise ValueError(
            f"initialize: timeout must be above 0 and below {int(TIMEOUT_MAX)} s (threading.TIMEOUT_MAX: the longest "
            f"wait this platform accepts), got {timeout!r} ({timeout.total_seconds():g} s)"
        )
    if backend is not None and backend not in ("nccl", "gloo", "mpi", "ucc", "xccl"):
        raise ValueError(f"initialize: unknown backend {backend!r}; use 'nccl' or 'gloo' (or None to pick one)")
    if dist.is_available() and dist.is_initialized():
        existing = str(dist.get_backend())
        if backend is not None and backend not in existing.split(":") and backend not in existing:
            raise ValueError(
                f"initialize: the default process group is already initialized with backend {existing!r}, not "
                f"{backend!r}; call shutdown() first to start over with another backend"
            )
        if _pg.active():
            _pg.state()  # adopt a group initialized elsewhere
        return
    world = os.environ.get("WORLD_SIZE")
    if world is None or world.strip() == "" or (world.strip() == "1" and not _pg.SINGLE_PROCESS_GROUP):
        return
    if not world.strip().isdigit() or int(world) < 1:
        raise ValueError(f"initialize: WORLD_SIZE must be a positive integer, got {world!r}")
    missing = [v for v in _ENV if not os.environ.get(v)]
    if missing:
        raise RuntimeError(
            f"initialize: WORLD_SIZE={world} asks for {world} processes, but {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not set. Launch the program with torchrun (which sets "
            f"{', '.join(_ENV)} and LOCAL_RANK), e.g. torchrun --nproc-per-node={world} prog.py"
        )
    if not dist.is_available():
        raise RuntimeError("initialize: this build of PyTorch has no torch.distributed support")
    rank, world_size = int(os.environ["RANK"]), int(world)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if not 0 <= rank < world_size:
        raise ValueError(f"initialize: RANK={rank} is outside 0..{world_size - 1} (WORLD_SIZE={world_size})")
    _pg.heartbeat_interval()  # a bad TORCHPMAP_HEARTBEAT_INTERVAL raises here, naming it, before joining
    cuda = torch.cuda.is_available()
    if backend is None:
        backend = "nccl" if cuda else "gloo"
    if cuda:
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    # torch's env:// rendezvous, with rank 0's server bound to MASTER_ADDR and one store per process
    store, use = _store.rendezvous(rank, world_size, timeout)
    # NCCL moves CUDA tensors only: gloo beside it carries the exchanges' headers on the
    # host, so that comparing them never waits for the GPU (see headers_on_host).
    dist.init_process_group(
        "cpu:gloo,cuda:nccl" if backend == "nccl" else backend,
        store=dist.PrefixStore(_store.group_prefix(use), store),
        rank=rank,
        world_size=world_size,
        timeout=timeout,
    )
    st = _pg.install(
        backend=backend,
        timeout=timeout.total_seconds(),
        local_rank=local_rank,
        base_store=store,
        token=_pg.agree_on_token(backend),
        owns_group=True,
    )
    if st.store is not None:  # every process has published its device before anyone goes on
        st.store.wait([f"device/{r}" for r in range(world_size)], timeout)


def shutdown() -> None:
    """Leaves the multi-process run: stops the fault watch and destroys the default
    process group if :func:`initialize` created it. Idempotent; a no-op for a single
    process. Call it in every process at the end of the program.

    After a failure, destroying the group may wait until the failed process has exited
    (gloo finishes the collectives in flight first). The rendezvous store stays until the
    process exits (rank 0 keeps serving it), so that :func:`initialize` can be called
    again: the next group keeps its keys under a prefix of its own.
    """
    st = _pg.uninstall()
    if st is not None and st.owns_group and dist.is_available() and dist.is_initialized():
        if st.poisoned is None:
            # Leave together: rank 0 hosts the rendezvous store, and tearing its server down
            # while another rank's client still talks to it can abort that process at exit.
            try:
                dist.barrier()
            except Exception:  # noqa: BLE001 - a peer is gone: nothing to wait for
                pass
        # gloo's threads then drop the last collectives' tensors (the barrier's included)
        # while the interpreter lives: otherwise about one exit in 20 aborts
        _pg.destroy_default_group()


def is_initialized() -> bool:
    """True when more than one process takes part (``torch.distributed`` is initialized
    with a world size above 1), whoever initialized it."""
    return _pg.active()


def mesh(shape: Sequence[int], axis_names: Sequence[Hashable]) -> ProcessMesh:
    """Arranges all processes in a grid of the given ``shape`` with named axes.

    Built on ``torch.distributed.device_mesh.init_device_mesh``; a collective call, so
    every process must call it with the same arguments. ``prod(shape)`` must equal the
    number of processes. Rank ``r`` sits at the row-major coordinates of ``r``
    (:meth:`ProcessMesh.coordinate`); each process then holds one block of every mesh
    axis (``n_local`` instances, the same in every process).

    Example (4 processes, ``torchrun --nproc-per-node=4``)::

        m = torchpmap.distributed.mesh((2, 2), ("data", "model"))
        with m:
            step = torchpmap.pmap(torchpmap.pmap(f, axis_name="model"), axis_name="data")
            out = step(local_block)   # shape (1, 1, ...) per process

    Raises:
        RuntimeError: when no multi-process run is active (call :func:`initialize`
            under torchrun first; in one process, use :class:`torchpmap.Mesh`).
        ValueError: when the shape does not match the number of processes.
    """
    shape = tuple(shape)
    axis_names = tuple(axis_names)
    if not all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in shape):
        raise ValueError(f"mesh: shape must be positive ints, got {shape!r}")
    if len(shape) != len(axis_names):
        raise ValueError(
            f"mesh: shape {shape} has {len(shape)} axes but {len(axis_names)} names were given: {axis_names}"
        )
    if len(set(axis_names)) != len(axis_names) or not all(isinstance(a, str) for a in axis_names):
        raise ValueError(f"mesh: axis_names must be distinct strings, got {axis_names!r}")
    if not _pg.active():
        raise RuntimeError(
            "mesh: no multi-process run is active. Launch with torchrun and call torchpmap.distributed.initialize() "
            "first; within one process, use torchpmap.Mesh over torchpmap.devices() instead."
        )
    world = dist.get_world_size()
    if math.prod(shape) != world:
        raise ValueError(
            f"mesh: shape {shape} holds {math.prod(shape)} processes, but the run has {world}; the shape's "
            f"product must equal the number of processes"
        )
    from torch.distributed.device_mesh import init_device_mesh

    st = _pg.state()
    st.check_usable()
    names = cast("tuple[str, ...]", axis_names)  # torch types them as strings; any hashable works
    device_mesh = init_device_mesh(st.local_device.platform, shape, mesh_dim_names=names)
    return ProcessMesh(device_mesh, axis_names)


# --------------------------------------------------------------------------- replicated values


class ReplicasDiffer(ValueError):
    """:func:`check_same`: the processes hold different values for a leaf that must be the
    same in all of them. Every process raises it.

    Attributes:
        path: the leaf's key path in the tree (``"['w']"``).
        ranks: the processes whose value differs from process 0's.
    """

    def __init__(self, message: str, path: str, ranks: Sequence[int]):
        super().__init__(message)
        self.path, self.ranks = path, list(ranks)


def _tensor_leaves(tree: Any, what: str) -> tuple[list[tuple[str, torch.Tensor]], Any]:
    from torchpmap._state.torch_private import pytree

    flat, spec = pytree.tree_flatten_with_path(tree)
    leaves = []
    for path, leaf in flat:
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"{what}: the leaf at tree{pytree.keystr(path)} is a {type(leaf).__name__} ({leaf!r}); only tensors "
                "can be leaves here (a Python value is the same in every process that computes it alike)"
            )
        leaves.append((pytree.keystr(path), leaf.detach()))
    return leaves, spec


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes, a flat uint8 tensor (a copy only when ``t`` is not contiguous)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def broadcast(tree: Any, axis_name: Hashable = "processes") -> Any:
    """Process 0's value of every tensor leaf of ``tree``, in every process, bitwise:
    ``torch.distributed.broadcast(t, src=0)`` for a pytree, through torchpmap's agreement
    check (processes whose trees differ in structure, shapes or dtypes raise
    :class:`ExchangeMismatch` instead of exchanging garbage). Every process must call it.

    ``data_parallel_step`` calls it on its model's parameters and buffers at its first
    step, as ``DistributedDataParallel`` does when it wraps a model. Inside ``with m:``
    for a :func:`mesh` that has ``axis_name`` as an axis, it copies along that axis only
    (from the process at index 0 of it). In one process it returns ``tree`` unchanged.

    Example (2 processes, ``torchrun --nproc-per-node=2``)::

        torch.manual_seed(torchpmap.process_index())       # a different model in each process
        model = torch.nn.Linear(4, 2)
        model.load_state_dict(tpd.broadcast(dict(model.state_dict())))  # process 0's everywhere

    In one process ``tree`` comes back as it is:

    >>> import torch, torchpmap.distributed as tpd
    >>> tpd.broadcast({"w": torch.ones(2)})
    {'w': tensor([1., 1.])}
    """
    from torchpmap._collectives.public import axis_index, psum
    from torchpmap._frontend.api import pmap
    from torchpmap._state.torch_private import pytree

    leaves, spec = _tensor_leaves(tree, "broadcast")
    if process_count() == 1 or not leaves:
        return tree

    def from_first(*values: torch.Tensor) -> list[torch.Tensor]:
        first = axis_index(axis_name) == 0
        # summed as bytes, everyone else's zeros: the bits of process 0, exactly (-0.0, NaNs)
        return psum([_as_bytes(v) * first for v in values], axis_name)

    summed = pmap(from_first, axis_name=axis_name, in_axes=None, out_axes=None, axis_size=1)(*(t for _, t in leaves))
    out = [b.view(t.dtype).reshape(t.shape) for b, (_, t) in zip(summed, leaves)]
    return pytree.tree_unflatten(out, spec)


#: Words of a leaf that a checksum reads at once (bounds its working memory to ~64 MiB).
_CHECKSUM_CHUNK = 1 << 22


def _checksum(t: torch.Tensor) -> torch.Tensor:
    """Two position-weighted sums of ``t``'s bytes as int32 words (a permutation or a
    flipped bit changes them), on ``t``'s device: int64[2]."""
    b = _as_bytes(t)
    if b.numel() % 4:
        b = torch.cat([b, b.new_zeros(4 - b.numel() % 4)])
    words = b.view(torch.int32)
    total = torch.zeros(2, dtype=torch.int64, device=t.device)
    for start in range(0, words.numel(), _CHECKSUM_CHUNK):
        w = words[start : start + _CHECKSUM_CHUNK].to(torch.int64)
        position = torch.arange(start + 1, start + 1 + w.numel(), dtype=torch.int64, device=t.device)
        total += torch.stack([w.sum(), (w * position).sum()])  # wraps around in int64: a checksum
    return total


def check_same(tree: Any, what: str = "tree", axis_name: Hashable = "processes") -> None:
    """Raises :class:`ReplicasDiffer` in every process unless every process holds the same
    bits in every tensor leaf of ``tree``, naming the first leaf that differs and the
    processes whose value differs from process 0's.

    Use it on the values a pmap receives with ``in_axes=None`` (parameters, a learning
    rate tensor, a lookup table): pmap copies nothing between processes, so a process
    that computed such a value differently (another seed, another file) silently runs
    another program. It costs a checksum of every leaf on its device (about two passes
    over its bytes) and one all-gather of 32 bytes per leaf: call it once after setting
    up, every so many steps, or in a debug run. Every process must call it; in one
    process it does nothing. Inside ``with m:`` for a :func:`mesh` with ``axis_name`` as
    an axis, it compares along that axis only.

    Example (in one process nothing can differ):

    >>> import torch, torchpmap.distributed as tpd
    >>> tpd.check_same({"w": torch.ones(2)}, what="parameters")
    """
    from torchpmap._collectives.public import all_gather
    from torchpmap._frontend.api import pmap

    leaves, _ = _tensor_leaves(tree, "check_same")
    if process_count() == 1 or not leaves:
        return
    rows = []
    for _, t in leaves:
        kind = hashlib.blake2b(repr((tuple(t.shape), str(t.dtype))).encode(), digest_size=8).digest()
        rows.append(
            torch.cat([_checksum(t).cpu(), torch.tensor([int.from_bytes(kind, "little", signed=True), t.numel()])])
        )
    mine = torch.stack(rows)  # (leaves, 4) int64
    everyone = pmap(lambda d: all_gather(d, axis_name), axis_name=axis_name, in_axes=None, out_axes=None, axis_size=1)(
        mine
    )
    everyone = everyone.cpu()
    ranks = _group_ranks(axis_name)
    for k, (path, t) in enumerate(leaves):
        column = everyone[:, k]
        differ = [ranks[r] for r in range(column.shape[0]) if not torch.equal(column[r], column[0])]
        if differ:
            raise ReplicasDiffer(
                f"check_same: {what}{path} (shape {tuple(t.shape)}, {str(t.dtype).removeprefix('torch.')}) differs "
                f"between the processes: process{'es' if len(differ) > 1 else ''} {', '.join(map(str, differ))} "
                f"hold{'' if len(differ) > 1 else 's'} other values than process {ranks[0]} (this is process "
                f"{process_index()}). A value passed with in_axes=None must be the same in every process: compute "
                "it from the same seed and data, or copy process 0's with torchpmap.distributed.broadcast.",
                path,
                differ,
            )


def _group_ranks(axis_name: Hashable) -> list[int]:
    """The ranks along ``axis_name``: those of the enclosing process mesh' axis, or all."""
    from torchpmap._placement import mesh as _mesh

    current = _mesh.current()
    if isinstance(current, ProcessMesh) and axis_name in current.axis_names:
        return list(dist.get_process_group_ranks(current.group(axis_name)))
    return list(range(process_count()))
