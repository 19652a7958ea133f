"""Differential tests: the same program in torchpmap and in JAX must give the same numbers,
shapes and dtypes (tests/jax_reference.py: how programs are written and compared).

Each case runs the program once in JAX, as ``jax.pmap`` (8 host devices, so sizes <= 8) or
as ``jax.vmap(..., axis_name=...)`` (the ``jax_kind`` parameter), and compares both
``tp.pmap`` and ``tp.vmap`` against it. Where one JAX form raises in JAX 0.10.2 the test
uses the other and says why. Nested maps use ``jax.vmap`` as the JAX reference: nested
``jax.pmap`` raises in 0.10.2 (pmap is jit(shard_map) there); the reference doc records
that the numbers are those of classic nested pmap.

To keep the number of JAX compilations (the cost of this file) down, one program often
returns a dict of several variants (keys name them, and a failure names the key).

Deliberate differences from JAX are tested against JAX with the equivalent form
(negative axes: the JAX side gets the normalized axis; sizes above 8: jax.vmap) or
against a hand computation (uneven ``axis_index_groups`` in pmean).
"""
from __future__ import annotations

from collections import namedtuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax import lax

import torchpmap as tp
from jax_reference import JAX, TORCH, arange, assert_same, check, jit_call, sample, to_numpy

jax_param = pytest.mark.parametrize("jax_kind", ["pmap", "vmap"], ids=["jax.pmap", "jax.vmap"])

Pair = namedtuple("Pair", ["left", "right"])


def mapped(op, axis_name="i", **map_options):
    """The program ``M(lambda *v: op(B, *v), axis_name, **map_options)(*args)``."""

    def program(B, M, *args):
        return M(lambda *vs: op(B, *vs), axis_name, **map_options)(*args)

    return program


def variants(ops: dict):
    """One program applying each of ``ops`` (name -> op(B, v)) to its own argument (a dict
    of the same keys); returns a dict of results."""

    def op(B, d):
        return {k: f(B, d[k]) for k, f in ops.items()}

    return mapped(op)


# =========================================================================== reductions

SIZES_SHAPES = [(1, ()), (4, (3,)), (8, (2, 3))]
sizes_param = pytest.mark.parametrize("n,shape", SIZES_SHAPES, ids=[f"n{n}" for n, _ in SIZES_SHAPES])
ALL_DTYPES = ["float32", "float16", "bfloat16", "int32", "bool"]


@jax_param
@sizes_param
@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_psum(jax_kind, n, shape, dtype):
    x = sample((n, *shape), dtype, seed=n)
    # bool: JAX counts in its default int (int32), torchpmap in int64 (documented exception).
    check(mapped(lambda B, v: B.psum(v, "i")), (x,), jax_kind=jax_kind, jax_default_int=dtype == "bool")


@jax_param
@sizes_param
@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_pmean(jax_kind, n, shape, dtype):
    # int32 and bool become float32 in both.
    x = sample((n, *shape), dtype, seed=n + 1)
    check(mapped(lambda B, v: B.pmean(v, "i")), (x,), jax_kind=jax_kind)


@jax_param
@sizes_param
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int32", "bool"])
def test_pmax_pmin(jax_kind, n, shape, dtype):
    x = sample((n, *shape), dtype, seed=n + 2)
    check(mapped(lambda B, v: {"max": B.pmax(v, "i"), "min": B.pmin(v, "i")}), (x,), jax_kind=jax_kind)


def test_reductions_documented_numbers():
    """The reference doc's examples as literal numbers, so that a mistake shared by both
    sides' conversions could not hide."""
    t, _ = check(mapped(lambda B, v: B.psum(v, "i")), (arange(4),))
    np.testing.assert_array_equal(t, [6, 6, 6, 6])
    t, _ = check(mapped(lambda B, v: B.psum(v, "i")), (np.array([True, False, True, True]),), jax_default_int=True)
    np.testing.assert_array_equal(t, [3, 3, 3, 3])
    t, _ = check(mapped(lambda B, v: B.psum(v, "i", axis_index_groups=[[0, 1], [2, 3]])), (arange(4, "int32"),))
    np.testing.assert_array_equal(t, [1, 1, 5, 5])
    t, _ = check(mapped(lambda B, v: (B.pmean(v, "i"), B.pmax(v, "i"), B.pmin(v, "i"))), (arange(4, "int32"),))
    np.testing.assert_array_equal(t[0], [1.5] * 4)
    np.testing.assert_array_equal(t[1], [3] * 4)
    np.testing.assert_array_equal(t[2], [0] * 4)


# ----------------------------------------------------------------- axis_index_groups
# jax.vmap raises "axis_index_groups not supported in vmap collectives" (NotImplementedError)
# in 0.10.2, so jax.pmap is the JAX reference for every grouped collective.

GROUPS = {
    "pairs": (4, [[0, 1], [2, 3]]),
    "interleaved": (4, [[0, 3], [2, 1]]),
    "halves8": (8, [[0, 1, 2, 3], [4, 5, 6, 7]]),
    "strided8": (8, [[0, 2, 4, 6], [1, 3, 5, 7]]),
    "quads8": (8, [[7, 0], [1, 6], [2, 5], [3, 4]]),
}
UNEVEN = {"uneven": (4, [[1], [0, 2, 3]]), "uneven8": (8, [[0, 5, 6], [1, 2, 3, 4, 7]])}


# pmean with uneven groups is left out here: JAX divides by len(groups[0]) there (see
# test_pmean_uneven_groups).
GROUPED_REDUCTIONS = [(g, op) for g in list(GROUPS) + list(UNEVEN) for op in ("psum", "pmean", "pmax", "pmin")
                      if not (op == "pmean" and g in UNEVEN)]


@pytest.mark.parametrize("group,op", GROUPED_REDUCTIONS)
def test_reductions_with_groups(group, op):
    n, groups = {**GROUPS, **UNEVEN}[group]
    tree = {"f32": sample((n, 3), "float32", seed=len(groups)), "i32": sample((n,), "int32", seed=n)}
    check(mapped(lambda B, t: getattr(B, op)(t, "i", axis_index_groups=groups)), (tree,))


def test_psum_groups_bool():
    x = np.array([True, True, False, True])
    prog = mapped(lambda B, v: B.psum(v, "i", axis_index_groups=[[0, 1], [2, 3]]))
    t, _ = check(prog, (x,), jax_default_int=True)
    np.testing.assert_array_equal(t, [2, 2, 1, 1])


