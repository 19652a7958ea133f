"""Part ``dispatch-profile``: where the time of one eager mapped call goes, on CUDA and on the CPU.

The bench's row (a) times ``x + 1`` over 8 instances with a synchronisation after every
call: on an H200 torchpmap took 78-88 us against plain PyTorch's 22 us, where on a CPU
machine its overhead is about 10 us. This part splits that up on the machine that shows
it, in one process, for the first CUDA device and for the CPU:

* each column's host time per call without a synchronisation (what dispatch costs the
  calling thread) and with one (what the bench times);
* the costs of the machine's own primitives that torchpmap's call path uses and plain
  PyTorch's does not (an uncontended lock, a context variable set and reset, a
  ``contextvars`` copy, a ``time.perf_counter``): a sandboxed kernel (gVisor) can make
  some of them far dearer than on a plain Linux machine;
* a cProfile of the calls: the functions with the most own time per call, printed to
  the part's log and kept as measurements.

Nothing here passes or fails on speed (the benchmark measures, tests assert): the
checks are that each column gives ``x + 1``.
"""
from __future__ import annotations

import contextvars
import cProfile
import io
import pstats
import threading
import time
from collections.abc import Callable

import torch

import torchpmap as tp
from torchpmap.bench.gpu_check.programs.common import QUICK, Recorder, has_cuda, main_guard

INSTANCES = 8
CALLS = 300 if QUICK else 3000
#: The functions listed per device: those with the most own time.
TOP = 12


def add_one(x: torch.Tensor) -> torch.Tensor:
    return x + 1


def per_call_us(fn: Callable[[], object], calls: int, sync: Callable[[], None]) -> float:
    """Host microseconds per call, ``sync`` after each (a no-op: dispatch alone)."""
    for _ in range(min(200, calls)):
        fn()
        sync()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
        sync()
    return (time.perf_counter() - start) / calls * 1e6


def primitives(rec: Recorder) -> None:
    """The machine's own costs, per operation, in nanoseconds."""
    lock, var = threading.Lock(), contextvars.ContextVar("probe", default=0)

    def locked() -> None:
        with lock:
            pass

    def var_set() -> None:
        var.reset(var.set(1))

    for name, op in (("an uncontended lock", locked), ("a context variable set and reset", var_set),
                     ("contextvars.copy_context()", contextvars.copy_context), ("time.perf_counter()",
                                                                                   time.perf_counter)):
        start = time.perf_counter()
        for _ in range(CALLS * 10):
            op()
        rec.measure(f"machine: {name} (ns)", round((time.perf_counter() - start) / (CALLS * 10) * 1e9, 1))


def profile_of(fn: Callable[[], object], calls: int) -> list[tuple[str, float]]:
    """The ``TOP`` functions with the most own time, in microseconds per call."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(TOP)
    print(text.getvalue(), flush=True)
    rows = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:TOP]  # type: ignore[attr-defined]
    return [(f"{file.rsplit('/', 2)[-1] if '/' in file else file}:{line} {func}", tt / calls * 1e6)
            for (file, line, func), (_, _, tt, _, _) in rows]


def one_device(rec: Recorder, device: torch.device) -> None:
    x = torch.arange(INSTANCES * 4, dtype=torch.float32, device=device).reshape(INSTANCES, 4)
    # with CUDA the part runs with TORCHPMAP_EXTRA_CPU_DEVICES=1: a CPU device beside cuda:0
    found = [d for d in tp.devices() if d.torch_device.type == device.type]
    if not found:
        raise RuntimeError(f"no torchpmap device on {device} among {tp.devices()}")
    mapped = tp.pmap(add_one, devices=found[:1])
    columns = {"torchpmap": lambda: mapped(x), "torch": lambda: add_one(x)}
    for name, fn in columns.items():
        rec.check(f"{device.type}: {name} gives x + 1", bool(torch.equal(torch.as_tensor(fn()).cpu(), (x + 1).cpu())))
    sync: Callable[[], None] = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for name, fn in columns.items():
        rec.measure(f"{device.type}: {name}, host us per call", round(per_call_us(fn, CALLS, lambda: None), 1))
        rec.measure(f"{device.type}: {name}, us per call with a sync", round(per_call_us(fn, CALLS, sync), 1))
    print(f"== cProfile of {CALLS} torchpmap calls on {device}", flush=True)
    for k, (where, us) in enumerate(profile_of(columns["torchpmap"], CALLS)):
        rec.measure(f"{device.type}: profile #{k + 1} (own us per call, under cProfile)", f"{us:.2f} {where}")


def main() -> int:
    rec = Recorder()
    primitives(rec)
    devices = [torch.device("cuda", 0)] if has_cuda() else []
    if not devices:
        rec.skip("the CUDA column", "no CUDA")
    for device in [*devices, torch.device("cpu")]:
        with rec.case(f"dispatch profile on {device}"):
            one_device(rec, device)
    return rec.finish()


if __name__ == "__main__":
    main_guard(main)
