"""Recurrent networks under ``torch.func.grad`` inside a map: their initial state batched.

``nn.GRU``, ``nn.RNN`` and ``nn.LSTM`` called without an initial state make one of
zeros, the same for every instance (unbatched at the map's vmap level). Under
``torch.func.grad`` inside the map (``data_parallel_step``), ``grad`` decomposes the
network into its cells before vmap sees it (so
:func:`torchpmap._engines.batching_rules._recurrent` plays no part there), and the first
cell adds the instances' (batched) input gates *in place* into the gates computed from
that unbatched state: vmap cannot write a batched value into an unbatched tensor
("output with shape [8, 32] doesn't match the broadcast shape [4, 8, 32]"), and the whole
function used to run one instance at a time (``nn.GRU``, ``nn.RNN``, a float64
``nn.LSTM``; a float32 ``nn.LSTM`` on CPU goes through ``mkldnn_rnn_layer``, which vmap
loops over, state batched or not).

Given an initial state of zeros made from the input (``input.new_zeros``, batched like
it), every cell's op is batched as vmap batches it: the products with the shared weights
take all instances' rows at once, and each instance's weight gradients come out of its
own rows, as in the loop. The values are those of the module's own zeros.

:func:`zero_states_supplied` supplies that state, through forward pre-hooks on the
modules, for the duration of one call of the model (only inside a map: outside one the
hooks change nothing).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from torchpmap._state import torch_private as private

#: The modules whose decomposition writes into the state in place.
WRITES_INTO_STATE = (nn.GRU, nn.RNN, nn.LSTM)


def modules_needing_state(model: nn.Module) -> list[nn.Module]:
    """The submodules of ``model`` (itself included) that need :func:`zero_states_supplied`."""
    return [m for m in model.modules() if isinstance(m, WRITES_INTO_STATE)]


@contextlib.contextmanager
def zero_states_supplied(modules: Sequence[nn.Module]) -> Iterator[None]:
    """While the block runs, each of ``modules`` called inside a map with its input alone
    gets an initial state of zeros made from that input (see the module docstring)."""
    if not modules:
        yield
        return
    handles = [m.register_forward_pre_hook(_supply_zero_state, with_kwargs=True) for m in modules]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _supply_zero_state(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """The forward pre-hook: ``(input,)`` (or an ``hx`` of None) becomes ``(input, zeros)``
    inside a map; anything else (a state given, a PackedSequence, no map) is left as it is."""
    if private.current_vmap_level() is None or not args or len(args) > 2:
        return None
    given = args[1] if len(args) == 2 else kwargs.get("hx")
    x = args[0]
    if given is not None or not isinstance(x, torch.Tensor) or x.dim() not in (2, 3):  # a PackedSequence: as it is
        return None
    return (x, zero_state(module, x)), {k: v for k, v in kwargs.items() if k != "hx"}


def zero_state(module: Any, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The initial state ``module`` (an ``nn.GRU``, ``nn.RNN`` or ``nn.LSTM``) makes for
    input ``x`` when given none (layers x batch x hidden, or layers x hidden for an
    unbatched input; for the LSTM the pair (h, c), h of ``proj_size`` when it projects),
    as zeros made from ``x`` (batched where ``x`` is)."""
    layers = module.num_layers * (2 if module.bidirectional else 1)
    batch = (x.size(0 if module.batch_first else 1),) if x.dim() == 3 else ()
    if not isinstance(module, nn.LSTM):
        return x.new_zeros(layers, *batch, module.hidden_size)
    out = module.proj_size if module.proj_size > 0 else module.hidden_size
    return x.new_zeros(layers, *batch, out), x.new_zeros(layers, *batch, module.hidden_size)