@pytest.mark.parametrize("torch_kind", ["pmap", "vmap"])
@pytest.mark.parametrize("group", list(UNEVEN))
def test_pmean_uneven_groups(torch_kind, group):
    """Deliberate difference: JAX 0.10.2 computes pmean as psum(x)/psum(1), and psum of a
    constant with groups assumes equal group sizes (``size = len(axis_index_groups[0])`` in
    jax/_src/lax/parallel.py), so with uneven groups JAX divides every instance by the size
    of the *first* group (groups [[1],[0,2,3]] on arange(4.) give [5, 1, 5, 5]).
    torchpmap divides by each instance's own group size; checked by hand here."""
    n, groups = UNEVEN[group]
    x = sample((n, 2), "float32", seed=3)
    M = TORCH.map(torch_kind)
    out = M(lambda v: tp.pmean(v, "i", axis_index_groups=groups), "i")(torch.from_numpy(x))
    expected = np.empty_like(x)
    for g in groups:
        expected[g] = x[g].mean(0)
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-6)
    # psum of a constant with uneven groups: each instance's own group size.
    count = M(lambda v: tp.psum(1.0, "i", axis_index_groups=groups) + 0 * v, "i")(torch.from_numpy(x[:, 0]))
    np.testing.assert_array_equal(count.numpy(), [len(next(g for g in groups if k in g)) for k in range(n)])


GATHER_FORMS = {
    "axis0": (0, False), "axis1": (1, False), "axis2": (2, False), "axis-1": (-1, False), "axis-3": (-3, False),
    "tiled0": (0, True), "tiled1": (1, True), "tiled-1": (-1, True), "tiled-2": (-2, True),
}


@pytest.mark.parametrize("group", list(GROUPS))
def test_all_gather_with_groups(group):
    n, groups = GROUPS[group]
    ops = {k: (lambda B, v, a=a, t=t: B.all_gather(v, "i", axis=a, tiled=t, axis_index_groups=groups))
           for k, (a, t) in GATHER_FORMS.items()}
    x = sample((n, 2, 3), "float32", seed=n)
    check(variants(ops), ({k: x for k in ops},))


def _scatter_forms(groups) -> dict:
    """psum_scatter and all_to_all within ``groups`` (of size s), each form's key naming
    it: (op, value shape for s, keyword arguments). No negative scatter_dimension: JAX
    0.10.2 fails to lower a grouped reduce_scatter along dim -1."""
    return {
        "scatter0": ("psum_scatter", lambda s: (s, 3), {"scatter_dimension": 0}),
        "scatter1": ("psum_scatter", lambda s: (3, s), {"scatter_dimension": 1}),
        "scatter1_tiled": ("psum_scatter", lambda s: (2, 2 * s), {"scatter_dimension": 1, "tiled": True}),
        "a2a_0_0": ("all_to_all", lambda s: (s, 3), {"split_axis": 0, "concat_axis": 0}),
        "a2a_0_1": ("all_to_all", lambda s: (s, 3), {"split_axis": 0, "concat_axis": 1}),
        "a2a_1_0_tiled": ("all_to_all", lambda s: (2, 3 * s), {"split_axis": 1, "concat_axis": 0, "tiled": True}),
        "a2a_0_1_tiled": ("all_to_all", lambda s: (2 * s, 3), {"split_axis": 0, "concat_axis": 1, "tiled": True}),
    }


@pytest.mark.parametrize("dtype", ["float32", "int32"])
@pytest.mark.parametrize("group", list(GROUPS))
def test_psum_scatter_and_all_to_all_with_groups(group, dtype):
    """Each group scatters (or exchanges) within itself; the member at position p of its
    group keeps piece p. jax.pmap is the reference (jax.vmap has no groups)."""
    n, groups = GROUPS[group]
    s = len(groups[0])
    forms = _scatter_forms(groups)
    ops = {
        k: (lambda B, v, op=op, kw=kw: getattr(B, op)(v, "i", axis_index_groups=groups, **kw))
        for k, (op, _, kw) in forms.items()
    }
    args = {k: sample((n, *shape(s)), dtype, seed=j) for j, (k, (_, shape, _)) in enumerate(forms.items())}
    check(variants(ops), (args,))


# =========================================================================== constants


@jax_param
def test_psum_of_unmapped_values(jax_kind):
    x, w = sample((4, 3), seed=1), sample((3,), seed=2)
    # A Python float: weakly-typed float32 in JAX, float32 in torchpmap; times the size.
    t, _ = check(mapped(lambda B, v: B.psum(2.0, "i") + 0 * v), (x[:, 0],), jax_kind=jax_kind)
    np.testing.assert_array_equal(t, [8, 8, 8, 8])
    # A broadcast (in_axes None) argument.
    check(mapped(lambda B, v, u: B.psum(u, "i") + v, in_axes=(0, None)), (x, w), jax_kind=jax_kind)
    # A Python int: JAX's default int vs torchpmap's int64 (documented exception).
    t, _ = check(mapped(lambda B, v: B.psum(3, "i")), (x,), jax_kind=jax_kind, jax_default_int=True)
    np.testing.assert_array_equal(t, [12, 12, 12, 12])


@jax_param
def test_constant_outputs(jax_kind):
    x = sample((4,), seed=0)
    check(mapped(lambda B, v: 3.0), (x,), jax_kind=jax_kind)
    t, _ = check(mapped(lambda B, v: 3), (x,), jax_kind=jax_kind, jax_default_int=True)
    np.testing.assert_array_equal(t, [3, 3, 3, 3])


@jax_param
@pytest.mark.parametrize("n", [1, 3, 8])
def test_axis_index_and_size(jax_kind, n):
    x = sample((n, 2), seed=n)
    # axis_index and a returned Python int: JAX's default int (int32) vs torchpmap's int64.
    t, _ = check(
        mapped(lambda B, v: (B.axis_index("i"), B.axis_size("i"))), (x,), jax_kind=jax_kind, jax_default_int=True
    )
    np.testing.assert_array_equal(t[0], np.arange(n))
    np.testing.assert_array_equal(t[1], [n] * n)
    check(mapped(lambda B, v: v * B.axis_size("i") + B.cast(B.axis_index("i"), "float32")), (x,), jax_kind=jax_kind)


@jax_param
def test_collectives_over_no_axis_return_the_value(jax_kind):
    """An empty tuple of axis names names no axis: JAX returns the value as it is (pmean
    divides it by 1, so integers become floats; all_gather adds no dim), and axis_index
    is 0. ppermute and all_to_all refuse it in both."""
    ops = {
        "psum": lambda B, v: B.psum(v, ()),
        "psum_list": lambda B, v: B.psum(v, []),
        "pmean": lambda B, v: B.pmean(v, ()),
        "pmax": lambda B, v: B.pmax(v, ()),
        "pmin": lambda B, v: B.pmin(v, ()),
        "all_gather": lambda B, v: B.all_gather(v, ()),
        "all_gather_tiled": lambda B, v: B.all_gather(v, (), tiled=True),
        "psum_scatter": lambda B, v: B.psum_scatter(v, ()),
        "psum_bool": lambda B, v: B.psum(v > 0, ()),
        "pmean_int": lambda B, v: B.pmean(B.cast(v, "int32"), ()),
        "axis_size": lambda B, v: v * B.axis_size(()),
        "grad": lambda B, v: B.grad(lambda u: (B.psum(u, ()) ** 2).sum())(v),
    }
    x = sample((4, 3), seed=7)
    check(variants(ops), ({k: x for k in ops},), jax_kind=jax_kind)
    t, _ = check(mapped(lambda B, v: B.axis_index(())), (x,), jax_kind=jax_kind, jax_default_int=True)
    np.testing.assert_array_equal(t, [0, 0, 0, 0])
    with pytest.raises(ValueError, match="must name at least one axis"):
        tp.pmap(lambda v: tp.ppermute(v, (), [(0, 0)]), "i")(torch.from_numpy(x))


