"""Part ``versions``: the versions, the device, and the private-API door's probes."""
from __future__ import annotations

import importlib
import platform

import torch

from torchpmap.bench.gpu_check.programs.common import Recorder, describe, has_cuda, main_guard


def main() -> int:
    rec = Recorder()
    rec.measure("python", platform.python_version())
    rec.measure("torch", torch.__version__)
    rec.measure("torch.version.cuda", torch.version.cuda)
    for name in ("triton", "jax", "numpy", "transformers"):
        try:
            rec.measure(name, importlib.import_module(name).__version__)
        except Exception as error:  # noqa: BLE001 -- an absent package is a finding, not a failure
            rec.measure(name, f"not importable ({type(error).__name__})")
    if has_cuda():
        props = torch.cuda.get_device_properties(0)
        rec.measure("device", f"{props.name}, {props.total_memory / 2**30:.1f} GiB, "
                              f"{props.multi_processor_count} SMs, capability {props.major}.{props.minor}")
        rec.measure("cuda devices", torch.cuda.device_count())
        rec.measure("cudnn", torch.backends.cudnn.version())
        try:
            rec.measure("nccl", ".".join(map(str, torch.cuda.nccl.version())))
        except Exception as error:  # noqa: BLE001
            rec.measure("nccl", f"unknown ({describe(error)})")
    else:
        rec.measure("device", f"cpu ({platform.machine()}), no CUDA")
        rec.skip("the CUDA device's properties", "torch.cuda.is_available() is False")

    from torchpmap._state import torch_private

    for name in torch_private.ENTRIES:
        try:
            torch_private.check(name)
            rec.check(f"torch_private.{name}", True)
        except Exception as error:  # noqa: BLE001 -- every entry is reported
            rec.check(f"torch_private.{name}", False, describe(error))

    import torchpmap as tp

    rec.measure("torchpmap.devices()", ", ".join(map(str, tp.devices())))
    return rec.finish()


if __name__ == "__main__":
    main_guard(main)
