"""Run the same program in torchpmap and in JAX, and compare numbers, shapes and dtypes.

A *program* is written once against a :class:`Backend`, which gives it the array module
(``B.xp``: ``torch`` or ``jax.numpy``), the collectives (``B.psum``, ``B.all_gather``, ...,
with torchpmap's and ``jax.lax``'s common signatures), the maps (``B.map("pmap")``,
``B.map("vmap")``, both called pmap-style: ``M(fun, axis_name, in_axes=..., out_axes=...)``)
and the autodiff transforms (``B.grad``, ``B.jvp``, ``B.jacrev``, ``B.jacfwd``)::

    def program(B, M, x):
        return M(lambda v: B.psum(v * 2, "i"), "i")(x)

    check(program, (np.arange(4.0, dtype=np.float32),), jax_kind="pmap")

:func:`check` converts the numpy arguments for each side (same dtype on both), runs the
program once with JAX (under ``jax.jit``: one compilation per program) and with torchpmap
(``tp.pmap`` and ``tp.vmap`` by default), and asserts with :func:`assert_same` that the
results have the same pytree structure and, leaf by leaf, the same shape, corresponding
dtypes and the same numbers.

Dtypes: torch float32/float16/bfloat16/int32/bool correspond to the same JAX dtype.
JAX runs with x64 disabled (its default; ``tests/conftest.py`` leaves it alone), so its
default integer is int32. torchpmap returns torch's default integer, int64, where JAX
returns its default int: the count of a ``psum`` over bools, ``axis_index``, and a Python
``int`` returned by the mapped function. That is the one documented exception
(:data:`DEFAULT_INT_EXCEPTION`), and it is not a relaxation: a comparison made with
``jax_default_int=True`` *requires* int64 on the torch side wherever JAX has int32 (an
int32 there fails), and one made without it requires int32 == int32.
"""
from __future__ import annotations

import os

# tests/conftest.py sets these first; repeated here so that this module is usable alone.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import torch
from jax import lax

import torchpmap as tp

assert not jax.config.jax_enable_x64, "the JAX reference runs with x64 disabled, JAX's default"

JAX_DEVICE_COUNT = jax.device_count()
assert JAX_DEVICE_COUNT >= 8, (
    f"JAX sees {JAX_DEVICE_COUNT} device(s): jax was imported before XLA_FLAGS asked for 8 host devices"
)

# --------------------------------------------------------------------------- dtypes

#: dtype names usable in tests, and their torch / JAX / numpy counterparts.
DTYPES: dict[str, tuple[torch.dtype, Any, Any]] = {
    "float32": (torch.float32, jnp.float32, np.float32),
    "float16": (torch.float16, jnp.float16, np.float16),
    "bfloat16": (torch.bfloat16, jnp.bfloat16, ml_dtypes.bfloat16),
    "int32": (torch.int32, jnp.int32, np.int32),
    "bool": (torch.bool, jnp.bool_, np.bool_),
}

#: torch dtype -> the numpy dtype JAX must report for the same leaf.
TORCH_TO_JAX_DTYPE: dict[torch.dtype, np.dtype] = {t: np.dtype(j) for t, j, _ in DTYPES.values()}

#: The one documented dtype exception: where JAX returns its default integer (int32 with
#: x64 disabled), torchpmap returns torch's default integer, int64, by design. Applies to
#: psum of bools (a count), axis_index, and Python ints returned by the mapped function
#: (or summed by psum). Only allowed (and then required) under ``jax_default_int=True``.
DEFAULT_INT_EXCEPTION = (torch.int64, np.dtype(np.int32))

#: (rtol, atol) per torch dtype; integers and bools are compared exactly.
TOLERANCES = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


def np_dtype(name: str):
    return DTYPES[name][2]


def sample(shape, dtype: str = "float32", seed: int = 0, *, low: int = -4, high: int = 5) -> np.ndarray:
    """A numpy array of small integer values (exact in every float dtype, so sums agree
    bit for bit whatever the accumulation order), random signs; bools ~half True."""
    rng = np.random.default_rng(seed)
    if dtype == "bool":
        return rng.random(shape) < 0.5
    return rng.integers(low, high, size=shape).astype(np.float32).astype(np_dtype(dtype))