# =========================================================================== pytrees


@jax_param
def test_collectives_on_pytrees(jax_kind):
    tree = {
        "a": sample((4, 2), "float32", seed=1),
        "b": (sample((4,), "int32", seed=2), sample((4, 3), "float16", seed=3)),
    }
    check(mapped(lambda B, t: {"sum": B.psum(t, "i"), "gather": B.all_gather(t, "i"), "max": B.pmax(t, "i")}),
          (tree,), jax_kind=jax_kind)
    pair = Pair(sample((4, 2), seed=4), sample((4,), "int32", seed=5))
    check(mapped(lambda B, p: B.pshuffle(p, "i", [3, 1, 0, 2])), (pair,), jax_kind=jax_kind)
    bools = {"flags": sample((4, 2), "bool", seed=6)}
    check(mapped(lambda B, t: B.psum(t, "i")), (bools,), jax_kind=jax_kind, jax_default_int=True)


# =========================================================================== all_gather


@jax_param
@pytest.mark.parametrize("n", [2, 5, 8])
def test_all_gather(jax_kind, n):
    # JAX 0.10.2 accepts negative all_gather axes (unlike most other collectives).
    ops = {k: (lambda B, v, a=a, t=t: B.all_gather(v, "i", axis=a, tiled=t)) for k, (a, t) in GATHER_FORMS.items()}
    x = sample((n, 2, 3), seed=n)
    check(variants(ops), ({k: x for k in ops},), jax_kind=jax_kind)


@jax_param
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "int32", "bool"])
def test_all_gather_dtypes(jax_kind, dtype):
    x = sample((4, 3), dtype, seed=7)
    ops = {
        "stacked": lambda B, v: B.all_gather(v, "i"),
        "tiled": lambda B, v: B.all_gather(v, "i", tiled=True),
        "scalar": lambda B, v: B.all_gather(v[0], "i"),
    }
    check(variants(ops), ({k: x for k in ops},), jax_kind=jax_kind)


# =========================================================================== psum_scatter


def _with_size(shape, dim, size):
    shape = list(shape)
    shape[dim] = size
    return tuple(shape)


@jax_param
@pytest.mark.parametrize("tiled", [False, True], ids=["untiled", "tiled"])
@pytest.mark.parametrize("n", [2, 4, 8])
def test_psum_scatter(jax_kind, tiled, n):
    dims = {"dim0": 0, "dim1": 1, "dim-1": -1, "dim-2": -2}
    args = {k: sample((n, *_with_size((2, 3), d, 2 * n if tiled else n)), seed=n + d) for k, d in dims.items()}
    prog = variants(
        {k: (lambda B, v, d=d: B.psum_scatter(v, "i", scatter_dimension=d, tiled=tiled)) for k, d in dims.items()}
    )
    # Negative scatter_dimension: JAX 0.10.2 asserts (vmap) or fails to lower (pmap);
    # torchpmap normalizes it, so the JAX side gets the normalized dimension.
    jax_prog = variants(
        {k: (lambda B, v, d=d: B.psum_scatter(v, "i", scatter_dimension=d % 2, tiled=tiled)) for k, d in dims.items()}
    )
    check(prog, (args,), jax_kind=jax_kind, jax_program=jax_prog)


@jax_param
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "int32"])
def test_psum_scatter_dtypes(jax_kind, dtype):
    # bool is left out: JAX raises ("reduce_sum does not accept dtype bool").
    args = {"untiled": sample((4, 4, 3), dtype, seed=8), "tiled": sample((4, 3, 8), dtype, seed=9)}
    ops = {
        "untiled": lambda B, v: B.psum_scatter(v, "i"),
        "tiled": lambda B, v: B.psum_scatter(v, "i", scatter_dimension=1, tiled=True),
    }
    check(variants(ops), (args,), jax_kind=jax_kind)


def test_psum_scatter_documented_numbers():
    t, _ = check(mapped(lambda B, v: B.psum_scatter(v, "i")), (arange((4, 4)),))
    np.testing.assert_array_equal(t, [24, 28, 32, 36])


# =========================================================================== permutations

PERMS = {
    "shift_right4": (4, [(j, (j + 1) % 4) for j in range(4)]),
    "shift3_8": (8, [(j, (j + 3) % 8) for j in range(8)]),
    "swap_pairs": (4, [(0, 1), (1, 0), (2, 3), (3, 2)]),
    "identity": (3, [(0, 0), (1, 1), (2, 2)]),
    "reverse8": (8, [(j, 7 - j) for j in range(8)]),
}
# Partial permutations (some instances receive zeros): jax.vmap asserts "Permutation
# doesn't match the axis size!" in 0.10.2, so jax.pmap is the JAX reference for these.
PARTIAL_PERMS = {
    "partial": (4, [(0, 1), (1, 2)]),
    "partial8": (8, [(7, 0), (3, 5), (0, 6)]),
    "empty": (4, []),
}


@jax_param
@pytest.mark.parametrize("perm", list(PERMS))
def test_ppermute(jax_kind, perm):
    n, pairs = PERMS[perm]
    tree = {d: sample((n, 2), d, seed=n, low=1) for d in ("float32", "int32", "bool")}
    check(mapped(lambda B, t: B.ppermute(t, "i", pairs)), (tree,), jax_kind=jax_kind)


@pytest.mark.parametrize("perm", list(PARTIAL_PERMS))
def test_ppermute_partial(perm):
    n, pairs = PARTIAL_PERMS[perm]
    tree = {d: sample((n, 3), d, seed=n, low=1) for d in ("float32", "int32")}  # non-zero: received zeros show
    check(mapped(lambda B, t: B.ppermute(t, "i", pairs)), (tree,), jax_kind="pmap")


def test_ppermute_documented_numbers():
    t, _ = check(mapped(lambda B, v: B.ppermute(v, "i", PERMS["shift_right4"][1])), (arange(4),))
    np.testing.assert_array_equal(t, [3, 0, 1, 2])


@jax_param
@pytest.mark.parametrize("n,perm", [(4, [2, 0, 3, 1]), (8, [5, 2, 7, 0, 1, 6, 3, 4]), (1, [0])])
def test_pshuffle(jax_kind, n, perm):
    x = sample((n, 2, 2), seed=n)
    check(mapped(lambda B, v: B.pshuffle(v, "i", perm)), (x,), jax_kind=jax_kind)


