"""``randomness="per_instance"``: every instance draws from its own random stream.

With ``"different"`` (torch.func.vmap's semantics) the numbers an instance draws depend on
how the instances are laid out: one device draws all instances' numbers in one call,
several devices draw per device. With ``"per_instance"`` instance ``i`` of a call draws
from a generator seeded from ``(call seed, i)``, where the call seed is one draw from the
caller's generator: the numbers are the same on one device, on several, in the debug
mode and across processes (seeded alike), like a JAX program that folds the axis index
into its key.

How: a :class:`~torch.overrides.TorchFunctionMode` inside the instances' vmap level sees
every torch call; a random one is rebuilt from *noise* drawn per instance with the
instance's generator (uniform or normal numbers of the instance's shape, outside the
vmap), stacked and wrapped as batched at the level, and deterministic math (dropout's
mask, ``normal``'s ``mean + std * noise``). Each random op costs one draw per instance
and the mode costs every torch call a Python hop (measured in ``docs/device-threads.md``),
which is why it is not the default. The instances' vmap level itself runs with
randomness ``"error"``, so a random op this module does not know (``torch.poisson``, or
one inside C++ such as ``nn.LSTM``'s dropout) raises instead of drawing
placement-dependent numbers.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from torchpmap._state import torch_private as private

_MIX = 0x9E3779B97F4A7C15  # an odd 64-bit constant: instance seeds far apart for close indices

Rule = Callable[["InstanceStreams", tuple, dict], Any]


def instance_seed(seed: int, index: int) -> int:
    """The seed of instance ``index``'s stream in a call seeded ``seed``."""
    return (seed ^ ((index + 1) * _MIX)) % (1 << 63)


def resolves_first(types: Any) -> bool:
    """Whether an argument of an op is of a tensor class that asks torch function modes
    to let its own ``__torch_function__`` go first (``torchpmap_resolves_first``: the
    sharded step's placeholders, whose read may run a collective, which must not happen
    while a random stream's lock is held). The mode returns NotImplemented then, and sees
    the op again with the values."""
    return any(getattr(t, "torchpmap_resolves_first", False) for t in types)