def arange(shape, dtype: str = "float32") -> np.ndarray:
    """``arange(prod(shape)).reshape(shape)`` in ``dtype`` (readable test data)."""
    return np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape).astype(np_dtype(dtype))


# --------------------------------------------------------------------------- backends


def _is_array_leaf(x: Any) -> bool:
    return isinstance(x, np.ndarray)


class Backend:
    """What a program may use; :data:`TORCH` and :data:`JAX` are the two instances."""

    name: str
    xp: Any

    def map(self, kind: str) -> Callable:
        """``M(fun, axis_name=None, *, in_axes=0, out_axes=0, **options)`` for kind
        ``"pmap"`` or ``"vmap"``."""
        raise NotImplementedError

    def from_numpy(self, a: np.ndarray):
        raise NotImplementedError

    def tree_from_numpy(self, tree: Any) -> Any:
        return jax.tree_util.tree_map(self.from_numpy, tree, is_leaf=_is_array_leaf)

    def asarray(self, values, dtype: str = "float32"):
        return self.from_numpy(np.asarray(values, dtype=np.float32).astype(np_dtype(dtype)))

    def __repr__(self) -> str:
        return self.name


class _Torch(Backend):
    name = "torchpmap"
    xp = torch

    psum = staticmethod(tp.psum)
    pmean = staticmethod(tp.pmean)
    pmax = staticmethod(tp.pmax)
    pmin = staticmethod(tp.pmin)
    all_gather = staticmethod(tp.all_gather)
    psum_scatter = staticmethod(tp.psum_scatter)
    ppermute = staticmethod(tp.ppermute)
    pshuffle = staticmethod(tp.pshuffle)
    pswapaxes = staticmethod(tp.pswapaxes)
    all_to_all = staticmethod(tp.all_to_all)
    axis_index = staticmethod(tp.axis_index)
    axis_size = staticmethod(tp.axis_size)

    grad = staticmethod(torch.func.grad)
    jvp = staticmethod(torch.func.jvp)
    jacrev = staticmethod(torch.func.jacrev)
    jacfwd = staticmethod(torch.func.jacfwd)

    def map(self, kind: str) -> Callable:
        if kind == "pmap":
            return _pmap_on_valid_devices
        if kind == "vmap":
            def vmap(fun, axis_name=None, *, in_axes=0, out_axes=0, **options):
                return tp.vmap(fun, in_axes=in_axes, out_axes=out_axes, axis_name=axis_name, **options)

            return vmap
        if kind == "pmap_jit":  # inductor compiles on every device of the run; Dynamo's backends on one
            pinned = {} if JIT_OPTIONS is True else {"devices": tp.devices()[:1]}
            return lambda fun, axis_name=None, **options: _pmap_on_valid_devices(
                fun, axis_name, jit=JIT_OPTIONS, **{**pinned, **options}
            )
        raise ValueError(kind)

    def from_numpy(self, a: np.ndarray) -> torch.Tensor:
        a = np.asarray(a)
        if a.dtype == np.int64:
            raise TypeError("int64 test inputs are ambiguous: JAX (x64 disabled) would make them int32")
        if a.dtype == ml_dtypes.bfloat16:
            return torch.from_numpy(a.astype(np.float32)).to(torch.bfloat16)
        return torch.from_numpy(np.array(a))

    @staticmethod
    def cast(x, dtype: str):
        return x.to(DTYPES[dtype][0])


