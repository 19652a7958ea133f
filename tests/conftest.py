"""Shared test set-up: JAX on CPU with 8 host devices, for the differential tests."""
import os

# Must be set before jax is imported anywhere.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