# =========================================================================== all_to_all

A2A_FORMS = [(s, c) for s in range(3) for c in range(3)]


@jax_param
@pytest.mark.parametrize("tiled", [False, True], ids=["untiled", "tiled"])
@pytest.mark.parametrize("n", [2, 4])
def test_all_to_all(jax_kind, tiled, n):
    args, ops = {}, {}
    for s, c in A2A_FORMS:
        key = f"split{s}_concat{c}"
        args[key] = sample((n, *_with_size((2, 3, 1), s, 2 * n if tiled else n)), seed=3 * s + c)
        ops[key] = lambda B, v, s=s, c=c: B.all_to_all(v, "i", s, c, tiled=tiled)
    check(variants(ops), (args,), jax_kind=jax_kind)


@jax_param
@pytest.mark.parametrize("tiled", [False, True], ids=["untiled", "tiled"])
def test_all_to_all_negative_axes(jax_kind, tiled):
    # JAX 0.10.2 mis-handles negative split/concat axes (a reshape TypeError under vmap, an
    # MLIR error under pmap); torchpmap normalizes them: the JAX side gets the normalized axes.
    n, forms = 8, [(-1, 0), (0, -1), (-3, -2), (-2, -2)]
    args, ops, jax_ops = {}, {}, {}
    for s, c in forms:
        key = f"split{s}_concat{c}"
        args[key] = sample((n, *_with_size((2, 3, 1), s % 3, 2 * n if tiled else n)), seed=5)
        ops[key] = lambda B, v, s=s, c=c: B.all_to_all(v, "i", s, c, tiled=tiled)
        jax_ops[key] = lambda B, v, s=s, c=c: B.all_to_all(v, "i", s % 3, c % 3, tiled=tiled)
    check(variants(ops), (args,), jax_kind=jax_kind, jax_program=variants(jax_ops))


@pytest.mark.parametrize("tiled", [False, True], ids=["untiled", "tiled"])
def test_all_to_all_of_a_replicated_value(tiled):
    """all_to_all of a value that is the same on every instance (a psum result). JAX 0.10.2's
    vmap gets this wrong (an extra axis: vmap of all_to_all(psum(v), 'i', 0, 0) on (3, 3)
    gives shape (3, 3, 3)), so jax.pmap is the reference; the numbers are also checked."""
    x = arange((3, 6 if tiled else 3))
    t, _ = check(mapped(lambda B, v: B.all_to_all(B.psum(v, "i"), "i", 0, 0, tiled=tiled)), (x,), jax_kind="pmap")
    total = x.sum(0)
    expected = np.stack([np.tile(blk, 3) for blk in np.split(total, 3)]) if tiled else np.repeat(total[:, None], 3, 1)
    np.testing.assert_array_equal(t, expected)


@jax_param
@pytest.mark.parametrize("dtype", ["float16", "int32", "bool"])
def test_all_to_all_dtypes(jax_kind, dtype):
    x = sample((4, 4, 2), dtype, seed=9)
    check(mapped(lambda B, v: B.all_to_all(v, "i", 0, 1)), (x,), jax_kind=jax_kind)


def test_all_to_all_documented_numbers():
    t, _ = check(mapped(lambda B, v: B.all_to_all(v, "i", 0, 1)), (arange((4, 4, 2), "int32"),))
    np.testing.assert_array_equal(t[0], [[0, 8, 16, 24], [1, 9, 17, 25]])
    t, _ = check(mapped(lambda B, v: B.all_to_all(v, "i", 0, 0)), (arange((4, 4), "int32"),))
    np.testing.assert_array_equal(t, arange((4, 4), "int32").T)


@jax_param
@pytest.mark.parametrize("n", [2, 4])
def test_pswapaxes(jax_kind, n):
    axes = {"axis0": 0, "axis1": 1, "axis-1": -1}
    args = {k: sample((n, *_with_size((3, 3), a, n)), seed=n + a) for k, a in axes.items()}
    prog = variants({k: (lambda B, v, a=a: B.pswapaxes(v, "i", a)) for k, a in axes.items()})
    # Negative axis: JAX 0.10.2 fails (as for all_to_all); it gets the normalized axis.
    jax_prog = variants({k: (lambda B, v, a=a: B.pswapaxes(v, "i", a % 2)) for k, a in axes.items()})
    check(prog, (args,), jax_kind=jax_kind, jax_program=jax_prog)


# =========================================================================== in_axes / out_axes


@jax_param
def test_dict_in_axes_prefix(jax_kind):
    d = {"a": sample((4, 3), seed=1), "b": sample((5,), seed=2)}
    prog = mapped(lambda B, t: t["a"] * t["b"].sum() + B.psum(t["a"], "i"), in_axes=({"a": 0, "b": None},))
    check(prog, (d,), jax_kind=jax_kind)
    nested = {"a": sample((3, 4), seed=3), "b": (sample((4,), "int32", seed=4), sample((2, 4), seed=5))}
    prog = mapped(
        lambda B, t: {"x": B.all_gather(t["a"], "i"), "y": t["b"][0] * 2, "z": B.psum(t["b"][1], "i")},
        in_axes=({"a": 1, "b": (0, 1)},),
    )
    check(prog, (nested,), jax_kind=jax_kind)
    # a dict prefix matches by key, whatever the order of the value's keys (JAX sorts them)
    reordered = {"b": sample((5,), seed=2), "a": sample((4, 3), seed=1)}
    prog = mapped(lambda B, t: {"s": t["a"] * t["b"].sum(), "t": B.psum(t["a"], "i")}, in_axes=({"a": 0, "b": None},))
    check(prog, (reordered,), jax_kind=jax_kind)


@jax_param
def test_tuple_in_axes_and_none(jax_kind):
    x, w, y = sample((4, 3), seed=1), sample((3,), seed=2), sample((3, 4), seed=3)
    prog = mapped(lambda B, a, b, c: (B.psum(a * b, "i"), c - a, b), in_axes=(0, None, 1))
    check(prog, (x, w, y), jax_kind=jax_kind)


@jax_param
def test_namedtuple_in_and_out(jax_kind):
    p = Pair(sample((4, 2), seed=1), sample((4,), "int32", seed=2))
    check(mapped(lambda B, q: Pair(B.psum(q.left, "i"), q.right * 2)), (p,), jax_kind=jax_kind)
    prog = mapped(lambda B, q: Pair(q.left, B.pmax(q.right, "i")), in_axes=(Pair(1, 0),), out_axes=Pair(0, None))
    check(prog, (Pair(sample((2, 4), seed=3), sample((4,), "int32", seed=4)),), jax_kind=jax_kind)