class _Jax(Backend):
    name = "jax"
    xp = jnp

    psum = staticmethod(lax.psum)
    pmean = staticmethod(lax.pmean)
    pmax = staticmethod(lax.pmax)
    pmin = staticmethod(lax.pmin)
    all_gather = staticmethod(lax.all_gather)
    psum_scatter = staticmethod(lax.psum_scatter)
    ppermute = staticmethod(lax.ppermute)
    pshuffle = staticmethod(lax.pshuffle)
    pswapaxes = staticmethod(lax.pswapaxes)
    all_to_all = staticmethod(lax.all_to_all)
    axis_index = staticmethod(lax.axis_index)

    @staticmethod
    def axis_size(axis_name):
        # lax.axis_size exists in recent JAX; psum(1) is the classic spelling (a Python int
        # under vmap/pmap tracing, as torchpmap's axis_size is).
        return lax.axis_size(axis_name) if hasattr(lax, "axis_size") else lax.psum(1, axis_name)

    grad = staticmethod(jax.grad)
    jvp = staticmethod(jax.jvp)
    jacrev = staticmethod(jax.jacrev)
    jacfwd = staticmethod(jax.jacfwd)

    def map(self, kind: str) -> Callable:
        if kind == "pmap":
            return jax.pmap
        if kind == "vmap":
            def vmap(fun, axis_name=None, *, in_axes=0, out_axes=0, **options):
                return jax.vmap(fun, in_axes=in_axes, out_axes=out_axes, axis_name=axis_name, **options)

            return vmap
        raise ValueError(kind)

    def from_numpy(self, a: np.ndarray):
        a = np.asarray(a)
        if a.dtype == np.int64:
            raise TypeError("int64 test inputs are ambiguous: JAX (x64 disabled) would make them int32")
        return jnp.asarray(a)

    @staticmethod
    def cast(x, dtype: str):
        return x.astype(DTYPES[dtype][1])


TORCH = _Torch()
JAX = _Jax()


# --------------------------------------------------------------------------- running


def run(program: Callable, backend: Backend, kind: str | None, args: tuple) -> Any:
    """``program(B, M, *args)`` with the numpy ``args`` converted for ``backend``; ``M`` is
    ``backend.map(kind)`` (or None when ``kind`` is None).

    The JAX side runs under ``jax.jit``: one compilation per program instead of one per
    primitive and shape in eager ``jax.vmap`` (the numbers are the same; it only saves time).
    """
    mapper = None if kind is None else backend.map(kind)
    converted = backend.tree_from_numpy(args)
    if backend is JAX:
        return jit_call(lambda *a: program(backend, mapper, *a), *converted)
    try:
        return gather_sharded(program(backend, mapper, *converted))
    except (RuntimeError, ValueError, NotImplementedError) as e:
        # By design, on several devices an axis size that does not divide over the devices
        # raises. Require exactly that error, then check the numbers with the pmap on one
        # device. (Every other program must run on several devices as it runs on one.)
        if tp.device_count() == 1 or not any(m in str(e) for m in MULTI_DEVICE_ERRORS):
            raise
        return gather_sharded(program(backend, _one_device(mapper), *converted))


MULTI_DEVICE_ERRORS = ("does not divide evenly over the",)


#: How the differential sweep compiles (TORCHPMAP_TEST_JIT=1 adds tp.pmap(jit=...) to every
#: check): aot_eager runs the traced graph through dynamo and AOTAutograd without
#: generating code, so the sweep checks the trace; tests/test_jit.py also runs inductor.
#: TORCHPMAP_TEST_JIT_BACKEND=inductor sweeps with jit=True, the path users get: inductor
#: without Dynamo, on every device of the run (TORCHPMAP_NUM_CPU_DEVICES=4: compiled device
#: slices, see torchpmap._engines.compiled_devices); the aot_eager sweep runs on one device,
#: as a ``backend`` compiles there only. (``make test`` runs the sweeps; ``make
#: test-jit-inductor`` the inductor sweep alone.)
_JIT_BACKEND = os.environ.get("TORCHPMAP_TEST_JIT_BACKEND", "aot_eager")
JIT_OPTIONS: Any = True if _JIT_BACKEND == "inductor" else {"backend": _JIT_BACKEND}
DEFAULT_TORCH_KINDS = ("pmap", "vmap", "pmap_jit") if os.environ.get("TORCHPMAP_TEST_JIT") == "1" else ("pmap", "vmap")


