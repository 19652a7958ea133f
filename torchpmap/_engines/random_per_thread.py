"""Random streams per device thread: what device threads must not share.

A thread-local TorchFunctionMode sees every torch call of a device thread. Device threads
share torch's default generators, so the numbers an instance draws would depend on thread
scheduling. Each thread instead gets its own stream, seeded from one draw of the caller's
generator (so ``torch.manual_seed`` makes a whole pmap reproducible); the mode swaps the
thread's state into the default generator around each random op, under a lock (the
stream is made at the thread's first draw). Other ops pass straight through. The mode is
in force while the function's body runs (see ``multi_device.device_thread``): each torch
call it sees costs a Python call. Under ``randomness="error"`` the mode refuses
random ops; ``"per_instance"`` streams are :mod:`torchpmap._engines.random_per_instance`'s.

The seed is drawn only where a thread makes its stream: a call whose threads draw
nothing leaves the caller's generator as it was, as one device's vectorized call does
(until 2026-11-29 every call on several devices drew it, so the caller's next
``torch.rand`` gave other numbers after a call on 2 devices than after the same call on
one). A call made outside any device thread takes a snapshot of the caller's generator
instead (:class:`DeferredSeed`): the first thread that needs a stream derives the seed
from it (a draw there would run inside the call's transforms and traces), and the
caller's generator moves on by one draw after the call.

Under ``randomness="same"`` every instance draws what one device draws for all of them
from the caller's generator: the threads' streams start from the caller's generator state
(no seed is drawn), and when the call ends the caller's generator moves on to where the
first thread's stream stopped, as if one device had drawn. Inside an enclosing device
thread "the caller's generator" is that thread's stream.
(Forward-mode AD, which PyTorch keeps per process, is shared by the device threads of a
call: see :func:`torchpmap._state.context.shared_forward_ad`.)
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import hashlib
import threading
from collections.abc import Iterator
from typing import Any, cast

import torch
from torch.overrides import TorchFunctionMode

from torchpmap._engines.random_per_instance import instance_seed, resolves_first
from torchpmap._state.torch_private import functorch_layers_cleared

_DRAWING_OPS = frozenset(
    """rand randn randint randperm rand_like randn_like randint_like bernoulli multinomial normal poisson
    dropout alpha_dropout feature_alpha_dropout dropout1d dropout2d dropout3d rrelu gumbel_softmax
    uniform_ normal_ bernoulli_ random_ exponential_ geometric_ cauchy_ log_normal_""".split()
)
# ops that may draw inside C++ (their dropout in training): their draws use the thread's stream
_RANDOM_OPS = _DRAWING_OPS | {"lstm", "gru", "rnn_tanh", "rnn_relu", "scaled_dot_product_attention",
                              "multi_head_attention_forward"}
_lock = threading.Lock()
_drawing = threading.local()  # .now: this thread is drawing from a device thread's stream


class DeferredSeed:
    """The seed of a ``randomness="different"`` call made outside any device thread, drawn
    only if a thread makes its stream (module docstring).

    Made from a snapshot of the caller's generator (so ``torch.manual_seed`` makes the
    call reproducible); :meth:`settle`, in the caller after the call, moves the caller's
    generator on by one draw where a thread took the seed, so that the next call takes
    another."""

    def __init__(self) -> None:
        with functorch_layers_cleared():  # an enclosing transform must not wrap the snapshot
            self._state = torch.default_generator.get_state().numpy().tobytes()
        self._value: int | None = None

    def value(self) -> int:
        """The seed (derived at the first request, under the streams' lock)."""
        if self._value is None:
            digest = hashlib.blake2b(self._state, digest_size=8).digest()
            self._value = int.from_bytes(digest, "little") >> 2  # room for the threads' indices
        return self._value

    def settle(self) -> None:
        """After the call, in the caller: one draw from its generator where the seed was taken."""
        if self._value is not None:
            with functorch_layers_cleared():  # the draw is ours: an enclosing vmap must not batch it
                torch.randint(0, 2**62, (), generator=torch.default_generator)


#: A call's seed: drawn (an int), deferred, or none (no stream of its own).
Seed = int | DeferredSeed | None


def call_seed(randomness: str, first: torch.device | None = None) -> Seed:
    """The seed of a call that may use random numbers: for ``"different"`` outside any
    device thread, deferred (:class:`DeferredSeed`: call its ``settle`` after the call),
    else one draw from the caller's generator (inside a device thread: its stream); for
    ``"same"``, no draw: the caller's generator state (``first``: the call's first
    device, whose CUDA generator one device would draw from) is where the device threads'
    streams start (see :class:`_SameStart`)."""
    if randomness == "error":
        return None
    if randomness == "same":
        _same_start.set(_SameStart.of_caller(first))
        return 0
    if randomness == "different" and not getattr(_entered, "modes", None):
        return DeferredSeed()
    with functorch_layers_cleared():  # the draw is ours: an enclosing vmap must not batch (or refuse) it
        return int(torch.randint(0, 2**62, (), generator=torch.default_generator))


def settle(seed: Seed) -> None:
    """After a call: see :meth:`DeferredSeed.settle` (nothing for any other seed)."""
    if isinstance(seed, DeferredSeed):
        seed.settle()


class _DeviceThreadMode(TorchFunctionMode):
    def __init__(
        self, seed: Seed, device: torch.device, refuse: bool = False, what: str = "pmap",
        same: _SameStart | None = None, index: int = 0,
    ):
        super().__init__()
        self.seed, self.refuse, self.what, self.device, self.same = seed, refuse, what, device, same
        self.index = index  # added to a deferred seed
        self.generators: list[torch.Generator] = []
        self.states: list[torch.Tensor] = []  # the thread's streams, made at its first draw

    def __enter__(self) -> _DeviceThreadMode:
        _entered.__dict__.setdefault("modes", []).append(self)
        return cast(_DeviceThreadMode, super().__enter__())

    def __exit__(self, *exc: Any) -> None:
        _entered.modes.pop()
        super().__exit__(*exc)

    def _streams(self) -> list[torch.Tensor]:
        if not self.states:
            self.generators = [torch.default_generator]
            if self.device.type == "cuda":
                self.generators.append(torch.cuda.default_generators[self.device.index or 0])
            for g in self.generators:
                if self.same is not None:  # the caller's state: one device's numbers
                    self.states.append(self.same.state_for(g))
                    continue
                own = torch.Generator(device=g.device)
                seed = self.seed.value() + self.index if isinstance(self.seed, DeferredSeed) else self.seed
                own.manual_seed(cast(int, seed))
                self.states.append(own.get_state())
        return self.states

    def finish_same(self) -> None:
        """The first thread of a ``"same"`` call, at its end: the caller's generator moves
        on to where this thread's stream stopped (nothing drawn: it stays)."""
        if self.same is None or not self.states:
            return
        with _lock:
            self.same.advance(self.generators, self.states)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = getattr(func, "__name__", None)
        own_seed = kwargs is not None and kwargs.get("generator") is torch.default_generator  # see call_seed
        if self.refuse and name in _DRAWING_OPS and not own_seed:  # what vmap does under randomness="error"
            raise RuntimeError(
                f"{self.what}: called random operation {name} while in randomness error mode (randomness='error'); "
                "pass randomness='different', 'same' or 'per_instance' to draw random numbers"
            )
        if name in _RANDOM_OPS and resolves_first(types):  # before the lock: see resolves_first
            return NotImplemented
        if self.seed is None or name not in _RANDOM_OPS or getattr(_drawing, "now", False):
            # (a mode of an enclosing device thread sees the op that an inner one draws:
            # the innermost stream is the one that draws)
            return func(*args, **(kwargs or {}))
        with self.swapped_in():
            return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """Torch's default generators hold this thread's streams while the block runs (under
        the lock: no other thread draws meanwhile), and the streams move on by what it drew."""
        with _lock:
            streams = self._streams()
            saved = [g.get_state() for g in self.generators]
            for g, state in zip(self.generators, streams):
                g.set_state(state)
            _drawing.now = True
            try:
                yield
            finally:
                _drawing.now = False
                self.states = [g.get_state() for g in self.generators]
                for g, state in zip(self.generators, saved):
                    g.set_state(state)


@dataclasses.dataclass(frozen=True)
class _SameStart:
    """Where the device threads of a ``randomness="same"`` call start their streams: the
    caller's generator states (CPU, and the call's first CUDA device's), or those of the
    enclosing device thread's streams (``outer``), which the call then advances."""

    cpu: torch.Tensor
    cuda: torch.Tensor | None
    outer: _DeviceThreadMode | None

    @classmethod
    def of_caller(cls, first: torch.device | None) -> _SameStart:
        modes = getattr(_entered, "modes", None)
        outer = modes[-1] if modes else None
        if outer is not None and outer.seed is not None:
            states = outer._streams()
            return cls(states[0], states[1] if len(states) > 1 else None, outer)
        states = [g.get_state() for g in caller_generators(first)]
        return cls(states[0], states[1] if len(states) > 1 else None, None)

    def state_for(self, generator: torch.Generator) -> torch.Tensor:
        if generator.device.type != "cuda":
            return self.cpu
        return self.cuda if self.cuda is not None else generator.get_state()

    def advance(self, generators: list[torch.Generator], states: list[torch.Tensor]) -> None:
        if self.outer is not None:
            self.outer.states = list(states) + self.outer.states[len(states):]
            return
        for g, state in zip(generators, states):
            if g.device.type != "cuda" or self.cuda is not None:
                g.set_state(state)


def caller_generators(first: torch.device | None) -> list[torch.Generator]:
    """The caller's generators that a ``randomness="same"`` call draws from, when it runs
    on device ``first`` (its first): the CPU's, and that CUDA device's where it is one."""
    if first is not None and first.type == "cuda":
        return [torch.default_generator, torch.cuda.default_generators[first.index or 0]]
    return [torch.default_generator]


_same_start: contextvars.ContextVar[_SameStart | None] = contextvars.ContextVar("same_start", default=None)
_entered = threading.local()  # .modes: this thread's device-thread modes in force, innermost last
_own = threading.local()  # .mode: the mode of the device thread this thread is, while it is one


@contextlib.contextmanager
def owned(mode: _DeviceThreadMode) -> Iterator[None]:
    """``mode`` is this device thread's (see :func:`compiled_draws`) while the block runs."""
    previous = getattr(_own, "mode", None)
    _own.mode = mode
    try:
        yield
    finally:
        _own.mode = previous


def compiled_draws() -> contextlib.AbstractContextManager:
    """Around a compiled program that draws random numbers in a device thread: torch's
    default generators hold the thread's stream while it runs.

    A compiled program draws from torch's default generator itself, below any
    ``TorchFunctionMode`` (inductor draws the seeds of its random kernels when the program
    starts), so the device thread's mode never sees the draw; the generators are shared
    by every thread. With the thread's stream swapped in, each device's program draws from
    its own stream, seeded from the call's one draw of the caller's generator (so
    ``torch.manual_seed`` makes the call reproducible, whatever order the threads run in).
    Nothing where this thread has no stream (not a device thread, or ``randomness="error"``)."""
    mode = getattr(_own, "mode", None)
    return mode.swapped_in() if mode is not None and mode.seed is not None else contextlib.nullcontext()


def device_thread_mode(
    seed: Seed, index: int, randomness: str, device: torch.device, what: str = "pmap"
) -> _DeviceThreadMode:
    """The mode for device thread ``index``: its random stream is seed + index for
    "different", the caller's generator state for "same" (see :func:`call_seed`), none
    for "error" (random ops are refused, in messages that name the map as ``what``) and
    for "per_instance" (each instance's own stream: see
    :mod:`torchpmap._engines.random_per_instance`)."""
    if isinstance(seed, int) and randomness == "per_instance":
        # Random ops are drawn per instance (see random_per_instance); what reaches this mode
        # comes from C++ (nn.LSTM's dropout) in an instance run without a vmap level, one
        # per thread: its own stream, seeded from the instance's index, as on any placement
        seed = instance_seed(seed, index) ^ 1
    elif isinstance(seed, int) and randomness == "different":
        seed += index
    same = _same_start.get() if randomness == "same" else None
    # an instance run without vmap (one per device) has no vmap level to refuse random ops
    return _DeviceThreadMode(seed, device, refuse=randomness == "error", what=what, same=same, index=index)
