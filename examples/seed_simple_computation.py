"""A first pmap: x * 2 on an (n_devices, 3) array (seed 002).

The JAX original::

    pmapped_computation = jax.pmap(simple_computation)
    input_data = jnp.arange(num_devices * 3).reshape((num_devices, 3))
    result = pmapped_computation(input_data)

Run: python examples/seed_simple_computation.py
"""
import torch

import torchpmap

# The devices torchpmap can run on (jax.devices() in JAX).
print(f"Available torchpmap devices: {torchpmap.devices()}")
num_devices = len(torchpmap.devices())
print(f"Number of devices: {num_devices}")


# The per-instance function: x is one row of the input, shape (3,).
def simple_computation(x):
    return x * 2


pmapped_computation = torchpmap.pmap(simple_computation)

# Leading axis = one row per device, as JAX requires. (torchpmap also accepts more rows
# than devices; see the end of this file.)
input_data = torch.arange(num_devices * 3).reshape(num_devices, 3)
print(f"Input data shape: {tuple(input_data.shape)}")

result = pmapped_computation(input_data)
# Arrays print through numpy so that the text matches JAX's.
print(f"Output result:\n{result.cpu().numpy()}")
# JAX returns a jax.Array sharded over the devices. torchpmap returns a plain
# torch.Tensor when one device computed everything, and a torchpmap.ShardedTensor (one
# shard per device, with .devices() like a jax.Array) when several did.
print(f"Output type: {type(result)}")
print(f"Output shape: {tuple(result.shape)}")
if isinstance(result, torchpmap.ShardedTensor):
    print(f"Output devices: {result.devices()}")
else:  # one device computed everything: the first one (printed like the shards' devices)
    print(f"Output devices: {torchpmap.devices()[:1]}")

# ---------------------------------------------------------------------------------
# Beyond JAX: the seed's except-branch warns that pmap "requires the size of the mapped
# axis to be equal to the number of available devices". Not in torchpmap: a device can
# run several instances, vectorized (the device count must divide the axis size). Here
# 4 rows run on the first device alone.
on_one_device = torchpmap.pmap(simple_computation, devices=torchpmap.local_devices()[:1])
input_4 = torch.arange(4 * 3).reshape(4, 3)
result_4 = on_one_device(input_4)
print(f"4 instances, output result:\n{result_4.cpu().numpy()}")
print(f"4 instances, output shape: {tuple(result_4.shape)}")
