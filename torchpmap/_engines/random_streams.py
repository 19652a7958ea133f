"""Reproducible random numbers in device threads.

Device threads share torch's default generators, so without care the numbers an
instance draws would depend on how the threads happen to be scheduled. Each thread
instead gets its own stream, seeded from one draw of the caller's generator (so
``torch.manual_seed`` makes a whole pmap reproducible): a thread-local TorchFunctionMode
swaps the thread's state into the default generator around each random op, under a
lock, and swaps it out again. Non-random ops pass straight through and run concurrently.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch
from torch.overrides import TorchFunctionMode

_RANDOM_OPS = frozenset(
    """rand randn randint randperm rand_like randn_like randint_like bernoulli multinomial normal poisson
    dropout alpha_dropout feature_alpha_dropout dropout1d dropout2d dropout3d rrelu gumbel_softmax
    uniform_ normal_ bernoulli_ random_ exponential_ geometric_ cauchy_ log_normal_""".split()
)
_lock = threading.Lock()


def call_seed(randomness: str) -> int | None:
    """One draw from the caller's generator for a call that may use random numbers."""
    if randomness == "error":
        return None
    return int(torch.randint(0, 2**62, (), generator=torch.default_generator))


class _ThreadStream(TorchFunctionMode):
    def __init__(self, seed: int, device: torch.device):
        super().__init__()
        self.generators = [torch.default_generator]
        if device.type == "cuda":
            self.generators.append(torch.cuda.default_generators[device.index or 0])
        self.states = []
        for g in self.generators:
            own = torch.Generator(device=g.device)
            own.manual_seed(seed)
            self.states.append(own.get_state())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", None) not in _RANDOM_OPS:
            return func(*args, **(kwargs or {}))
        with _lock:
            saved = [g.get_state() for g in self.generators]
            for g, state in zip(self.generators, self.states):
                g.set_state(state)
            try:
                return func(*args, **(kwargs or {}))
            finally:
                self.states = [g.get_state() for g in self.generators]
                for g, state in zip(self.generators, saved):
                    g.set_state(state)


@contextlib.contextmanager
def thread_stream(seed: int | None, index: int, randomness: str, device: torch.device) -> Iterator[None]:
    """Gives this thread its own stream: seed + index for "different", seed for "same"."""
    if seed is None:
        yield
        return
    with _ThreadStream(seed + (index if randomness == "different" else 0), device):
        yield
