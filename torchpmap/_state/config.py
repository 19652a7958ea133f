"""Run-time settings, read from the environment and changeable in code.

Every environment variable torchpmap reads, in one table. Each is read and validated
when its value is first needed, never by ``import torchpmap``: a setting of ``config``
when it is first read (by a pmap that needs it, or in code), the device count when
devices are first listed, the heartbeat interval and the store's setting by
``torchpmap.distributed.initialize``. A bad value raises a ``ValueError`` there that
names the variable, its value and what it accepts, and ``import torchpmap`` still works
(a program that never needs the value never sees the error). Seconds must be finite, above
0 and below ``threading.TIMEOUT_MAX`` (about 9.2e9 s on Linux: the longest wait
Python's locks and conditions accept; a larger one would fail with ``OverflowError`` in
the middle of a collective). A number is never a ``bool``: ``True`` is refused where
seconds or a count are expected.

| variable | setting | accepts | default |
|---|---|---|---|
| ``TORCHPMAP_COLLECTIVE_TIMEOUT`` | ``config.collective_timeout`` | seconds, a number > 0 below ``threading.TIMEOUT_MAX`` | 300 |
| ``TORCHPMAP_DISABLE_VECTORIZATION`` | ``config.disable_vectorization`` | 1/0, true/false, yes/no, on/off | 0 |
| ``TORCHPMAP_BITWISE_PLACEMENT`` | ``config.bitwise_placement`` | 1/0, true/false, yes/no, on/off | 0 |
| ``TORCHPMAP_JIT_CACHE_SIZE`` | ``config.jit_cache_size`` | compiled programs kept per function, an integer >= 1 | 32 |
| ``TORCHPMAP_ALL_REDUCE_BYTES`` | ``config.all_reduce_bytes`` | bytes from which a ``psum``/``pmean`` across processes runs as one all-reduce instead of gathering every process' partial sum, an integer >= 1 | 1048576 |
| ``TORCHPMAP_BUCKET_BYTES`` | ``config.bucket_bytes`` | bytes of gradients a data-parallel step sends together while the backward runs (after a first bucket of 1 MiB), an integer >= 1 | 26214400 |
| ``TORCHPMAP_WORKER_IDLE_TIMEOUT`` | ``config.worker_idle_timeout`` | seconds an idle device-thread worker waits for work before it exits, a number > 0 below ``threading.TIMEOUT_MAX`` | 60 |
| ``TORCHPMAP_HEARTBEAT_INTERVAL`` | (processes) | seconds between two heartbeats of a process, a number > 0 below ``threading.TIMEOUT_MAX`` | 0.5 |
| ``TORCHPMAP_STORE_LISTEN_ALL`` | (processes) | 1 keeps torch's rendezvous store server on every interface instead of the address ``MASTER_ADDR`` names (read by ``initialize``), 1/0, true/false, yes/no, on/off | 0 |
| ``TORCHPMAP_NUM_CPU_DEVICES`` | (devices) | simulated CPU devices without a GPU, an integer >= 1 | 1 |

Example:
    >>> import torchpmap
    >>> torchpmap.config.collective_timeout > 0
    True
    >>> torchpmap.config.collective_timeout = -1
    Traceback (most recent call last):
    ...
    ValueError: torchpmap.config.collective_timeout must be a number > 0 (seconds) below 9223372036
    (threading.TIMEOUT_MAX: the longest wait this platform accepts), got -1
"""  # noqa: E501 - the table's rows above are one line each (Markdown)
from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

from torchpmap._state import context as _context

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


#: The longest wait Python's locks, conditions and queues accept, in seconds (about
#: 9.2e9 on Linux); a longer timeout fails with ``OverflowError`` when it is waited on.
TIMEOUT_MAX = threading.TIMEOUT_MAX


def _seconds(value: Any) -> float:
    """A finite number of seconds > 0 that every wait accepts; never a bool."""
    if isinstance(value, bool):  # True would be 1.0: a flag given where seconds are expected
        raise TypeError
    number = float(value)  # ValueError/TypeError for text or None
    if not 0 < number < TIMEOUT_MAX:  # also refuses nan and inf
        raise ValueError
    return number


_SECONDS = (
    f"a number > 0 (seconds) below {int(TIMEOUT_MAX)} (threading.TIMEOUT_MAX: the longest wait this platform accepts)"
)


def _at_least_one(value: Any) -> int:
    if isinstance(value, bool) or int(value) != float(value) or int(value) < 1:
        raise ValueError
    return int(value)


