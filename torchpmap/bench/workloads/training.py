"""(b) A data-parallel MLP training step: 8 instances of 64 samples, grads averaged with pmean."""

from __future__ import annotations

import torch

from torchpmap.bench import frameworks as fw
from torchpmap.bench.core import NA, Case, Cell, Config, Workload
from torchpmap.bench.workloads import _mlp

N = _mlp.INSTANCES


def build(cfg: Config) -> list[Case]:
    params = _mlp.init_params(cfg.device)
    x, y = _mlp.make_data(cfg.device)
    columns: dict[str, Cell] = {
        "torchpmap": fw.torch_impl(cfg, _mlp.torchpmap_step(fw.torchpmap_devices()), params, x, y),
        "torch": fw.torch_impl(cfg, _mlp.plain_step, params, *_mlp.flatten_batch(x, y)),
        "torch.compile": fw.torch_impl(cfg, torch.compile(_mlp.plain_step), params, *_mlp.flatten_batch(x, y)),
        "jax.pmap": jax_pmap_step(params, x, y),
        "jax.vmap": jax_vmap_step(params, x, y),
        "torchpmap.jit": fw.torch_impl(cfg, _mlp.torchpmap_step(fw.torchpmap_devices(), jit=True), params, x, y),
    }
    return [Case("mlp_step", "mlp_step", "step", columns, rtol=1e-4, atol=1e-5)]


def jax_pmap_step(params: _mlp.Params, x: torch.Tensor, y: torch.Tensor) -> Cell:
    """JAX's idiom: params replicated on every device, in and out."""
    jax = fw.jax_pmap_or_na(N)
    if isinstance(jax, NA):
        return jax
    step = jax.pmap(_mlp.jax_instance_step(jax), axis_name=_mlp.AXIS)
    args = fw.shard_for_pmap(N, fw.replicate(N, params), x, y)
    return fw.jax_impl(step, *args, result=fw.first)


def jax_vmap_step(params: _mlp.Params, x: torch.Tensor, y: torch.Tensor) -> Cell:
    jax = fw.jax_or_na()
    if isinstance(jax, NA):
        return jax
    step = jax.vmap(_mlp.jax_instance_step(jax), in_axes=(None, 0, 0), out_axes=None, axis_name=_mlp.AXIS)
    return fw.jax_impl(jax.jit(step), *fw.to_jax((params, x, y)))


WORKLOAD = Workload(
    "mlp_step",
    "data-parallel MLP step (64-256-256-10, 8 x 64 samples): per-instance grads, pmean, SGD",
    build,
)
