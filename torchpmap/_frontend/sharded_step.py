"""The sharded data-parallel step (ZeRO-3, FSDP): ``data_parallel_step(shard_params=...)``.

Every instance of the data axis holds ``1/N`` of every trained parameter (a flat row,
see :mod:`~torchpmap._frontend.flat_shards`), of its gradient and of the optimizer's
state for it. A step, on every instance:

1. the forward, with the model's layers of PyTorch's own (``Linear``, ``Conv*d``,
   ``Embedding``, the norms without buffers) gathering their own rows as each runs and
   letting the gathered weight go after it; the backward gathers them again, layer by
   layer (:mod:`~torchpmap._frontend.layer_gather`). The other trained parameters
   (a batch norm's, a custom module's) are gathered at the start, in one ``all_gather``;
2. the gradient with respect to the *rows*: autograd's transpose of ``all_gather`` is
   ``psum_scatter``, so each instance receives the sum over the instances of its own
   row's gradient, divided by ``N`` here: the averaged gradient, already split;
3. ``pmean`` of the loss, the buffers' changes and ``aux``, as the replicated step.

Then the optimizer steps the rows (it holds them in place of the parameters, see
:mod:`~torchpmap._frontend.sharded_params`), which is the replicated step's update only
for an elementwise optimizer (:mod:`~torchpmap._frontend.elementwise_optimizers`).

Each device thread runs the forward on a shadow of the module of its own
(:class:`layer_gather.Shadow`): a layer's gather is a collective inside the forward,
and the threads take turns at collectives (see ``layer_gather``'s docstring).
"""
from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, Protocol

import torch

from torchpmap._collectives.public import all_gather, pmean, psum
from torchpmap._engines import instance_autograd
from torchpmap._frontend import buffer_means, layer_gather, sparse_gradients
from torchpmap._frontend.api import pmap
from torchpmap._frontend.instance_grad import instance_grad_and_value
from torchpmap._frontend.reached import reached
from torchpmap._frontend.sharded_params import ShardedParams
from torchpmap._placement import devices as _devices
from torchpmap._placement.devices import Device, DeviceLike
from torchpmap._state.listing import first_few
from torchpmap._state.torch_private import pytree
from torchpmap._state.type_aliases import PyTree, Randomness

Tensors = dict[str, torch.Tensor]


class RunModel(Protocol):
    """One instance's forward: ``(params, frozen, floating buffers, other buffers, batch,
    module) -> (loss, aux, the buffers after the forward)``, through ``module`` (by
    default the model and loss as one module, or a shadow of it) (``data_parallel_step``'s
    ``run_model``)."""

    def __call__(
        self, params: Tensors, frozen: Tensors, floating: Tensors, other: Tensors, batch: Any,
        module: torch.nn.Module | None = None,
    ) -> tuple[torch.Tensor, PyTree, Tensors]: ...


#: The step's result for the gradients, loss, buffer changes, counters, aux, the squared
#: L2 norm of the whole averaged gradient (None unless the step clips) and the number of
#: its elements that are inf or NaN, over every instance (None unless the step counts them).
StepOut = tuple[Tensors, torch.Tensor, buffer_means.Sent, Tensors, PyTree, torch.Tensor | None, torch.Tensor | None]


