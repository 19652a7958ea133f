"""(f) The multi-device path: the MLP step of (b) over 2 CPU devices vs one device, eager
and compiled (``jit=True``: each device thread runs its compiled slice; ``jit/torchpmap.1dev.jit``
is the compiled step on 2 devices against the compiled step on one).

Needs torchpmap to offer several CPU devices (``TORCHPMAP_NUM_CPU_DEVICES``, which the
suite sets to 2 unless it is set); until then the row reports why it is empty.
"""

from __future__ import annotations

import dataclasses

import torch

import torchpmap
from torchpmap.bench import frameworks as fw
from torchpmap.bench.core import Case, Cell, Config, Workload
from torchpmap.bench.workloads import _mlp

DEVICES = 2


def needs() -> str | None:
    count = len(fw.torchpmap_cpu_devices())
    if count >= DEVICES:
        return None
    if any(d.platform == "cuda" for d in torchpmap.devices()):
        return "needs CPU devices: torchpmap's devices are GPUs on this machine"
    return f"needs TORCHPMAP_NUM_CPU_DEVICES support (torchpmap sees {count} CPU device, {DEVICES} wanted)"


def build(cfg: Config) -> list[Case]:
    cpu_cfg = dataclasses.replace(cfg, device=torch.device("cpu"))
    devs = fw.torchpmap_cpu_devices()
    params = _mlp.init_params(cpu_cfg.device)
    x, y = _mlp.make_data(cpu_cfg.device)
    columns: dict[str, Cell] = {
        "torchpmap": fw.torch_impl(cpu_cfg, _mlp.torchpmap_step(devs[:DEVICES]), params, x, y),
        "torchpmap.1dev": fw.torch_impl(cpu_cfg, _mlp.torchpmap_step(devs[:1]), params, x, y),
        "torchpmap.jit": fw.torch_impl(cpu_cfg, _mlp.torchpmap_step(devs[:DEVICES], jit=True), params, x, y),
        "torchpmap.1dev.jit": fw.torch_impl(cpu_cfg, _mlp.torchpmap_step(devs[:1], jit=True), params, x, y),
        "torch": fw.torch_impl(cpu_cfg, _mlp.plain_step, params, *_mlp.flatten_batch(x, y)),
    }
    return [Case("multidevice", f"multidevice[{DEVICES} cpu]", "step", columns, rtol=1e-4, atol=1e-5)]


WORKLOAD = Workload(
    "multidevice",
    f"the MLP step on {DEVICES} CPU devices vs the one-device path",
    build,
    needs,
)
