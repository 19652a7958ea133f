"""Per-call state in one place: what every device thread of a call must see as its caller does.

A pmap over several devices runs one thread per device, and PyTorch keeps much of what
changes a program's results per thread. Two kinds of state follow the caller:

* **torch's thread-local state**, captured in the calling thread by
  :meth:`CallerState.capture` and entered in every device thread by
  :meth:`CallerState.entered`: grad mode, inference mode, forward-grad mode, autocast
  (every device type, its dtype and cache flag), the torch function modes (among them
  ``with torch.device(...)`` and ``torch.set_default_device``), the number of intra-op
  threads (a reduction split differently rounds differently) and the torch.func
  transforms around the call (their interpreter stack), so that ``grad``, ``vjp``,
  ``vmap``, ``jvp`` and ``jacfwd`` enclose a pmap on several devices as they enclose one
  on one device. The default dtype, deterministic-algorithms mode and anomaly mode are
  process-wide in PyTorch, so device threads see them without help.
* **torchpmap's own state**: the active meshes, debug mode, bound axes, device placement,
  an instance thread's position (mesh axes, one at a time) and the process exchange's state live in
  :mod:`contextvars`, so that a ``with mesh:`` or ``disable_vectorization()`` in one
  thread never leaks into another, nested contexts restore what they found (on error
  too), and device threads run in a copy of their caller's context
  (:func:`run_in_copy`).

Forward-mode AD needs one more piece: PyTorch keeps a single forward-AD level per
process, and ``torch.func.jvp`` opens and closes it only at its outermost nesting.
:func:`shared_forward_ad` opens it once around the device threads, so that no device
thread's ``jvp`` closes it while another still uses it.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch

from torchpmap._state import torch_private as private

T = TypeVar("T")

# ----------------------------------------------------------------------- torchpmap's own state

_own = threading.local()


def own_vmap_levels() -> list[int]:
    """The vmap levels torchpmap's own maps opened in this thread, innermost last (their
    batching rules may read a value that every instance holds; see
    ``batching_rules._value_read``), pushed and popped around each vectorized run. A
    plain per-thread list (a ContextVar cost a few hundred nanoseconds per call): device
    threads get their caller's with its torch.func levels (:meth:`CallerState.entered`)."""
    levels: list[int] | None = getattr(_own, "levels", None)
    if levels is None:
        levels = _own.levels = []
    return levels


#: The meshes (:class:`torchpmap.Mesh`) entered with ``with mesh:`` here, innermost last.
active_meshes: contextvars.ContextVar[tuple[Any, ...]] = contextvars.ContextVar("torchpmap_meshes", default=())
#: Inside an instance running on a device: that device, as a 1-tuple (nested pmaps stay on it).
default_devices: contextvars.ContextVar[tuple[Any, ...] | None] = contextvars.ContextVar(
    "torchpmap_devices", default=None
)
#: The named axes bound here, innermost last (:mod:`torchpmap._state.axis_env` reads them).
axis_frames: contextvars.ContextVar[tuple[Any, ...]] = contextvars.ContextVar("torchpmap_axis_frames", default=())
#: The state of an instance thread (:mod:`torchpmap._engines.instance_threads`: a mesh pmap or
#: one instance at a time), else None.
instance_thread: contextvars.ContextVar[Any | None] = contextvars.ContextVar("torchpmap_instance", default=None)
#: In a device thread, the watch over module forwards of its call (see ``module_guard``).
module_watch: contextvars.ContextVar[Any | None] = contextvars.ContextVar("torchpmap_module_watch", default=None)
#: The axes (mesh axis names, or the world) of the distributed pmaps running here, outermost first.
process_axes: contextvars.ContextVar[tuple[Any, ...]] = contextvars.ContextVar("torchpmap_process_axes", default=())
#: True while a program spanning processes is traced here (``pmap(jit=True)``).
tracing_processes: contextvars.ContextVar[bool] = contextvars.ContextVar("torchpmap_tracing_processes", default=False)
#: The mesh axes of the shard_map whose body runs here (mesh order), () outside shard_map bodies.
shard_map_axes: contextvars.ContextVar[tuple[Any, ...]] = contextvars.ContextVar("torchpmap_shard_map_axes", default=())
#: True while a collective runs: shard_map's implicit pvary leaves its ops alone.
in_collective: contextvars.ContextVar[bool] = contextvars.ContextVar("torchpmap_in_collective", default=False)
#: In a shard_map body under ``check_vma``: JAX's implicit ``pvary`` of a collective's input
#: (``vary(x, axis_names)``) for the collectives that need it varying along their axes.
implicit_pvary_input: contextvars.ContextVar[Callable[[Any, tuple[Any, ...]], Any] | None] = contextvars.ContextVar(
    "torchpmap_implicit_pvary_input", default=None
)
#: ``disable_vectorization()`` in this context: True inside, None where no such block is open.
debug_mode: contextvars.ContextVar[bool | None] = contextvars.ContextVar("torchpmap_debug", default=None)


