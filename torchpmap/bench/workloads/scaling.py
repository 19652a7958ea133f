"""(d) Scaling: the same small per-instance work on axes of 1, 8, 64 and 512 instances.

Times are per instance: a flat torchpmap column means a flat per-instance overhead. The
per-instance work is ``y = tanh(x @ w)`` on a 16 x 32 block, centred with ``pmean``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import torchpmap
from torchpmap.bench import frameworks as fw
from torchpmap.bench.core import NA, Case, Cell, Config, Workload

SIZES = (1, 8, 64, 512)
AXIS = "i"


def instance_fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    y = torch.tanh(x @ w)
    return y - torchpmap.pmean(y, AXIS)


def batched_fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    y = torch.tanh(x @ w)
    return y - y.mean(0, keepdim=True)


def build(cfg: Config) -> list[Case]:
    return [_case(cfg, n) for n in SIZES]


def _case(cfg: Config, n: int) -> Case:
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(n, 16, 32, generator=gen).to(cfg.device)
    w = (torch.randn(32, 32, generator=gen) / 32**0.5).to(cfg.device)
    tp = torchpmap.pmap(instance_fn, axis_name=AXIS, in_axes=(0, None), devices=fw.torchpmap_devices())
    columns: dict[str, Cell] = {
        "torchpmap": fw.torch_impl(cfg, tp, x, w),
        "torch": fw.torch_impl(cfg, batched_fn, x, w),
        "jax.pmap": _jax_pmap(n, x, w),
        "jax.vmap": _jax_vmap(x, w),
    }
    if not cfg.quick:  # compiling costs seconds; CI's quick run leaves it to mlp_step and dispatch
        jit = torchpmap.pmap(instance_fn, axis_name=AXIS, in_axes=(0, None), devices=fw.torchpmap_devices(), jit=True)
        columns["torchpmap.jit"] = fw.torch_impl(cfg, jit, x, w)
    return Case("scaling", f"scaling[n={n}]", "instance", columns, per=n, rtol=1e-4, atol=1e-5)


def _jax_instance_fn(jax: Any) -> Callable[[Any, Any], Any]:
    def fn(x: Any, w: Any) -> Any:
        y = jax.numpy.tanh(x @ w)
        return y - jax.lax.pmean(y, AXIS)

    return fn


def _jax_pmap(n: int, x: torch.Tensor, w: torch.Tensor) -> Cell:
    jax = fw.jax_pmap_or_na(n)
    if isinstance(jax, NA):
        return jax
    args = fw.shard_for_pmap(n, x, fw.replicate(n, w))  # w replicated, JAX's idiom
    step = jax.pmap(_jax_instance_fn(jax), axis_name=AXIS, devices=jax.local_devices()[:n])
    return fw.jax_impl(step, *args)


def _jax_vmap(x: torch.Tensor, w: torch.Tensor) -> Cell:
    jax = fw.jax_or_na()
    if isinstance(jax, NA):
        return jax
    step = jax.vmap(_jax_instance_fn(jax), axis_name=AXIS, in_axes=(0, None))
    return fw.jax_impl(jax.jit(step), *fw.to_jax((x, w)))


WORKLOAD = Workload("scaling", "axis size 1, 8, 64, 512, fixed small work per instance (time per instance)", build)