@jax_param
@pytest.mark.parametrize(
    "out_axes",
    [None, 0, 1, 2, {"s": None, "v": 1}, {"s": 0, "v": (2, None)}],
    ids=["None", "0", "1", "2", "dict", "nested"],
)
def test_out_axes(jax_kind, out_axes):
    x = sample((4, 2, 3), seed=1)

    def op(B, v):
        s = B.psum(v, "i")
        if out_axes is None:
            return s
        return {"s": s, "v": (v * 2, B.pmin(v, "i"))} if isinstance(out_axes, dict) else v * 2 + s

    check(mapped(op, out_axes=out_axes), (x,), jax_kind=jax_kind)


@jax_param
def test_nonzero_in_and_out_axes(jax_kind):
    x, y = sample((2, 3, 4), seed=1), sample((2, 4, 3), seed=2)
    check(mapped(lambda B, v: B.psum(v, "i") * v, in_axes=2, out_axes=1), (x,), jax_kind=jax_kind)
    check(mapped(lambda B, v: B.all_gather(v, "i", axis=1), in_axes=1, out_axes=2), (y,), jax_kind=jax_kind)


@jax_param
@pytest.mark.parametrize("in_axis,out_axis", [(-1, 0), (0, -1), (-2, -2), (-1, -3)])
def test_negative_in_out_axes(jax_kind, in_axis, out_axis):
    # Negative map axes: torchpmap normalizes them; jax.pmap does not support them (a
    # sharding error in 0.10.2), so the JAX side gets the normalized axes.
    x = sample((3, 4, 4) if in_axis == -2 else (3, 2, 4), seed=2)
    prog = mapped(lambda B, v: B.psum(v, "i") + v, in_axes=in_axis, out_axes=out_axis)
    jax_prog = mapped(lambda B, v: B.psum(v, "i") + v, in_axes=in_axis % 3, out_axes=out_axis % 3)
    check(prog, (x,), jax_kind=jax_kind, jax_program=jax_prog)


@jax_param
def test_keyword_arguments_map_axis_0(jax_kind):
    x, y = sample((4, 3), seed=1), sample((4, 3), seed=2)

    def program(B, M, a, b):
        return M(lambda u, w=None: B.psum(u * w, "i") + w, "i")(a, w=b)

    check(program, (x, y), jax_kind=jax_kind)


def test_static_broadcasted_argnums():
    x = sample((4, 3), seed=1)

    def program(B, M, a):
        f = M(
            lambda u, k, scale: B.psum(u, "i") * k + scale,
            "i",
            static_broadcasted_argnums=(1,),
            in_axes=(0, None, None),
        )
        return f(a, 3, 0.5)

    check(program, (x,), torch_kind="pmap", jax_kind="pmap")  # a pmap-only option


def test_donate_argnums_is_transparent():
    x = sample((4, 3), seed=1)
    check(mapped(lambda B, v: B.psum(v, "i") * 2, donate_argnums=(0,)), (x,), torch_kind="pmap", jax_kind="pmap")


@pytest.mark.parametrize("n", [12, 16])
def test_size_larger_than_jax_device_count(n):
    # jax.pmap needs one device per instance (8 here); torchpmap runs several instances per
    # device. jax.vmap, which has no device limit, gives the same numbers.
    ops = {
        "psum": lambda B, v: B.psum(v, "i"),
        "all_gather": lambda B, v: B.all_gather(v, "i", axis=1),
        "ppermute": lambda B, v: B.ppermute(v, "i", [(j, (j + 5) % n) for j in range(n)]),
        "psum_scatter": lambda B, v: B.psum_scatter(B.xp.stack([v] * n), "i"),
        "all_to_all": lambda B, v: B.all_to_all(B.xp.stack([v] * n), "i", 0, 1),
    }
    x = sample((n, 3), seed=n)
    check(variants(ops), ({k: x for k in ops},), jax_kind="vmap")
    check(mapped(lambda B, v: B.axis_index("i")), (x,), jax_kind="vmap", jax_default_int=True)


def test_axis_size_without_mapped_arguments():
    # jax.pmap raises "pmap requires at least one argument with a mapped axis" in 0.10.2;
    # jax.vmap(axis_size=...) is the reference.
    j = jax.vmap(lambda: lax.axis_index("i") * 2, axis_name="i", axis_size=3)()
    for kind in ("pmap", "vmap"):
        assert_same(TORCH.map(kind)(lambda: tp.axis_index("i") * 2, "i", axis_size=3)(), j, jax_default_int=True)


# =========================================================================== nested axes
# JAX reference: jax.vmap(jax.vmap(...)). Nested jax.pmap raises in 0.10.2 ("The context
# mesh ... should match the mesh passed to shard_map"). Every torchpmap nesting is compared.

NESTS = [("pmap", "pmap"), ("pmap", "vmap"), ("vmap", "pmap"), ("vmap", "vmap")]


def nested(op, *, outer_in=0, inner_in=0, outer_out=0, inner_out=0):
    def program(B, nest, x):
        outer, inner = (B.map(k) for k in nest)
        f = inner(lambda v: op(B, v), "j", in_axes=inner_in, out_axes=inner_out)
        return outer(f, "i", in_axes=outer_in, out_axes=outer_out)(x)

    return program


def check_nested(program, x, *, jax_program=None, jax_nest=("vmap", "vmap"), **kw):
    j = jit_call(lambda a: (jax_program or program)(JAX, jax_nest, a), JAX.from_numpy(x))
    for nest in NESTS:
        t = program(TORCH, nest, TORCH.from_numpy(x))
        try:
            assert_same(t, j, **kw)
        except AssertionError as e:
            raise AssertionError(f"tp.{nest[0]}(tp.{nest[1]}) vs jax.{jax_nest[0]}(jax.{jax_nest[1]}): {e}") from None
    return to_numpy(t)


NAMES = ["i", "j", ("i", "j"), ("j", "i")]
names_param = pytest.mark.parametrize("names", NAMES, ids=["i", "j", "ij", "ji"])


@names_param
def test_nested_reductions(names):
    x = sample((2, 4, 3), seed=1)
    ops = ("psum", "pmean", "pmax", "pmin")
    check_nested(nested(lambda B, v: {op: getattr(B, op)(v, names) for op in ops}), x)


@names_param
def test_nested_axis_index_and_size(names):
    x = sample((2, 4), seed=1)
    t = check_nested(nested(lambda B, v: B.axis_index(names)), x, jax_default_int=True)
    expected = {"i": [[0] * 4, [1] * 4], "j": [[0, 1, 2, 3]] * 2, ("i", "j"): [[0, 1, 2, 3], [4, 5, 6, 7]],
                ("j", "i"): [[0, 2, 4, 6], [1, 3, 5, 7]]}[names]
    np.testing.assert_array_equal(t, expected)
    check_nested(nested(lambda B, v: v * B.axis_size(names)), x)


