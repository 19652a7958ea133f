"""Settings: every environment value and every assignment is validated, with an error that
names the variable and what it accepts."""
import os
import subprocess
import sys

import pytest
import torch

import torchpmap as tp


def _import_with(**env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", "import torchpmap as tp; print(tp.config)"],
        capture_output=True, text=True, timeout=120, env={**os.environ, **env},
    )


#: Bad values of every variable torchpmap reads (the device count has its own test in test_multi_device).
BAD = {
    "TORCHPMAP_COLLECTIVE_TIMEOUT": ("abc", "a number > 0 (seconds) below 9223372036"),
    "TORCHPMAP_DISABLE_VECTORIZATION": ("maybe", "1/0, true/false, yes/no"),
    "TORCHPMAP_BITWISE_PLACEMENT": ("2", "1/0, true/false, yes/no"),
    "TORCHPMAP_JIT_CACHE_SIZE": ("0", "an integer >= 1"),
    "TORCHPMAP_WORKER_IDLE_TIMEOUT": ("nan", "a number > 0 (seconds)"),
    "TORCHPMAP_ALL_REDUCE_BYTES": ("1.5", "an integer >= 1"),
    "TORCHPMAP_BUCKET_BYTES": ("inf", "an integer >= 1"),
    "TORCHPMAP_HEARTBEAT_INTERVAL": ("abc", "a number > 0 (seconds) below 9223372036"),
}

_USE_EACH = """
import datetime, os, torch, torchpmap as tp, torchpmap.distributed as tpd
print("imported")
for name in tp._state.config._SETTINGS:
    try:
        print(name, getattr(tp.config, name))
    except ValueError as e:
        print(name, "raised:", e)
os.environ.update(WORLD_SIZE="2", RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="1")  # raises before joining
try:
    tpd.initialize(timeout=datetime.timedelta(seconds=5))
except ValueError as e:
    print("initialize raised:", e)
"""


def test_bad_environment_values_never_break_the_import_and_name_the_variable_where_used():
    env = {**os.environ, **{variable: value for variable, (value, _) in BAD.items()}}
    proc = subprocess.run([sys.executable, "-c", _USE_EACH], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0 and "imported" in proc.stdout, proc.stderr
    said = {line.split(" ", 1)[0]: line for line in proc.stdout.splitlines()}
    for name, (variable, *_) in tp._state.config._SETTINGS.items():
        value, accepts = BAD[variable]
        assert f"raised: environment variable {variable}={value!r} is not valid: it must be" in said[name], said[name]
        assert accepts in said[name], said[name]
    value, accepts = BAD["TORCHPMAP_HEARTBEAT_INTERVAL"]
    assert f"initialize raised: environment variable TORCHPMAP_HEARTBEAT_INTERVAL={value!r}" in proc.stdout, proc.stdout
    assert accepts in said["initialize"]


@pytest.mark.parametrize("value", ["inf", "1e10", "9223372037"])
def test_a_timeout_the_platform_cannot_wait_is_refused_naming_the_variable(four_devices, monkeypatch, value):
    """Such a timeout used to pass validation, then every collective on several devices failed
    with OverflowError ("timestamp out of range for platform time_t")."""
    monkeypatch.delattr(tp.config, "collective_timeout")  # read from the environment again at its next use
    monkeypatch.setenv("TORCHPMAP_COLLECTIVE_TIMEOUT", value)
    psum = tp.pmap(lambda v: tp.psum(v, "i"), "i", devices=four_devices)
    # never waits
    assert tp.pmap(lambda v: tp.psum(v, "i"), "i", devices=four_devices[:1])(torch.ones(4)).tolist() == [4.0] * 4
    with pytest.raises(ValueError, match=rf"TORCHPMAP_COLLECTIVE_TIMEOUT={value!r} is not valid: .*below 9223372036"):
        psum(torch.ones(4))
    with pytest.raises(ValueError, match=r"collective_timeout must be a number > 0 \(seconds\) below 9223372036"):
        tp.config.collective_timeout = float(value)
    monkeypatch.setenv("TORCHPMAP_COLLECTIVE_TIMEOUT", "9e9")  # the longest waits that work, work
    assert psum(torch.ones(4)).tolist() == [4.0] * 4
    tp.config.collective_timeout = 9.2e9
    assert psum(torch.ones(4)).tolist() == [4.0] * 4


@pytest.mark.parametrize("name", ["collective_timeout", "worker_idle_timeout"])  # the counts refused them already
def test_booleans_are_refused_where_numbers_are_expected(monkeypatch, name):
    before = getattr(tp.config, name)
    for flag in (True, False):
        with pytest.raises(ValueError, match=rf"torchpmap.config.{name} must be .*, got {flag}"):
            setattr(tp.config, name, flag)
    assert getattr(tp.config, name) == before


def test_booleans_accept_the_usual_spellings(monkeypatch):
    spellings = {
        "1": True,
        "true": True,
        "YES": True,
        "on": True,
        "0": False,
        "false": False,
        "no": False,
        "Off": False,
    }
    for value, expected in spellings.items():
        monkeypatch.setenv("TORCHPMAP_DISABLE_VECTORIZATION", value)
        assert tp._state.config.Config().disable_vectorization is expected, value
    proc = _import_with(TORCHPMAP_DISABLE_VECTORIZATION="true")  # the import reads it (once, end to end)
    assert proc.returncode == 0 and "disable_vectorization=True" in proc.stdout, proc.stderr


def test_assignments_are_validated(monkeypatch):
    with pytest.raises(ValueError, match=r"collective_timeout must be a number > 0 \(seconds\) below \d+ .*, got -1"):
        tp.config.collective_timeout = -1
    with pytest.raises(ValueError, match=r"jit_cache_size must be an integer >= 1, got 2.5"):
        tp.config.update("jit_cache_size", 2.5)
    with pytest.raises(AttributeError, match="no setting 'colective_timeout'"):
        tp.config.colective_timeout = 3
    monkeypatch.setattr(tp.config, "collective_timeout", "7")
    assert tp.config.collective_timeout == 7.0
