"""Part ``attention``: ``F.scaled_dot_product_attention`` under the map, on each attention
kernel this device has (math, memory-efficient, flash, cuDNN), against plain PyTorch on
the whole batch: values, and gradients taken outside the map (``.backward()`` on the
pmap's result) and inside it (``torch.func.grad`` per instance), eager and ``jit=True``.

The instances fold into the kernels' batch, so the oracle is one plain call on the
instances and batch flattened together, with the same kernel chosen."""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import cast

import torch
import torch.nn.functional as F
from torch.func import grad
from torch.nn.attention import SDPBackend, sdpa_kernel

import torchpmap as tp
from torchpmap.bench.gpu_check.programs.common import QUICK, Recorder, close, device, has_cuda, main_guard

N, B, H, L, E = 4, 2, 4, 64, 32  # instances, batch, heads, length, head size


def _kernels() -> list[tuple[str, SDPBackend | None, torch.dtype, bool]]:
    """(name, kernel, dtype, takes a mask) for each case this device can run."""
    if not has_cuda():
        return [("default kernel, float32", None, torch.float32, True)]
    cases = [
        ("math, float32", SDPBackend.MATH, torch.float32, True),
        ("memory-efficient, float32", SDPBackend.EFFICIENT_ATTENTION, torch.float32, True),
        ("memory-efficient, bfloat16", SDPBackend.EFFICIENT_ATTENTION, torch.bfloat16, True),
        ("flash, bfloat16", SDPBackend.FLASH_ATTENTION, torch.bfloat16, False),
        ("cuDNN, bfloat16", SDPBackend.CUDNN_ATTENTION, torch.bfloat16, False),
        ("default kernel, float32", None, torch.float32, True),
        ("default kernel, bfloat16", None, torch.bfloat16, True),
    ]
    return cases[-2:] if QUICK else cases


@contextlib.contextmanager
def _using(kernel: SDPBackend | None) -> Iterator[None]:
    if kernel is None:
        yield
    else:
        with sdpa_kernel([kernel]):
            yield


def _outside(fn: Callable[..., torch.Tensor], weights: torch.Tensor, *inputs: torch.Tensor) -> tuple:
    """Values and the inputs' gradients of ``(fn(*inputs) * weights).sum()``."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    (out.float() * weights).sum().backward()
    return out.detach().float(), [cast(torch.Tensor, t.grad).float() for t in leaves]


def _check_kernel(
    rec: Recorder, dev: torch.device, g: torch.Generator, name: str, kernel: SDPBackend | None, dtype: torch.dtype,
    masked: bool,
) -> None:
    """One case of :func:`_kernels`: the pmap's values and gradients against plain PyTorch."""
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    q, k, v = (torch.randn(N, B, H, L, E, generator=g).to(dev, dtype) for _ in range(3))
    weights = torch.randn(N, B, H, L, E, generator=g).to(dev)
    mask = (torch.randn(N, B, 1, L, L, generator=g) * 0.5).to(dev, dtype) if masked else None
    flat = lambda t: t.flatten(0, 1)  # noqa: E731 -- the instances folded into the batch
    unflat = lambda t: t.unflatten(0, (N, B))  # noqa: E731

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: torch.Tensor | None = None) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=m is None)

    def plain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return unflat(attend(flat(q), flat(k), flat(v), None if mask is None else flat(mask)))

    with _using(kernel):
        oracle = None
        with rec.case(f"{name}: plain PyTorch runs (the oracle)"):
            oracle = _outside(plain, weights, q, k, v)
        if oracle is None:  # this kernel refuses these inputs on this device: recorded above
            return
        want, want_grads = oracle
        for jit in (False, True):
            label = f"{name}{', jit=True' if jit else ''}"
            with rec.case(f"{label}: the gradient outside the map"):
                mapped = tp.pmap(attend, jit=jit)
                fn = (lambda q, k, v: mapped(q, k, v, mask)) if mask is not None else mapped  # noqa: B023 -- called here
                got, got_grads = _outside(fn, weights, q, k, v)
                close(rec, f"{label}: values vs plain PyTorch", got, want, tolerance)
                close(rec, f"{label}: gradients outside the map vs plain PyTorch", got_grads, want_grads, tolerance)
        with rec.case(f"{name}: the gradient inside the map"):
            def inner(
                q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, w: torch.Tensor, *m: torch.Tensor
            ) -> tuple[torch.Tensor, ...]:
                return grad(lambda q, k, v: (attend(q, k, v, *m).float() * w).sum(), argnums=(0, 1, 2))(q, k, v)

            args = (q, k, v, weights, *(() if mask is None else (mask,)))
            inside = [t.float() for t in tp.pmap(inner)(*args)]
            close(rec, f"{name}: gradients inside the map vs plain PyTorch", inside, want_grads, tolerance)


def main() -> int:
    rec = Recorder()
    dev = device()
    torch.backends.cuda.matmul.allow_tf32 = False
    rec.measure("device", str(dev))
    g = torch.Generator().manual_seed(0)
    for name, kernel, dtype, masked in _kernels():
        _check_kernel(rec, dev, g, name, kernel, dtype, masked)
    return rec.finish()


if __name__ == "__main__":
    main_guard(main)
