"""Named axes: a psum over the axis called 'devices' (seed 001, first program).

The JAX original::

    parallel_computation = pmap(scaled_sum, axis_name='devices')
    result = parallel_computation(jnp.arange(n_devices, dtype=jnp.float32))

Run: python examples/seed_scaled_sum.py
"""
import torch

import torchpmap


def scaled_sum(x):
    # x is this instance's element of `data` (a 0-d tensor).
    scaled_x = x * 2.0
    # Sum over all instances of the axis named 'devices'; every instance gets the total.
    total_sum = torchpmap.psum(scaled_x, axis_name="devices")
    return total_sum


# Number of devices (jax.local_device_count() in JAX).
n_devices = torchpmap.local_device_count()
print(f"Using {n_devices} devices.")

# One element per device, as in the JAX program.
data = torch.arange(n_devices, dtype=torch.float32)

# pmap binds the name 'devices' to the mapped axis (axis 0 of `data`).
parallel_computation = torchpmap.pmap(scaled_sum, axis_name="devices")

result = parallel_computation(data)
print("Input data:", data.cpu().numpy())
# Every instance holds sum(data * 2): e.g. [0., 1., 2., 3.] -> [12. 12. 12. 12.].
print("Result (same on all devices):", result.cpu().numpy())

expected_sum = torch.sum(data * 2.0)
print("Expected sum:", expected_sum.item())
assert torch.allclose(result[0], expected_sum)

# ---------------------------------------------------------------------------------
# Beyond JAX: JAX requires len(data) <= the number of devices. torchpmap does not: a
# device can run several instances, vectorized (the device count must divide the axis
# size). Here all 4 instances run on the first device alone, which gives the numbers
# JAX prints on a 4-device machine, whatever this machine has.
on_one_device = torchpmap.pmap(scaled_sum, axis_name="devices", devices=torchpmap.local_devices()[:1])
data4 = torch.arange(4, dtype=torch.float32)
result4 = on_one_device(data4)
print("4 instances, input data:", data4.cpu().numpy())
print("4 instances, result:", result4.cpu().numpy())
assert torch.allclose(result4, torch.full((4,), 12.0))
