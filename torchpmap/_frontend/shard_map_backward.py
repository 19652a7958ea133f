"""``.backward()`` through a shard_map result across processes: the forward again, in a vjp.

On a mesh of processes a shard_map's results are DTensors, and each process holds only
its own blocks, so autograd cannot follow the program from outside: its collectives ran
between the processes, and a replicated result's cotangent is handed to every process
whole (DTensor's convention), where the map's own backward would count it once per
process. The gradient is taken *inside* the map instead, where shard_map's ``check_vma``
rules apply (an invariant cotangent passes ``psum``'s transpose once, and a replicated
argument's gradient is summed over the positions that used it, see
:mod:`~torchpmap._frontend.implicit_pvary`):

* the forward runs the map without autograd, keeps the arguments (and the random
  streams' states), and returns the results as DTensors;
* the backward runs a second shard_map over the same mesh: ``f`` again on the same
  blocks, under ``torch.func.vjp``, pulled back by the results' cotangents (taken by the
  out specs: a ``Partial`` cotangent is reduced, another placement redistributed). Its
  results, split by the in specs, are the arguments' gradients: a DTensor's in its own
  placements, a tensor that every process holds whole, whole.

The forward is thus computed twice, as under activation checkpointing; random draws in
``f`` repeat, because the generators are put back to where they stood.
"""
from __future__ import annotations

import contextvars
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from torchpmap._placement import dtensor as _dtensor
from torchpmap._placement.partition_spec import PartitionSpec
from torchpmap._state.context import run_in_copy
from torchpmap._state.torch_private import pytree


class ShardMapped(Protocol):
    """What this module needs of :class:`torchpmap._frontend.shard_map.ShardMapped`."""

    fun: Callable[..., Any]

    def run(self, args: tuple) -> Any:
        """The call, without differentiating it from outside."""
        ...

    def out_spec_leaves(self, results: Any) -> list[tuple[PartitionSpec | None, Any]]:
        """Each result leaf's out spec (with its path)."""
        ...

    def remapped(self, fun: Callable[..., Any], in_specs: Any, out_specs: Any) -> ShardMapped:
        """A shard_map of ``fun`` over the same mesh, under check_vma, eager."""
        ...


def wants_gradient(leaves: Sequence[Any]) -> bool:
    """Whether autograd must follow a call with these argument leaves."""
    return torch.is_grad_enabled() and any(
        isinstance(leaf, torch.Tensor) and leaf.requires_grad for leaf in leaves
    )


@dataclasses.dataclass
class _Call:
    """One call's plan: which leaves are tensors (the autograd inputs), which of those
    are differentiated, and the structure of the results (filled in by the forward)."""

    mapped: ShardMapped
    leaves: list[Any]
    tree: pytree.TreeSpec
    specs: list[PartitionSpec | None]
    tensor_at: list[int]  # positions of the tensor leaves among ``leaves``
    out_tree: pytree.TreeSpec | None = None
    out_specs: list[PartitionSpec | None] = dataclasses.field(default_factory=list)
    rng: tuple[list[int], list[torch.Tensor]] | None = None  # CUDA devices and the generators' states
    #: the forward's context (meshes entered, default devices, debug mode): the backward maps in it,
    #: also where autograd runs it in a device thread of its own (CUDA), where none of it is set
    context: contextvars.Context | None = None

    def arguments(self, tensors: Sequence[Any]) -> Any:
        leaves = list(self.leaves)
        for k, t in zip(self.tensor_at, tensors):
            leaves[k] = t
        return pytree.tree_unflatten(leaves, self.tree)


def call(mapped: ShardMapped, args: tuple, leaves: list[Any], tree: pytree.TreeSpec,
         specs: list[PartitionSpec | None]) -> Any:
    """``mapped(*args)`` on a mesh of processes, differentiable from outside."""
    plan = _Call(mapped, leaves, tree, specs, [k for k, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)])
    outs = _AcrossProcesses.apply(plan, *(leaves[k] for k in plan.tensor_at))
    assert plan.out_tree is not None
    return pytree.tree_unflatten(list(outs), plan.out_tree)


def _random_states() -> tuple[list[int], list[torch.Tensor]]:
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    return devices, [torch.get_rng_state(), *(torch.cuda.get_rng_state(d) for d in devices)]


class _AcrossProcesses(torch.autograd.Function):
    """The map without autograd forward; its vjp inside a second map backward."""

    @staticmethod
    def forward(ctx: Any, plan: _Call, *tensors: torch.Tensor) -> tuple[Any, ...]:
        plan.rng = _random_states()
        plan.context = contextvars.copy_context()
        results = plan.mapped.run(plan.arguments(tensors))
        out_leaves, plan.out_tree = pytree.tree_flatten(results)
        plan.out_specs = [s for s, _ in plan.mapped.out_spec_leaves(results)]
        ctx.plan = plan
        ctx.save_for_backward(*tensors)
        return tuple(out_leaves)

    @staticmethod
    def backward(ctx: Any, *cotangents: Any) -> tuple[Any, ...]:
        plan: _Call = ctx.plan
        tensors = ctx.saved_tensors
        wanted = [k for k, t in enumerate(tensors) if ctx.needs_input_grad[1 + k]]
        assert plan.rng is not None and plan.context is not None
        devices, states = plan.rng

        def pulled_back() -> Any:
            with torch.random.fork_rng(devices=devices):
                torch.set_rng_state(states[0])
                for d, state in zip(devices, states[1:]):
                    torch.cuda.set_rng_state(state, d)
                return _pullback(plan, wanted)(tensors, cotangents)

        grads = run_in_copy(plan.context, pulled_back)
        out: list[Any] = [None] * len(tensors)
        for k, g in zip(wanted, grads):
            out[k] = _like_input(g, tensors[k])
        return (None, *out)


def _pullback(plan: _Call, wanted: list[int]) -> Callable[[Sequence[Any], Sequence[Any]], Any]:
    """The shard_map of ``f``'s vjp: (argument tensors, result cotangents) -> the wanted
    arguments' gradients, each split as its argument's in spec."""
    fun = plan.mapped.fun

    def vjp_blocks(blocks: tuple, cts: tuple) -> tuple:
        def of_wanted(*xs: torch.Tensor) -> tuple:
            blocks_now = list(blocks)
            for k, x in zip(wanted, xs):
                blocks_now[k] = x
            return tuple(pytree.tree_leaves(fun(*plan.arguments(blocks_now))))

        pull = torch.func.vjp(of_wanted, *(blocks[k] for k in wanted))[1]
        return tuple(pull(tuple(cts)))

    tensor_specs = tuple(plan.specs[k] for k in plan.tensor_at)
    mapped = plan.mapped.remapped(
        vjp_blocks, in_specs=(tensor_specs, tuple(plan.out_specs)), out_specs=tuple(tensor_specs[k] for k in wanted)
    )
    return lambda tensors, cts: mapped.run((tuple(tensors), tuple(cts)))


def _like_input(grad: Any, arg: torch.Tensor) -> Any:
    """The gradient as autograd expects it for ``arg``: a DTensor in ``arg``'s placements,
    or the whole tensor for a tensor every process holds."""
    if _dtensor.is_dtensor(arg):
        if list(grad.placements) != list(arg.placements):  # type: ignore[attr-defined]
            grad = grad.redistribute(arg.device_mesh, arg.placements)  # type: ignore[attr-defined]
        return grad
    return grad.full_tensor()
