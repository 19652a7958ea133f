"""in_axes / out_axes: scale a batch by a broadcast scalar (seed 000).

The JAX original::

    pmapped_scale = jax.pmap(scale, in_axes=(0, None), out_axes=0)
    result = pmapped_scale(data, scalar)

Axis size versus device count: the tutorial claims that on 2 devices each device gets
a (2, 3) chunk. That is not what pmap does: pmap maps axis 0 one *slice* per instance,
so ``scale`` sees ``x`` of shape (3,), and JAX needs at least 4 devices here (on 1 or 2
devices JAX 0.10 raises). torchpmap also runs the 4 instances on fewer devices, as long
as the device count divides 4: each device then runs several instances, vectorized (1
device: all 4; 2 devices: 2 each). The printed numbers are JAX's on 4 or more devices.

Run: python examples/seed_scale.py
"""
import torch

import torchpmap


# The per-instance function: x is one row of `data`, shape (3,); k is the whole scalar.
def scale(x, k):
    return x * k


# Input data: 4 items, feature size 3.
data = torch.arange(12, dtype=torch.float32).reshape(4, 3)
# Scalar factor (jnp.float32(10.0) in JAX).
scalar = torch.tensor(10.0, dtype=torch.float32)

# Map `data` (x) along axis 0, pass `scalar` (k) unchanged to every instance (None),
# stack the per-instance results along axis 0.
pmapped_scale = torchpmap.pmap(scale, in_axes=(0, None), out_axes=0)

result = pmapped_scale(data, scalar)

# Shapes are printed as tuples and arrays through numpy so that the text matches JAX's.
print("Number of devices:", torchpmap.local_device_count())
print("Original data shape:", tuple(data.shape))
print("Scalar value:", scalar.item())
print("Pmapped result shape:", tuple(result.shape))
print("Pmapped result:\n", result.cpu().numpy())
# Expected output (the device count is whatever this machine has):
# Original data shape: (4, 3)
# Scalar value: 10.0
# Pmapped result shape: (4, 3)
# Pmapped result:
#  [[  0.  10.  20.]
#  [ 30.  40.  50.]
#  [ 60.  70.  80.]
#  [ 90. 100. 110.]]