@contextlib.contextmanager
def setting(var: contextvars.ContextVar[T], value: T) -> Iterator[None]:
    """Sets ``var`` for the block and restores what it was, on error too (re-entrant)."""
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


def run_in_copy(context: contextvars.Context, fn: Callable[[], T]) -> T:
    """Runs ``fn`` in a copy of ``context`` (a device thread in its caller's context)."""
    return context.copy().run(fn)


# ----------------------------------------------------------------------- torch's thread-local state

def _known_autocast_device_type(device_type: str) -> bool:
    try:
        torch.is_autocast_enabled(device_type)
    except (RuntimeError, ValueError):  # a device type this torch build does not know
        return False
    return True


#: The device types whose autocast state this torch build knows (probed once, at import).
AUTOCAST_DEVICE_TYPES: tuple[str, ...] = tuple(
    t for t in ("cpu", "cuda", "xpu", "mps", "hpu") if _known_autocast_device_type(t)
)
#: Those torchpmap's own devices can be (CPU and CUDA): what hot-path checks look at.
DEVICE_AUTOCAST_TYPES: tuple[str, ...] = tuple(t for t in AUTOCAST_DEVICE_TYPES if t in ("cpu", "cuda"))


class autocast_off:  # lower case: used as a context manager, like torch.autocast
    """A block in which no autocast region is in force: every device type's that is on is
    turned off, and back on after. For torchpmap's own work on values whose casts are
    decided already: a compiled program, traced with the caller's casts in it (run or
    compiled again under autocast, its ops would be cast anew, over the regions the
    function entered itself), and results put together as the instances returned them.
    Nothing to do when autocast is off (the common case: two state reads)."""

    __slots__ = ("_entered",)

    def __enter__(self) -> None:
        self._entered = [
            torch.autocast(t, enabled=False) for t in DEVICE_AUTOCAST_TYPES if torch.is_autocast_enabled(t)
        ]
        for region in self._entered:
            region.__enter__()

    def __exit__(self, *exc: object) -> None:
        for region in reversed(self._entered):
            region.__exit__(None, None, None)


