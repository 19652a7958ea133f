"""The parts of the GPU check, in the order they start (the longest first, so that the parts
running at once end together; the bench last, alone): what each runs, and for how long."""
from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Mapping

#: Test files run with CUDA as the device, in three parts that run side by side (one part
#: took 240 s for 79% of them on an H200, 2026-11-30): the issue's list (equivalence, API,
#: sharded, multi-device) and autocast under the map; the sharded step, its layer by layer
#: gathering and writes into copies of the arguments' slices; shard_map and results in
#: memory of their own.
TEST_FILES = (
    "tests/test_device_equivalence.py", "tests/test_api.py", "tests/test_sharded.py", "tests/test_multi_device.py",
    "tests/test_autocast_policy.py",
)
SHARDED_STEP_TEST_FILES = (
    "tests/test_sharded_step.py", "tests/test_layer_gather.py", "tests/test_written_copies.py",
)
SHARD_MAP_TEST_FILES = ("tests/test_shard_map.py", "tests/test_output_copies.py")
#: The RNN and value-read rules' tests, a part of their own: their compiled steps unroll the
#: sequence, and Triton compiles them for minutes on an H200 (196 s of the 286 s that all the
#: test files took in one part).
RNN_TEST_FILES = ("tests/test_recurrent_rules.py",)
#: Test files that run on CUDA and CPU devices together.
MIXED_TEST_FILES = ("tests/test_api.py", "tests/test_multi_device.py")


@dataclasses.dataclass(frozen=True)
class Context:
    """What a part's command depends on."""

    out: str  # the report folder
    quick: bool
    cuda: bool


@dataclasses.dataclass(frozen=True)
class Part:
    """One part of the check.

    Attributes:
        name, title: how the report names it.
        argv: the Python arguments that run it (after the interpreter), for a context.
        env: environment variables for it (a value of None removes the variable).
        cuda_only: skipped, and named as skipped, without CUDA.
        timeout: seconds it may run (less when the budget is nearly spent).
        junit: the part runs pytest and writes this JUnit file into the report folder.
        alone: nothing runs beside it (timings).
    """

    name: str
    title: str
    argv: Callable[[Context], list[str]]
    env: Callable[[Context], Mapping[str, str | None]] = lambda ctx: {}
    cuda_only: bool = False
    timeout: float = 120.0
    junit: str = ""
    alone: bool = False


def _program(name: str) -> Callable[[Context], list[str]]:
    return lambda ctx: ["-m", f"torchpmap.bench.gpu_check.programs.{name}"]


def _pytest(files: tuple[str, ...], junit: str, quick_files: tuple[str, ...]) -> Callable[[Context], list[str]]:
    def argv(ctx: Context) -> list[str]:
        chosen = quick_files if ctx.quick else files
        # -rfE: the failures' names last, also when the part is interrupted at its deadline
        return ["-m", "pytest", "-q", "-rfE", "--tb=short", "-p", "no:cacheprovider", "-o", "addopts=",
                f"--junitxml={ctx.out}/{junit}", *chosen]
    return argv


def _tests_env(ctx: Context) -> Mapping[str, str | None]:
    # CUDA: every CUDA device is a device (the variable is unset); else 4 CPU devices
    return {"TORCHPMAP_NUM_CPU_DEVICES": None if ctx.cuda else "4"}


def _beside_a_cpu_device(without_cuda: int) -> Callable[[Context], Mapping[str, str | None]]:
    """The environment of a part that runs on ``cuda:0`` and one CPU device together with
    CUDA, on ``without_cuda`` CPU devices without."""
    return lambda ctx: {"TORCHPMAP_NUM_CPU_DEVICES": None if ctx.cuda else str(without_cuda),
                        "TORCHPMAP_EXTRA_CPU_DEVICES": "1" if ctx.cuda else None}