class InstanceStreams(TorchFunctionMode):
    """Draws the random numbers of instances ``first .. first + count - 1`` of a call.

    Args:
        seed: the call seed (one draw from the caller's generator).
        first: the global index of this slice's first instance along the axis.
        count: the number of instances in the slice.
        index: each instance's index in the slice, batched at the instances' vmap level
            (``arange(count)`` passed through the vmap), or None for one instance without
            a vmap level.
        device: where the instances' tensors live.
    """

    def __init__(self, seed: int, first: int, count: int, index: torch.Tensor | None, device: torch.device | None):
        super().__init__()
        self.seed, self.first, self.count, self.index = seed, first, count, index
        self.device = device if device is not None else torch.device("cpu")
        self._generators: list[torch.Generator] | None = None
        # the vmap the instances run in (theirs, or one around them): a random op inside
        # another vmap, nested in an instance, is refused
        self.vmap_level = private.innermost_vmap_level()

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        rule = _RULES.get(getattr(func, "__name__", ""))
        if rule is None:
            return func(*args, **kwargs)
        if resolves_first(types):
            return NotImplemented
        name = func.__name__
        if kwargs.get("generator") is torch.default_generator:  # torchpmap's own call seed of a nested pmap
            return func(*args, **kwargs)
        if kwargs.get("generator") is not None:
            raise NotImplementedError(
                f"pmap(randomness='per_instance'): {name}(generator=...) inside the mapped function; each instance "
                "draws from its own stream, seeded from the caller's generator. Drop the generator argument, or use "
                "randomness='different'."
            )
        kwargs = {k: v for k, v in kwargs.items() if k != "generator"}
        if private.innermost_vmap_level() != self.vmap_level:
            raise NotImplementedError(
                f"pmap(randomness='per_instance'): {name} inside a vmap or pmap nested in the mapped function is not "
                "supported yet (its instances would all draw the same numbers). Draw the numbers in the outer "
                "function and pass them in, or use randomness='different'."
            )
        return rule(self, args, kwargs)

    def generators(self) -> list[torch.Generator]:
        if self._generators is None:
            self._generators = [
                torch.Generator(device=self.device).manual_seed(instance_seed(self.seed, self.first + i))
                for i in range(self.count)
            ]
        return self._generators

    def noise(self, draw: Callable[[torch.Generator], torch.Tensor]) -> torch.Tensor:
        """``draw(generator)`` once per instance, as one tensor batched at this level."""
        with private.functorch_layers_cleared():  # our draws: no enclosing vmap batches or refuses them
            drawn = [draw(g) for g in self.generators()]
        if self.index is None:
            return drawn[0]
        # each instance picks its own row: an ordinary (batched) indexing op, so any
        # transform inside the instance (grad, jvp) sees the noise as a constant
        return torch.stack(drawn)[self.index]

    def uniform(self, shape: Sequence[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.noise(lambda g: torch.rand(tuple(shape), generator=g, dtype=dtype, device=self.device))


# --------------------------------------------------------------------------- the rules, op by op


def _arg(args: tuple, kwargs: dict, i: int, name: str, default: Any = None) -> Any:
    return args[i] if len(args) > i else kwargs.get(name, default)


def _size(args: tuple, kwargs: dict, start: int = 0) -> tuple[int, ...]:
    rest = args[start:]
    if len(rest) == 1 and isinstance(rest[0], (tuple, list, torch.Size)):
        return tuple(rest[0])
    return tuple(rest) if rest else tuple(kwargs["size"])


def _factory_options(kwargs: dict, device: torch.device) -> dict:
    out = {k: v for k, v in kwargs.items() if k in ("dtype", "layout", "device", "pin_memory")}
    out.setdefault("device", device)
    return out


def _finish(t: torch.Tensor, kwargs: dict) -> torch.Tensor:
    return t.requires_grad_() if kwargs.get("requires_grad") else t


def _factory(op: Callable[..., torch.Tensor], size_from: int = 0) -> Rule:
    """rand(*size), randn(*size): the op per instance, with the instance's generator."""

    def rule(m: InstanceStreams, args: tuple, kwargs: dict) -> torch.Tensor:
        size, options = _size(args, kwargs, size_from), _factory_options(kwargs, m.device)
        return _finish(m.noise(lambda g: op(size, generator=g, **options)), kwargs)

    return rule


def _randint(m: InstanceStreams, args: tuple, kwargs: dict) -> torch.Tensor:
    # randint(high, size) or randint(low, high, size)
    if len(args) >= 3 or (len(args) == 2 and "size" in kwargs):
        low, high, size = args[0], args[1], (args[2] if len(args) > 2 else kwargs["size"])
    elif len(args) == 2:
        low, high, size = kwargs.get("low", 0), args[0], args[1]
    else:
        low, high, size = kwargs.get("low", 0), _arg(args, kwargs, 0, "high"), kwargs["size"]
    options = _factory_options(kwargs, m.device)
    return _finish(m.noise(lambda g: torch.randint(low, high, tuple(size), generator=g, **options)), kwargs)


def _randperm(m: InstanceStreams, args: tuple, kwargs: dict) -> torch.Tensor:
    n, options = _arg(args, kwargs, 0, "n"), _factory_options(kwargs, m.device)
    return _finish(m.noise(lambda g: torch.randperm(n, generator=g, **options)), kwargs)


def _like(op: Callable[..., torch.Tensor]) -> Rule:
    """rand_like(x), randn_like(x): the factory per instance, of x's (per-instance) shape."""

    def rule(m: InstanceStreams, args: tuple, kwargs: dict) -> torch.Tensor:
        x = args[0] if args else kwargs["input"]
        dtype, device = kwargs.get("dtype") or x.dtype, kwargs.get("device") or x.device
        return _finish(m.noise(lambda g: op(tuple(x.shape), generator=g, dtype=dtype, device=device)), kwargs)

    return rule


def _randint_like(m: InstanceStreams, args: tuple, kwargs: dict) -> torch.Tensor:
    x = args[0] if args else kwargs["input"]
    bounds = [a for a in args[1:]] or [kwargs.get("low", 0), kwargs["high"]]
    low, high = (0, bounds[0]) if len(bounds) == 1 else (bounds[0], bounds[1])
    dtype, device = kwargs.get("dtype") or x.dtype, kwargs.get("device") or x.device
    return m.noise(lambda g: torch.randint(low, high, tuple(x.shape), generator=g, dtype=dtype, device=device))


def _normal(m: InstanceStreams, args: tuple, kwargs: dict) -> torch.Tensor:
    mean, std = _arg(args, kwargs, 0, "mean", 0.0), _arg(args, kwargs, 1, "std", 1.0)
    if not isinstance(mean, torch.Tensor) and not isinstance(std, torch.Tensor):  # normal(mean, std, size)
        size, options = tuple(_arg(args, kwargs, 2, "size")), _factory_options(kwargs, m.device)
        return _finish(m.noise(lambda g: torch.normal(float(mean), float(std), size, generator=g, **options)), kwargs)
    like = mean if isinstance(mean, torch.Tensor) else std
    shape = torch.broadcast_shapes(*(t.shape for t in (mean, std) if isinstance(t, torch.Tensor)))
    z = m.noise(lambda g: torch.randn(tuple(shape), generator=g, dtype=like.dtype, device=like.device))
    return mean + std * z


def _bernoulli(m: InstanceStreams, args: tuple, kwargs: dict) -> torch.Tensor:
    x, p = args[0] if args else kwargs["input"], _arg(args, kwargs, 1, "p")
    u = m.uniform(x.shape, torch.float64 if x.dtype == torch.float64 else torch.float32)
    return (u < (x if p is None else p)).to(x.dtype)


def _in_place(fill: Callable[[torch.Tensor, torch.Generator, tuple, dict], torch.Tensor]) -> Rule:
    """self.uniform_(...) and the like: the noise per instance, copied into self."""

    def rule(m: InstanceStreams, args: tuple, kwargs: dict) -> torch.Tensor:
        x, rest = args[0], args[1:]
        shape, dtype, device = tuple(x.shape), x.dtype, x.device
        noise = m.noise(lambda g: fill(torch.empty(shape, dtype=dtype, device=device), g, rest, kwargs))
        return x.copy_(noise)

    return rule


def _method_fill(name: str) -> Callable[[torch.Tensor, torch.Generator, tuple, dict], torch.Tensor]:
    return lambda blank, g, rest, kwargs: getattr(blank, name)(*rest, generator=g, **kwargs)


def _bernoulli_fill(blank: torch.Tensor, g: torch.Generator, rest: tuple, kwargs: dict) -> torch.Tensor:
    p = rest[0] if rest else kwargs.get("p", 0.5)
    if isinstance(p, torch.Tensor):  # a tensor of probabilities, maybe batched: compare with noise
        raise _unsupported("bernoulli_ with a tensor p", "use (torch.rand_like(x) < p) instead")
    return blank.bernoulli_(p, generator=g)


def _dropout_options(args: tuple, kwargs: dict) -> tuple[torch.Tensor, float, bool, bool]:
    x = args[0] if args else kwargs["input"]
    p = _arg(args, kwargs, 1, "p", 0.5)
    training = _arg(args, kwargs, 2, "training", kwargs.get("train", True))
    return x, float(p), bool(training), bool(_arg(args, kwargs, 3, "inplace", False))


def _kept(m: InstanceStreams, shape: Sequence[int], p: float) -> torch.Tensor:
    """A 0/1 mask that keeps each entry with probability 1 - p."""
    return (m.uniform(shape) >= p).to(torch.float32)


def _apply(x: torch.Tensor, out: torch.Tensor, inplace: bool) -> torch.Tensor:
    return x.copy_(out) if inplace else out


def _dropout_rule(channel_dims: int | None, alpha: bool = False) -> Rule:
    """dropout, dropoutNd (a mask per channel), alpha_dropout and feature_alpha_dropout."""

    def rule(m: InstanceStreams, args: tuple, kwargs: dict) -> torch.Tensor:
        x, p, training, inplace = _dropout_options(args, kwargs)
        if not training or p == 0.0:
            return x
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
        if channel_dims is None:
            shape = tuple(x.shape)
        else:  # one draw per (sample, channel): (N, C, 1, ...), or (C, 1, ...) without a batch dim
            lead = 1 if x.dim() == channel_dims + 1 and channel_dims != 2 else 2
            shape = tuple(x.shape[:lead]) + (1,) * (x.dim() - lead)
        keep = _kept(m, shape, p).to(x.dtype)
        if p == 1.0:
            return _apply(x, x * 0.0, inplace)
        if not alpha:
            return _apply(x, x * keep * (1.0 / (1.0 - p)), inplace)
        scale = 1.7580993408473766  # SELU's -alpha * lambda: alpha dropout's saturation value
        a = 1.0 / math.sqrt((scale * scale * p + 1.0) * (1.0 - p))
        b = (keep - 1.0) * (scale * a) + scale * a * p
        return _apply(x, x * (keep * a) + b, inplace)

    return rule


def _rrelu(m: InstanceStreams, args: tuple, kwargs: dict) -> torch.Tensor:
    x = args[0] if args else kwargs["input"]
    lower, upper = _arg(args, kwargs, 1, "lower", 1.0 / 8), _arg(args, kwargs, 2, "upper", 1.0 / 3)
    training, inplace = _arg(args, kwargs, 3, "training", False), _arg(args, kwargs, 4, "inplace", False)
    if not training:
        return F.rrelu(x, lower, upper, False, inplace)
    slope = m.uniform(x.shape, x.dtype if x.is_floating_point() else torch.float32) * (upper - lower) + lower
    return _apply(x, torch.where(x >= 0, x, x * slope), inplace)


def _gumbel_softmax(m: InstanceStreams, args: tuple, kwargs: dict) -> torch.Tensor:
    logits = args[0] if args else kwargs["logits"]
    tau, hard = _arg(args, kwargs, 1, "tau", 1.0), _arg(args, kwargs, 2, "hard", False)
    dim = _arg(args, kwargs, 4, "dim", -1)
    shape, dtype, device = tuple(logits.shape), logits.dtype, logits.device
    gumbels = -m.noise(lambda g: torch.empty(shape, dtype=dtype, device=device).exponential_(generator=g)).log()
    y = ((logits + gumbels) / tau).softmax(dim)
    if not hard:
        return y
    index = y.argmax(dim, keepdim=True)
    return torch.zeros_like(logits).scatter(dim, index, 1.0) - y.detach() + y


def _unsupported(what: str, instead: str) -> NotImplementedError:
    return NotImplementedError(f"pmap(randomness='per_instance') does not support {what} yet: {instead}, or use "
                               "randomness='different'.")


def _refuse(name: str) -> Rule:
    def rule(m: InstanceStreams, args: tuple, kwargs: dict) -> Any:
        raise _unsupported(f"torch.{name}", "draw the numbers outside the pmap and pass them in")

    return rule


#: Samplers vmap cannot batch: without a refusal here, one device fell back to running the
#: instances one at a time and a device that holds one instance ran it directly, both with
#: the thread's own stream, so the numbers depended on the placement (and on the run).
_SAMPLERS = {
    "binomial": "binomial",
    "_standard_gamma": "_standard_gamma (sampling a Gamma, Beta, Dirichlet, Chi2 or StudentT distribution)",
    "_sample_dirichlet": "_sample_dirichlet (sampling a Dirichlet or Beta distribution)",
}


_RULES: dict[str, Rule] = {
    "rand": _factory(torch.rand),
    "randn": _factory(torch.randn),
    "randint": _randint,
    "randperm": _randperm,
    "rand_like": _like(torch.rand),
    "randn_like": _like(torch.randn),
    "randint_like": _randint_like,
    "normal": _normal,
    "bernoulli": _bernoulli,
    "uniform_": _in_place(_method_fill("uniform_")),
    "normal_": _in_place(_method_fill("normal_")),
    "random_": _in_place(_method_fill("random_")),
    "exponential_": _in_place(_method_fill("exponential_")),
    "geometric_": _in_place(_method_fill("geometric_")),
    "cauchy_": _in_place(_method_fill("cauchy_")),
    "log_normal_": _in_place(_method_fill("log_normal_")),
    "bernoulli_": _in_place(_bernoulli_fill),
    "dropout": _dropout_rule(None),
    "dropout1d": _dropout_rule(1),
    "dropout2d": _dropout_rule(2),
    "dropout3d": _dropout_rule(3),
    "alpha_dropout": _dropout_rule(None, alpha=True),
    "feature_alpha_dropout": _dropout_rule(0, alpha=True),
    "rrelu": _rrelu,
    "gumbel_softmax": _gumbel_softmax,
    "multinomial": _refuse("multinomial"),
    "poisson": _refuse("poisson"),
    **{name: _refuse(what) for name, what in _SAMPLERS.items()},
}