def _boolean(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ValueError


#: setting -> (environment variable, parse, what it accepts, default)
_SETTINGS: dict[str, tuple[str, Callable[[Any], Any], str, Any]] = {
    "collective_timeout": ("TORCHPMAP_COLLECTIVE_TIMEOUT", _seconds, _SECONDS, 300.0),
    "disable_vectorization": (
        "TORCHPMAP_DISABLE_VECTORIZATION",
        _boolean,
        "one of 1/0, true/false, yes/no, on/off",
        False,
    ),
    "bitwise_placement": ("TORCHPMAP_BITWISE_PLACEMENT", _boolean, "one of 1/0, true/false, yes/no, on/off", False),
    "jit_cache_size": ("TORCHPMAP_JIT_CACHE_SIZE", _at_least_one, "an integer >= 1", 32),
    "worker_idle_timeout": ("TORCHPMAP_WORKER_IDLE_TIMEOUT", _seconds, _SECONDS, 60.0),
    "all_reduce_bytes": ("TORCHPMAP_ALL_REDUCE_BYTES", _at_least_one, "an integer >= 1 (bytes)", 1 << 20),
    "bucket_bytes": ("TORCHPMAP_BUCKET_BYTES", _at_least_one, "an integer >= 1 (bytes)", 25 << 20),
}


def env_value(variable: str, parse: Callable[[str], Any], accepts: str, default: Any) -> Any:
    """``parse(os.environ[variable])``, or ``default`` when it is unset; a bad value raises
    a ValueError that names the variable and what it accepts."""
    raw = os.environ.get(variable)
    if raw is None:
        return default
    try:
        return parse(raw)
    except (ValueError, TypeError, OverflowError):
        raise ValueError(f"environment variable {variable}={raw!r} is not valid: it must be {accepts}") from None


def seconds(variable: str, default: float) -> float:
    """Seconds from the environment: a finite number > 0 below :data:`TIMEOUT_MAX` (see :func:`env_value`)."""
    return env_value(variable, _seconds, _SECONDS, default)


def at_least_one(variable: str, default: int) -> int:
    """An integer >= 1 from the environment (see :func:`env_value`)."""
    return env_value(variable, _at_least_one, "an integer >= 1", default)


class Config:
    """Settings that apply to every pmap (see the module docstring for the environment).

    A setting not assigned in code is read from its environment variable when it is
    first read (not when torchpmap is imported): a bad value raises a ``ValueError``
    naming the variable then, and again at every read until the variable is fixed or the
    setting is assigned. An assignment is validated at once.

    Attributes:
        collective_timeout: seconds a collective waits for the other devices before it
            raises TimeoutError (environment: ``TORCHPMAP_COLLECTIVE_TIMEOUT``, default 300).
        disable_vectorization: run instances one at a time in plain Python threads so
            that ``print`` and ``pdb`` work inside a pmapped function (environment:
            ``TORCHPMAP_DISABLE_VECTORIZATION=1``).
        bitwise_placement: a device (or process) that holds a single instance runs it
            through ``vmap`` like one device running all the instances, so that results
            are bitwise the same on every placement. Off (the default), it runs the
            instance directly, at plain PyTorch speed with every op (no batching rule
            needed); results then agree with one device to rounding (environment:
            ``TORCHPMAP_BITWISE_PLACEMENT=1``).
        jit_cache_size: compiled programs ``pmap(jit=True)`` keeps per function, the least
            recently used dropped first (environment: ``TORCHPMAP_JIT_CACHE_SIZE``, default 32).
        worker_idle_timeout: seconds an idle device-thread worker waits for work before it
            exits (environment: ``TORCHPMAP_WORKER_IDLE_TIMEOUT``, default 60).
        all_reduce_bytes: a ``psum`` or ``pmean`` across processes of at least this many
            bytes (all the tensors of one exchange) runs as one all-reduce per dtype, after
            a header-only agreement round; a smaller one gathers every process' partial
            sum in one collective with its header (environment:
            ``TORCHPMAP_ALL_REDUCE_BYTES``, default 1 MiB). Set it alike in every process.
            Under ``bitwise_placement`` sums always gather (in one device's order).
        bucket_bytes: across processes with one instance each, ``data_parallel_step``
            starts the all-reduce of its gradients bucket by bucket while the backward
            still runs, as DDP does: a first bucket of about 1 MiB, then buckets of this
            many bytes (environment: ``TORCHPMAP_BUCKET_BYTES``, default 25 MiB, DDP's
            ``bucket_cap_mb``). Set it alike in every process.
    """

    def __getattr__(self, name: str) -> Any:
        # Only for a setting not read yet: it comes from the environment now, so that a
        # bad value fails where it is used (naming the variable), never at import.
        if name not in _SETTINGS:
            raise AttributeError(f"torchpmap.config has no setting {name!r}; settings: {list(_SETTINGS)}")
        value = env_value(*_SETTINGS[name])
        object.__setattr__(self, name, value)
        return value

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in _SETTINGS:
            raise AttributeError(f"torchpmap.config has no setting {name!r}; settings: {list(_SETTINGS)}")
        _, parse, accepts, _ = _SETTINGS[name]
        try:
            parsed = parse(value)
        except (ValueError, TypeError, OverflowError):
            raise ValueError(f"torchpmap.config.{name} must be {accepts}, got {value!r}") from None
        object.__setattr__(self, name, parsed)

    def update(self, name: str, value: Any) -> None:
        """Sets one setting, like ``jax.config.update``."""
        setattr(self, name, value)

    def __repr__(self) -> str:
        return f"Config({', '.join(f'{name}={getattr(self, name)!r}' for name in _SETTINGS)})"


config = Config()


@contextlib.contextmanager
def disable_vectorization() -> Iterator[None]:
    """Runs every pmap/vmap instance one at a time in plain Python, for debugging.

    Inside, ``print``, ``pdb.set_trace()`` and ``.item()`` work in a mapped function, and an
    error names the exact instance that raised. Results are the same as vectorized, only
    slower. Like ``jax.disable_jit()``.

    Example:
        >>> import torch, torchpmap
        >>> with torchpmap.disable_vectorization():
        ...     out = torchpmap.pmap(lambda x: x * 2 if x.item() > 0 else x)(torch.tensor([0., 1.]))
        >>> out
        tensor([0., 2.])
    """
    with _context.setting(_context.debug_mode, True):  # this context only: other threads run as they did
        yield


def vectorization_disabled() -> bool:
    """Debug mode in this context: inside ``disable_vectorization()``, or set in ``config``."""
    inside = _context.debug_mode.get()
    return config.disable_vectorization if inside is None else inside
