"""Part ``jit``: ``pmap(jit=True)`` (inductor; Triton kernels on CUDA) against eager, values
and gradients. A fallback to eager (:class:`torchpmap.JitFallbackWarning`) is a failure."""
from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.func import grad

import torchpmap as tp
from torchpmap.bench.gpu_check.programs.common import QUICK, Recorder, close, device, main_guard

N = 8  # instances


def _collectives(w: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    perm = [(j, (j + 3) % N) for j in range(N)]

    def f(x: torch.Tensor) -> torch.Tensor:  # x: (N, 4) per instance
        y = tp.psum(torch.sin(x) @ w, "i") * x
        y = y + tp.all_gather(x, "i").mean(0) + tp.ppermute(x, "i", perm)
        return y + tp.all_to_all(x, "i", 0, 0) * tp.axis_index("i") + tp.pmean(x.exp(), "i")

    return f


def _values_and_grads(fn: Callable[..., torch.Tensor], *args: torch.Tensor) -> tuple[torch.Tensor, list]:
    leaves = [a.detach().clone().requires_grad_(a.is_floating_point()) for a in args]
    out = fn(*leaves)
    (torch.as_tensor(out) * torch.linspace(-1, 1, out.numel(), device=out.device).reshape(out.shape)).sum().backward()
    return out.detach(), [a.grad for a in leaves if a.requires_grad]


def _compare(rec: Recorder, name: str, make: Callable[[bool], Callable[..., torch.Tensor]], *args: torch.Tensor,
             tolerance: float) -> None:
    with rec.case(f"{name}: eager and jit=True run"):
        eager_out, eager_grads = _values_and_grads(make(False), *args)
        jit_fn = make(True)
        jit_out, jit_grads = _values_and_grads(jit_fn, *args)
        close(rec, f"{name}: values, jit=True vs eager", jit_out, eager_out, tolerance)
        close(rec, f"{name}: gradients, jit=True vs eager", jit_grads, eager_grads, tolerance)
        again, _ = _values_and_grads(jit_fn, *[a + 0.5 for a in args])  # a second call reuses the program
        expected, _ = _values_and_grads(make(False), *[a + 0.5 for a in args])
        close(rec, f"{name}: a second call with new values", again, expected, tolerance)


def main() -> int:
    rec = Recorder()
    dev = device()
    warnings.simplefilter("error", tp.JitFallbackWarning)  # a fallback to eager is a failure here
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 products compared at float32 precision
    torch.backends.cudnn.allow_tf32 = False
    g = torch.Generator().manual_seed(0)
    on = lambda *shape: torch.randn(*shape, generator=g).to(dev)  # noqa: E731
    rec.measure("device", str(dev))

    w = on(4, 4)
    _compare(rec, "collectives (psum, all_gather, ppermute, all_to_all, pmean)",
             lambda jit: tp.pmap(_collectives(w), axis_name="i", jit=jit), on(N, N, 4), tolerance=1e-5)

    def loss(p: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(x @ p["w1"] + p["b1"])
        return F.mse_loss(h @ p["w2"], y)

    params = {"w1": on(16, 32), "b1": on(32), "w2": on(32, 3)}
    x, y = on(N, 64, 16), on(N, 64, 3)
    with rec.case("data-parallel gradient (pmean of grad)"):
        step = lambda jit: tp.pmap(  # noqa: E731
            lambda p, x, y: tp.pmean(grad(loss)(p, x, y), "b"), "b", in_axes=(None, 0, 0), out_axes=None, jit=jit
        )
        close(rec, "data-parallel gradient: jit=True vs eager", step(True)(params, x, y), step(False)(params, x, y),
              1e-5)

    if QUICK:
        rec.skip("attention and layer-norm programs", "--quick")
        return rec.finish()

    q, k, v = on(N, 2, 4, 64, 32), on(N, 2, 4, 64, 32), on(N, 2, 4, 64, 32)
    _compare(rec, "causal attention (scaled_dot_product_attention)",
             lambda jit: tp.pmap(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), jit=jit),
             q, k, v, tolerance=1e-4)
    with rec.case("attention against plain PyTorch on the whole batch"):
        plain = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        mapped = tp.pmap(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), jit=True)(q, k, v)
        close(rec, "attention: jit=True vs plain PyTorch", mapped, plain, 1e-4)

    layer = torch.nn.LayerNorm(32).to(dev)
    def normed(h: torch.Tensor) -> torch.Tensor:
        return F.gelu(torch.func.functional_call(layer, dict(layer.named_parameters()), (h,)))

    _compare(rec, "layer norm and GELU through functional_call", lambda jit: tp.pmap(normed, jit=jit),
             on(N, 16, 32), tolerance=1e-5)
    return rec.finish()


if __name__ == "__main__":
    main_guard(main)