def sharded_instance_step(
    run_model: RunModel, params: ShardedParams, axis_name: Hashable, has_aux: bool, clips: bool = False,
    counts_nonfinite: bool = False, module: torch.nn.Module | None = None,
    layers: Mapping[str, Mapping[str, str]] | None = None,
) -> Callable[..., StepOut]:
    """One instance's step on its rows: gather, loss, gradient of the rows, means (and,
    when the step ``clips``, the psum over the instances of its rows' squared norms; when
    it ``counts_nonfinite``, the psum of its rows' inf and NaN elements).

    ``layers`` (paths in ``module``, see :func:`layer_gather.layers`): the modules that
    gather their own rows as they run; the other rows are gathered at the start."""
    layouts = params.layouts
    layers = dict(layers or {})
    by_layer = {k for names in layers.values() for k in names.values()}

    def instance_step(
        rows: Tensors, frozen: Tensors, floating: Tensors, other: Tensors, batch: Any, scale: torch.Tensor | None
    ) -> StepOut:
        found: list[str] = []

        def loss_of(rows: Tensors) -> tuple[torch.Tensor, tuple[Tensors, torch.Tensor, PyTree]]:
            at_start = {k: v for k, v in rows.items() if k not in by_layer}
            gathered = all_gather(at_start, axis_name, tiled=True) if at_start else {}
            whole = {k: layouts[k].unflatten(gathered[k]) for k in at_start}
            if not by_layer:
                loss, aux, state = run_model(whole, frozen, floating, other, batch)
                found.extend(reached(loss, whole))
            else:
                # this thread's own module objects: see layer_gather's docstring
                assert module is not None
                own = layer_gather.Shadow(module, layers)
                with layer_gather.rows_for(layer_gather.LayerRows(rows, layouts, axis_name, own)) as used:
                    loss, aux, state = run_model(whole, frozen, floating, other, batch, own.root)
                own.write_back()
                met = used.reached(loss, whole)
                found.extend(k for k in rows if k in met)
            return (loss if scale is None else loss * scale), (state, loss, aux)

        grads, (_, (state, loss, aux)) = instance_grad_and_value(loss_of, rows)
        total = layouts[next(iter(layouts))].instances
        grads = {k: grads[k] / total for k in found}  # psum_scatter summed them: their mean
        buffer_change = buffer_means.sent(state, floating)
        counters = {k: state[k] for k in other}
        if has_aux:
            loss, buffer_change, aux = pmean((loss, buffer_change, aux), axis_name)
        else:
            loss, buffer_change = pmean((loss, buffer_change), axis_name)
        squared_norm = None
        if clips:  # the rows partition the gradient (the padding is zero): their squares sum to its norm's
            # in float32 at least, float64 where a gradient is (clip_grad_norm_ keeps its precision)
            wide = torch.float64 if any(g.dtype == torch.float64 for g in grads.values()) else torch.float32
            zero = torch.zeros((), device=loss.device, dtype=wide)
            mine = sum((g.to(wide).pow(2).sum() for g in grads.values()), zero)
            squared_norm = psum(mine, axis_name)
        nonfinite = None
        if counts_nonfinite:  # every process must agree on GradScaler's skip (see ShardedStep._agree_on_skip)
            bad = sum(((~torch.isfinite(g)).sum() for g in grads.values()), torch.zeros((), device=loss.device))
            nonfinite = psum(bad.float(), axis_name)
        return grads, loss, buffer_change, counters, aux, squared_norm, nonfinite

    return instance_step


