"""Adapters for the frameworks of the columns: torch (with CUDA sync), torchpmap, JAX."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import numpy as np
import torch

import torchpmap
from torchpmap.bench.core import NA, Config, Impl

JAX_DEVICES = 8
_XLA_FLAG = f"--xla_force_host_platform_device_count={JAX_DEVICES}"


def configure_environment() -> None:
    """Sets the environment the columns need, for a process that runs the suite.

    ``TORCHPMAP_NUM_CPU_DEVICES=2`` gives the multi-device workload its devices once
    torchpmap supports it; the other workloads pin the one-device path (see
    :func:`torchpmap_devices`). Values already set by the user win.
    """
    configure_jax_environment()
    os.environ.setdefault("TORCHPMAP_NUM_CPU_DEVICES", "2")


def configure_jax_environment() -> None:
    """JAX on the CPU with 8 forced host devices; works only before JAX is imported."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {_XLA_FLAG}".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


# --------------------------------------------------------------------------- torch


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def torch_impl(cfg: Config, fn: Callable[..., Any], *args: Any, result: Callable[[Any], Any] | None = None) -> Impl:
    """``fn(*args)`` followed by a device synchronization."""
    sync = cfg.sync

    def call() -> Any:
        out = fn(*args)
        sync()
        return out

    return Impl(call) if result is None else Impl(call, result)


def torchpmap_devices() -> list[torchpmap.Device] | None:
    """The one-device path: None (the default) when torchpmap has one device, else its first."""
    devs = torchpmap.devices()
    return None if len(devs) == 1 else devs[:1]


def torchpmap_cpu_devices() -> list[torchpmap.Device]:
    return [d for d in torchpmap.devices() if d.platform == "cpu"]


# --------------------------------------------------------------------------- JAX


_jax_disabled: list[str] = []


def disable_jax(reason: str) -> None:
    """Every JAX column of this process becomes "not applicable", for ``reason``."""
    _jax_disabled.append(reason)
    _import_jax.cache_clear()


@functools.lru_cache(maxsize=1)
def _import_jax() -> ModuleType | NA:
    if _jax_disabled:
        return NA(f"jax {_jax_disabled[-1]}")
    configure_jax_environment()
    try:
        import jax
    except ImportError as exc:
        return NA(f"jax not installed ({exc})")
    return jax


def jax_or_na() -> ModuleType | NA:
    """The ``jax`` module, or why it cannot be used."""
    return _import_jax()


def jax_pmap_or_na(size: int) -> ModuleType | NA:
    """``jax``, if ``jax.pmap`` can map an axis of ``size`` on its devices."""
    jax = jax_or_na()
    if isinstance(jax, NA):
        return jax
    count = jax.local_device_count()
    if size > count:
        hint = "" if count >= JAX_DEVICES else " (jax was imported before XLA_FLAGS was set)"
        return NA(f"jax.pmap needs axis size <= device count; {size} > {count}{hint}")
    return jax


def jax_impl(fn: Callable[..., Any], *args: Any, result: Callable[[Any], Any] | None = None) -> Impl:
    """``fn(*args)`` followed by ``jax.block_until_ready``."""
    jax = jax_or_na()
    assert not isinstance(jax, NA)

    def call() -> Any:
        return jax.block_until_ready(fn(*args))

    return Impl(call) if result is None else Impl(call, result)


def to_jax(tree: Any) -> Any:
    """Torch tensors of a dict/list/tuple tree as JAX arrays on JAX's default device."""
    jax = jax_or_na()
    assert not isinstance(jax, NA)
    return jax.tree_util.tree_map(lambda t: jax.numpy.asarray(_np(t)), tree)


def shard_for_pmap(size: int, *trees: Any) -> Sequence[Any]:
    """Places the leading axis of every leaf on JAX's devices, as ``jax.pmap`` outputs
    are placed, so that timed calls do not include host-to-device copies."""
    jax = jax_or_na()
    assert not isinstance(jax, NA)
    return jax.pmap(lambda *xs: xs, devices=jax.local_devices()[:size])(*to_jax(trees))


def replicate(size: int, tree: Any) -> Any:
    """Every tensor of a tensor or dict of tensors with a new leading axis of ``size``
    copies, as numpy arrays (to be sharded)."""
    if isinstance(tree, dict):
        return {k: replicate(size, v) for k, v in tree.items()}
    return np.broadcast_to(_np(tree), (size, *tree.shape)).copy()


def first(tree: Any) -> Any:
    """The first instance of every leaf of a replicated output, as numpy arrays."""
    if isinstance(tree, dict):
        return {k: first(v) for k, v in tree.items()}
    return _np(tree)[0]


def _np(t: Any) -> np.ndarray:
    return t.detach().cpu().numpy() if isinstance(t, torch.Tensor) else np.asarray(t)
