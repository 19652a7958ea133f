"""Shared test set-up: JAX on CPU with 8 host devices, for the differential tests."""
import os

# Must be set before jax is imported anywhere.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")


import pytest


def _cpu_devices(monkeypatch, count: int):
    """``count`` CPU devices (no CUDA) for one test, put back after it."""
    import torch

    from torchpmap._placement import devices as _devices

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("TORCHPMAP_NUM_CPU_DEVICES", str(count))
    _devices._local_devices.cache_clear()
    yield _devices.devices()
    monkeypatch.undo()
    _devices._local_devices.cache_clear()


@pytest.fixture(params=[1, 4], ids=["1-device", "4-devices"])
def placement(request, monkeypatch):
    """The CPU devices of a test run twice, on 1 and on 4 devices, whatever
    TORCHPMAP_NUM_CPU_DEVICES the suite runs with: one device is the oracle."""
    yield from _cpu_devices(monkeypatch, request.param)


@pytest.fixture
def four_devices(monkeypatch):
    """Four CPU devices for this test, whatever TORCHPMAP_NUM_CPU_DEVICES the run uses."""
    yield from _cpu_devices(monkeypatch, 4)
