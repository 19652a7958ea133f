"""Settings: every environment value and every assignment is validated, with an error that
names the variable and what it accepts."""
import os
import subprocess
import sys

import pytest

import torchpmap as tp


def _import_with(**env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", "import torchpmap as tp; print(tp.config)"],
        capture_output=True, text=True, timeout=120, env={**os.environ, **env},
    )


@pytest.mark.parametrize(
    "variable, value, accepts",
    [
        ("TORCHPMAP_COLLECTIVE_TIMEOUT", "abc", "a number > 0"),
        ("TORCHPMAP_COLLECTIVE_TIMEOUT", "-3", "a number > 0"),
        ("TORCHPMAP_DISABLE_VECTORIZATION", "maybe", "1/0, true/false, yes/no"),
        ("TORCHPMAP_JIT_CACHE_SIZE", "0", "an integer >= 1"),
        ("TORCHPMAP_WORKER_IDLE_TIMEOUT", "nan", "a number > 0"),
    ],
)
def test_a_bad_environment_value_names_the_variable(variable, value, accepts):
    proc = _import_with(**{variable: value})
    assert proc.returncode != 0
    assert f"{variable}={value!r} is not valid: it must be" in proc.stderr and accepts in proc.stderr, proc.stderr


def test_booleans_accept_the_usual_spellings(monkeypatch):
    spellings = {"1": True, "true": True, "YES": True, "on": True, "0": False, "false": False, "no": False, "Off": False}
    for value, expected in spellings.items():
        monkeypatch.setenv("TORCHPMAP_DISABLE_VECTORIZATION", value)
        assert tp._state.config.Config().disable_vectorization is expected, value
    proc = _import_with(TORCHPMAP_DISABLE_VECTORIZATION="true")  # the import reads it (once, end to end)
    assert proc.returncode == 0 and "disable_vectorization=True" in proc.stdout, proc.stderr


def test_assignments_are_validated(monkeypatch):
    with pytest.raises(ValueError, match=r"collective_timeout must be a number > 0 \(seconds\), got -1"):
        tp.config.collective_timeout = -1
    with pytest.raises(ValueError, match=r"jit_cache_size must be an integer >= 1, got 2.5"):
        tp.config.update("jit_cache_size", 2.5)
    with pytest.raises(AttributeError, match="no setting 'colective_timeout'"):
        tp.config.colective_timeout = 3
    monkeypatch.setattr(tp.config, "collective_timeout", "7")
    assert tp.config.collective_timeout == 7.0
