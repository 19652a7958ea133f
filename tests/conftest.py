"""Shared test set-up: JAX on CPU with 8 host devices, for the differential tests."""
import json
import os
from pathlib import Path

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
def autograd_device_thread():
    """Each custom autograd function's backward and each tensor hook runs in an empty
    ``contextvars`` context, as in autograd's CUDA device thread (tests/_autograd_thread.py)."""
    from _autograd_thread import empty_backward_context

    with empty_backward_context():
        yield


if os.environ.get("TORCHPMAP_TEST_BACKWARD_CONTEXT") == "empty":  # the whole run, as on CUDA
    from _autograd_thread import empty_backward_context

    empty_backward_context().__enter__()


@pytest.fixture
def four_devices(monkeypatch):
    """Four CPU devices for this test, whatever TORCHPMAP_NUM_CPU_DEVICES the run uses."""
    yield from _cpu_devices(monkeypatch, 4)


# --------------------------------------------------------------------------- what a pass runs

# A test marked ``same_on_every_placement`` never reads TORCHPMAP_NUM_CPU_DEVICES: it pins
# its devices (the ``placement`` and ``four_devices`` fixtures mark it so by themselves),
# or runs no map at all. The passes that set TORCHPMAP_NUM_CPU_DEVICES above 1 (`make
# test`'s 4-device passes) leave it out: the 1-device pass ran it just the same.
_PINNING_FIXTURES = {"placement", "four_devices"}

# TORCHPMAP_TEST_SHARD=K/N runs the K-th of N parts of what was selected (`make test` runs
# two parts at once, one a core). The parts are fixed, so that each runs its tests in the
# same order every time: whole files (a module's fixtures run once), the heaviest first,
# each to the part with the least weight so far; a run of one file is dealt out test by
# test. A file's weight is the sum of its selected tests' seconds in tests/durations.json
# (every test of 0.5 s or more in CI's 1-device pass, torch 2.11, both halves at once on the
# 2-core machine, 2026-11-30: `pytest --durations=0 --durations-min=0.5`, setup, call and
# teardown summed), a tenth of a second for the rest. Refresh it when the halves drift apart.
_DURATIONS: dict[str, float] = json.loads((Path(__file__).parent / "durations.json").read_text())
_SECONDS_A_TEST = 0.1


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "same_on_every_placement: pins its own devices; passes on more than 1 device leave it out"
    )
    config.addinivalue_line(
        "markers", "also_on_four_devices: slow, but `make test`'s 4-device pass (-m 'not slow') runs it too"
    )


def _devices_from_environment() -> int:
    return int(os.environ.get("TORCHPMAP_NUM_CPU_DEVICES", "1") or "1")


def _pins_its_devices(item: pytest.Item) -> bool:
    fixtures = set(getattr(item, "fixturenames", ()))
    return bool(fixtures & _PINNING_FIXTURES) or item.get_closest_marker("same_on_every_placement") is not None


def _shard() -> tuple[int, int] | None:
    spec = os.environ.get("TORCHPMAP_TEST_SHARD", "")
    if not spec:
        return None
    k, _, n = spec.partition("/")
    part, parts = int(k), int(n)
    if not 1 <= part <= parts:
        raise pytest.UsageError(f"TORCHPMAP_TEST_SHARD={spec!r}: expected K/N with 1 <= K <= N, e.g. 1/2")
    return part, parts


def _part_of_each_file(items: list[pytest.Item], parts: int) -> dict[str, int]:
    """Whole files to parts (0-based), heaviest first, each to the lightest part so far."""
    weight: dict[str, float] = {}
    for item in items:
        path = str(item.path)
        weight[path] = weight.get(path, 0.0) + _DURATIONS.get(item.nodeid, _SECONDS_A_TEST)
    load = [0.0] * parts
    part_of: dict[str, int] = {}
    for path in sorted(weight, key=lambda p: (-weight[p], p)):
        part_of[path] = min(range(parts), key=lambda k: (load[k], k))
        load[part_of[path]] += weight[path]
    return part_of


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected theirs: halves of what runs
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    keep = items
    if _devices_from_environment() > 1:
        keep = [item for item in keep if not _pins_its_devices(item)]
    shard = _shard()
    if shard is not None:
        part, parts = shard
        if len({item.path for item in keep}) == 1:
            keep = keep[part - 1 :: parts]
        else:
            part_of = _part_of_each_file(keep, parts)
            keep = [item for item in keep if part_of[str(item.path)] == part - 1]
    if len(keep) < len(items):
        kept = set(map(id, keep))
        config.hook.pytest_deselected(items=[item for item in items if id(item) not in kept])
        items[:] = keep
