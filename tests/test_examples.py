"""The seed examples (examples/seed_*.py) run and print the numbers the JAX programs print.

Each example runs once, as a subprocess with this interpreter and this environment (so
``TORCHPMAP_NUM_CPU_DEVICES`` carries over); every expected number is computed here
independently, with plain torch, never with torchpmap.
"""
from __future__ import annotations

import ast
import concurrent.futures
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

# the examples, each run as a process of its own: `make test-quick` leaves them out
pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
SEEDS = (
    "seed_scale.py",
    "seed_scaled_sum.py",
    "seed_gradient_step.py",
    "seed_simple_computation.py",
    "seed_named_axis.py",
    "seed_predict.py",
)


def _device_count() -> int:
    """The device count the example sees: the same environment as this process."""
    if torch.cuda.is_available():
        return torch.cuda.device_count()
    return int(os.environ.get("TORCHPMAP_NUM_CPU_DEVICES", "1"))


def _run(name: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(EXAMPLES / name)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )


@pytest.fixture(scope="module")
def runs() -> dict[str, subprocess.CompletedProcess]:
    """Every seed example, run once; all at once (each is mostly torch's import, ~300 MB)."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(SEEDS)) as pool:
        return dict(zip(SEEDS, pool.map(_run, SEEDS)))


def _output(runs, name: str) -> str:
    proc = runs[name]
    assert proc.returncode == 0, (
        f"{name} exited with {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    )
    return proc.stdout


_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


def _numbers(text: str) -> list[float]:
    return [float(m) for m in _NUMBER.findall(text)]


def _line(out: str, prefix: str) -> str:
    """The rest of the line starting with ``prefix`` (exactly one such line)."""
    found = [line[len(prefix):] for line in out.splitlines() if line.startswith(prefix)]
    assert len(found) == 1, f"expected one line starting with {prefix!r}, found {len(found)} in:\n{out}"
    return found[0]


def _block(out: str, header: str, rows: int) -> str:
    """The ``rows`` lines printed after the line that starts with ``header`` (header line included)."""
    lines = out.splitlines()
    starts = [k for k, line in enumerate(lines) if line.startswith(header)]
    assert len(starts) == 1, f"expected one line starting with {header!r} in:\n{out}"
    k = starts[0]
    return "\n".join([lines[k][len(header):], *lines[k + 1 : k + 1 + rows]])


def _assert_numbers(text: str, expected: torch.Tensor, atol: float = 0.0) -> None:
    got = torch.tensor(_numbers(text), dtype=torch.float64)
    want = expected.to(torch.float64).flatten()
    assert got.shape == want.shape, f"printed {got.tolist()}, expected {want.tolist()}"
    assert torch.allclose(got, want, rtol=0, atol=atol), f"printed {got.tolist()}, expected {want.tolist()}"


@pytest.mark.parametrize("name", SEEDS)
def test_example_exits_cleanly(runs, name):
    out = _output(runs, name)
    assert out.strip(), f"{name} printed nothing"
    assert "Traceback" not in runs[name].stderr


def test_seed_scale(runs):
    out = _output(runs, "seed_scale.py")
    data = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    assert _numbers(_line(out, "Number of devices:")) == [_device_count()]
    assert _line(out, "Original data shape:").strip() == "(4, 3)"
    assert _numbers(_line(out, "Scalar value:")) == [10.0]
    assert _line(out, "Pmapped result shape:").strip() == "(4, 3)"
    _assert_numbers(_block(out, "Pmapped result:", 4), data * 10.0)


def test_seed_scaled_sum(runs):
    out = _output(runs, "seed_scaled_sum.py")
    n = _device_count()
    data = torch.arange(n, dtype=torch.float32)
    total = float((data * 2.0).sum())
    assert _numbers(_line(out, "Using ")) == [n]
    _assert_numbers(_line(out, "Input data:"), data)
    _assert_numbers(_line(out, "Result (same on all devices):"), torch.full((n,), total))
    assert _numbers(_line(out, "Expected sum:")) == [total]
    # Four instances, whatever the device count: JAX's numbers on 4 devices.
    _assert_numbers(_line(out, "4 instances, input data:"), torch.arange(4.0))
    _assert_numbers(_line(out, "4 instances, result:"), torch.full((4,), 12.0))


def _expected_update(n: int) -> dict[str, float]:
    """One data-parallel step of the seed, computed shard by shard with plain autograd."""
    xs = torch.arange(n * 4, dtype=torch.float32).reshape(n, 4, 1)
    ys = xs * 2.0 + 0.5
    w = torch.ones((), requires_grad=True)
    b = torch.zeros((), requires_grad=True)
    grads_w, grads_b = [], []
    for k in range(n):
        loss = torch.mean((w * xs[k] + b - ys[k]) ** 2)
        gw, gb = torch.autograd.grad(loss, (w, b))
        grads_w.append(gw)
        grads_b.append(gb)
    avg_w, avg_b = torch.stack(grads_w).mean(), torch.stack(grads_b).mean()
    return {"w": float(1.0 - 0.01 * avg_w), "b": float(0.0 - 0.01 * avg_b)}


def _printed_dict(out: str, prefix: str) -> dict[str, float]:
    value = ast.literal_eval(_line(out, prefix).strip())
    assert isinstance(value, dict) and set(value) == {"w", "b"}, value
    return value


def test_seed_gradient_step(runs):
    out = _output(runs, "seed_gradient_step.py")
    assert _printed_dict(out, "Original params:") == {"w": 1.0, "b": 0.0}
    for prefix, n in (
        ("Updated params (on device 0):", _device_count()),
        ("4 instances, updated params (instance 0):", 4),
    ):
        got, want = _printed_dict(out, prefix), _expected_update(n)
        for key in ("w", "b"):
            assert got[key] == pytest.approx(want[key], abs=1e-5), (prefix, key, got, want)
    # JAX's numbers for the seed on a 4-device machine.
    assert _printed_dict(out, "4 instances, updated params (instance 0):") == pytest.approx(
        {"w": 2.625, "b": 0.16}, abs=1e-5
    )
    assert _line(out, "4 instances, same on every instance:").strip() == "True"


def test_seed_simple_computation(runs):
    out = _output(runs, "seed_simple_computation.py")
    n = _device_count()
    assert _numbers(_line(out, "Number of devices:")) == [n]
    assert _line(out, "Input data shape:").strip() == f"({n}, 3)"
    _assert_numbers(_block(out, "Output result:", n), torch.arange(n * 3).reshape(n, 3) * 2)
    assert _line(out, "Output shape:").strip() == f"({n}, 3)"
    kind = _line(out, "Output type:")
    assert ("ShardedTensor" in kind) if n > 1 else ("torch.Tensor" in kind), kind
    devices = _line(out, "Output devices:").strip()
    assert devices.startswith("[") and devices.count(":") == n, devices
    _assert_numbers(_block(out, "4 instances, output result:", 4), torch.arange(12).reshape(4, 3) * 2)
    assert _line(out, "4 instances, output shape:").strip() == "(4, 3)"


def test_seed_named_axis(runs):
    out = _output(runs, "seed_named_axis.py")
    lines = out.splitlines()
    assert lines[0].strip() == "(4, 5)"
    expected = torch.arange(20).reshape(4, 5) * 2
    start = next(k for k, line in enumerate(lines) if line.startswith("[["))
    _assert_numbers("\n".join(lines[start : start + 4]), expected)
    _assert_numbers(_line(out, "psum over 'data_parallel_axis', instance 0:"), expected.sum(0))


def test_seed_predict(runs):
    out = _output(runs, "seed_predict.py")
    n = _device_count()
    assert _numbers(_line(out, "Number of devices:")) == [n]
    assert _line(out, "Parameter shapes:").strip() == "w=(10, 5), b=(5,)"
    assert _line(out, "Global data batch shape:").strip() == f"({32 * n}, 10)"
    assert _line(out, "Sharded data shape:").strip() == f"({n}, 32, 10)"
    assert _line(out, "Output predictions shape:").strip() == f"({n}, 32, 5)"
    assert _line(out, "Matches unsharded predict:").strip() == "True"
    # The same draws as the example, then the first example's prediction by hand.
    torch.manual_seed(0)
    w, b = torch.randn(10, 5), torch.randn(5)
    data = torch.randn(32 * n, 10)
    first = (data[0].double() @ w.double()) + b.double()
    _assert_numbers(_line(out, "First prediction (device 0, example 0):"), first, atol=1e-5)
    assert _line(out, "8 instances, output predictions shape:").strip() == f"(8, {32 * n // 8}, 5)"
    assert _line(out, "8 instances, matches unsharded predict:").strip() == "True"


def _loss_lines(devices: int) -> list[str]:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "multiprocess_data_parallel.py")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "TORCHPMAP_NUM_CPU_DEVICES": str(devices)},
    )
    assert proc.returncode == 0, proc.stderr
    assert "matches the single-process step: True" in proc.stdout, proc.stdout
    return [line for line in proc.stdout.splitlines() if line.startswith("step")]


@pytest.mark.skipif(os.environ.get("TORCHPMAP_NUM_CPU_DEVICES", "1") != "1", reason="sets its own device counts")
def test_the_data_parallel_example_trains_the_same_on_one_and_on_four_devices():
    """One device is the oracle: the repo's own example must not diverge on four (it did,
    when device threads shared one module through functional_call)."""
    one, four = _loss_lines(1), _loss_lines(4)
    assert len(one) >= 5 and one == four, (one, four)
