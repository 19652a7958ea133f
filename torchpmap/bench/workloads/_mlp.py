"""The MLP of the training-step workloads: 64-256-256-10, cross-entropy, plain SGD.

Each of 8 instances holds 64 samples. The data-parallel step (per-instance gradients,
averaged with ``pmean``) equals the plain step on the full 512-sample batch with the
mean loss, because the mean of equal-sized means is the overall mean.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

import torchpmap

SIZES = (64, 256, 256, 10)
INSTANCES = 8
SAMPLES = 64
LR = 0.1
AXIS = "batch"

Params = dict[str, torch.Tensor]


def init_params(device: torch.device, seed: int = 0) -> Params:
    gen = torch.Generator().manual_seed(seed)
    params: Params = {}
    for k, (fan_in, fan_out) in enumerate(zip(SIZES[:-1], SIZES[1:]), start=1):
        params[f"w{k}"] = torch.randn(fan_in, fan_out, generator=gen) / fan_in**0.5
        params[f"b{k}"] = torch.randn(fan_out, generator=gen) * 0.1
    return {k: v.to(device) for k, v in params.items()}


def make_data(device: torch.device, instances: int = INSTANCES, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs ``(instances, SAMPLES, 64)`` and integer labels ``(instances, SAMPLES)``."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(instances, SAMPLES, SIZES[0], generator=gen)
    y = torch.randint(0, SIZES[-1], (instances, SAMPLES), generator=gen)
    return x.to(device), y.to(device)


def loss(params: Params, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    h = torch.relu(x @ params["w1"] + params["b1"])
    h = torch.relu(h @ params["w2"] + params["b2"])
    return F.cross_entropy(h @ params["w3"] + params["b3"], y)


def sgd(params: Params, grads: Params) -> Params:
    return {k: p - LR * grads[k] for k, p in params.items()}


def instance_step(params: Params, x: torch.Tensor, y: torch.Tensor) -> Params:
    """One instance's step inside ``pmap``: its own gradient, averaged over the axis."""
    grads = torchpmap.pmean(torch.func.grad(loss)(params, x, y), AXIS)
    return sgd(params, grads)


def torchpmap_step(devices: Any = None, jit: bool = False) -> Callable[[Params, torch.Tensor, torch.Tensor], Params]:
    """The data-parallel step: params broadcast, data mapped, updated params replicated."""
    return torchpmap.pmap(instance_step, axis_name=AXIS, in_axes=(None, 0, 0), out_axes=None, devices=devices, jit=jit)


def plain_step(params: Params, x: torch.Tensor, y: torch.Tensor) -> Params:
    """The same math as one batched computation: ``x`` holds all samples, ``(N, 64)``."""
    return sgd(params, torch.func.grad(loss)(params, x, y))


def flatten_batch(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x.reshape(-1, x.shape[-1]), y.reshape(-1)


# --------------------------------------------------------------------------- JAX


def jax_instance_step(jax: Any) -> Callable[[Any, Any, Any], Any]:
    """The per-instance step written with JAX, for ``jax.pmap`` and ``jax.vmap``."""
    jnp = jax.numpy

    def jax_loss(params: Any, x: Any, y: Any) -> Any:
        h = jax.nn.relu(x @ params["w1"] + params["b1"])
        h = jax.nn.relu(h @ params["w2"] + params["b2"])
        logp = jax.nn.log_softmax(h @ params["w3"] + params["b3"])
        return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))

    def step(params: Any, x: Any, y: Any) -> Any:
        grads = jax.lax.pmean(jax.grad(jax_loss)(params, x, y), AXIS)
        return jax.tree_util.tree_map(lambda p, g: p - LR * g, params, grads)

    return step
