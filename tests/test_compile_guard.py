"""torch.compile must never return wrong numbers through a collective."""
import pytest
import torch

import torchpmap as tp


def fresh_pmap():
    return tp.pmap(lambda v: v / tp.psum(v, "i"), axis_name="i", devices=tp.devices()[:1])


def test_fullgraph_compile_raises_a_clear_error():
    torch._dynamo.reset()
    with pytest.raises(Exception, match="cannot run under torch.compile"):
        torch.compile(fresh_pmap(), fullgraph=True)(torch.tensor([1.0, 2.0, 3.0, 4.0]))


def test_plain_compile_runs_the_pmap_eagerly_with_correct_numbers():
    torch._dynamo.reset()
    x = torch.tensor([1.0, 2.0, 3.0, 4.0])
    out = torch.compile(lambda x: fresh_pmap()(x) * 2)(x)
    assert torch.allclose(out, 2 * x / x.sum())  # a compiled-away rule would give 2 * ones


def test_compiled_collective_inside_pmap_is_correct():
    torch._dynamo.reset()
    inner = torch.compile(lambda u: u / tp.psum(u, "i"))
    out = tp.pmap(inner, axis_name="i", devices=tp.devices()[:1])(torch.tensor([1.0, 3.0]))
    assert torch.allclose(out, torch.tensor([0.25, 0.75]))
