"""The Device record: which device an instance runs on (a value, at the bottom of the
layers so that process state can name devices; :mod:`torchpmap._placement.devices` lists them)."""
from __future__ import annotations

import dataclasses
import functools

import torch


@dataclasses.dataclass(frozen=True, order=True)
class Device:
    """One device a pmap instance can run on: its kind (``"cpu"``/``"cuda"``), its index
    among the devices of that kind in its process, and the process that owns it.

    Example:
        >>> import torchpmap
        >>> torchpmap.devices()[0].torch_device.type in ("cpu", "cuda")
        True
    """

    platform: str
    id: int
    process_index: int = 0

    @functools.cached_property  # read on every call: made once (a frozen dataclass still has a __dict__)
    def torch_device(self) -> torch.device:
        return torch.device(self.platform, self.id) if self.platform == "cuda" else torch.device("cpu")

    def __repr__(self) -> str:
        if self.process_index:  # a device of process 1, 2, ... in a multi-process run
            return f"{self.platform}:{self.id} (process {self.process_index})"
        return f"{self.platform}:{self.id}"