def _tests_part(name: str, what: str, files: tuple[str, ...], quick_files: tuple[str, ...],
                timeout: float = 240) -> Part:
    """A part that runs test files with CUDA as the device (``quick_files`` with ``--quick``)."""
    junit = f"{name}.xml"
    return Part(name, f"{what}, CUDA as the device", _pytest(files, junit, quick_files), env=_tests_env,
                timeout=timeout, junit=junit)


PARTS: list[Part] = [
    _tests_part("tests-rnn", "RNN-rule tests (GRU, LSTM, RNN; value reads; Hugging Face padding masks)",
                RNN_TEST_FILES, ("tests/test_recurrent_rules.py::test_weights_per_instance_run_one_call_each",),
                timeout=300),
    _tests_part("tests", "device-equivalence, API, sharded, multi-device and autocast tests", TEST_FILES,
                ("tests/test_sharded.py",)),
    _tests_part("tests-sharded-step", "sharded-step, layer-gather and written-copy tests", SHARDED_STEP_TEST_FILES,
                ("tests/test_written_copies.py",)),
    _tests_part("tests-shard-map", "shard_map and output-copy tests", SHARD_MAP_TEST_FILES,
                ("tests/test_output_copies.py",)),
    Part("host-sync", "no host synchronisation in a warmed step: one device, gloo (2 processes), NCCL",
         _program("host_sync"), cuda_only=True, timeout=300),
    Part("step", "data_parallel_step against plain PyTorch: eager, compiled, bf16, fp16 + GradScaler",
         _program("step_check"), timeout=240),
    Part("jit", "pmap(jit=True) against eager: values and gradients", _program("jit_check"), timeout=240),
    Part("attention", "scaled_dot_product_attention under the map on each kernel, gradients outside and inside",
         _program("attention_check"), timeout=240),
    Part(
        "shard-map",
        "shard_map's notebook programs on the GPU, and on the GPU and a CPU device together, against a CPU device",
        _program("shard_map_check"),
        env=_beside_a_cpu_device(without_cuda=2),
        timeout=180,
    ),
    Part(
        "tests-mixed",
        "API and multi-device tests on CUDA and CPU devices together (cuda:0 and 3 CPU devices)",
        _pytest(MIXED_TEST_FILES, "tests-mixed.xml", MIXED_TEST_FILES),
        env=lambda ctx: {"TORCHPMAP_NUM_CPU_DEVICES": None, "TORCHPMAP_EXTRA_CPU_DEVICES": "3"},
        cuda_only=True,
        timeout=180,
        junit="tests-mixed.xml",
    ),
    Part("memory", "a step's peak CUDA memory against plain PyTorch's", _program("memory_check"), cuda_only=True,
         timeout=120),
    Part("versions", "versions, the device, the private-API door's probes", _program("versions"), timeout=90),
    Part(
        "dispatch-profile",
        "where an eager call's time goes, on CUDA and on the CPU: host time, the machine's primitives, cProfile",
        _program("dispatch_profile"),
        env=_beside_a_cpu_device(without_cuda=1),
        timeout=90,
    ),
    Part(
        "bench",
        "benchmark rows (a) dispatch, (b) MLP step, (h) transformer step",
        lambda ctx: ["-m", "torchpmap.bench", "--no-jax", f"--json={ctx.out}/bench.json", f"--png={ctx.out}/bench.png",
                     *(["--quick", "--only", "dispatch"] if ctx.quick else
                       ["--only", "dispatch", "--only", "mlp_step", "--only", "transformer",
                        "--seconds-per-case", "4"])],
        env=lambda ctx: {"TORCHPMAP_NUM_CPU_DEVICES": None if ctx.cuda else "1"},
        timeout=300,
        alone=True,
    ),
]


def by_name(names: list[str]) -> list[Part]:
    known = {p.name for p in PARTS}
    unknown = sorted(set(names) - known)
    if unknown:
        raise SystemExit(f"gpu-check: unknown part(s) {unknown}; the parts are {[p.name for p in PARTS]}")
    return [p for p in PARTS if p.name in names]


def command_line(part: Part, ctx: Context) -> list[str]:
    return [sys.executable, *part.argv(ctx)]
