"""Naming the mapped axis: a (4, 5) array, one row per instance (seed 003).

The JAX original::

    data = jnp.arange(4 * 5).reshape((4, 5))
    parallel_computation = jax.pmap(simple_computation, axis_name='data_parallel_axis', in_axes=0)

Axis size versus device count: the seed assumes 4 devices; in JAX the axis size (4) may
not exceed the device count, so on 1 or 2 devices it raises. torchpmap also runs the 4
instances on fewer devices when their count divides 4 (1 device: all 4 vectorized; 2
devices: 2 each), so this prints JAX's 4-device numbers on 1, 2 or at least 4 devices.

Run: python examples/seed_named_axis.py
"""
import torch

import torchpmap


def simple_computation(x):
    # x is one row of `data`, shape (5,).
    return x * 2


data = torch.arange(4 * 5).reshape(4, 5)  # shape (4, 5): one row per instance

# 'data_parallel_axis' names the mapped axis; collectives inside simple_computation
# could address it, e.g. torchpmap.psum(x, axis_name='data_parallel_axis').
parallel_computation = torchpmap.pmap(simple_computation, axis_name="data_parallel_axis", in_axes=0)

result = parallel_computation(data)

print(tuple(result.shape))  # (4, 5): shape is maintained
print(torchpmap.devices())  # the devices used
# Row k was computed by instance k:
# [[ 0  2  4  6  8]
#  [10 12 14 16 18]
#  [20 22 24 26 28]
#  [30 32 34 36 38]]
print(result.cpu().numpy())

# The name at work: every instance's row summed over the named axis (not in the seed).
column_totals = torchpmap.pmap(
    lambda x: torchpmap.psum(x * 2, axis_name="data_parallel_axis"), axis_name="data_parallel_axis"
)(data)
print("psum over 'data_parallel_axis', instance 0:", column_totals[0].cpu().numpy())