def _pmap_on_valid_devices(fun: Callable, axis_name=None, **options) -> Callable:
    """``tp.pmap``, except that an axis size that cannot be split over this run's devices
    (a documented ValueError, required here) runs on one device instead; sharded results
    come back gathered."""
    mapped = tp.pmap(fun, axis_name, **options)

    def call(*args, **kwargs):
        try:
            return gather_sharded(mapped(*args, **kwargs))
        except ValueError as e:
            if tp.device_count() == 1 or MULTI_DEVICE_ERRORS[0] not in str(e) or "devices" in options:
                raise
            return tp.pmap(fun, axis_name, devices=tp.devices()[:1], **options)(*args, **kwargs)

    return call


def _one_device(mapper: Callable) -> Callable:
    if mapper is not _pmap_on_valid_devices:
        return mapper
    return lambda fun, axis_name=None, **options: tp.pmap(fun, axis_name, devices=tp.devices()[:1], **options)


def gather_sharded(tree: Any) -> Any:
    """Multi-device results (ShardedTensor) as plain tensors, keeping autograd."""
    return jax.tree_util.tree_map(
        lambda x: x.gather() if isinstance(x, tp.ShardedTensor) else x,
        tree,
        is_leaf=lambda x: isinstance(x, (torch.Tensor, tp.ShardedTensor)),
    )


def jit_call(fn: Callable, *args: Any) -> Any:
    """``fn(*args)`` for JAX arrays, traced and compiled once with ``jax.jit``."""
    return jax.jit(fn)(*args)


def check(
    program: Callable,
    args: tuple,
    *,
    torch_kind: Any = DEFAULT_TORCH_KINDS,
    jax_kind: str | None = "pmap",
    jax_args: tuple | None = None,
    jax_program: Callable | None = None,
    jax_default_int: bool = False,
    tol: tuple[float, float] | None = None,
) -> tuple[Any, Any]:
    """Runs ``program`` once with JAX (map kind ``jax_kind``) and with torchpmap for each map
    kind in ``torch_kind`` (a kind or a tuple of kinds; by default both ``tp.pmap`` and
    ``tp.vmap``), and asserts that every torchpmap result is the same as JAX's.

    ``jax_program``/``jax_args`` replace the program or its arguments on the JAX side only,
    for forms JAX lacks (negative axes: the JAX side gets the normalized axis); each use
    says why in its test. Returns (first torchpmap result, JAX result), as numpy.
    """
    torch_kinds = (torch_kind,) if isinstance(torch_kind, str) or torch_kind is None else tuple(torch_kind)
    jax_out = run(jax_program or program, JAX, jax_kind, args if jax_args is None else jax_args)
    first = None
    for kind in torch_kinds:
        torch_out = run(program, TORCH, kind, args)
        try:
            assert_same(torch_out, jax_out, jax_default_int=jax_default_int, tol=tol)
        except AssertionError as e:
            raise AssertionError(f"tp.{kind} vs jax.{jax_kind}: {e}") from None
        first = torch_out if first is None else first
    return to_numpy(first), to_numpy(jax_out)


# --------------------------------------------------------------------------- comparing


def _leaf_to_numpy(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu()
        return (x.float() if x.dtype == torch.bfloat16 else x).numpy()
    if isinstance(x, jax.Array):
        a = np.asarray(x)
        return a.astype(np.float32) if a.dtype == ml_dtypes.bfloat16 else a
    return x


def to_numpy(tree: Any) -> Any:
    """Every torch/JAX array leaf as numpy (bfloat16 as float32, for the values only)."""
    return jax.tree_util.tree_map(_leaf_to_numpy, gather_sharded(tree), is_leaf=lambda x: isinstance(x, torch.Tensor))


def _torch_leaves(tree: Any):
    return jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, torch.Tensor))


def expected_jax_dtype(torch_dtype: torch.dtype, *, jax_default_int: bool) -> np.dtype:
    """The dtype JAX must report for a torchpmap leaf of ``torch_dtype``."""
    if torch_dtype == DEFAULT_INT_EXCEPTION[0]:
        if not jax_default_int:
            raise AssertionError(
                "torchpmap returned int64 where no JAX default-int value is expected "
                "(pass jax_default_int=True only for bool counts, axis_index and Python ints)"
            )
        return DEFAULT_INT_EXCEPTION[1]
    if torch_dtype not in TORCH_TO_JAX_DTYPE:
        raise AssertionError(f"torchpmap returned {torch_dtype}, which has no JAX counterpart in these tests")
    return TORCH_TO_JAX_DTYPE[torch_dtype]


