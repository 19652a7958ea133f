"""Data parallelism: a linear `predict` with broadcast params and sharded data (seed 004).

The JAX original::

    parallel_predict = jax.pmap(predict, in_axes=(None, 0))
    sharded_predictions = parallel_predict(params, sharded_data)

Randomness: JAX draws params and data from jax.random.PRNGKey(0) (the same key for all
three, so w, b and the data are correlated); here they are successive draws after
torch.manual_seed(0). The values therefore differ from JAX's, the shapes do not.

Run: python examples/seed_predict.py
"""
import torch

import torchpmap

num_devices = torchpmap.local_device_count()
print(f"Number of devices: {num_devices}")


# A simple linear layer, written for one shard of the batch: inputs (batch_per_device, 10).
def predict(params, inputs):
    return torch.matmul(inputs, params["w"]) + params["b"]


torch.manual_seed(0)
input_dim = 10
output_dim = 5
# Parameters: passed to every instance unchanged (in_axes None below).
params = {
    "w": torch.randn(input_dim, output_dim),
    "b": torch.randn(output_dim),
}

global_batch_size = 32 * num_devices
dummy_data = torch.randn(global_batch_size, input_dim)
print(f"Parameter shapes: w={tuple(params['w'].shape)}, b={tuple(params['b'].shape)}")
print(f"Global data batch shape: {tuple(dummy_data.shape)}")

# Reshape for pmap: (num_devices, batch_per_device, features).
batch_per_device = global_batch_size // num_devices
sharded_data = dummy_data.reshape(num_devices, batch_per_device, input_dim)
print(f"Sharded data shape: {tuple(sharded_data.shape)}")

# params broadcast (None), sharded_data split along axis 0 (0).
parallel_predict = torchpmap.pmap(predict, in_axes=(None, 0))
sharded_predictions = parallel_predict(params, sharded_data)
# No block_until_ready() needed: a torch result is ready once the call returns (on CUDA,
# torch.cuda.synchronize() would wait for the device).
print(f"Output predictions shape: {tuple(sharded_predictions.shape)}")

# Not in the seed: the sharded predictions equal the unsharded ones, and a value to check.
unsharded = predict(params, dummy_data).reshape(num_devices, batch_per_device, output_dim)
print("Matches unsharded predict:", torch.allclose(sharded_predictions, unsharded, atol=1e-5))
print("First prediction (device 0, example 0):", sharded_predictions[0, 0].cpu().numpy())

# ---------------------------------------------------------------------------------
# Beyond JAX: JAX needs the leading axis to be at most the device count. A torchpmap
# device can run several instances, vectorized (the device count must divide the axis
# size). Here the same global batch, as 8 shards of global_batch_size // 8 examples,
# runs on the first device alone.
parallel_predict_one_device = torchpmap.pmap(predict, in_axes=(None, 0), devices=torchpmap.local_devices()[:1])
sharded_8 = dummy_data.reshape(8, global_batch_size // 8, input_dim)
predictions_8 = parallel_predict_one_device(params, sharded_8)
print(f"8 instances, output predictions shape: {tuple(predictions_8.shape)}")
print(
    "8 instances, matches unsharded predict:",
    torch.allclose(predictions_8.reshape(global_batch_size, output_dim), predict(params, dummy_data), atol=1e-5),
)
