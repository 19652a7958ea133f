"""A model's trained parameters held as shards, one row per instance, on their devices.

What ``data_parallel_step(shard_params=...)`` keeps between steps (ZeRO-3): for every
parameter that requires grad, its :class:`~torchpmap._frontend.flat_shards.FlatLayout`
rows, this process' ``n`` of the ``N`` instances, split over the devices the step's
``pmap`` runs on, each device holding the rows of its own instances (a
:class:`~torchpmap.ShardedTensor`'s shards: the pmap takes them where they are).

The optimizer is moved onto the shards: in each of its param groups, a parameter of the
model is replaced by its pieces (one per device), and its state, if it has any already,
is split the same way, so the optimizer's state is per shard from its first step on.
Its hyperparameters, learning-rate schedulers and ``GradScaler`` keep working on it.

The module's own trained parameters are released (emptied to 0 elements, the same
``Parameter`` objects) so that nothing holds their whole values between steps;
:meth:`ShardedParams.gather_into_module` writes them back, and the next step takes the
module's values again (:meth:`ShardedParams.reload_from_module`).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

from torchpmap._collectives.public import all_gather
from torchpmap._frontend.api import pmap
from torchpmap._frontend.elementwise_optimizers import SHARED_STATE
from torchpmap._frontend.flat_shards import FlatLayout
from torchpmap._placement import devices as _devices
from torchpmap._placement.devices import Device, DeviceLike
from torchpmap._placement.sharded import Shard, ShardedTensor

# Marks (attributes) that let a checkpoint tell a sharded step's state from replicated
# state: a module parameter the step emptied, and a piece the step's optimizer steps.
_EMPTIED = "_torchpmap_emptied_by_sharded_step"
_PIECE = "_torchpmap_sharded_step_piece"


def emptied_parameters(module: torch.nn.Module) -> list[str]:
    """The names of ``module``'s parameters that a sharded step has emptied (its values
    are in the step's rows until ``step.gather_params()``)."""
    return [k for k, p in module.named_parameters() if p.numel() == 0 and getattr(p, _EMPTIED, False)]


