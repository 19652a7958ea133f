"""Run-time settings, read from the environment and changeable in code.

Example:
    >>> import torchpmap
    >>> torchpmap.config.collective_timeout > 0
    True
"""
from __future__ import annotations

import dataclasses
import os


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
