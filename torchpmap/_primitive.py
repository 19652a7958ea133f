"""How a collective runs inside ``torch.func`` transforms.

A collective is a :class:`Primitive` (what to compute, given every instance's value at
once) bound through one ``torch.autograd.Function``, :class:`_Bind`, whose ``vmap`` rule
finds the vmap level that owns the named axis:

* The op receives the axis *token* (``arange(n)``, batched only at the owning level). At
  any other level the token is unbatched: the rule moves that level's batch dim to the
  front, records it as a pass-through "lead" dim and re-binds one level down.
* At the owning level the rule holds the values of all instances as one physical tensor
  ``X`` of shape ``(n, *lead, *instance_shape)`` and calls :meth:`Primitive.compute`.

``backward`` and ``jvp`` bind the primitive's transpose (or the primitive itself, for
``jvp`` of a linear op), so ``grad``/``jvp`` inside the map follow JAX's conventions;
transforms outside the map differentiate the plain torch ops of ``compute`` directly.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from torchpmap._axis_env import AxisFrame


@dataclasses.dataclass(frozen=True, eq=False)
class Primitive:
    """A collective over one named axis. Subclasses define the math.

    ``lead`` counts the pass-through dims that sit between the member dim and the
    instance's own dims when :meth:`compute` runs; user-facing dim arguments are
    relative to the instance shape and get shifted by ``1 + lead``.
    """

    frame: AxisFrame
    lead: int = 0

    name = "collective"
    linear = True

    def compute(self, X: torch.Tensor) -> tuple[torch.Tensor, Optional[int]]:
        """All instances' values ``X`` -> (result, member dim of the result or None)."""
        raise NotImplementedError

    def compute_unbatched(self, x: torch.Tensor) -> tuple[torch.Tensor, Optional[int]]:
        """Same as compute, when every instance holds the same ``x`` (no member dim)."""
        n = self.frame.local_size
        return self.compute(x.unsqueeze(0).expand(n, *x.shape))

    def transpose(self) -> "Primitive":
        raise NotImplementedError(f"{self.name} has no transpose")

    def with_lead(self, lead: int) -> "Primitive":
        return dataclasses.replace(self, lead=lead)

    def dim(self, d: int) -> int:
        """Physical position in ``X`` of instance dim ``d``."""
        return 1 + self.lead + d


def bind(prim: Primitive, x: torch.Tensor) -> torch.Tensor:
    """Applies ``prim`` to this instance's ``x``."""
    if prim.frame.exchange is not None:
        _refuse_forward_mode(prim)
    if not prim.frame.vectorized and torch._C._functorch.maybe_current_level() is None:
        return _run_unvectorized(prim, x)  # plain torch ops: outer autograd sees them directly
    return _Bind.apply(prim, prim.frame.token, x)


def _refuse_forward_mode(prim: Primitive) -> None:
    """PyTorch keeps forward-mode AD levels per process, not per thread, so jvp/jacfwd in
    concurrent device threads interfere; refuse instead of risking wrong tangents."""
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

    if any(i.key() == torch._C._functorch.TransformType.Jvp for i in retrieve_all_functorch_interpreters()):
        from torchpmap._engines.multi_device import FORWARD_MODE_ACROSS_DEVICES

        raise NotImplementedError(f"{FORWARD_MODE_ACROSS_DEVICES} (It reached {prim.name} over axis {prim.frame.name!r}.)")


def _run_unvectorized(prim: Primitive, x: torch.Tensor) -> torch.Tensor:
    """``prim`` on a slice that holds a single instance and has no vmap level."""
    out, member_dim = run_owning(prim, x.unsqueeze(0))
    return out if member_dim is None else out.select(member_dim, 0)


class _Bind(torch.autograd.Function):
    generate_vmap_rule = False

    @staticmethod
    def forward(prim: Primitive, token: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if not prim.frame.vectorized:  # every vmap level above was peeled off
            return _run_unvectorized(prim, x)
        raise RuntimeError(
            f"torchpmap: {prim.name} over axis {prim.frame.name!r} ran outside the vmap level "
            "of that axis. This happens when the axis token escapes its pmap, or under "
            "torch.compile, which ignores custom batching rules."
        )

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.prim, ctx.token = inputs[0], inputs[1]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if not ctx.prim.frame.vectorized and torch._C._functorch.maybe_current_level() is None:
            # plain autograd runs this node in one thread; the other devices' nodes would never meet it
            raise NotImplementedError(
                f"torchpmap: .backward() through {ctx.prim.name} over mesh axis {ctx.prim.frame.name!r} called "
                "under a torch.func transform inside the pmap is not supported. Differentiate inside the pmap "
                "with torch.func.grad, or call the collective outside the inner transform."
            )
        return None, None, _Bind.apply(ctx.prim.transpose(), ctx.token, grad)

    @staticmethod
    def jvp(ctx, _prim_t, _token_t, x_t: torch.Tensor) -> torch.Tensor:
        if not ctx.prim.linear:
            ctx.prim.transpose()  # raises the primitive's own "not differentiable" error
        return _Bind.apply(ctx.prim, ctx.token, x_t)

    @staticmethod
    def vmap(info, in_dims, prim: Primitive, token: torch.Tensor, x: torch.Tensor):
        _, token_dim, x_dim = in_dims
        if token_dim is None:  # another level: pass its batch dim through
            if x_dim is None:
                return _Bind.apply(prim, token, x), None
            moved = x.movedim(x_dim, 0)
            return _Bind.apply(prim.with_lead(prim.lead + 1), token, moved), 0
        if x_dim is None:
            if prim.frame.exchange is None:
                return prim.compute_unbatched(x)
            return run_owning(prim, x.unsqueeze(0).expand(prim.frame.local_size, *x.shape))
        return run_owning(prim, x.movedim(x_dim, 0))


def run_owning(prim: Primitive, X: torch.Tensor) -> tuple[torch.Tensor, Optional[int]]:
    """Runs ``prim`` at the level that owns its axis, on this slice's instances ``X``.

    When the axis is split over devices, every slice's ``X`` is gathered first and the
    same math runs on the whole axis, so results are bitwise those of one device.
    """
    exchange = prim.frame.exchange
    if exchange is None:
        return prim.compute(X)
    everyone = exchange.all_gather(X, f"{prim.name} over axis {prim.frame.name!r}").flatten(0, 1)
    out, member_dim = prim.compute(everyone)
    if member_dim is None:
        return out, None
    return out.narrow(member_dim, prim.frame.offset, prim.frame.local_size), member_dim
