"""The benchmark suite: ``python -m torchpmap.bench [--quick] [--only NAME]``.

Each workload runs its columns side by side in one process: torchpmap; plain PyTorch
doing the same math as one batched computation (the practical limit); ``jax.pmap`` on 8
forced CPU host devices; and ``jax.jit(jax.vmap(..., axis_name=...))``. The timing
method is described in :mod:`torchpmap.bench.timing`. Results are printed as a table
and written as JSON (``--json``) and as a PNG chart (``--png``).
"""

from torchpmap.bench.cli import main

__all__ = ["main"]