def cat_as_they_are(parts: Sequence[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """``torch.cat`` of torchpmap's own assembling of results, in the parts' dtype also
    under a caller's autocast (whose ``cat`` promotes, and refuses float16 parts under a
    bfloat16 autocast: a float16 result would raise on one placement only)."""
    with autocast_off():
        return torch.cat(list(parts), dim)


@dataclasses.dataclass(frozen=True)
class Autocast:
    device_type: str
    dtype: torch.dtype
    cache_enabled: bool


def autocast_regions() -> tuple[Autocast, ...]:
    """The autocast regions in force in this thread: one per device type whose autocast is on."""
    cache = torch.is_autocast_cache_enabled()
    return tuple(
        Autocast(t, torch.get_autocast_dtype(t), cache) for t in AUTOCAST_DEVICE_TYPES if torch.is_autocast_enabled(t)
    )


@contextlib.contextmanager
def autocast_as(regions: Sequence[Autocast]) -> Iterator[None]:
    """A block with exactly ``regions`` in force (see :func:`autocast_regions`): any other
    autocast turned off, e.g. to run again what ran under the regions captured then."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(autocast_off())
        for a in regions:
            stack.enter_context(torch.autocast(a.device_type, dtype=a.dtype, cache_enabled=a.cache_enabled))
        yield


@dataclasses.dataclass(frozen=True)
class CallerState:
    """The calling thread's torch state that a device thread must share.

    Attributes:
        grad_enabled: ``torch.is_grad_enabled()``.
        inference_mode: ``torch.is_inference_mode_enabled()``.
        forward_grad_enabled: forward-mode AD switched on (inside ``torch.func.jvp``).
        autocast: one entry per device type whose autocast is on.
        function_modes: the torch function modes in force, outermost first.
        transforms: the torch.func transforms around the call (opaque interpreter layers).
        intra_op_threads: ``torch.get_num_threads()``: kept per thread by OpenMP, and a
            reduction split over another number of threads rounds differently.
        cuda_streams: the caller's current CUDA stream on each CUDA device of the call,
            where it is not that device's default stream. CUDA keeps the current stream
            per thread, so a device thread would otherwise enqueue on the default stream,
            unordered with what the caller enqueued on its own (``with
            torch.cuda.stream(s):`` around a pmap).
    """

    grad_enabled: bool
    inference_mode: bool
    forward_grad_enabled: bool
    autocast: tuple[Autocast, ...]
    function_modes: tuple[Any, ...]
    transforms: tuple[Any, ...]
    intra_op_threads: int
    cuda_streams: tuple[Any, ...] = ()
    own_levels: tuple[int, ...] = ()

    @classmethod
    def capture(cls, devices: Sequence[Any] = ()) -> CallerState:
        """The calling thread's state; ``devices`` (torchpmap Devices): those of the call,
        whose current CUDA streams are captured."""
        return cls(
            grad_enabled=torch.is_grad_enabled(),
            inference_mode=torch.is_inference_mode_enabled(),
            forward_grad_enabled=private.forward_grad_enabled(),
            autocast=autocast_regions(),
            function_modes=tuple(private.function_mode_stack()),
            transforms=tuple(private.functorch_layers()),
            intra_op_threads=torch.get_num_threads(),
            cuda_streams=_non_default_streams(devices),
            own_levels=tuple(own_vmap_levels()),
        )

    @contextlib.contextmanager
    def entered(self) -> Iterator[None]:
        """Puts this state in force in the current (device) thread for the block."""
        if torch.get_num_threads() != self.intra_op_threads:  # a pooled worker keeps what it was given
            torch.set_num_threads(self.intra_op_threads)
        if self.own_levels:  # the caller's maps' levels (with its transforms, restored below)
            with _own_levels_set(self.own_levels), self._entered_rest():
                yield
            return
        with self._entered_rest():
            yield

    @contextlib.contextmanager
    def _entered_rest(self) -> Iterator[None]:
        if self._in_force_already():  # the common case: nothing to enter (each context costs microseconds)
            yield
            return
        with contextlib.ExitStack() as stack:
            stack.enter_context(private.functorch_layers_restored(self.transforms))
            if self.inference_mode:
                stack.enter_context(torch.inference_mode())
            stack.enter_context(torch.set_grad_enabled(self.grad_enabled))
            stack.enter_context(private.forward_grad_set(self.forward_grad_enabled))
            stack.enter_context(autocast_as(self.autocast))
            for mode in self.function_modes:
                stack.enter_context(private.function_mode_pushed(mode))
            for stream in self.cuda_streams:
                stack.enter_context(torch.cuda.stream(stream))
            yield

    def _in_force_already(self) -> bool:
        """Whether this thread's state is already this one (plain grad mode, nothing else):
        checked on each entry, so a pooled worker whose last body changed its grad mode
        is put right."""
        return (
            not (self.transforms or self.inference_mode or self.autocast or self.function_modes or self.cuda_streams)
            and torch.is_grad_enabled() == self.grad_enabled
            and not torch.is_inference_mode_enabled()
            and private.forward_grad_enabled() == self.forward_grad_enabled
            and not private.function_mode_stack()
            and not any(torch.is_autocast_enabled(t) for t in AUTOCAST_DEVICE_TYPES)
        )


@contextlib.contextmanager
def _own_levels_set(levels: Sequence[int]) -> Iterator[None]:
    mine = own_vmap_levels()
    saved = mine[:]
    mine[:] = levels
    try:
        yield
    finally:
        mine[:] = saved


def _non_default_streams(devices: Sequence[Any]) -> tuple[Any, ...]:
    """The current CUDA stream of each CUDA device among ``devices`` that is not its
    default stream (the common case captures nothing)."""
    if not devices or not torch.cuda.is_initialized():
        return ()
    found = []
    for index in {d.torch_device.index or 0 for d in devices if d.torch_device.type == "cuda"}:
        stream = torch.cuda.current_stream(index)
        if stream != torch.cuda.default_stream(index):
            found.append(stream)
    return tuple(found)


def carries_tangent(t: Any) -> bool:
    """Whether ``t`` is a tensor with a forward-mode tangent at the open forward-AD level
    (the caller's ``forward_ad.dual_level()``, or ``torch.func.jvp``'s): False at once
    when no level is open, the common case."""
    if private.forward_ad_level() < 0 or not isinstance(t, torch.Tensor):
        return False
    return torch.autograd.forward_ad.unpack_dual(t).tangent is not None


@contextlib.contextmanager
def shared_forward_ad() -> Iterator[None]:
    """Opens the process' forward-AD level around the device threads of one call (see
    the module docstring); a no-op where an enclosing ``jvp``, or the caller's own
    ``forward_ad.dual_level()``, has opened it already."""
    if private.jvp_nesting() > 0 or private.forward_ad_level() >= 0:
        yield
        return
    with torch.autograd.forward_ad.dual_level(), private.jvp_nesting_raised():
        yield
