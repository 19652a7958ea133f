"""Layer by layer gathering for the sharded step (FSDP): each layer's weight is whole only
while that layer runs.

A sharded step (``data_parallel_step(shard_params=...)``) holds ``1/N`` of each trained
parameter on each instance, as a flat row (:mod:`~torchpmap._frontend.flat_shards`).
Gathering every row before the forward would make each instance hold the whole model
for the length of the step, since autograd keeps what a layer saves for its backward
(a ``Linear`` saves its weight) until that backward. Here each *layer* of PyTorch's own
(:data:`LAYER_FORWARDS`) gathers its own rows when it is called, computes, and lets the
gathered weight go; its backward gathers them again and runs the layer once more to
differentiate it (activation checkpointing of that one layer, as JAX's FSDP recipe
rematerializes its ``all_gather``). So an instance holds, besides its rows, at most the
weights of the layer running and the small parameters of the modules that are not such
layers (gathered at the start of the step).

Autograd's transpose of the ``all_gather`` is a ``psum_scatter``, as when every row is
gathered at once: each instance receives the sum over the instances of its own row's
gradient. The layer is called inside an ``autograd.Function``
(:class:`_GatheredLayer`) whose forward gathers and computes and whose backward
recomputes under :func:`torch.func.vjp`; both run the same collectives on every
instance, in the same order, on every placement.

A forward that waits in a collective hands the device threads' turn over (see
:func:`torchpmap._engines.multi_device.run_threads`) while ``functional_call`` has this
instance's tensors swapped into the module. So each thread runs the step on a *shadow*
of the module (:class:`Shadow`): new module objects that share every attribute of the
user's modules but the dicts of parameters, buffers and submodules, made at every step
(so a change to the model between steps, ``.eval()``, a new dropout rate, is seen), and
attributes the forward sets are set on the user's modules after it.

While the step runs, the user's module holds an :class:`Unread` placeholder for each
trained parameter: code that reads a parameter directly (a weight decay over
``model.parameters()`` in the loss, a head tied through ``F.linear(h, emb.weight)``)
gets it gathered where it reads it.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.func import vjp

from torchpmap._collectives.public import all_gather
from torchpmap._engines import module_modes
from torchpmap._frontend.flat_shards import FlatLayout
from torchpmap._frontend.reached import reached
from torchpmap._state.context import Autocast, autocast_as, autocast_regions, run_in_copy
from torchpmap._state.torch_private import make_wrapper_subclass, pytree

#: The forwards of PyTorch layers that read only their own parameters, hold no buffers
#: and no submodules, draw no random numbers and write nothing: running one again in
#: its backward gives the same values. A subclass that keeps its class's forward counts.
LAYER_FORWARDS: frozenset[Callable[..., Any]] = frozenset(
    f.forward
    for f in (
        torch.nn.Linear, torch.nn.Bilinear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d,
        torch.nn.ConvTranspose1d, torch.nn.ConvTranspose2d, torch.nn.ConvTranspose3d, torch.nn.Embedding,
        torch.nn.LayerNorm, torch.nn.GroupNorm, *((torch.nn.RMSNorm,) if hasattr(torch.nn, "RMSNorm") else ()),
    )
)


def layers(model: torch.nn.Module, sharded: Mapping[str, FlatLayout]) -> dict[str, dict[str, str]]:
    """The modules of ``model`` gathered layer by layer: module path -> {its own
    parameter's attribute name -> the sharded parameter's name}. A module qualifies when
    its forward is one of :data:`LAYER_FORWARDS`, it has no buffers and no submodules,
    every parameter it holds is sharded (trained), and (an ``Embedding``) it neither
    renormalizes its weight (``max_norm``) nor makes sparse gradients."""
    by_identity = {id(p): k for k, p in model.named_parameters() if k in sharded}
    modules = dict(model.named_modules(remove_duplicate=False))
    found: dict[str, dict[str, str]] = {}
    for path, module in modules.items():
        own = {a: by_identity.get(id(p)) for a, p in module._parameters.items() if p is not None}
        if own and all(k is not None for k in own.values()) and _is_layer(module):
            found[path] = {a: k for a, k in own.items() if k is not None}
    # a parameter shared with a module that is not such a layer is gathered at the start
    # for it, and so for the layers that share it too
    elsewhere = {
        id(p) for path, module in modules.items() if path not in found for p in module._parameters.values()
    }
    return {
        path: names for path, names in found.items()
        if not any(id(modules[path]._parameters[a]) in elsewhere for a in names)
    }


def _is_layer(module: torch.nn.Module) -> bool:
    """Whether ``module`` runs its class's own forward on its own ``weight`` and ``bias``
    (not on a weight made by a forward pre-hook from others, as the old
    ``torch.nn.utils.weight_norm``'s ``weight_g`` and ``weight_v``), with no pre-hook
    that could change them first."""
    if getattr(type(module), "forward", None) not in LAYER_FORWARDS or "forward" in module.__dict__:
        return False
    if module._buffers or module._modules or module._forward_pre_hooks:
        return False
    if not set(module._parameters) <= {"weight", "bias"} or any(a in module.__dict__ for a in ("weight", "bias")):
        return False
    return not (isinstance(module, torch.nn.Embedding) and (module.max_norm is not None or module.sparse))


_TENSOR = object()  # where a tensor goes among a layer call's leaves


@dataclasses.dataclass
class _LayerCall:
    """What one call of a layer needs besides its tensors: the layer, how its arguments
    and rows sit among the tensors handed to :class:`_GatheredLayer`, the axis and the
    rows' layouts."""

    layer: torch.nn.Module
    spec: pytree.TreeSpec  # of (args, kwargs)
    constants: list[Any]  # the non-tensor leaves of (args, kwargs), _TENSOR where a tensor goes
    names: tuple[str, ...]  # the layer's own attribute names of its parameters, in the rows' order
    layouts: tuple[FlatLayout, ...]
    axis_name: Any
    owner: LayerRows  # whose forward is open while a derivative taken inside it runs
    autocast: tuple[Autocast, ...]  # the regions the forward ran under: the backward runs it again so
    #: the forward's context (its bound axes, devices, instance thread): the backward runs the layer
    #: again in it, since autograd runs a CUDA backward in a thread of its own, where no axis is bound
    context: contextvars.Context

    def run(self, tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The layer's output: its rows gathered (the last ``len(names)`` tensors), cut
        to the parameters' shapes and put in place for one call of its own forward."""
        count = len(self.names)
        inputs, rows = tensors[: len(tensors) - count], tensors[len(tensors) - count:]
        gathered = all_gather(tuple(rows), self.axis_name, tiled=True)
        weights = {a: layout.unflatten(g) for a, layout, g in zip(self.names, self.layouts, gathered)}
        it = iter(inputs)
        leaves = [next(it) if c is _TENSOR else c for c in self.constants]
        args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        own: dict[str, Any] = self.layer._parameters  # tensors, not Parameters, for one call
        before = {a: own[a] for a in self.names}
        try:
            own.update(weights)  # within this thread's own shadow of the layer: see Shadow
            return type(self.layer).forward(self.layer, *args, **kwargs)
        finally:
            own.update(before)


class _GatheredLayer(torch.autograd.Function):
    """One layer call: gathers its rows and computes in the forward; keeps only the
    inputs and the rows; in the backward gathers and computes again, under ``vjp``."""

    generate_vmap_rule = True

    @staticmethod
    def forward(call: _LayerCall, *tensors: torch.Tensor) -> torch.Tensor:
        return call.run(tensors)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        call, *tensors = inputs
        ctx.call = call
        ctx.save_for_backward(*tensors)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        tensors = ctx.saved_tensors
        wanted = [i for i, t in enumerate(tensors) if t.is_floating_point() or t.is_complex()]

        def again(*differentiated: torch.Tensor) -> torch.Tensor:
            full = list(tensors)
            for i, t in zip(wanted, differentiated):
                full[i] = t
            return ctx.call.run(tuple(full))

        # torch.func's grad differentiates with create_graph=True, so ops here would be
        # recorded for a second derivative, keeping this layer's gathered weight alive
        # until the step ends: not recorded when the step's own backward runs this. A
        # derivative taken inside the forward (a gradient penalty) is part of the loss,
        # and is differentiated again: recorded then.
        def pulled_back() -> tuple[torch.Tensor, ...]:
            with contextlib.nullcontext() if ctx.call.owner.open else torch.no_grad(), autocast_as(ctx.call.autocast):
                _, pull = vjp(again, *(tensors[i] for i in wanted))[:2]
                return pull(grad)

        pulled = run_in_copy(ctx.call.context, pulled_back)
        grads: list[torch.Tensor | None] = [None] * len(tensors)
        for i, g in zip(wanted, pulled):
            grads[i] = g
        return (None, *grads)


class LayerRows:
    """The rows that the layers of one instance's forward gather, and the tensors made
    from them that tell which of them the loss reaches (see
    :func:`torchpmap._frontend.reached.reached`)."""

    def __init__(
        self, rows: Mapping[str, torch.Tensor], layouts: Mapping[str, FlatLayout], axis_name: Any,
        shadow: Shadow | None = None,
    ):
        self.rows, self.layouts, self.axis_name = rows, layouts, axis_name
        self.used: list[tuple[str, torch.Tensor]] = []
        self.open = False  # while the instance's forward runs (see rows_for)
        self.read: dict[str, torch.Tensor] = {}  # parameters gathered where read directly (see Unread)
        self.shadow = shadow  # the module objects the forward runs on, and their buffers

    def value_of(self, placeholder: Unread) -> torch.Tensor:
        """What an :class:`Unread` placeholder stands for in this instance's forward."""
        if placeholder.owner is None:
            return self.whole(placeholder.param)
        assert self.shadow is not None
        return self.shadow.copy_of(placeholder.owner)._buffers[placeholder.attr]  # type: ignore[return-value]

    def whole(self, name: str) -> torch.Tensor:
        """Parameter ``name`` whole, gathered from its rows at its first direct read in
        this forward (the same on every instance: each runs the same program)."""
        got = self.read.get(name)
        if got is None:
            got = self.layouts[name].unflatten(all_gather(self.rows[name], self.axis_name, tiled=True))
            self.read[name] = got
            self.used.append((name, got))
        return got

    def call(self, layer: torch.nn.Module, names: Mapping[str, str], args: tuple, kwargs: dict) -> torch.Tensor:
        """``layer(*args, **kwargs)`` with its parameters gathered from their rows."""
        leaves, spec = pytree.tree_flatten((args, kwargs))
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        constants = [_TENSOR if isinstance(t, torch.Tensor) else t for t in leaves]
        rows = []
        for k in names.values():
            seen = self.rows[k].view_as(self.rows[k])  # a node of its own: reached() finds this use
            self.used.append((k, seen))
            rows.append(seen)
        call = _LayerCall(
            layer, spec, constants, tuple(names), tuple(self.layouts[k] for k in names.values()), self.axis_name,
            self, autocast_regions(), contextvars.copy_context(),
        )
        return _GatheredLayer.apply(call, *tensors, *rows)

    def reached(self, loss: torch.Tensor, gathered: Mapping[str, torch.Tensor]) -> set[str]:
        """The names of the parameters ``loss`` depends on: through the layers that used
        their rows, or through ``gathered`` (the parameters gathered at the start)."""
        uses = {**{(k, -1): t for k, t in gathered.items()}, **{(k, i): t for i, (k, t) in enumerate(self.used)}}
        keys = list(uses)
        found = reached(loss, {str(j): uses[key] for j, key in enumerate(keys)})
        return {keys[int(j)][0] for j in found}


class _Current(threading.local):
    rows: LayerRows | None = None


_current = _Current()


def _forward_of(layer: torch.nn.Module, names: dict[str, str]) -> Callable[..., torch.Tensor]:
    def forward(*args: Any, **kwargs: Any) -> torch.Tensor:
        rows = _current.rows
        if rows is None:
            raise RuntimeError(
                f"torchpmap: a shadow of {type(layer).__name__} made for a sharded step was called outside the step"
            )
        return rows.call(layer, names, args, kwargs)

    return forward


#: What a shadow holds of its own: never written back to the module it stands for.
_OWN = frozenset({"_parameters", "_buffers", "_modules", "forward", "_flat_weights"})


class Shadow:
    """New module objects for a module and its submodules (:attr:`root`), sharing every
    attribute of theirs (``training``, hooks, configuration) but their own dicts of
    parameters, buffers and submodules, which ``functional_call`` swaps tensors into;
    the modules at the paths of ``gathered`` run through :class:`_GatheredLayer` with the
    rows of :func:`rows_for`. An attribute that the forward sets on a shadow (a count, a
    cached mask) is set on its module by :meth:`write_back`, as when the forward ran on
    the module itself."""

    def __init__(self, module: torch.nn.Module, gathered: Mapping[str, Mapping[str, str]]):
        self.pairs: list[tuple[torch.nn.Module, torch.nn.Module]] = []
        self.root = self._copy(module, gathered, "")
        self._copies = {id(m): c for m, c in reversed(self.pairs)}  # a module at two paths: its first copy

    def copy_of(self, module: torch.nn.Module) -> torch.nn.Module:
        """The shadow of one of the module's submodules."""
        return self._copies[id(module)]

    def _copy(self, module: torch.nn.Module, gathered: Mapping[str, Mapping[str, str]], path: str) -> torch.nn.Module:
        copy = object.__new__(type(module))
        copy.__dict__.update(module.__dict__)
        copy.__dict__["_parameters"] = dict(module._parameters)
        copy.__dict__["_buffers"] = dict(module._buffers)
        if isinstance(module.__dict__.get("_flat_weights"), list):  # an RNN's: refreshed in place as weights swap
            copy.__dict__["_flat_weights"] = list(module.__dict__["_flat_weights"])
        copy.__dict__["_modules"] = {
            name: None if child is None else self._copy(child, gathered, f"{path}.{name}" if path else name)
            for name, child in module._modules.items()
        }
        names = gathered.get(path)
        if names is not None:
            copy.__dict__["forward"] = _forward_of(copy, dict(names))
        self.pairs.append((module, copy))
        module_modes.stands_for(copy, module)  # a jit=True trace keys on the module's train/eval mode
        return copy

    def write_back(self) -> None:
        """Sets on each module the attributes its shadow was given since it was made."""
        for module, copy in self.pairs:
            mine = module.__dict__
            for k, v in copy.__dict__.items():
                if k not in _OWN and mine.get(k, _OWN) is not v:
                    mine[k] = v


class rows_for:
    """``with rows_for(rows):`` the gathered layers this thread calls take their rows
    from ``rows`` (a :class:`LayerRows`)."""

    def __init__(self, rows: LayerRows):
        self.rows = rows

    def __enter__(self) -> LayerRows:
        self.before, _current.rows = _current.rows, self.rows
        self.rows.open = True
        return self.rows

    def __exit__(self, *exc: object) -> None:
        _current.rows, self.rows.open = self.before, False


#: Tensor queries that read only a placeholder's metadata: answered without gathering.
_METADATA: frozenset[Any] = frozenset(
    [
        *(getattr(torch.Tensor, a).__get__ for a in ("shape", "dtype", "device", "requires_grad", "ndim", "is_leaf",
                                                    "grad", "layout")),
        torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.nelement, torch.Tensor.element_size,
        torch.Tensor.is_floating_point, torch.Tensor.is_complex, torch.Tensor.__len__,
    ]
)


class Unread(torch.Tensor):
    """A tensor of the user's module while a sharded step runs, in place of a trained
    parameter or (gathering layer by layer) a buffer. Code that reads it directly, not
    through the call of its layer (a penalty over ``model.parameters()`` in the loss,
    ``F.linear(h, self.embed.weight)``, the model called again by the loss), gets the
    value of the instance it runs for: a parameter's whole value, gathered from that
    instance's rows at its first read; a buffer as the instance's own copy of it, the one
    the step's forward reads and writes. Its shape, dtype and device answer without
    that. It holds no data: outside a step's forward it refuses to be read."""

    #: Torch function modes that would hold a lock or a turn across the op (a random
    #: stream's) let it go first (see random_per_instance.resolves_first): its read may
    #: gather, a collective.
    torchpmap_resolves_first = True

    param: str  # its name in the model
    owner: torch.nn.Module | None  # a buffer's module (None for a parameter)
    attr: str  # a buffer's name in its module

    @staticmethod
    def __new__(cls, name: str, like: torch.Tensor, shape: torch.Size, owner: torch.nn.Module | None = None,
                attr: str = "") -> Unread:
        out = make_wrapper_subclass(
            cls, shape, dtype=like.dtype, device=like.device, requires_grad=owner is None and like.requires_grad
        )
        out.param, out.owner, out.attr = name, owner, attr
        return out

    def __repr__(self) -> str:  # type: ignore[override]
        return f"Unread({self.param!r}, shape={tuple(self.shape)}, dtype={self.dtype})"

    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func in _METADATA:
            return super().__torch_function__(func, types, args, kwargs)
        rows = _current.rows
        if rows is None:
            name = next(t.param for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, Unread))
            raise RuntimeError(
                f"torchpmap: the model's tensor {name!r} was read while a data_parallel_step(shard_params=...) "
                "ran, outside the forward of any of its instances (another thread, or autograd's backward): its "
                "values are the step's. Read it inside the model or the loss, or after step.gather_params()."
            )
        args, kwargs = pytree.tree_map_only(Unread, rows.value_of, (args, kwargs))
        return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]  # torch declares it without func
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        name = next(t.param for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, Unread))
        raise RuntimeError(
            f"torchpmap: {func} reached the model's tensor {name!r} below torch functions, where a sharded step "
            "cannot give it its value. Read it through a torch function or method, or train with the replicated "
            "step (leave shard_params out)."
        )


@contextlib.contextmanager
def read_on_demand(
    model: torch.nn.Module, layouts: Mapping[str, FlatLayout], buffers: bool = False
) -> Iterator[None]:
    """While the block runs, every trained parameter of ``model`` (at every module that
    holds it), and with ``buffers`` every buffer, is an :class:`Unread` placeholder; the
    module's own tensors again after."""
    names = {id(p): k for k, p in model.named_parameters() if k in layouts}
    placeholders = {k: Unread(k, model.get_parameter(k), layouts[k].shape) for k in set(names.values())}
    held: list[tuple[dict[str, Any], str, torch.Tensor, torch.Tensor]] = []
    for path, module in model.named_modules(remove_duplicate=False):
        for attr, p in module._parameters.items():
            if p is not None and id(p) in names:
                held.append((module._parameters, attr, p, placeholders[names[id(p)]]))
        if buffers:
            for attr, b in module._buffers.items():
                if b is not None:
                    name = f"{path}.{attr}" if path else attr
                    held.append((module._buffers, attr, b, Unread(name, b, b.shape, module, attr)))
    try:
        for where, attr, _, placeholder in held:
            where[attr] = placeholder
        yield
    finally:
        for where, attr, tensor, _ in held:
            where[attr] = tensor
