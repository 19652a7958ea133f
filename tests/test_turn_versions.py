"""torchpmap._engines.turn_versions: each device thread's in-place writes into its slice of
a mapped argument count as if it ran alone, so that a ``.backward()`` after the call
computes on several devices what it computes on one, and refuses what one refuses."""
from __future__ import annotations

import pytest
import torch

import torchpmap as tp
from torchpmap._engines.turn_versions import TurnVersions


def _placements(four_devices, per_device):
    yield "1 device", four_devices[:1], per_device * 4
    yield "2 devices", four_devices[:2], per_device * 2
    yield "4 devices", four_devices, per_device


@pytest.mark.parametrize("per_device", [1, 2])
def test_a_write_into_a_nonleaf_argument_then_backward(four_devices, per_device):
    """One device wrote ``x`` once and ``sin`` saved it after; each of several devices
    moved the count its slice shares with the others', and the backward raised "modified
    by an inplace operation" (AsStrided) where one device computed."""
    x0 = torch.linspace(-1.0, 1.0, 4 * per_device * 3).reshape(-1, 3).requires_grad_()
    want = torch.autograd.grad((6 * x0).sin().sum(), x0)[0]
    for label, devices, _ in _placements(four_devices, per_device):
        x0.grad = None
        x = x0 * 2
        before = x._version
        y = tp.pmap(lambda a: a.mul_(3).sin(), devices=devices)(x)
        assert x._version == before + 1, label  # one write, as one vectorized write counts
        y.sum().backward()
        torch.testing.assert_close(x0.grad, want, msg=label)


def test_a_write_then_a_product_with_a_weight(four_devices):
    x = torch.linspace(-1.0, 1.0, 12).reshape(4, 3)
    w = torch.tensor([0.5, -1.0, 2.0], requires_grad=True)
    want = torch.autograd.grad((3 * x * w).sin().sum(), w)[0]
    for label, devices, _ in _placements(four_devices, 1):
        w.grad = None
        written = x.clone()
        tp.pmap(lambda a, v: (a.mul_(3) * v).sin(), in_axes=(0, None), devices=devices)(written, w).sum().backward()
        torch.testing.assert_close(written, 3 * x, msg=label)
        torch.testing.assert_close(w.grad, want, msg=label)


def test_writes_on_both_sides_of_a_collective(four_devices):
    """The threads take turns at the ``psum``: each thread's count is switched in and out."""
    x0 = torch.linspace(0.1, 1.2, 12).reshape(4, 3).requires_grad_()

    def f(a: torch.Tensor) -> torch.Tensor:
        a.mul_(2)
        s = tp.psum(a * 2, "i")  # saves nothing of a
        a.add_(s)
        return (a * a).sum()

    results = []
    for label, devices, _ in _placements(four_devices, 1):
        x0.grad = None
        x = x0 * 1.5
        before = x._version
        y = tp.pmap(f, axis_name="i", devices=devices)(x)
        assert x._version == before + 2, label
        y.sum().backward()
        results.append((label, y.detach(), x.detach(), x0.grad.clone()))
    for label, *got in results[1:]:
        for a, b in zip(got, results[0][1:]):
            torch.testing.assert_close(a, b, msg=label)


def test_a_write_after_a_save_is_still_refused_everywhere(four_devices):
    """A thread's own slice written after it was saved: refused on every placement, as on one."""
    for label, devices, _ in _placements(four_devices, 1):
        x = torch.linspace(0.1, 1.2, 12).reshape(4, 3).requires_grad_() * 1.0

        def f(a: torch.Tensor) -> torch.Tensor:
            y = a.sin()
            a.mul_(2)
            return y

        y = tp.pmap(f, devices=devices)(x)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.sum().backward()
        assert label


def test_debug_mode_counts_as_one_device(four_devices):
    x0 = torch.linspace(-1.0, 1.0, 12).reshape(4, 3).requires_grad_()
    want = torch.autograd.grad((6 * x0).sin().sum(), x0)[0]
    for devices in (four_devices[:1], four_devices):
        x0.grad = None
        with tp.disable_vectorization():
            tp.pmap(lambda a: a.mul_(3).sin(), devices=devices)(x0 * 2).sum().backward()
        torch.testing.assert_close(x0.grad, want)


def test_shard_map_blocks_written_then_backward(four_devices):
    x0 = torch.linspace(-1.0, 1.0, 8 * 3).reshape(8, 3).requires_grad_()
    want = torch.autograd.grad((6 * x0).sin().sum(), x0)[0]
    for devices in (four_devices[:1], four_devices[:2], four_devices):
        x0.grad = None
        mesh = tp.make_mesh((len(devices),), ("b",), devices=devices)
        f = tp.shard_map(lambda a: a.mul_(3).sin(), mesh=mesh, in_specs=tp.P("b"), out_specs=tp.P("b"))
        torch.as_tensor(f(x0 * 2)).sum().backward()
        torch.testing.assert_close(x0.grad, want)


def test_the_counts_by_hand():
    """Two threads writing their slices: each finds its own count; after, the most."""
    x = torch.zeros(4)
    start = x._version
    versions = TurnVersions.of([x, x[:2], torch.ones(1)])
    assert versions is not None and len(versions._tensors) == 2  # views of x share x's counter
    versions.register(1)
    versions.register(2)
    versions.entered(1)
    x[:2].add_(1)
    x[:2].add_(1)
    versions.left(1)
    versions.entered(2)
    assert x._version == start  # thread 2 has written nothing yet
    x[2:].add_(1)
    versions.left(2)
    versions.entered(99)  # not a thread of this call (a nested call's): counts for everyone
    x.add_(0)
    versions.left(99)
    versions.entered(2)
    assert x._version == start + 2
    versions.left(2)
    versions.finish()
    assert x._version == start + 3  # the most any thread counted (2), and the nested write