def test_nested_documented_numbers():
    x = arange((2, 4))
    np.testing.assert_array_equal(check_nested(nested(lambda B, v: B.psum(v, "j")), x), [[6] * 4, [22] * 4])
    np.testing.assert_array_equal(check_nested(nested(lambda B, v: B.psum(v, "i")), x), [[4, 6, 8, 10]] * 2)
    np.testing.assert_array_equal(check_nested(nested(lambda B, v: B.psum(v, ("i", "j"))), x), np.full((2, 4), 28.0))


@pytest.mark.parametrize("jax_nest", [("pmap", "vmap"), ("vmap", "pmap")], ids=["jax.pmap(vmap)", "jax.vmap(pmap)"])
def test_nested_against_mixed_jax_forms(jax_nest):
    # One level of jax.pmap around or inside jax.vmap works in 0.10.2: a second JAX reference.
    x = sample((2, 4, 3), seed=2)
    check_nested(
        nested(lambda B, v: {
            "mix": B.psum(v, ("i", "j")) + B.pmax(v, "j") - B.pmean(v, "i"),
            "a2a": B.all_to_all(B.xp.stack([v] * 8), ("i", "j"), 0, 1),
        }),
        x, jax_nest=jax_nest,
    )
    check_nested(nested(lambda B, v: B.axis_index(("j", "i"))), x, jax_nest=jax_nest, jax_default_int=True)


@names_param
@pytest.mark.parametrize("tiled", [False, True], ids=["untiled", "tiled"])
def test_nested_all_to_all(names, tiled):
    n = 8 if isinstance(names, tuple) else {"i": 2, "j": 4}[names]
    size = n * (2 if tiled else 1)
    args = {
        "s0c0": _with_size((3, 2), 0, size),
        "s0c1": _with_size((3, 2), 0, size),
        "s1c0": _with_size((3, 2), 1, size),
    }
    forms = {"s0c0": (0, 0), "s0c1": (0, 1), "s1c0": (1, 0)}
    xs = {k: sample((2, 4, *shape), seed=len(k)) for k, shape in args.items()}

    # nested() takes one array: pass the dict through as one pytree argument.
    def prog(B, nest, d):
        outer, inner = (B.map(k) for k in nest)
        f = inner(lambda t: {k: B.all_to_all(t[k], names, s, c, tiled=tiled) for k, (s, c) in forms.items()}, "j")
        return outer(f, "i")(d)

    j = jit_call(lambda d: prog(JAX, ("vmap", "vmap"), d), JAX.tree_from_numpy(xs))
    for nest in NESTS:
        assert_same(prog(TORCH, nest, TORCH.tree_from_numpy(xs)), j)


# Over a tuple of names, JAX 0.10.2's vmap asserts ("axis size doesn't match") for
# all_gather and psum_scatter, and ("Permutation doesn't match the axis size!") for
# ppermute/pshuffle; jax.pmap(vmap) fails likewise. The JAX reference is then built from
# JAX's single-axis collectives, following the documented product semantics (row-major,
# first name most significant).


def _jax_gather_product(v, names, axis):
    """all_gather over ``names`` (non-tiled), from one all_gather per name."""
    g = v
    for name in reversed(names):  # least significant innermost
        g = lax.all_gather(g, name, axis=axis)
    return g.reshape(g.shape[:axis] + (-1,) + g.shape[axis + len(names):])


def _jax_index(names):
    idx = 0
    for name in names:
        idx = idx * lax.axis_size(name) + lax.axis_index(name)
    return idx


TUPLE_NAMES = pytest.mark.parametrize("names", [("i", "j"), ("j", "i")], ids=["ij", "ji"])


@TUPLE_NAMES
def test_nested_all_gather_over_tuple(names):
    x = sample((2, 4, 2, 3), seed=3)

    def torch_op(B, v):
        return {k: B.all_gather(v, names, axis=a, tiled=t) for k, (a, t) in GATHER_FORMS.items()}

    def jax_op(B, v):
        out = {}
        for k, (a, t) in GATHER_FORMS.items():
            if not t:
                out[k] = _jax_gather_product(v, names, a % (v.ndim + 1))
            else:
                a = a % v.ndim
                g = _jax_gather_product(v, names, a)  # (..., 8 at a, v.shape[a] at a+1, ...)
                out[k] = g.reshape(g.shape[:a] + (-1,) + g.shape[a + 2:])
        return out

    check_nested(nested(torch_op), x, jax_program=nested(jax_op))


@TUPLE_NAMES
@pytest.mark.parametrize("tiled", [False, True], ids=["untiled", "tiled"])
def test_nested_psum_scatter_over_tuple(names, tiled):
    size = 8 * (2 if tiled else 1)
    dims = {"dim0": 0, "dim1": 1, "dim-1": -1}
    xs = {k: sample((2, 4, *_with_size((3, 2), d, size)), seed=4 + d) for k, d in dims.items()}

    def prog(op):
        def program(B, nest, d):
            outer, inner = (B.map(k) for k in nest)
            f = inner(lambda t: {k: op(B, t[k], dim) for k, dim in dims.items()}, "j")
            return outer(f, "i")(d)

        return program

    def jax_op(B, v, dim):  # psum, then keep my slice (block) along the dimension
        d = dim % v.ndim
        total, idx = lax.psum(v, names), _jax_index(names)
        if not tiled:
            return jnp.take(total, idx, axis=d)
        chunk = v.shape[d] // 8
        return lax.dynamic_slice_in_dim(total, idx * chunk, chunk, axis=d)

    j = jit_call(lambda d: prog(jax_op)(JAX, ("vmap", "vmap"), d), JAX.tree_from_numpy(xs))
    torch_prog = prog(lambda B, v, dim: B.psum_scatter(v, names, scatter_dimension=dim, tiled=tiled))
    for nest in NESTS:
        assert_same(torch_prog(TORCH, nest, TORCH.tree_from_numpy(xs)), j)


@TUPLE_NAMES
@pytest.mark.parametrize(
    "pairs", [[(k, (k + 3) % 8) for k in range(8)], [(0, 7), (5, 1), (6, 6)]], ids=["shift3", "partial"]
)
def test_nested_ppermute_and_pshuffle_over_tuple(names, pairs):
    x = sample((2, 4, 3), seed=5, low=1)
    source = [-1] * 8
    for s, d in pairs:
        source[d] = s
    perm = [5, 2, 7, 0, 1, 6, 3, 4]

    def jax_op(B, v):  # gather every instance's value, keep the one from my source
        g, me = _jax_gather_product(v, names, 0), _jax_index(names)
        mine = jnp.asarray(source)[me]
        return {"ppermute": jnp.where(mine >= 0, g[jnp.maximum(mine, 0)], jnp.zeros_like(v)),
                "pshuffle": g[jnp.asarray(perm)[me]]}

    torch_op = lambda B, v: {"ppermute": B.ppermute(v, names, pairs), "pshuffle": B.pshuffle(v, names, perm)}  # noqa: E731
    check_nested(nested(torch_op), x, jax_program=nested(jax_op))


