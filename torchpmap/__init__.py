"""torchpmap: JAX-style ``pmap`` for PyTorch, with named-axis collectives."""
from torchpmap import checkpoint, data, distributed
from torchpmap._collectives.public import (
    all_gather,
    all_to_all,
    axis_index,
    axis_size,
    pmax,
    pmean,
    pmin,
    ppermute,
    pshuffle,
    psum,
    psum_scatter,
    pswapaxes,
    pvary,
)
from torchpmap._engines.engine_warnings import JitFallbackWarning, JitRecompileWarning, VectorizationFallbackWarning
from torchpmap._frontend.api import pmap, shard_map, vmap
from torchpmap._placement.devices import (
    Device,
    device_count,
    devices,
    local_device_count,
    local_devices,
    process_count,
    process_index,
)
from torchpmap._placement.mesh import AbstractMesh, Mesh, make_mesh
from torchpmap._placement.partition_spec import P, PartitionSpec
from torchpmap._placement.sharded import ShardedTensor, ShardedView
from torchpmap._state.config import config, disable_vectorization
from torchpmap.data import ShardedLoader
from torchpmap.training import (
    data_parallel_step,
    prefetch_to_device,
    replicate,
    shard,
    unreplicate,
    unshard,
)

__version__ = "0.1.0"

__all__ = [
    "pmap",
    "vmap",
    "shard_map",
    "psum",
    "pmean",
    "pmax",
    "pmin",
    "all_gather",
    "psum_scatter",
    "ppermute",
    "pshuffle",
    "pswapaxes",
    "pvary",
    "all_to_all",
    "axis_index",
    "axis_size",
    "Mesh",
    "AbstractMesh",
    "make_mesh",
    "PartitionSpec",
    "P",
    "ShardedTensor",
    "ShardedView",
    "config",
    "disable_vectorization",
    "JitFallbackWarning",
    "JitRecompileWarning",
    "VectorizationFallbackWarning",
    "Device",
    "devices",
    "local_devices",
    "device_count",
    "local_device_count",
    "process_index",
    "process_count",
    "replicate",
    "unreplicate",
    "shard",
    "unshard",
    "prefetch_to_device",
    "data_parallel_step",
    "ShardedLoader",
    "distributed",
    "data",
    "checkpoint",
]
