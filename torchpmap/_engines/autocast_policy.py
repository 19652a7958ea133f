"""Autocast's casts, made where plain PyTorch makes them: at the op the function calls.

``torch.autocast`` casts an op's arguments in a dispatcher layer (``AutocastCPU``,
``AutocastCUDA``) that sits *below* vmap's. Under ``torch.func.vmap``, an op that vmap
decomposes or whose batching rule calls other ops reaches autocast as those other ops,
which autocast may not know or may cast differently. The function's results then differ
from plain PyTorch's, silently, and from torchpmap's one-instance-at-a-time engine:
measured on torch 2.11 (CPU, bfloat16), ``F.linear`` with a bias, ``F.conv2d``,
``F.conv_transpose2d``, ``torch.addmm``, ``torch.baddbmm``, ``F.prelu`` and
``F.scaled_dot_product_attention`` came out float32 instead of bfloat16, and
``F.cross_entropy`` and ``F.nll_loss`` of a bfloat16 input bfloat16 instead of float32. On
CUDA, ``F.conv2d`` with a bias raised ("Input type (c10::BFloat16) and bias type (float)
should be the same"). The same is pytorch#192617 for ``nn.Linear``.

While a map runs under autocast, :func:`like_autocast` applies autocast's policy to
the op the function called, before vmap sees it, for the ops of :data:`POLICIES`, and only
where torch registers an autocast kernel for that op on that device type (so only where
plain PyTorch would cast): ``"lower"`` casts every eligible argument (floating point, not
float64, on the autocast device type) to autocast's dtype; ``"fp32"`` casts them to
float32; ``"fp32_unless_dtype"`` does so unless the call gives a ``dtype`` (softmax). The
casts are autocast's own (``Tensor.to``), so values and gradients are plain PyTorch's. The
op then runs with that device type's autocast off, as autocast's kernels run it: the ops
vmap's rule calls are not cast again (on CUDA, ``addbmm``'s rule sums with ``sum``, which
autocast would run in float32). Ops outside the table keep vmap's behaviour (elementwise
ops are batched as themselves, so autocast still sees them).
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F

from torchpmap._state import torch_private as private
from torchpmap._state.torch_private import pytree

Policy = Literal["lower", "fp32", "fp32_unless_dtype"]

#: The dispatch key of each device type's autocast layer.
_AUTOCAST_KEYS = {"cpu": "AutocastCPU", "cuda": "AutocastCUDA", "xpu": "AutocastXPU", "mps": "AutocastMPS"}


@dataclasses.dataclass(frozen=True)
class OpPolicy:
    """What autocast does to one op: its aten name (whose autocast kernels say on which
    device types it casts) and the cast."""

    aten: str
    policy: Policy


def _table() -> dict[Callable[..., object], OpPolicy]:
    T = torch.Tensor
    lower: dict[str, tuple[Callable[..., object], ...]] = {
        "aten::linear": (F.linear,),
        "aten::conv1d": (torch.conv1d,),
        "aten::conv2d": (torch.conv2d,),
        "aten::conv3d": (torch.conv3d,),
        "aten::conv_transpose1d": (torch.conv_transpose1d,),
        "aten::conv_transpose2d.input": (torch.conv_transpose2d,),
        "aten::conv_transpose3d.input": (torch.conv_transpose3d,),
        "aten::conv_tbc": (torch.conv_tbc,),
        "aten::matmul": (torch.matmul, T.matmul, T.__matmul__),
        "aten::mm": (torch.mm, T.mm),
        "aten::bmm": (torch.bmm, T.bmm),
        "aten::mv": (torch.mv, T.mv),
        "aten::addmm": (torch.addmm, T.addmm),
        "aten::addbmm": (torch.addbmm, T.addbmm),
        "aten::baddbmm": (torch.baddbmm, T.baddbmm),
        "aten::addmv": (torch.addmv, T.addmv),
        "aten::addr": (torch.addr, T.addr),
        "aten::einsum": (torch.einsum,),
        "aten::prelu": (torch.prelu, T.prelu),
        "aten::scaled_dot_product_attention": (F.scaled_dot_product_attention,),
        "aten::linalg_vecdot": (torch.linalg.vecdot,),
        "aten::chain_matmul": (torch.chain_matmul,),
        "aten::linalg_multi_dot": (torch.linalg.multi_dot,),
    }
    fp32: dict[str, tuple[Callable[..., object], ...]] = {
        "aten::cross_entropy_loss": (F.cross_entropy,),
        "aten::nll_loss": (F.nll_loss,),
        "aten::binary_cross_entropy_with_logits": (F.binary_cross_entropy_with_logits,),
        "aten::mse_loss": (F.mse_loss,),
        "aten::l1_loss": (F.l1_loss,),
        "aten::smooth_l1_loss": (F.smooth_l1_loss,),
        "aten::huber_loss": (F.huber_loss,),
        "aten::kl_div": (F.kl_div,),
        "aten::margin_ranking_loss": (F.margin_ranking_loss,),
        "aten::soft_margin_loss": (F.soft_margin_loss,),
        "aten::poisson_nll_loss": (F.poisson_nll_loss,),
        "aten::cosine_embedding_loss": (F.cosine_embedding_loss,),
        "aten::hinge_embedding_loss": (F.hinge_embedding_loss,),
        "aten::multi_margin_loss": (F.multi_margin_loss,),
        "aten::multilabel_margin_loss": (F.multilabel_margin_loss,),
        "aten::cdist": (torch.cdist,),
        "aten::dist": (torch.dist, T.dist),
        "aten::pdist": (torch.pdist,),
        "aten::cosine_similarity": (torch.cosine_similarity,),
        "aten::group_norm": (F.group_norm,),
        "aten::layer_norm": (F.layer_norm,),
        "aten::logsumexp": (torch.logsumexp, T.logsumexp),
    }
    fp32_unless_dtype: dict[str, tuple[Callable[..., object], ...]] = {
        "aten::softmax.int": (F.softmax, torch.softmax, T.softmax),
        "aten::log_softmax.int": (F.log_softmax, torch.log_softmax, T.log_softmax),
    }
    table: dict[Callable[..., object], OpPolicy] = {}
    for policy, ops in (("lower", lower), ("fp32", fp32), ("fp32_unless_dtype", fp32_unless_dtype)):
        for aten, functions in ops.items():
            for fn in functions:
                table[fn] = OpPolicy(aten, policy)  # type: ignore[arg-type]
    return table


#: The functions (as a torch function mode sees them) whose autocast casts are made here.
POLICIES: dict[Callable[..., object], OpPolicy] = _table()


@functools.cache
def _autocast_casts(aten: str, device_type: str) -> bool:
    """Whether autocast has a kernel of its own for ``aten`` on ``device_type``."""
    key = _AUTOCAST_KEYS.get(device_type)
    return key is not None and bool(private.has_kernel_for_dispatch_key(aten, key))


@functools.cache
def _is_composite(aten: str) -> bool:
    """Whether ``aten`` is made of other ops, each of which meets autocast in plain PyTorch."""
    return bool(private.has_kernel_for_dispatch_key(aten, "CompositeImplicitAutograd"))


def _first_floating_device(args: tuple, kwargs: dict) -> str | None:
    for leaf in pytree.tree_leaves((args, kwargs)):
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            return leaf.device.type
    return None


@dataclasses.dataclass(frozen=True)
class Call:
    """An op's call as autocast would make it: its arguments, cast or not, and the device
    type whose autocast must be off while it runs (None: leave autocast as it is)."""

    args: tuple
    kwargs: dict
    autocast_off: str | None = None

    def run(self, func: Callable[..., object]) -> object:
        if self.autocast_off is None:
            return func(*self.args, **self.kwargs)
        torch.set_autocast_enabled(self.autocast_off, False)  # as autocast's own kernels call the op
        try:
            return func(*self.args, **self.kwargs)
        finally:
            torch.set_autocast_enabled(self.autocast_off, True)


def like_autocast(func: Callable[..., object], args: tuple, kwargs: dict) -> Call:
    """The call of ``func`` as plain PyTorch's autocast makes it (see the module docstring).

    An op of the table without an autocast kernel on the device type and with a kernel of
    its own (not made of other ops: ``torch.mv`` on CPU) is not cast in plain PyTorch, but
    vmap's rule may turn it into ops autocast does cast (``mm``): it runs with that device
    type's autocast off."""
    op = POLICIES.get(func)
    if op is None:
        return Call(args, kwargs)
    device_type = _first_floating_device(args, kwargs)
    if device_type is None or not torch.is_autocast_enabled(device_type):
        return Call(args, kwargs)
    if not _autocast_casts(op.aten, device_type):
        return Call(args, kwargs, autocast_off=None if _is_composite(op.aten) else device_type)
    if op.policy == "fp32_unless_dtype" and any(isinstance(a, torch.dtype) for a in (*args, *kwargs.values())):
        return Call(args, kwargs, autocast_off=device_type)  # a dtype given: autocast casts nothing
    to = torch.get_autocast_dtype(device_type) if op.policy == "lower" else torch.float32

    def cast(leaf: object) -> object:
        if (
            isinstance(leaf, torch.Tensor)
            and leaf.is_floating_point()
            and leaf.dtype != torch.float64
            and leaf.dtype != to
            and leaf.device.type == device_type
        ):
            return leaf.to(to)
        return leaf

    cast_args, cast_kwargs = pytree.tree_map(cast, (args, kwargs))
    return Call(cast_args, cast_kwargs, autocast_off=device_type)