def assert_same(
    torch_out: Any,
    jax_out: Any,
    *,
    jax_default_int: bool = False,
    tol: tuple[float, float] | None = None,
) -> None:
    """Same pytree structure, and per leaf: same shape, corresponding dtype, same values.

    ``jax_default_int``: the result holds JAX default-int leaves (see
    :data:`DEFAULT_INT_EXCEPTION`); every leaf where JAX has int32 must then be int64 in
    torchpmap, and an int64 leaf anywhere else fails. ``tol`` overrides (rtol, atol).
    """
    t_leaves, t_def = _torch_leaves(gather_sharded(torch_out))
    j_leaves, j_def = jax.tree_util.tree_flatten_with_path(jax_out)
    assert t_def == j_def, f"pytree structure differs:\n  torchpmap: {t_def}\n  jax:       {j_def}"
    seen_default_int = False
    for (path, t), (_, j) in zip(t_leaves, j_leaves):
        where = jax.tree_util.keystr(path) or "(root)"
        if not isinstance(t, torch.Tensor):
            # A Python scalar (e.g. axis_size): same type and value.
            assert not isinstance(j, jax.Array), f"{where}: torchpmap gave {type(t).__name__} {t!r}, JAX an array {j}"
            assert type(t) is type(j) and t == j, f"{where}: torchpmap {t!r} != JAX {j!r}"
            continue
        assert isinstance(j, (jax.Array, np.ndarray)), f"{where}: JAX gave {type(j).__name__} {j!r}, torchpmap a tensor"
        assert tuple(t.shape) == tuple(j.shape), f"{where}: shape torchpmap {tuple(t.shape)} != JAX {tuple(j.shape)}"
        j_dtype = np.dtype(j.dtype)
        want = expected_jax_dtype(t.dtype, jax_default_int=jax_default_int)
        assert j_dtype == want, f"{where}: dtype torchpmap {t.dtype} does not correspond to JAX {j_dtype}"
        if t.dtype == torch.int64:
            seen_default_int = True
        tn, jn = _leaf_to_numpy(t), _leaf_to_numpy(j)
        if t.dtype.is_floating_point:
            rtol, atol = tol or TOLERANCES[t.dtype]
            np.testing.assert_allclose(
                tn, jn.astype(tn.dtype), rtol=rtol, atol=atol, err_msg=f"values differ at {where}"
            )
        else:
            np.testing.assert_array_equal(tn, jn, err_msg=f"values differ at {where}")
    if jax_default_int:
        assert seen_default_int, "jax_default_int=True but no leaf has JAX's default int: drop the flag"


def assert_same_torch(actual: Any, expected: Any, *, tol: tuple[float, float] | None = None) -> None:
    """For torch-vs-torch comparisons (torchpmap against a Python loop): same pytree
    structure, and per leaf the same shape, exactly the same dtype and the same values."""
    a_leaves, a_def = _torch_leaves(actual)
    e_leaves, e_def = _torch_leaves(expected)
    assert a_def == e_def, f"pytree structure differs:\n  actual:   {a_def}\n  expected: {e_def}"
    for (path, a), (_, e) in zip(a_leaves, e_leaves):
        where = jax.tree_util.keystr(path) or "(root)"
        assert tuple(a.shape) == tuple(e.shape), f"{where}: shape {tuple(a.shape)} != expected {tuple(e.shape)}"
        assert a.dtype == e.dtype, f"{where}: dtype {a.dtype} != expected {e.dtype}"
        an, en = _leaf_to_numpy(a), _leaf_to_numpy(e)
        if a.dtype.is_floating_point:
            rtol, atol = tol or TOLERANCES[a.dtype]
            np.testing.assert_allclose(an, en, rtol=rtol, atol=atol, err_msg=f"values differ at {where}")
        else:
            np.testing.assert_array_equal(an, en, err_msg=f"values differ at {where}")