def steps_sharded_rows(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` has been moved onto a sharded step's rows (its state is this
    process' rows, one entry per piece)."""
    return any(getattr(p, _PIECE, False) for group in optimizer.param_groups for p in group["params"])


@dataclasses.dataclass
class ShardedParams:
    """The shards of a model's trained parameters, and where each piece lives.

    Attributes:
        model: the module whose parameters these are.
        layouts: per parameter name, how it is split into ``N`` rows.
        pieces: per parameter name, its rows on this process, one ``(device, tensor)``
            per device (the tensor ``(instances on that device, s)``); these tensors are
            what the optimizer holds and steps.
        first: the index of this process' first row (``process_index * n``).
        count: ``n``, the rows (instances) on this process.
        released: whether the module's own parameters are emptied (the shards are the
            values) rather than holding the values gathered by ``gather_into_module``.
    """

    model: torch.nn.Module
    layouts: dict[str, FlatLayout]
    pieces: dict[str, list[Shard]]
    first: int
    count: int
    released: bool = False

    @classmethod
    def split(
        cls, model: torch.nn.Module, names: Sequence[str], count: int, axis_name: Hashable,
        devices: Sequence[DeviceLike] | None,
    ) -> ShardedParams:
        """Splits the model's current values of ``names`` into rows, ``count`` instances
        here of ``count * process_count()`` in all, placed as the step's pmap places
        its instances."""
        total = count * _devices.process_count()
        first = _devices.process_index() * count
        layouts = {k: FlatLayout(model.get_parameter(k).shape, total) for k in names}
        rows = {k: layouts[k].rows(model.get_parameter(k), first, count) for k in names}
        placed = pmap(_copy, axis_name=axis_name, in_axes=0, out_axes=0, devices=devices, randomness="error")(rows)
        pieces = {k: _pieces_of(v) for k, v in placed.items()}
        for shards in pieces.values():
            for s in shards:
                s.tensor.requires_grad_(True)  # a leaf the optimizer steps, as a Parameter is
                setattr(s.tensor, _PIECE, True)
        return cls(model, layouts, pieces, first, count)

    # ------------------------------------------------------------------ the optimizer

    def move_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Replaces each of the model's parameters in ``optimizer``'s param groups by
        its pieces, with its state (if any) split the same way."""
        if steps_sharded_rows(optimizer):
            raise ValueError(
                "data_parallel_step(shard_params=...): the optimizer already steps the rows of another sharded step "
                "(its param groups hold that step's pieces, not this model's parameters), so this step's rows would "
                "not be what it steps. Give each sharded step its own optimizer, or one step a loss that combines "
                "both objectives."
            )
        names = {id(self.model.get_parameter(k)): k for k in self.pieces}
        for group in optimizer.param_groups:
            params: list[torch.Tensor] = []
            for p in group["params"]:
                k = names.get(id(p))
                if k is None:
                    params.append(p)
                    continue
                state = optimizer.state.pop(p, None)
                for piece in self.pieces[k]:
                    params.append(piece.tensor)
                    if state:
                        optimizer.state[piece.tensor] = {
                            key: self._split_state(k, value, piece, shared=key in SHARED_STATE)
                            for key, value in state.items()
                        }
            group["params"] = params

    def _split_state(self, name: str, value: Any, piece: Shard, shared: bool = False) -> Any:
        """One optimizer state entry for ``piece``: a tensor of the parameter's shape split
        as the parameter is; a scalar (Adam's ``step``: ``shared``, or of another shape)
        copied. (Told apart by shape alone, a 0-dim parameter's ``step`` was split like
        the parameter, into one row per instance, and ``optimizer.step()`` raised.)"""
        if not isinstance(value, torch.Tensor):
            return value
        layout = self.layouts[name]
        if shared or tuple(value.shape) != tuple(layout.shape):
            return value.clone()
        mine = layout.rows(value, self.first, self.count)
        start = 0
        for other in self.pieces[name]:
            if other is piece:
                break
            start += other.tensor.shape[0]
        return mine[start : start + piece.tensor.shape[0]].to(piece.tensor.device)

    # ------------------------------------------------------------------ the module

    def release_module(self) -> None:
        """Empties the module's own trained parameters (the same Parameter objects, 0
        elements, no gradient): between steps the shards are the values."""
        with torch.no_grad():
            for k in self.pieces:
                p = self.model.get_parameter(k)
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
                p.grad = None
                setattr(p, _EMPTIED, True)
        self.released = True

    def reload_from_module(self) -> None:
        """Takes the module's values (written by :meth:`gather_into_module`, perhaps
        changed since) into the shards, in place, and releases the module again."""
        with torch.no_grad():
            for k, shards in self.pieces.items():
                p = self.model.get_parameter(k)
                layout = self.layouts[k]
                if tuple(p.shape) != tuple(layout.shape):
                    raise ValueError(
                        f"data_parallel_step(shard_params=...): the model's parameter {k!r} has shape "
                        f"{tuple(p.shape)}, but the step shards it as {tuple(layout.shape)}. Change the values "
                        "after step.gather_params(), not the shapes (build a new step for a new model)."
                    )
                rows = layout.rows(p, self.first, self.count)
                for piece, part in zip(shards, rows.split([s.tensor.shape[0] for s in shards])):
                    piece.tensor.copy_(part)
        self.release_module()

    def gather_into_module(self, axis_name: Hashable, devices: Sequence[DeviceLike] | None) -> None:
        """Writes every parameter's whole value into the module (across processes, by
        an ``all_gather`` over ``axis_name``)."""
        whole = self.gather_rows(self.pieces, axis_name, devices)
        with torch.no_grad():
            for k, value in whole.items():
                p = self.model.get_parameter(k)
                p.data = value.to(p.device).clone()
        self.released = False

    def gather_rows(
        self, rows: dict[str, list[Shard]], axis_name: Hashable, devices: Sequence[DeviceLike] | None
    ) -> dict[str, torch.Tensor]:
        """Per parameter name, the whole tensor (the parameter's shape, on its device)
        whose rows are ``rows[name]``: one piece per device, as :attr:`pieces` (the
        parameter's own rows, or an optimizer state of their shape). Across processes an
        ``all_gather`` over ``axis_name`` that every process runs."""
        with torch.no_grad():
            if _devices.process_count() == 1:
                flat = {
                    k: torch.cat([s.tensor.detach().to(self._home(k)) for s in shards]).reshape(-1)
                    for k, shards in rows.items()
                }
            else:
                gather = pmap(_gathered(axis_name), axis_name=axis_name, in_axes=0, out_axes=None, devices=devices,
                            randomness="error")
                flat = gather({k: _detached(shards) for k, shards in rows.items()})
            return {k: self.layouts[k].unflatten(v).to(self._home(k)) for k, v in flat.items()}

    def optimizer_state_dict(
        self, optimizer: torch.optim.Optimizer, axis_name: Hashable, devices: Sequence[DeviceLike] | None
    ) -> dict[str, Any]:
        """``optimizer``'s state as if it had stepped the model's own parameters: the
        format of ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict``
        (parameters named by their fully qualified names, whole tensors), the pieces'
        state tensors gathered as :meth:`gather_rows` gathers parameters."""
        piece_of = {id(piece.tensor): (k, i) for k, shards in self.pieces.items() for i, piece in enumerate(shards)}
        name_of = {id(p): k for k, p in self.model.named_parameters()}
        groups = []
        for group in optimizer.param_groups:
            names = []
            for p in group["params"]:
                hit = piece_of.get(id(p))
                if hit is None:
                    names.append(name_of[id(p)])
                elif hit[1] == 0:
                    names.append(hit[0])
            groups.append({**{key: v for key, v in group.items() if key != "params"}, "params": names})
        state: dict[str, dict[str, Any]] = {}
        by_key: dict[str, dict[str, list[Shard]]] = {}  # state key -> parameter -> its pieces' tensors
        for k, shards in self.pieces.items():
            held = [optimizer.state.get(piece.tensor, {}) for piece in shards]
            if not held[0]:
                continue
            state[k] = {}
            for key, value in held[0].items():
                if isinstance(value, torch.Tensor) and tuple(value.shape) == tuple(shards[0].tensor.shape):
                    by_key.setdefault(key, {})[k] = [Shard(s.device, h[key]) for s, h in zip(shards, held)]
                    state[k][key] = None  # filled below, in the optimizer's key order
                else:
                    state[k][key] = value.detach().clone() if isinstance(value, torch.Tensor) else value
        for key, rows in by_key.items():
            for k, whole in self.gather_rows(rows, axis_name, devices).items():
                state[k][key] = whole
        for p, value in optimizer.state.items():  # parameters the step does not shard
            if id(p) in name_of:
                state[name_of[id(p)]] = {
                    key: v.detach().clone() if isinstance(v, torch.Tensor) else v for key, v in value.items()
                }
        return {"state": state, "param_groups": groups}

    def _home(self, name: str) -> torch.device:
        return self.model.get_parameter(name).device

    def module_is_released(self) -> bool:
        """Whether the module's parameters are still emptied (no one wrote into them)."""
        return self.released and all(self.model.get_parameter(k).numel() == 0 for k in self.pieces)

    def released_in(self, module: torch.nn.Module) -> list[str]:
        """The names of released parameters that ``module`` would use as they are (not
        swapped for values by ``functional_call``)."""
        if not self.released:
            return []
        out = []
        for k in self.pieces:
            owner, _, leaf = k.rpartition(".")
            sub = module.get_submodule(owner) if owner else module
            p = sub._parameters.get(leaf)
            if p is not None and p.numel() == 0 and self.layouts[k].numel > 0:
                out.append(k)
        return out

    # ------------------------------------------------------------------ values for the step

    def values(self) -> dict[str, torch.Tensor]:
        """Per parameter, its ``(n, s)`` rows as the pmap takes them: a ShardedTensor
        over the pieces (a plain tensor on one device), detached."""
        return {k: _detached(shards) for k, shards in self.pieces.items()}

    def set_grads(self, grads: dict[str, torch.Tensor]) -> None:
        """Each piece's ``.grad``: its rows of ``grads`` (the step's sharded gradients);
        None for a parameter the loss does not reach, as after ``loss.backward()``."""
        for k, shards in self.pieces.items():
            g = grads.get(k)
            parts: list[torch.Tensor | None] = [None] * len(shards) if g is None else _rows_like(_pieces_of(g), shards)
            if len(parts) != len(shards):
                raise RuntimeError(
                    f"sharded step: the gradient of {k!r} came back in {len(parts)} pieces, not {len(shards)}"
                )
            for piece, part in zip(shards, parts):
                piece.tensor.grad = None if part is None else part.detach().to(piece.tensor.device)

    def bytes_per_device(self, optimizer: torch.optim.Optimizer | None) -> dict[Device, int]:
        """The bytes each device holds for the trained parameters: their pieces, the
        pieces' gradients and ``optimizer``'s state for them."""
        out: dict[Device, int] = {}
        for shards in self.pieces.values():
            for s in shards:
                held = [s.tensor, s.tensor.grad]
                if optimizer is not None:
                    held += list(optimizer.state.get(s.tensor, {}).values())
                out[s.device] = out.get(s.device, 0) + sum(
                    t.numel() * t.element_size() for t in held if isinstance(t, torch.Tensor)
                )
        return out


def _copy(rows: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in rows.items()}


def _gathered(axis_name: Hashable) -> Callable[[dict[str, torch.Tensor]], Any]:
    def gather(rows: dict[str, torch.Tensor]) -> Any:
        return all_gather(rows, axis_name, tiled=True)

    return gather


def _pieces_of(value: torch.Tensor) -> list[Shard]:
    """A pmap result mapped along dim 0 as (device, tensor) pieces: a ShardedTensor's
    shards, or the one tensor of a pmap on one device."""
    if isinstance(value, ShardedTensor):
        return list(value.shards)
    found = _devices.at(value.device)
    if found is None:
        raise RuntimeError(f"sharded step: a shard on {value.device}, which is none of torchpmap's devices")
    return [Shard(found[0], value)]


def _rows_like(pieces: list[Shard], shards: list[Shard]) -> list[torch.Tensor | None]:
    """``pieces`` (a gradient's, rows along dim 0) regrouped as ``shards`` hold their rows:
    where the instances ran one at a time, each instance's rows come back as a piece of
    their own (4 pieces for 2 devices of 2 instances), consecutive pieces of one device
    joined. Returned as they are when they cannot be so grouped (the caller says so)."""
    if len(pieces) == len(shards):
        return [p.tensor for p in pieces]
    out: list[torch.Tensor | None] = []
    rest = iter(pieces)
    for shard in shards:
        want, rows, group = shard.tensor.shape[0], 0, []
        while rows < want and (piece := next(rest, None)) is not None:
            group.append(piece.tensor.to(shard.tensor.device))
            rows += piece.tensor.shape[0]
        if rows != want:
            return [p.tensor for p in pieces]
        out.append(torch.cat(group))
    return out if next(rest, None) is None else [p.tensor for p in pieces]


def _assembled(shards: list[Shard]) -> torch.Tensor:
    return shards[0].tensor if len(shards) == 1 else ShardedTensor(shards)


def _detached(shards: list[Shard]) -> torch.Tensor:
    """The pieces, detached, as the pmap takes them (:func:`_assembled`)."""
    return _assembled([Shard(s.device, s.tensor.detach()) for s in shards])
