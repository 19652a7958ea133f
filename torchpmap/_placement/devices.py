"""The devices a pmap can run on.

Every CUDA GPU torch sees, else ``TORCHPMAP_NUM_CPU_DEVICES`` CPU devices (default 1, at
most 4096; like JAX's ``--xla_force_host_platform_device_count``), so that the multi-device path
runs and is tested on machines without GPUs. CPU devices share the host's memory: they
are separate instances of concurrency, not separate memories.

``TORCHPMAP_EXTRA_CPU_DEVICES=n`` adds ``n`` CPU devices after the CUDA devices: a
testing aid, so that a machine with one GPU still runs the multi-device engine with a
CUDA device in it (JAX never mixes platforms in one pmap; results on CUDA and CPU
devices agree to rounding, not bitwise).
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from torchpmap._state import context as _context
from torchpmap._state import process_group as _process_group
from torchpmap._state.config import at_least_one, env_value
from torchpmap._state.device_record import Device

#: A device as ``pmap(devices=)`` takes it: a :class:`Device`, a ``torch.device``, or its name
#: (``"cpu:1"``, ``"cuda:0"``).
DeviceLike = Device | torch.device | str


@functools.lru_cache(maxsize=1)
def _local_devices() -> tuple[Device, ...]:
    if torch.cuda.is_available():
        extra = env_value("TORCHPMAP_EXTRA_CPU_DEVICES", int, "an integer >= 0", 0)
        if not 0 <= extra <= _MAX_CPU_DEVICES:
            raise ValueError(
                f"environment variable TORCHPMAP_EXTRA_CPU_DEVICES={extra} must be between 0 and {_MAX_CPU_DEVICES}"
            )
        cuda = tuple(Device("cuda", i) for i in range(torch.cuda.device_count()))
        return cuda + tuple(Device("cpu", i) for i in range(extra))
    count = at_least_one("TORCHPMAP_NUM_CPU_DEVICES", 1)
    if count > _MAX_CPU_DEVICES:
        raise ValueError(
            f"environment variable TORCHPMAP_NUM_CPU_DEVICES={count} must be between 1 and {_MAX_CPU_DEVICES} (each "
            "device is a thread); for more instances than devices, pass a larger mapped axis: each device then runs "
            "several instances, vectorized"
        )
    return tuple(Device("cpu", i) for i in range(count))


#: More CPU devices than this is a mistake (each is a thread), not a configuration.
_MAX_CPU_DEVICES = 4096


_DIST_AVAILABLE = dist.is_available()


def _multi_process() -> Any:
    """The multi-process state when torch.distributed runs several processes, else None
    (see :mod:`torchpmap.distributed`: then each process has one device)."""
    if not (_DIST_AVAILABLE and dist.is_initialized()):  # the common case
        return None
    return _process_group.view()


def _this_process() -> tuple[Device, ...]:
    mp = _multi_process()
    return mp.local_devices if mp is not None else _local_devices()


def current_default() -> tuple[Device, ...] | None:
    """Inside an instance running on a device: that device (nested pmaps stay on it)."""
    return _context.default_devices.get()


def set_current_default(devices: tuple[Device, ...] | None) -> None:
    _context.default_devices.set(devices)


def at(device: torch.device) -> tuple[Device, ...] | None:
    """The local Device for a torch device, as a 1-tuple; None if torchpmap has none there."""
    for d in _this_process():
        if d.torch_device == device:
            return (d,)
    return None


def local_devices() -> list[Device]:
    """The devices of this process.

    Example:
        >>> import torchpmap
        >>> len(torchpmap.local_devices()) >= 1
        True
    """
    return list(_this_process())


def devices() -> list[Device]:
    """All devices of all processes (with several processes: one per process, in rank order)."""
    mp = _multi_process()
    return list(mp.devices) if mp is not None else local_devices()


def device_count() -> int:
    """``len(devices())``."""
    return len(devices())


def local_device_count() -> int:
    """``len(local_devices())``."""
    return len(local_devices())


def process_index() -> int:
    """This process' rank (0 for a single process)."""
    mp = _multi_process()
    return mp.rank if mp is not None else 0


def process_count() -> int:
    """How many processes take part (1 for a single process)."""
    mp = _multi_process()
    return mp.world_size if mp is not None else 1


def resolve(requested: Sequence[DeviceLike] | DeviceLike | None) -> tuple[Device, ...]:
    """The devices a pmap was asked to use, validated; all local devices for None."""
    if requested is None:  # every call of a pmap without devices=: no more calls than needed
        return _context.default_devices.get() or _this_process()
    if _context.default_devices.get() is not None:  # current_default(), inlined: this runs on every call
        # refused on every placement, also where devices= names the enclosing instance's own
        # device: on several devices another instance's is another device
        raise ValueError(
            "pmap: a pmap nested inside another map (a pmap, torchpmap.vmap or shard_map) runs on the device of "
            f"its enclosing instance, so it cannot take devices= (got {requested!r}). Leave devices= out; to "
            "spread nested axes over devices, use a Mesh with one named axis per pmap."
        )
    if isinstance(requested, (str, Device, torch.device)):
        raise TypeError(
            f"pmap: devices must be a list of devices, got the single device {requested!r}; write "
            f"devices=[{requested!r}]"
        )
    # A pmap resolves the same devices= at every call: remember the answer for this set
    # of known devices (compared by identity: a re-initialization makes new ones). A pmap
    # passes the same tuple each time (its options'): found by identity first.
    known = (_multi_process(), _local_devices())
    for seen_requested, seen_known, chosen in _resolved:
        if seen_requested is requested and seen_known[0] is known[0] and seen_known[1] is known[1]:
            return chosen
    requested = tuple(requested)
    for seen_requested, seen_known, chosen in _resolved:
        if seen_known[0] is known[0] and seen_known[1] is known[1] and _same(seen_requested, requested):
            return chosen
    chosen = _resolve_requested(requested)
    if len(_resolved) < 16:
        _resolved.append((requested, known, chosen))
    return chosen


_resolved: list[tuple[tuple, tuple, tuple[Device, ...]]] = []


def _same(a: tuple, b: tuple) -> bool:
    """Element-wise identity or equality, False for elements that cannot be compared."""
    comparable = (str, int, Device, torch.device)
    return len(a) == len(b) and all(
        x is y or (type(x) is type(y) and isinstance(x, comparable) and x == y) for x, y in zip(a, b)
    )


def _resolve_requested(requested: Sequence[Any]) -> tuple[Device, ...]:
    requested = list(requested)
    if not requested:
        raise ValueError("pmap: 'devices' must be a non-empty list of devices, or None for all of them")
    known: dict[Any, Device] = {}
    for d in devices():  # by Device, by "cpu:1", by torch.device; the first device wins ties
        for name in (d, str(d), d.torch_device, str(d.torch_device)):
            known.setdefault(name, d)
    chosen = []
    key: Any
    for i, d in enumerate(requested):
        try:
            key = d if isinstance(d, str) and d in known else torch.device(d) if isinstance(d, str) else d
        except RuntimeError:  # a string torch cannot parse as a device ("gpu:7", "tpu:0")
            key = None
        if key is None or key not in known:
            raise ValueError(f"pmap: devices[{i}] = {d!r} is not one of torchpmap.devices() = {devices()}")
        chosen.append(known[key])
    if len(set(chosen)) != len(chosen):
        raise ValueError(f"pmap: 'devices' lists a device more than once: {requested!r}")
    return tuple(chosen)