class ShardedStep:
    """``data_parallel_step(..., shard_params=...)``: call it with a sharded batch as
    the replicated step; between calls the parameters, gradients and optimizer state
    are split over the data axis (see ``data_parallel_step``).

    The module's trained parameters are emptied (0 elements) after the first call: the
    step holds their values. :meth:`gather_params` writes them back into the module
    (to evaluate, save, or change them); the next call takes them from there again.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        grad_scaler: torch.amp.GradScaler | None,
        *,
        run_model: RunModel,
        module: torch.nn.Module,
        prepare: Callable[[PyTree], tuple[PyTree, int]],
        start: Callable[[], None],
        write_buffers: Callable[[buffer_means.Sent, Tensors, Tensors], None],
        split_buffers: Callable[[], tuple[Tensors, Tensors]],
        axis_name: Hashable,
        devices: Sequence[DeviceLike] | None,
        jit: bool | Mapping[str, Any],
        randomness: Randomness,
        has_aux: bool,
        max_grad_norm: float | None = None,
        reshard_after_forward: bool = True,
    ) -> None:
        self.model, self.optimizer, self.grad_scaler = model, optimizer, grad_scaler
        self.max_grad_norm, self.reshard_after_forward = max_grad_norm, reshard_after_forward
        self._run_model, self._prepare, self._start = run_model, prepare, start
        self._module = module
        #: The modules that gather their parameters as they run, by path in the model
        #: (see :mod:`~torchpmap._frontend.layer_gather`), known at the first call.
        self.layers: dict[str, dict[str, str]] = {}
        self._write_buffers, self._split_buffers = write_buffers, split_buffers
        self.axis_name, self._devices, self._jit, self._randomness = axis_name, devices, jit, randomness
        self.has_aux = has_aux
        self.params: ShardedParams | None = None
        self._step: Callable[..., StepOut] | None = None
        model.register_forward_pre_hook(self._refuse_released)

    # ------------------------------------------------------------------ the step

    def __call__(self, batch: PyTree) -> Any:
        sparse_gradients.refuse(self.model)
        batch, n = self._prepare(batch)
        params = self._params(n)
        scaled = self.grad_scaler is not None and self.grad_scaler.is_enabled()
        if self._step is None:
            self._step = pmap(
                sharded_instance_step(
                    self._run_model, params, self.axis_name, self.has_aux, clips=self.max_grad_norm is not None,
                    counts_nonfinite=scaled and _devices.process_count() > 1, module=self._module,
                    layers={f"model.{p}" if p else "model": names for p, names in self.layers.items()},
                ),
                axis_name=self.axis_name,
                in_axes=(0, None, 0, None, 0, None),
                out_axes=(0, None, None, None, None, None, None),
                devices=self._devices,
                jit=self._jit,
                randomness=self._randomness,
            )
        named = dict(self.model.named_parameters())
        frozen = {k: p.detach() for k, p in named.items() if k not in params.pieces and not p.requires_grad}
        floating, other = self._split_buffers()
        per_instance = {k: b.unsqueeze(0).expand(n, *b.shape) for k, b in floating.items()}
        scale = None
        if scaled:
            assert self.grad_scaler is not None
            device = next(iter(params.pieces.values()))[0].tensor.device
            scale = self.grad_scaler.scale(torch.ones((), device=device))
        # code reading the model's tensors directly gets the step's values of them
        # backward hooks: refused by self._prepare
        with layer_gather.read_on_demand(self.model, params.layouts, buffers=bool(self.layers)), \
                instance_autograd.checked_by_caller():
            grads, loss, buffer_change, counters, aux, squared_norm, nonfinite = self._step(
                params.values(), frozen, per_instance, other, batch, scale
            )
        with torch.no_grad():
            params.set_grads(grads)
            for k in frozen:  # no gradient, as after zero_grad(): a stale one would be applied again
                named[k].grad = None
            self._write_buffers(buffer_change, counters, floating)
            if nonfinite is not None:
                self._agree_on_skip(params, nonfinite)
        if squared_norm is not None:
            self._clip(params, squared_norm, scale)
        if self.grad_scaler is not None:
            self.grad_scaler.step(self.optimizer)
            self.grad_scaler.update()
        else:
            self.optimizer.step()
        if self.has_aux:
            return loss.detach(), pytree.tree_map(lambda a: a.detach(), aux)
        return loss.detach()

    @staticmethod
    def _agree_on_skip(params: ShardedParams, nonfinite: torch.Tensor) -> None:
        """Across processes, each process' GradScaler sees only its own rows' gradients:
        an inf in a row of one process would skip the step there and not elsewhere. When
        any instance's rows hold an inf or NaN (``nonfinite``, summed over all of them),
        one gradient element on this process is made inf too, so that every process'
        GradScaler skips the step and backs off its scale, as one process' would. It adds
        0 otherwise (no host synchronisation)."""
        for shards in params.pieces.values():
            for piece in shards:
                grad = piece.tensor.grad
                if grad is not None and grad.numel():
                    poison = torch.where(nonfinite.to(grad.device) > 0, float("inf"), 0.0).to(grad.dtype)
                    grad.view(-1)[:1].add_(poison)
                    return

    def _clip(self, params: ShardedParams, squared_norm: torch.Tensor, scale: torch.Tensor | None) -> None:
        """``torch.nn.utils.clip_grad_norm_``'s update on the rows: each row's gradient
        times ``min(1, max_norm / (norm + 1e-6))``, with the norm of the whole gradient
        (summed over every instance inside the step), unscaled first under a GradScaler."""
        assert self.max_grad_norm is not None
        norm = squared_norm.sqrt()
        if scale is not None and self.grad_scaler is not None:
            self.grad_scaler.unscale_(self.optimizer)  # the rows' gradients, as PyTorch's AMP recipe clips
            norm = norm / scale.to(norm.device)
        factor = torch.clamp(self.max_grad_norm / (norm + 1e-6), max=1.0)
        with torch.no_grad():
            for shards in params.pieces.values():
                for piece in shards:
                    if piece.tensor.grad is not None:
                        piece.tensor.grad.mul_(factor.to(piece.tensor.grad.device, piece.tensor.grad.dtype))

    def _params(self, n: int) -> ShardedParams:
        """The shards: made at the first call (from the module's values, after process
        0's are copied everywhere), taken from the module again after gather_params."""
        if self.params is None:
            self._start()
            names = [k for k, p in self.model.named_parameters() if p.requires_grad]
            params = ShardedParams.split(self.model, names, n, self.axis_name, self._devices)
            params.move_optimizer(self.optimizer)
            self.layers = layer_gather.layers(self.model, params.layouts) if self.reshard_after_forward else {}
            params.release_module()
            self.params = params
            return params
        params = self.params
        if n != params.count:
            raise ValueError(
                f"data_parallel_step(shard_params=...): the batch has {n} instances along its leading axis, but the "
                f"step split the parameters into rows for {params.count} at its first call "
                f"({params.count * _devices.process_count()} in all). Shard every batch into the same number of "
                f"instances (torchpmap.training.shard(batch, n={params.count})), or build a new step."
            )
        trained = {k for k, p in self.model.named_parameters() if p.requires_grad}
        if trained != set(params.pieces):
            raise ValueError(self._trained_set_changed(trained, set(params.pieces)))
        if not params.module_is_released():
            params.reload_from_module()
        return params

    @staticmethod
    def _trained_set_changed(now: set[str], sharded: set[str]) -> str:
        def listed(names: set[str]) -> str:
            return first_few([repr(k) for k in sorted(names)])

        changes = []
        if now - sharded:
            changes.append(f"{listed(now - sharded)} now require{'s' if len(now - sharded) == 1 else ''} grad")
        if sharded - now:
            changes.append(f"{listed(sharded - now)} no longer require{'s' if len(sharded - now) == 1 else ''} grad")
        return (
            "data_parallel_step(shard_params=...): the parameters that require grad changed since the step's first "
            f"call ({'; '.join(changes)}). The step split the parameters that required grad then into rows, with "
            "their optimizer state, and trains those: it would leave a newly unfrozen parameter as it is and keep "
            "training a frozen one. To freeze or unfreeze, call step.gather_params() and keep "
            "step.optimizer_state_dict(), then build a new optimizer and step (see the training loop tutorial)."
        )

    # ------------------------------------------------------------------ the module's view

    def gather_params(self) -> None:
        """Writes the whole value of every trained parameter into the module, in place
        of the emptied ones, e.g. to evaluate the model, read or save ``state_dict()``,
        or load new values into it. The module holds them until the next step, which
        takes them (and any change made to them) back into its shards. Across processes
        every process must call it (it is an ``all_gather``)."""
        if self.params is not None and self.params.released:
            self.params.gather_into_module(self.axis_name, self._devices)

    def optimizer_state_dict(self) -> dict[str, Any]:
        """The optimizer's state, whole, as the replicated step's optimizer would hold it:
        the format of PyTorch's ``get_optimizer_state_dict(model, optimizer)`` (state and
        param groups keyed by the parameters' fully qualified names), so that it saves
        with ``torch.distributed.checkpoint`` or ``torch.save`` and loads, with
        ``set_optimizer_state_dict(model, optimizer, ...)``, into an optimizer of the
        model on any number of devices and processes, sharded or not; a new sharded step
        splits it into its own rows at its first call. Across processes every process
        calls it (an ``all_gather`` of the rows)."""
        if self.params is None:  # before the first call the optimizer holds the model's own parameters
            from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

            return get_optimizer_state_dict(self.model, self.optimizer)
        return self.params.optimizer_state_dict(self.optimizer, self.axis_name, self._devices)

    def bytes_per_device(self) -> dict[Device, int]:
        """Per device, the bytes of the trained parameters' shards, their gradients and
        the optimizer's state for them (empty before the first call)."""
        if self.params is None:
            return {}
        return self.params.bytes_per_device(self.optimizer)

    def _refuse_released(self, module: torch.nn.Module, args: Any) -> None:
        """A forward pre-hook: the module called with its parameters emptied by the step."""
        if self.params is None or module is not self.model:  # the step's own shadows: see layer_gather
            return
        empty = self.params.released_in(module)
        if empty:
            raise RuntimeError(
                f"{type(module).__name__}: its parameters are held in shards by data_parallel_step(shard_params=...) "
                f"and emptied in the module ({first_few(empty)} have 0 "
                "elements). Call step.gather_params() first to write their values into the module."
            )
