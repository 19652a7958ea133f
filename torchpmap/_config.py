"""Run-time settings, read from the environment and changeable in code.

Example:
    >>> import torchpmap
    >>> torchpmap.config.collective_timeout > 0
    True
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Iterator

from torchpmap import _context


@dataclasses.dataclass
class Config:
    """Settings that apply to every pmap.

    Attributes:
        collective_timeout: seconds a collective waits for the other devices before it
            raises TimeoutError (environment: ``TORCHPMAP_COLLECTIVE_TIMEOUT``, default 300).
        disable_vectorization: run instances one at a time in plain Python threads so
            that ``print`` and ``pdb`` work inside a pmapped function (environment:
            ``TORCHPMAP_DISABLE_VECTORIZATION=1``).
    """

    collective_timeout: float = float(os.environ.get("TORCHPMAP_COLLECTIVE_TIMEOUT", "300"))
    disable_vectorization: bool = os.environ.get("TORCHPMAP_DISABLE_VECTORIZATION", "0") == "1"

    def update(self, name: str, value) -> None:
        """Sets one setting, like ``jax.config.update``."""
        if not hasattr(self, name):
            raise AttributeError(f"torchpmap.config has no setting {name!r}; settings: {[f.name for f in dataclasses.fields(self)]}")
        setattr(self, name, value)


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