def test_nested_in_out_axes():
    x = sample((3, 2, 4), seed=6)  # outer: axis 1 (size 2); inner: axis 1 of (3, 4) (size 4)
    prog = nested(
        lambda B, v: B.psum(v, "j") * v + B.cast(B.axis_index(("i", "j")), "float32"),
        outer_in=1, inner_in=1, inner_out=1, outer_out=2,
    )
    check_nested(prog, x)


# =========================================================================== autodiff
# The reference doc's table (x = [1, 2, 3, 4]): the per-instance functions and the
# documented gradient, identical for pmap(grad f), vmap(grad f) and grad(sum(pmap f)).

SHIFT_RIGHT = [(j, (j + 1) % 4) for j in range(4)]
W4 = np.array([1.0, 2.0, 3.0, 4.0], np.float32)

AD_TABLE = {
    "psum": (lambda B, v: B.psum(v, "i"), [4, 4, 4, 4]),
    "psum_sq": (lambda B, v: B.psum(v**2, "i"), [8, 16, 24, 32]),
    "pmean": (lambda B, v: B.pmean(v, "i"), [1, 1, 1, 1]),
    "x_over_psum": (lambda B, v: v / B.psum(v, "i"), [0, 0, 0, 0]),
    "sum_all_gather": (lambda B, v: B.all_gather(v, "i").sum(), [4, 4, 4, 4]),
    "weighted_all_gather": (lambda B, v: (B.all_gather(v, "i") * B.asarray(W4)).sum(), [4, 8, 12, 16]),
    "ppermute": (lambda B, v: B.ppermute(v, "i", SHIFT_RIGHT) * B.cast(B.axis_index("i") + 1, "float32"), [2, 3, 4, 1]),
    "psum_scatter": (lambda B, v: B.psum_scatter(B.xp.stack([v, 2 * v, 3 * v, 4 * v]), "i"), [10, 10, 10, 10]),
    "all_to_all": (
        lambda B, v: (B.all_to_all(B.xp.stack([v, 2 * v, 3 * v, 4 * v]), "i", 0, 0) * B.asarray(W4)).sum(),
        [10, 20, 30, 40],
    ),
}
ad_param = pytest.mark.parametrize("entry", list(AD_TABLE))
X4 = np.array([1.0, 2.0, 3.0, 4.0], np.float32)
T4 = np.array([0.5, -1.0, 2.0, 0.25], np.float32)  # a tangent that differs per instance


def _jacfwd_by_jvps(B, f):
    """jacfwd as a stack of jvps along the basis (the definition of jacfwd), for JAX forms
    whose jacfwd raises: jax.jacfwd of psum_scatter fails in 0.10.2 with "IndexError: tuple
    index out of range" (its batching of the jvp), under jax.pmap and inside the map."""

    def jac(v):
        basis = jnp.eye(v.size, dtype=v.dtype).reshape(v.size, *v.shape)
        cols = [B.jvp(f, (v,), (e,))[1] for e in basis]
        return jnp.stack(cols, axis=-1).reshape(cols[0].shape + v.shape)

    return jac


@jax_param
@ad_param
def test_grad_inside_map(jax_kind, entry):
    f, documented = AD_TABLE[entry]
    # jax.vmap(grad f) of all_to_all fails in JAX ("Expected cotangent type float32[4] but
    # got float32[4,4]", noted in the reference doc): jax.pmap is the reference there.
    jk = "pmap" if entry == "all_to_all" else jax_kind
    t, _ = check(lambda B, M, x: M(B.grad(lambda v: f(B, v)), "i")(x), (X4,), jax_kind=jk)
    np.testing.assert_allclose(t, documented, atol=1e-6)


@jax_param
@ad_param
def test_grad_of_function_calling_map(jax_kind, entry):
    f, documented = AD_TABLE[entry]
    prog = lambda B, M, x: B.grad(lambda v: M(lambda u: f(B, u), "i")(v).sum())(x)  # noqa: E731
    t, j = check(prog, (X4,), jax_kind=jax_kind)
    np.testing.assert_allclose(t, documented, atol=1e-6)
    # The same gradient through .backward(), against the same JAX result.
    for kind in ("pmap", "vmap"):
        x = torch.from_numpy(X4.copy()).requires_grad_()
        TORCH.map(kind)(lambda u: f(TORCH, u), "i")(x).sum().backward()
        np.testing.assert_allclose(x.grad.numpy(), j, rtol=1e-5, atol=1e-5, err_msg=f"tp.{kind} .backward()")
        assert x.grad.dtype == torch.float32


@jax_param
@ad_param
def test_jvp_inside_map(jax_kind, entry):
    f, _ = AD_TABLE[entry]
    prog = lambda B, M, x, t: M(lambda v, tv: B.jvp(lambda u: f(B, u), (v,), (tv,)), "i")(x, t)  # noqa: E731
    check(prog, (X4, T4), jax_kind=jax_kind)


@jax_param
@ad_param
def test_jvp_and_jacobians_of_map(jax_kind, entry):
    f, _ = AD_TABLE[entry]

    def prog(B, M, x, t):
        g = M(lambda u: f(B, u), "i")
        return {"jvp": B.jvp(g, (x,), (t,)), "jacrev": B.jacrev(g)(x), "jacfwd": B.jacfwd(g)(x)}

    jax_prog = None
    if entry == "psum_scatter" and jax_kind == "pmap":  # see _jacfwd_by_jvps
        def jax_prog(B, M, x, t):
            g = M(lambda u: f(B, u), "i")
            return {"jvp": B.jvp(g, (x,), (t,)), "jacrev": B.jacrev(g)(x), "jacfwd": _jacfwd_by_jvps(B, g)(x)}

    check(prog, (X4, T4), jax_kind=jax_kind, jax_program=jax_prog)


# Vector-valued per-instance functions for Jacobians inside the map (instance shape (2,)).
# jacrev (psum-transposed cotangents) and jacfwd (tangents summed over instances) give
# different per-instance Jacobians in JAX's pmap convention; both must match JAX.
JAC_FUNS = {
    "psum_sq": lambda B, v: B.psum(v**2, "i"),
    "all_gather": lambda B, v: B.all_gather(v * v, "i"),
    "ppermute": lambda B, v: B.ppermute(B.xp.sin(v), "i", SHIFT_RIGHT),
    "psum_scatter": lambda B, v: B.psum_scatter(B.xp.stack([v, 2 * v, v * v, -v]), "i"),
    "pmean_mix": lambda B, v: B.pmean(v, "i") * v,
}


# Under TORCHPMAP_TEST_JIT on one device, tracing jacfwd through torch.stack on fake tensors
# hits a device mismatch inside PyTorch (cpu vs meta), so pmap(jit=True) runs that program
# eagerly and warns. (On several devices each device's slice traces and compiles: no exclusion.)
_TRACE_FAILS_IN_TORCH = (
    pytest.mark.filterwarnings("ignore::torchpmap.JitFallbackWarning") if tp.device_count() == 1 else ()
)


