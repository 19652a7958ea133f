"""Data-parallel gradient step: per-instance grads averaged with pmean (seed 001, second program).

The JAX original::

    p_update_step = pmap(parallel_update_step, axis_name='data_parallel_axis')
    new_params = p_update_step(params, sharded_batch)

Note on the seed: as printed, it maps *every* argument over axis 0 (the default
in_axes), including the scalar params, so it fails in JAX (an IndexError in JAX 0.10)
and in torchpmap (a ValueError naming argument 'params' and its rank 0). The params are
meant to be the same on every device, so they are passed with in_axes None:
``in_axes=(None, 0)``. That is the only change.

Run: python examples/seed_gradient_step.py
"""
import torch
from torch.func import grad

import torchpmap


# Dummy loss function (mean squared error of a linear model).
def loss_fn(params, local_batch):
    predictions = params["w"] * local_batch["x"] + params["b"]
    error = predictions - local_batch["y"]
    return torch.mean(error**2)


# Gradients of this instance's shard (jax.grad -> torch.func.grad; both differentiate
# with respect to the first argument and return a dict shaped like `params`).
def compute_gradients(params, local_batch):
    return grad(loss_fn)(params, local_batch)


def parallel_update_step(params, sharded_batch):
    # Local gradients on this instance's shard of the batch.
    local_grads = compute_gradients(params, sharded_batch)
    # Average the gradients over the axis named 'data_parallel_axis' (pmean works on
    # the whole dict, leaf by leaf).
    avg_grads = torchpmap.pmean(local_grads, axis_name="data_parallel_axis")
    # Plain gradient descent.
    learning_rate = 0.01
    new_params = {
        "w": params["w"] - learning_rate * avg_grads["w"],
        "b": params["b"] - learning_rate * avg_grads["b"],
    }
    return new_params


def as_numbers(tree):
    """{'w': tensor(1.), ...} -> {'w': 1.0, ...}, rounded past float32 noise, for printing."""
    return {k: round(v.item(), 6) for k, v in tree.items()}


def make_batch(n):
    # Shape (n, batch_per_device=4, 1): leading axis = one shard per instance.
    xs = torch.arange(n * 4, dtype=torch.float32).reshape(n, 4, 1)
    ys = (xs * 2.0) + 0.5  # true w = 2.0, b = 0.5
    return {"x": xs, "y": ys}


n_devices = torchpmap.local_device_count()

# Parameters, the same for every instance.
params = {"w": torch.ones(()), "b": torch.zeros(())}
sharded_batch = make_batch(n_devices)

# params: in_axes None (broadcast); sharded_batch: every leaf mapped over axis 0.
p_update_step = torchpmap.pmap(parallel_update_step, axis_name="data_parallel_axis", in_axes=(None, 0))

new_params = p_update_step(params, sharded_batch)

# new_params['w'] has shape (n_devices,): the same value on every instance. Take
# instance 0's copy (jax.tree_map(lambda x: x[0], new_params) in JAX).
print("Original params:", as_numbers(params))
print("Updated params (on device 0):", as_numbers({k: v[0] for k, v in new_params.items()}))

# ---------------------------------------------------------------------------------
# Beyond JAX: JAX needs one device per shard. A torchpmap device can run several shards,
# vectorized (the device count must divide the number of shards). Here all 4 shards run
# on the first device alone; the result is what JAX prints on a 4-device machine:
# w = 2.625, b = 0.16.
p_update_step_one_device = torchpmap.pmap(
    parallel_update_step, axis_name="data_parallel_axis", in_axes=(None, 0), devices=torchpmap.local_devices()[:1]
)
new_params4 = p_update_step_one_device(params, make_batch(4))
print("4 instances, updated params (instance 0):", as_numbers({k: v[0] for k, v in new_params4.items()}))
print("4 instances, same on every instance:", all(bool((v == v[0]).all()) for v in new_params4.values()))
