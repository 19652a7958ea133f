"""Part ``shard-map``: ``shard_map`` on the GPU against the same programs on a CPU device.

The shard_map notebook's programs (a product summed over ``model``; FSDP: weights
gathered over ``data``, the gradient inside the map; a Megatron MLP whose output is
``psum_scatter``'d; a ``ppermute`` ring), on a ``(4, 2)`` mesh of ``("data", "model")``:
their values and the gradients of a weighted sum of their results (``.backward()``
outside the map) with every position on the first device (``cuda:0``: the positions
vectorized on it), then on ``cuda:0`` and a CPU device together (the first axis split over
the two: results stay on their devices as ``ShardedTensor``s, and one goes into a second
shard_map where it is), each against the positions on a CPU device; and the product
compiled (``jit=True``). Run with one CPU device beside the GPU
(``TORCHPMAP_EXTRA_CPU_DEVICES=1``); without CUDA, with 2 CPU devices.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.func import grad

import torchpmap as tp
from torchpmap import P
from torchpmap.bench.gpu_check.programs.common import Recorder, close, main_guard

SHAPE, NAMES = (4, 2), ("data", "model")
RING = [(j, (j + 1) % SHAPE[0]) for j in range(SHAPE[0])]
Program = Callable[[Any, bool], Callable[..., Any]]  # (mesh, jit) -> the mapped function


def _matmul(mesh: Any, jit: bool) -> Callable[..., Any]:
    return tp.shard_map(lambda x, w: tp.psum(x @ w, "model"), mesh=mesh, jit=jit,
                        in_specs=(P("data", "model"), P("model", None)), out_specs=P("data", None))


def _fsdp(mesh: Any, jit: bool) -> Callable[..., Any]:
    def loss(w1: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return tp.pmean((torch.tanh(x @ tp.all_gather(w1, "data", tiled=True)) ** 2).mean(), "data")

    return tp.shard_map(lambda w1, x: (loss(w1, x), grad(loss)(w1, x)), mesh=mesh, jit=jit,
                        in_specs=(P("data"), P("data")), out_specs=(P(), P("data")))


def _tensor_parallel(mesh: Any, jit: bool) -> Callable[..., Any]:
    def mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        return tp.psum_scatter(torch.relu(x @ w1) @ w2, "model", scatter_dimension=0, tiled=True)

    return tp.shard_map(mlp, mesh=mesh, jit=jit, in_specs=(P("data", None), P(None, "model"), P("model", None)),
                        out_specs=P(("data", "model"), None))


def _ring(mesh: Any, jit: bool) -> Callable[..., Any]:
    return tp.shard_map(lambda x: tp.ppermute(x, "data", RING) * (1 + tp.axis_index("model")), mesh=mesh, jit=jit,
                        in_specs=P("data", "model"), out_specs=P("data", "model"))


def _replicated_gradient(mesh: Any, jit: bool) -> Callable[..., Any]:
    """A gradient inside the map of a weight replicated over ``data``, used with the split
    batch (implicit pvary: summed over ``data``) and invariantly (a psum over ``model``)."""
    def block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return grad(lambda w: tp.psum((w ** 2).sum(), "model") + ((x @ w) ** 2).mean())(w)

    return tp.shard_map(block, mesh=mesh, jit=jit, in_specs=(P("data", None), P()), out_specs=P())


def _chained(mesh: Any) -> Callable[..., Any]:
    """A second shard_map that takes the product's result (split over ``data``) as it is."""
    return tp.shard_map(lambda h: tp.psum(h.sum(1, keepdim=True), "model") * h, mesh=mesh,
                        in_specs=P(("data", "model")), out_specs=P(("data", "model")))


def _arguments(name: str, g: torch.Generator) -> list[torch.Tensor]:
    shapes: dict[str, list[tuple[int, ...]]] = {
        "matmul": [(8, 8), (8, 6)], "fsdp": [(8, 8), (8, 8)], "tensor-parallel": [(8, 8), (8, 16), (16, 6)],
        "ring": [(8, 4)], "replicated-gradient": [(8, 6), (6,)],
    }
    return [torch.randn(*s, generator=g) for s in shapes[name]]


PROGRAMS: dict[str, Program] = {"matmul": _matmul, "fsdp": _fsdp, "tensor-parallel": _tensor_parallel, "ring": _ring,
                                 "replicated-gradient": _replicated_gradient}


def _run(program: Program, mesh: Any, args: list[torch.Tensor], jit: bool = False) -> tuple[list, list]:
    """The program's results (on the CPU) and the gradients of a weighted sum of them."""
    leaves = [a.clone().requires_grad_() for a in args]
    outs = program(mesh, jit)(*leaves)
    outs = list(outs) if isinstance(outs, tuple) else [outs]
    total = torch.stack(
        [(torch.as_tensor(o).cpu() * torch.linspace(-1.0, 1.0, o.numel()).reshape(o.shape)).sum() for o in outs]
    ).sum()
    total.backward()
    return [torch.as_tensor(o).detach().cpu() for o in outs], [leaf.grad for leaf in leaves]


def main() -> int:
    rec = Recorder()
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 products compared at float32 precision
    devices = tp.devices()
    target = devices[0]
    cpus = [d for d in devices if d.platform == "cpu" and d != target]
    rec.measure("devices", ", ".join(str(d) for d in devices))
    if not cpus:
        rec.skip("every comparison", f"no CPU device beside {target} (set TORCHPMAP_EXTRA_CPU_DEVICES=1)")
        return rec.finish()
    reference_mesh = tp.make_mesh(SHAPE, NAMES, devices=[cpus[0]])
    g = torch.Generator().manual_seed(0)
    placements = {f"{target} alone": [target], f"{target} and {cpus[0]}": [target, cpus[0]]}
    for name, program in PROGRAMS.items():
        args = _arguments(name, g)
        want = _run(program, reference_mesh, args)
        for where, on in placements.items():
            with rec.case(f"{name} on {where}: runs"):
                got = _run(program, tp.make_mesh(SHAPE, NAMES, devices=on), args)
                close(rec, f"{name} on {where}: values", got[0], want[0], 1e-5)
                close(rec, f"{name} on {where}: gradients outside the map", got[1], want[1], 1e-5)

    with rec.case("a result left on cuda and the CPU goes into the next shard_map where it is"):
        mesh = tp.make_mesh(SHAPE, NAMES, devices=placements[f"{target} and {cpus[0]}"])
        x, w = _arguments("matmul", g)
        h = _matmul(mesh, False)(x, w)
        rec.check("the first result is a ShardedTensor on both devices",
                  isinstance(h, tp.ShardedTensor) and h.devices() == [target, cpus[0]], repr(type(h)))
        close(rec, "the chain's values", torch.as_tensor(_chained(mesh)(h)).cpu(),
              torch.as_tensor(_chained(reference_mesh)(_matmul(reference_mesh, False)(x, w))).cpu(), 1e-5)

    with rec.case(f"matmul compiled (jit=True) on {target}"):
        warnings.simplefilter("error", tp.JitFallbackWarning)  # a fallback to eager is a failure here
        args = _arguments("matmul", g)
        got = _run(_matmul, tp.make_mesh(SHAPE, NAMES, devices=[target]), args, jit=True)
        want = _run(_matmul, reference_mesh, args)
        close(rec, f"matmul jit=True on {target}: values", got[0], want[0], 1e-5)
        close(rec, f"matmul jit=True on {target}: gradients outside the map", got[1], want[1], 1e-5)
    return rec.finish()


if __name__ == "__main__":
    main_guard(main)