@jax_param
@pytest.mark.parametrize(
    "fname", [pytest.param(f, marks=_TRACE_FAILS_IN_TORCH) if f == "psum_scatter" else f for f in JAC_FUNS]
)
def test_jacobians_inside_map(jax_kind, fname):
    g = JAC_FUNS[fname]

    def prog(B, M, x):
        return M(lambda v: {"jacrev": B.jacrev(lambda u: g(B, u))(v), "jacfwd": B.jacfwd(lambda u: g(B, u))(v)}, "i")(x)

    jax_prog = None
    if fname == "psum_scatter":  # jax.jacfwd raises here under both forms: see _jacfwd_by_jvps
        def jax_prog(B, M, x):
            h = lambda u: g(B, u)  # noqa: E731
            return M(lambda v: {"jacrev": B.jacrev(h)(v), "jacfwd": _jacfwd_by_jvps(B, h)(v)}, "i")(x)

    check(prog, (sample((4, 2), seed=11),), jax_kind=jax_kind, jax_program=jax_prog)


@pytest.mark.parametrize("group", ["pairs", "interleaved"])
def test_grad_with_groups(group):
    """Transposes with axis_index_groups: psum -> psum within the group, all_gather ->
    psum_scatter within the group. jax.pmap is the reference (jax.vmap has no groups)."""
    _, groups = GROUPS[group]
    w = np.array([1.0, -2.0], np.float32)

    def prog(B, M, x):
        def f(v):
            gathered = B.all_gather(v, "i", axis_index_groups=groups)  # (2,) per instance
            return (B.psum(v**2, "i", axis_index_groups=groups) + (gathered * B.asarray(w)).sum()
                    + B.pmean(v, "i", axis_index_groups=groups) * v)

        return {"inside": M(B.grad(f), "i")(x), "outside": B.grad(lambda a: M(f, "i")(a).sum())(x)}

    check(prog, (X4,), jax_kind="pmap")


@pytest.mark.parametrize("group", ["pairs", "interleaved"])
def test_grad_of_scatters_with_groups(group):
    """Transposes with axis_index_groups: psum_scatter -> all_gather within the group,
    all_to_all -> all_to_all with the axes swapped, within the group; inside the map and
    outside it. jax.pmap is the reference."""
    _, groups = GROUPS[group]
    w = np.array([[1.0, -2.0, 0.5], [3.0, 0.25, -1.0]], np.float32)

    def prog(B, M, x):
        def f(v):  # v: (2, 3) per instance, groups of 2
            scattered = B.psum_scatter(v, "i", axis_index_groups=groups)  # (3,)
            exchanged = B.all_to_all(v, "i", 0, 0, axis_index_groups=groups)  # (2, 3)
            # untiled with split_axis != concat_axis, JAX 0.10.2's grouped transpose fails
            # ("Expected cotangent type float32[2,3,1] but got float32[2,1,3]"): tiled here
            blocks = B.all_to_all(v, "i", 0, 1, axis_index_groups=groups, tiled=True)  # (1, 6)
            return ((scattered**2).sum() + (exchanged * B.asarray(w)).sum() ** 2
                    + (blocks * B.asarray(w).reshape(1, 6)).sum() ** 3)

        return {"inside": M(B.grad(f), "i")(x), "outside": B.grad(lambda a: M(f, "i")(a).sum())(x)}

    check(prog, (sample((4, 2, 3), seed=5),), jax_kind="pmap")


@jax_param
def test_pmax_pmin_are_not_differentiable(jax_kind):
    with pytest.raises(NotImplementedError):
        JAX.map(jax_kind)(JAX.grad(lambda v: JAX.pmax(v, "i")), "i")(JAX.from_numpy(X4))
    for kind in ("pmap", "vmap"):
        for op in (tp.pmax, tp.pmin):
            with pytest.raises(NotImplementedError):
                TORCH.map(kind)(TORCH.grad(lambda v: op(v, "i")), "i")(TORCH.from_numpy(X4))


# ----------------------------------------------------------------- data-parallel steps


def _loss(B, w, x):
    return ((x * w) ** 2).sum()


W0 = np.array(2.0, np.float32)


@jax_param
def test_data_parallel_step_pmean_of_grads(jax_kind):
    """``pmap(lambda w, x: pmean(grad(loss)(w, x), 'i'), in_axes=(None, 0))(2., arange(4.))``
    -> 14 on every instance (reference doc)."""

    def prog(B, M, w, x):
        return M(lambda w_, x_: B.pmean(B.grad(lambda a: _loss(B, a, x_))(w_), "i"), "i", in_axes=(None, 0))(w, x)

    t, _ = check(prog, (W0, arange(4)), jax_kind=jax_kind)
    np.testing.assert_allclose(t, [14, 14, 14, 14])


@jax_param
def test_grad_through_broadcast_argument_sums_cotangents(jax_kind):
    """``grad(lambda w: pmap(loss, in_axes=(None, 0))(w, arange(4.)).sum())(2.)`` -> 56."""

    def prog(B, M, w, x):
        return B.grad(lambda a: M(lambda w_, x_: _loss(B, w_, x_), "i", in_axes=(None, 0))(a, x).sum())(w)

    t, j = check(prog, (W0, arange(4)), jax_kind=jax_kind)
    np.testing.assert_allclose(t, 56)
    for kind in ("pmap", "vmap"):  # the same through .backward()
        w = torch.tensor(2.0, requires_grad=True)
        TORCH.map(kind)(lambda w_, x_: _loss(TORCH, w_, x_), "i", in_axes=(None, 0))(
            w, torch.arange(4.0)
        ).sum().backward()
        assert_same(w.grad, jnp.asarray(j))


@jax_param
def test_data_parallel_step_on_pytree_params(jax_kind):
    """A full DP step: per-instance grads of a dict of parameters, pmean'ed, then an SGD
    update; parameters broadcast (in_axes None), batch mapped, outputs replicated."""
    params = {"w": sample((3, 2), seed=1), "b": sample((2,), seed=2)}
    xs, ys = sample((4, 5, 3), seed=3), sample((4, 5, 2), seed=4)

    def program(B, M, p, x, y):
        def loss(p_, x_, y_):
            return ((x_ @ p_["w"] + p_["b"] - y_) ** 2).mean()

        def step(p_, x_, y_):
            g = B.pmean(B.grad(loss)(p_, x_, y_), "i")
            return {k: p_[k] - 0.1 * g[k] for k in p_}, B.pmean(loss(p_, x_, y_), "i")

        return M(step, "i", in_axes=(None, 0, 0), out_axes=(None, None))(p, x, y)

    check(program, (params, xs, ys), jax_kind=jax_kind)
