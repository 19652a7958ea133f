"""torchpmap._engines.written_copies: an instance's in-place write into its own slice of
a mapped argument reaches the caller on every placement, also where the engine hands the
function a copy (a ShardedTensor gathered because its shards are not where the instances
run). One device, where the slice is a view of the caller's tensor, is the oracle."""
from __future__ import annotations

import warnings

import pytest
import torch

import torchpmap as tp
from torchpmap import P


def _result_of_a_previous_map() -> torch.Tensor:
    """A pmap's result: a ShardedTensor split along dim 0 on several devices."""
    return tp.pmap(lambda v: v * 1)(torch.arange(16.0).reshape(4, 4))


def _write(v: torch.Tensor) -> torch.Tensor:
    v.add_(100)
    return v.sum()


@pytest.mark.parametrize("in_axes", [0, 1])
@pytest.mark.parametrize("jit", [False, True])
def test_a_write_into_a_gathered_argument_reaches_its_shards(placement, in_axes, jit):
    expected = torch.arange(16.0).reshape(4, 4) + 100
    z = _result_of_a_previous_map()
    with warnings.catch_warnings():  # several devices compile no input writes: they run eagerly
        warnings.simplefilter("ignore", tp.JitFallbackWarning)
        tp.pmap(_write, in_axes=in_axes, jit=jit)(z)
    torch.testing.assert_close(torch.as_tensor(z), expected)


def test_a_write_on_one_device_into_a_result_split_over_several(four_devices):
    z = _result_of_a_previous_map()
    assert isinstance(z, tp.ShardedTensor) and len(z.shards) == 4
    tp.pmap(_write, in_axes=1, devices=four_devices[:1])(z)
    torch.testing.assert_close(torch.as_tensor(z), torch.arange(16.0).reshape(4, 4) + 100)


@pytest.mark.parametrize("write", [False, True])
def test_a_gathered_argument_under_inference_mode(placement, write):
    """A previous map's result taken along another axis under ``torch.inference_mode``
    (an evaluation loop): the gathered copy was an inference tensor, whose version counter
    cannot be read, and every call on several devices raised; a write into it is seen."""
    with torch.inference_mode():
        z = _result_of_a_previous_map()
        got = tp.pmap(_write if write else (lambda v: v.sum()), in_axes=1)(z)
    torch.testing.assert_close(torch.as_tensor(got), torch.arange(16.0).reshape(4, 4).sum(0) + 400 * write)
    torch.testing.assert_close(torch.as_tensor(z), torch.arange(16.0).reshape(4, 4) + 100 * write)


@pytest.mark.parametrize("source, target", [(4, 2), (2, 4), (4, 1)])
def test_writes_into_a_resplit_argument_under_inference_mode(four_devices, source, target):
    """A write into a copy of a result split over another number of devices, under
    inference mode, in a map's first call (its attempt runs under a journal's dispatch
    mode): inside a dispatch mode under inference mode a write through some views moves no
    version counter, and the write was dropped, silently (4 -> 2 and 2 -> 4 devices)."""
    for write, in_axes, expected in ((lambda v: v[0].mul_(2), 0, 40.0), (lambda v: v.mul_(2), 1, 64.0)):
        with torch.inference_mode():
            y = tp.pmap(lambda x: x + 0, devices=four_devices[:source])(torch.ones(8, 4))
            tp.pmap(write, in_axes=in_axes, devices=four_devices[:target])(y)
        assert torch.as_tensor(y).sum().item() == expected


@pytest.mark.parametrize("spec", [P(("x", "y")), P(None, ("x", "y"))], ids=str)
def test_shard_map_writes_into_blocks_under_inference_mode(placement, spec):
    mesh = tp.make_mesh((2, 2), ("x", "y"))
    with torch.inference_mode():
        z = tp.shard_map(lambda v: v * 1, mesh=mesh, in_specs=P("x"), out_specs=P("x"))(torch.ones(4, 4))
        tp.shard_map(lambda v: v.add_(100), mesh=mesh, in_specs=spec, out_specs=spec)(z)
    torch.testing.assert_close(torch.as_tensor(z), torch.full((4, 4), 101.0))


OWN_BLOCKS = [P(("x", "y")), P("x", "y"), P(("y", "x")), P("y", "x"), P(None, ("x", "y"))]
SHARED_BLOCKS = [P("x"), P(None, "x"), P("y")]


@pytest.mark.parametrize("spec", OWN_BLOCKS + SHARED_BLOCKS, ids=str)
def test_shard_map_writes_into_a_sharded_argument_as_one_device(placement, spec):
    """A previous shard_map's result (split over the first axis' devices) taken as it is
    or gathered and split anew: each position's own block written back into the shards;
    a block several positions share refused, on every placement."""
    mesh = tp.make_mesh((2, 2), ("x", "y"))
    z = tp.shard_map(lambda v: v * 1, mesh=mesh, in_specs=P("x"), out_specs=P("x"))(torch.arange(16.0).reshape(4, 4))
    write = tp.shard_map(lambda v: v.add_(100), mesh=mesh, in_specs=spec, out_specs=spec)
    if spec in SHARED_BLOCKS:
        with pytest.raises(RuntimeError, match="wrote in place"):
            write(z)
        return
    write(z)
    torch.testing.assert_close(torch.as_tensor(z), torch.arange(16.0).reshape(4, 4) + 100)


def test_a_write_into_a_host_tensors_slice_reaches_it_from_the_devices():
    """The default devices (CUDA where ``make gpu-check`` runs this file, CPU devices
    otherwise): a host tensor's slices are copied onto a CUDA device, and the write comes
    back; on CPU devices each slice is a view. One call on the first device, one over all."""
    for devices in (tp.devices()[:1], tp.devices()):
        n = 2 * len(devices)
        x = torch.zeros(n, 3)
        tp.pmap(lambda v: v.add_(tp.axis_index("i").to(v.dtype) + 1), axis_name="i", devices=devices)(x)
        torch.testing.assert_close(x, torch.arange(1.0, n + 1).unsqueeze(1).expand(n, 3))
