"""Every error condition of pmap, vmap and the collectives: the exception type, and a
message that names the argument, key path or sizes involved and says how to fix it.

Runs the same with one device and with ``TORCHPMAP_NUM_CPU_DEVICES=4`` (where errors are
raised from the device threads and re-raised in the caller).
"""
from __future__ import annotations

import contextlib
import warnings

import pytest
import torch

import torchpmap as tp

X4 = torch.arange(4.0)
ONE_DEVICE = tp.devices()[:1]


@contextlib.contextmanager
def raises(exc_type: type[BaseException], *fragments: str):
    """Like ``pytest.raises``, and every fragment must appear in the message (case-insensitive)."""
    with pytest.raises(exc_type) as info:
        yield info
    message = str(info.value)
    missing = [f for f in fragments if f.lower() not in message.lower()]
    assert not missing, f"message lacks {missing}:\n{message}"


def collective(fn, x=X4, axis_name="i", **kwargs):
    """Runs ``fn`` as the per-instance function of a pmap over ``axis_name``."""
    return tp.pmap(fn, axis_name=axis_name, **kwargs)(x)


# --------------------------------------------------------------------------- mapped sizes


def test_mismatched_sizes_list_every_argument_with_its_size():
    with raises(ValueError, "inconsistent sizes", "'x'", "'y'", "size 4", "size 3") as info:
        tp.pmap(lambda x, y: x + y)(torch.ones(4), torch.ones(3))
    lines = str(info.value).splitlines()
    assert any("'x'" in line and "size 4" in line for line in lines), info.value
    assert any("'y'" in line and "size 3" in line for line in lines), info.value


def test_mismatched_sizes_name_the_key_path_inside_a_pytree():
    with raises(ValueError, "'x'", "['a']", "size 4", "'y'", "size 3", "(3, 2)"):
        tp.pmap(lambda x, y: x["a"] + y[:, 0])({"a": torch.ones(4)}, torch.ones(3, 2))


def test_mismatched_sizes_with_in_axes_1_name_the_axis():
    with raises(ValueError, "axis 1 of argument 'x'", "size 5", "axis 0 of argument 'y'", "size 4"):
        tp.pmap(lambda x, y: x, in_axes=(1, 0))(torch.ones(4, 5), torch.ones(4))


def test_mismatched_sizes_name_a_keyword_argument():
    # Keyword arguments are mapped over axis 0; a wrong size must name the keyword.
    with raises(ValueError, "inconsistent sizes", "'x'", "size 4", "keyword argument 'y'", "size 3"):
        tp.pmap(lambda x, y: x + y)(torch.ones(4), y=torch.ones(3))


def test_axis_size_that_does_not_match_names_both_sizes():
    with raises(ValueError, "axis_size=4", "size 3"):
        tp.pmap(lambda x: x, axis_size=4)(torch.ones(3))


@pytest.mark.parametrize("bad", [0, -1, 2.0, "4"])
def test_axis_size_must_be_a_positive_int(bad):
    with raises(ValueError, "axis_size", repr(bad)):
        tp.pmap(lambda x: x, axis_size=bad)


# --------------------------------------------------------------------------- in_axes against the arguments


def test_in_axes_beyond_the_rank():
    with raises(ValueError, "argument 'x'", "axis 2", "rank of at least 3", "rank 2", "(4, 4)", "in_axes"):
        tp.pmap(lambda x: x, in_axes=2)(torch.ones(4, 4))


def test_negative_in_axes_beyond_the_rank():
    with raises(ValueError, "argument 'x'", "axis -3", "rank 2", "(4, 4)"):
        tp.pmap(lambda x: x, in_axes=-3)(torch.ones(4, 4))


def test_in_axes_on_a_scalar():
    with raises(ValueError, "argument 'x'", "axis 0", "rank 0", "shape ()", "None"):
        tp.pmap(lambda x: x)(torch.tensor(1.0))


def test_in_axes_on_a_scalar_leaf_names_the_key_path():
    # The seed's gradient step as printed: the scalar params mapped over axis 0.
    params = {"w": torch.ones(()), "b": torch.zeros(())}
    with raises(ValueError, "argument 'params'", "['w']", "rank 0", "None"):
        tp.pmap(lambda params, x: x, axis_name="data_parallel_axis")(params, torch.ones(1, 4, 1))


@pytest.mark.parametrize("bad", [0.0, "0", True])
@pytest.mark.parametrize("where", ["in_axes", "out_axes"])
def test_axis_spec_must_be_int_or_none(where, bad):
    with raises(TypeError, f"{where} must be an int, None", repr(bad), type(bad).__name__):
        tp.pmap(lambda x: x, **{where: bad})


@pytest.mark.parametrize("bad", [0.0, "0", True])
def test_axis_spec_leaf_error_names_its_key_path(bad):
    with raises(TypeError, repr(bad), "in_axes[1]"):
        tp.pmap(lambda x, y: x, in_axes=(0, bad))
    with raises(TypeError, repr(bad), "out_axes['a']"):
        tp.pmap(lambda x: {"a": x}, out_axes={"a": bad})


@pytest.mark.parametrize("bad", [0.0, "0", True])
def test_vmap_axis_spec_must_be_int_or_none(bad):
    with raises(TypeError, "vmap in_axes", repr(bad)):
        tp.vmap(lambda x: x, in_axes=bad)
    with raises(TypeError, "vmap out_axes", repr(bad)):
        tp.vmap(lambda x: x, out_axes=bad)


@pytest.mark.parametrize("in_axes, n_entries", [((0,), 1), ((0, 0, 0), 3)])
def test_in_axes_tuple_of_the_wrong_length(in_axes, n_entries):
    with raises(ValueError, f"{n_entries} entries", "2 positional arguments", "one entry per positional argument"):
        tp.pmap(lambda x, y: x, in_axes=in_axes)(X4, X4)


def test_in_axes_top_level_list_is_refused_with_the_tuple_to_use():
    with raises(ValueError, "in_axes", "list [0, 0]", "in_axes=(0, 0)"):
        tp.pmap(lambda x, y: x, in_axes=[0, 0])


def test_in_axes_list_where_the_argument_is_a_dict():
    with raises(ValueError, "in_axes[0]", "argument 'd'", "not a pytree prefix", "list", "dict"):
        tp.pmap(lambda d: d["a"], in_axes=([0, 0],))({"a": X4, "b": X4})


def test_in_axes_mismatch_deep_inside_names_the_key_path():
    with raises(ValueError, "in_axes[0]", "argument 'd'", "key path ['a']", "tuple of 3", "tuple of 2"):
        tp.pmap(lambda d: d["a"][0], in_axes=({"a": (0, 0, 0)},))({"a": (X4, X4)})
    with raises(ValueError, "key path ['a']", "tuple of 2", "Tensor"):
        tp.pmap(lambda d: d["a"], in_axes=({"a": (0, 0)},))({"a": X4})


def test_in_axes_dict_with_other_keys_names_the_keys():
    # Both sides are "a dict of 2 entries": only the keys tell the user what is wrong.
    with raises(ValueError, "in_axes[0]", "argument 'd'", "'c'", "'b'"):
        tp.pmap(lambda d: d["a"], in_axes=({"a": 0, "c": 0},))({"a": X4, "b": X4})


def test_out_axes_tuple_of_the_wrong_length():
    with raises(ValueError, "out_axes", "not a pytree prefix", "tuple of 3", "tuple of 2"):
        tp.pmap(lambda x: (x, x), out_axes=(0, 0, 0))(X4)


def test_out_axes_list_where_the_output_is_a_tuple():
    with raises(ValueError, "out_axes", "not a pytree prefix", "list", "tuple"):
        tp.pmap(lambda x: (x, x), out_axes=[0, 0])(X4)


def test_out_axes_beyond_the_rank_of_the_output():
    with raises(ValueError, "out_axes", "is 2", "rank 0", "-1..0"):
        tp.pmap(lambda x: x, out_axes=2)(X4)


# --------------------------------------------------------------------------- what can be mapped


@pytest.mark.parametrize("in_axes, args", [(None, (X4,)), ((None, None), (X4, X4))])
def test_no_mapped_argument(in_axes, args):
    with raises(ValueError, "at least one mapped argument", "axis_size"):
        tp.pmap(lambda *a: a[0], in_axes=in_axes)(*args)


def test_no_argument_at_all():
    with raises(ValueError, "at least one mapped argument", "axis_size"):
        tp.pmap(lambda: torch.zeros(()))()


def test_mapping_a_python_number():
    with raises(TypeError, "argument 'y'", "float", "3.0", "None"):
        tp.pmap(lambda x, y: x * y)(X4, 3.0)


def test_mapping_a_python_number_inside_a_list_names_the_key_path():
    with raises(TypeError, "argument 'x'", "[0]", "float", "None"):
        tp.pmap(lambda x: x)([1.0, 2.0])


def test_output_of_an_unsupported_type():
    with raises(TypeError, "str", "'s'", "outputs must be"):
        tp.pmap(lambda x: "s")(X4)


def test_size_that_does_not_divide_over_the_devices():
    n = tp.device_count()
    if n == 1:
        pytest.skip("every size divides over one device")
    with raises(ValueError, f"size {n + 1}", f"{n} devices", "devices="):
        tp.pmap(lambda x: x)(torch.ones(n + 1))


# --------------------------------------------------------------------------- named axes


def test_unbound_axis_name_inside_pmap_names_the_axis_and_the_bound_ones():
    with raises(NameError, "'j'", "'i'", "axis_name='j'"):
        collective(lambda x: tp.psum(x, "j"))


def test_unbound_axis_name_outside_any_map():
    with raises(NameError, "'j'", "no axis is bound"):
        tp.psum(X4, "j")


@pytest.mark.parametrize(
    "op",
    [
        lambda x: tp.pmean(x, "j"),
        lambda x: tp.pmax(x, "j"),
        lambda x: tp.all_gather(x, "j"),
        lambda x: tp.ppermute(x, "j", [(0, 1)]),
        lambda x: tp.axis_index("j"),
        lambda x: x * tp.axis_size("j"),
    ],
    ids=["pmean", "pmax", "all_gather", "ppermute", "axis_index", "axis_size"],
)
def test_unbound_axis_name_in_every_collective(op):
    with raises(NameError, "'j'"):
        collective(op)


def test_unbound_axis_name_in_vmap():
    with raises(NameError, "'j'", "'i'"):
        tp.vmap(lambda x: tp.psum(x, "j"), axis_name="i")(X4)


# --------------------------------------------------------------------------- static arguments


def test_static_argument_passed_by_keyword():
    with raises(ValueError, "static_broadcasted_argnums", "1", "positionally"):
        tp.pmap(lambda x, n: x * n, static_broadcasted_argnums=1)(X4, n=2)


def test_static_argument_that_is_unhashable():
    with raises(ValueError, "static", "argument 'n'", "hashable", "list"):
        tp.pmap(lambda x, n: x * n[0], static_broadcasted_argnums=1)(X4, [2])


@pytest.mark.parametrize("bad", ["a", True, 1.5])
def test_static_broadcasted_argnums_must_be_ints(bad):
    with raises(TypeError, "static_broadcasted_argnums", repr(bad)):
        tp.pmap(lambda x: x, static_broadcasted_argnums=bad)


def test_static_and_donated_argument():
    with raises(ValueError, "static", "donated", "[0]"):
        tp.pmap(lambda x: x, static_broadcasted_argnums=0, donate_argnums=0)


@pytest.mark.parametrize("bad", ["a", True, 1.5])
def test_donate_argnums_must_be_ints(bad):
    with raises(TypeError, "donate_argnums", repr(bad)):
        tp.pmap(lambda x: x, donate_argnums=bad)


# --------------------------------------------------------------------------- devices


def test_empty_devices():
    with raises(ValueError, "'devices'", "non-empty", "None"):
        tp.pmap(lambda x: x, devices=[])


def test_device_listed_twice():
    with raises(ValueError, "devices", "more than once"):
        tp.pmap(lambda x: x, devices=ONE_DEVICE * 2)


def test_unknown_device():
    with raises(ValueError, "devices[0]", "torchpmap.devices()"):
        tp.pmap(lambda x: x, devices=[tp.Device("cpu", 99)])


# --------------------------------------------------------------------------- collective arguments

SHIFT = [(j, (j + 1) % 4) for j in range(4)]


@pytest.mark.parametrize(
    "perm, fragments",
    [
        ([(0, 1), (0, 2)], ("source", "0", "more than once")),
        ([(0, 1), (2, 1)], ("destination", "1", "more than once")),
        ([(0, 4)], ("(0, 4)", "out of range", "size 4", "0..3")),
        ([(-1, 0)], ("(-1, 0)", "out of range", "0..3")),
    ],
    ids=["duplicate-source", "duplicate-destination", "out-of-range", "negative"],
)
def test_bad_ppermute_perm(perm, fragments):
    with raises(ValueError, "ppermute", *fragments):
        collective(lambda x: tp.ppermute(x, "i", perm))


def test_ppermute_perm_that_is_not_pairs():
    with raises(TypeError, "ppermute", "(source, destination) pairs"):
        collective(lambda x: tp.ppermute(x, "i", [0, 1, 2, 3]))


@pytest.mark.parametrize("perm", [[0, 0, 1, 2], [0, 1, 2], [1, 2, 3, 4]])
def test_bad_pshuffle_perm(perm):
    with raises(ValueError, "pshuffle", repr(perm), "permutation of 0..3", "size 4"):
        collective(lambda x: tp.pshuffle(x, "i", perm))


def test_all_to_all_split_size_mismatch():
    with raises(ValueError, "all_to_all", "split_axis 0", "(3,)", "size 3", "size 4", "tiled=True"):
        collective(lambda x: tp.all_to_all(x, "i", 0, 0), torch.ones(4, 3))


def test_all_to_all_split_size_mismatch_on_another_axis():
    with raises(ValueError, "all_to_all", "split_axis 1", "(2, 3)", "size 3", "size 4"):
        collective(lambda x: tp.all_to_all(x, "i", 1, 0), torch.ones(4, 2, 3))


def test_all_to_all_tiled_split_not_divisible():
    with raises(ValueError, "all_to_all", "tiled=True", "(6,)", "size 6", "not divisible", "size 4"):
        collective(lambda x: tp.all_to_all(x, "i", 0, 0, tiled=True), torch.ones(4, 6))


def test_all_to_all_on_a_scalar():
    with raises(ValueError, "all_to_all", "scalar"):
        collective(lambda x: tp.all_to_all(x, "i", 0, 0))


def test_psum_scatter_size_mismatch():
    with raises(ValueError, "psum_scatter", "scatter_dimension 0", "(3,)", "size 3", "size 4", "tiled=True"):
        collective(lambda x: tp.psum_scatter(x, "i"), torch.ones(4, 3))


def test_psum_scatter_of_booleans(placement):
    """JAX refuses it ("add does not accept dtype bool"); a psum of booleans counts them."""
    with raises(TypeError, "psum_scatter", "booleans", "(4, 4)", "x.int()"):
        collective(lambda x: tp.psum_scatter(x, "i"), torch.ones(4, 4, 4, dtype=torch.bool))
    counts = collective(lambda x: tp.psum_scatter(x.int(), "i"), torch.ones(4, 4, dtype=torch.bool))
    torch.testing.assert_close(torch.as_tensor(counts).cpu(), torch.full((4,), 4, dtype=torch.int32))


def test_psum_scatter_tiled_not_divisible():
    with raises(ValueError, "psum_scatter", "tiled=True", "(6,)", "size 6", "not divisible", "size 4"):
        collective(lambda x: tp.psum_scatter(x, "i", tiled=True), torch.ones(4, 6))


def test_psum_scatter_dimension_out_of_range():
    with raises(ValueError, "psum_scatter", "scatter_dimension=3", "rank 2"):
        collective(lambda x: tp.psum_scatter(x, "i", scatter_dimension=3), torch.ones(4, 4, 4))


def test_all_gather_axis_out_of_range():
    with raises(ValueError, "all_gather", "axis=5", "rank 2"):
        collective(lambda x: tp.all_gather(x, "i", axis=5), torch.ones(4, 3))


def _grouped_scatter(op: str):
    """psum_scatter or all_to_all of a (4, 3) value per instance, in groups."""
    if op == "psum_scatter":
        return lambda groups: (lambda x: tp.psum_scatter(x.expand(4, 3), "i", axis_index_groups=groups))
    return lambda groups: (lambda x: tp.all_to_all(x.expand(4, 3), "i", 0, 0, axis_index_groups=groups))


@pytest.mark.parametrize("op", ["psum", "pmean", "pmax", "pmin", "all_gather", "psum_scatter", "all_to_all"])
@pytest.mark.parametrize(
    "groups",
    [[[0, 1], [2]], [[0, 1], [1, 2, 3]], [[0, 1], [2, 3, 4]]],
    ids=["not-covering", "duplicate", "out-of-range"],
)
def test_axis_index_groups_that_do_not_partition_the_axis(op, groups):
    with raises(ValueError, op, "axis_index_groups", repr(groups), "exactly once", "0..3"):
        if op in ("psum_scatter", "all_to_all"):
            collective(_grouped_scatter(op)(groups), torch.ones(4, 1))
        else:
            collective(lambda x: getattr(tp, op)(x, "i", axis_index_groups=groups))


@pytest.mark.parametrize("op", ["all_gather", "psum_scatter", "all_to_all"])
def test_axis_index_groups_of_unequal_sizes(op):
    """JAX refuses them too (all_to_all: "Replica groups must be equally sized"; psum_scatter
    fails to lower)."""
    groups = [[0], [1, 2, 3]]
    with raises(ValueError, op, "same size", "[[0], [1, 2, 3]]"):
        if op == "all_gather":
            collective(lambda x: tp.all_gather(x, "i", axis_index_groups=groups))
        else:
            collective(_grouped_scatter(op)(groups), torch.ones(4, 1))


@pytest.mark.parametrize("op", ["psum_scatter", "all_to_all"])
def test_grouped_scatter_needs_the_group_size(op):
    """Within groups of 2, the scattered (split) dim has the group's size, not the axis'."""
    with raises(ValueError, op, "(4, 3)", "has size 4", "groups (2, on axis 'i' (size 4))", "tiled=True"):
        collective(_grouped_scatter(op)([[0, 1], [2, 3]]), torch.ones(4, 1))


def test_axis_index_groups_with_a_tuple_of_axis_names():
    nested = tp.pmap(lambda x: tp.psum(x, ("i", "j"), axis_index_groups=[[0, 1], [2, 3]]), axis_name="j")
    with raises(NotImplementedError, "axis_index_groups", "single axis name"):
        tp.pmap(nested, axis_name="i", devices=ONE_DEVICE)(torch.ones(2, 2))


def test_axis_name_tuple_naming_an_axis_twice():
    with raises(ValueError, "psum", "more than once"):
        collective(lambda x: tp.psum(x, ("i", "i")))


# --------------------------------------------------------------------------- differentiation


@pytest.mark.parametrize("name", ["pmax", "pmin"])
def test_pmax_pmin_under_grad_inside_the_pmap(name):
    op = getattr(tp, name)
    with raises(NotImplementedError, name, "not differentiable", "psum"):
        collective(torch.func.grad(lambda x: op(x, "i")))


@pytest.mark.parametrize("name", ["pmax", "pmin"])
def test_pmax_pmin_under_jvp_inside_the_pmap(name):
    op = getattr(tp, name)
    with raises(NotImplementedError, name, "not differentiable"):
        collective(lambda x: torch.func.jvp(lambda a: op(a, "i"), (x,), (torch.ones(()),))[1], devices=ONE_DEVICE)


@pytest.mark.parametrize("name", ["pmax", "pmin"])
def test_pmax_pmin_under_grad_around_the_pmap(name):
    op = getattr(tp, name)
    f = tp.pmap(lambda x: op(x, "i"), axis_name="i", devices=ONE_DEVICE)
    with raises(NotImplementedError, name, "not differentiable"):
        torch.func.grad(lambda x: f(x).sum())(X4)


@pytest.mark.parametrize("name", ["pmax", "pmin"])
def test_pmax_pmin_under_backward(name):
    op = getattr(tp, name)
    x = X4.clone().requires_grad_()
    out = tp.pmap(lambda v: op(v * 2.0, "i"), axis_name="i")(x)
    with raises(NotImplementedError, name, "not differentiable", "detach"):
        out.sum().backward()


# --------------------------------------------------------------------------- vmap


def test_vmap_out_axes_none_on_a_varying_output():
    with raises(ValueError, "out_axes=None", "(the root)", "varies", "psum"):
        tp.vmap(lambda x: x * 2, out_axes=None)(X4)


def test_vmap_out_axes_none_names_the_key_path_of_the_varying_output():
    with raises(ValueError, "out_axes=None", "['q']", "varies"):
        tp.vmap(lambda x: {"p": x, "q": x * 2}, out_axes={"p": 0, "q": None})(X4)
    with raises(ValueError, "out_axes=None", "[1]", "varies"):
        tp.vmap(lambda x: (x, x * 2), out_axes=(0, None))(X4)


def test_vmap_randomness_must_be_known():
    with raises(ValueError, "randomness", "'foo'", "'different'"):
        tp.vmap(lambda x: x, randomness="foo")


def test_pmap_of_something_not_callable():
    with raises(TypeError, "callable", "3"):
        tp.pmap(3)


# --------------------------------------------------------------------------- torch.compile

COMPILE_FRAGMENTS = ("torchpmap", "torch.compile")


def _compiled(fn, **kwargs):
    torch._dynamo.reset()
    return torch.compile(fn, backend="eager", **kwargs)


def test_torch_compile_fullgraph_around_a_pmap_with_a_collective_raises_clearly():
    f = tp.pmap(lambda v: tp.psum(v, "i"), axis_name="i")
    # Dynamo wraps torchpmap's refusal in its own error type (a RuntimeError subclass).
    with raises(RuntimeError, *COMPILE_FRAGMENTS, "cannot run under torch.compile"):
        _compiled(f, fullgraph=True)(X4)


def test_torch_compile_fullgraph_of_a_collective_inside_a_pmap_raises_clearly():
    inner = _compiled(lambda v: tp.psum(v, "i"), fullgraph=True)
    with raises(RuntimeError, *COMPILE_FRAGMENTS, "psum"):
        tp.pmap(inner, axis_name="i")(X4)


@pytest.mark.parametrize("where", ["around", "inside"])
def test_torch_compile_never_returns_wrong_numbers(where):
    """Without fullgraph, Dynamo turns torchpmap's refusal into a graph break and runs the
    pmap eagerly. What matters is that no wrong number ever comes back: either a clear
    error, or the eager result."""
    per_instance = lambda v: tp.psum(v * v, "i") + tp.axis_index("i")  # noqa: E731
    if where == "around":
        f = _compiled(lambda v: tp.pmap(per_instance, axis_name="i")(v) * 2)
    else:
        f = lambda v: tp.pmap(_compiled(per_instance), axis_name="i")(v) * 2  # noqa: E731
    expected = (torch.full((4,), float((X4 * X4).sum())) + torch.arange(4.0)) * 2
    try:
        out = f(X4)
    except Exception as e:  # noqa: BLE001 - a refusal is fine if it says what is going on
        assert all(s.lower() in str(e).lower() for s in COMPILE_FRAGMENTS), str(e)
    else:
        torch.testing.assert_close(torch.as_tensor(out), expected)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_saved_tensor_hooks_around_a_pmap_are_refused_clearly(four_devices, jit):
    """As torch.func.vmap refuses them, on every placement: device threads never see the
    caller's thread-local hooks, so four devices (and one compiled) ignored them where one
    device refused them (a hook that changes what is saved changed nothing there;
    ``torch.utils.checkpoint`` around the call saved no memory). (Not checkpoint itself
    here: torch 2.11's leaves its hooks set when the function raises.)"""
    x = torch.randn(4, 3, requires_grad=True)
    for placement in (four_devices[:1], four_devices):
        f = tp.pmap(lambda v: (v * v).sum(), devices=placement, jit=jit)
        with raises(RuntimeError, "saved tensor hooks", "save_on_cpu", "outside that context"):
            with torch.autograd.graph.save_on_cpu():
                f(x)
        with raises(RuntimeError, "saved tensor hooks"):  # what checkpoint(use_reentrant=False) sets
            with torch.autograd.graph.saved_tensors_hooks(lambda t: t * 2, lambda t: t):
                f(x)
        # and the hooks are on again afterwards
        with torch.autograd.graph.save_on_cpu():
            (x * x).sum().backward()


# --------------------------------------------------------------------------- messages that used to be torch's


def test_axis_index_groups_of_strings_say_what_is_expected():
    with raises(
        TypeError,
        "axis_index_groups must be a list of lists of integer axis indices",
        "0..3",
        "[['a', 'b'], ['c', 'd']]",
    ):
        tp.pmap(lambda v: tp.psum(v, "i", axis_index_groups=[["a", "b"], ["c", "d"]]), "i")(torch.ones(4))


@pytest.mark.parametrize("bad", [["gpu:7"], ["tpu:0"], ["cuda:3"]])
def test_an_unknown_device_string_names_the_known_devices(bad):
    with raises(ValueError, f"devices[0] = {bad[0]!r} is not one of torchpmap.devices()"):
        tp.pmap(lambda v: v, devices=bad)
    with raises(ValueError, f"{bad[0]!r} is not one of torchpmap.devices()"):
        tp.Mesh([bad], ("a", "b"))


def test_a_single_device_instead_of_a_list():
    with raises(TypeError, "devices must be a list of devices, got the single device 'cpu:0'", "devices=['cpu:0']"):
        tp.pmap(lambda v: v, devices="cpu:0")
    with raises(TypeError, "got the single device cpu:0"):
        tp.pmap(lambda v: v, devices=tp.devices()[0])


@pytest.mark.parametrize("name", ["pmax", "pmin"])
def test_an_extremum_of_complex_values_is_refused_clearly(name):
    with raises(TypeError, f"{name}: complex values have no order", ".abs()"):
        tp.pmap(lambda v: getattr(tp, name)(v, "i"), "i")(torch.ones(2, dtype=torch.complex64))


def test_an_axis_name_list_is_refused_at_once():
    with raises(TypeError, "axis_name must be hashable", "axis_name='i'"):
        tp.pmap(lambda v: v, axis_name=["i"])


# --------------------------------------------------------------------------- cryptic errors of the battery (issue 27)


def test_numpy_integers_are_axes_as_in_jax(placement):
    import numpy as np

    x = torch.arange(24.0).reshape(2, 4, 3)
    want = tp.pmap(lambda v: v * 2, in_axes=1, out_axes=1)(x)
    got = tp.pmap(lambda v: v * 2, in_axes=np.int64(1), out_axes=np.int32(1))(x)
    assert torch.equal(torch.as_tensor(got), torch.as_tensor(want))
    nested = tp.pmap(lambda v, w: v + w, in_axes=(np.int64(1), None), axis_size=np.int64(4))(x, torch.ones(3))
    assert torch.equal(torch.as_tensor(nested), x.movedim(1, 0) + 1)
    static = tp.pmap(lambda v, k: v * k, static_broadcasted_argnums=np.int64(1))(X4, 3)
    assert torch.equal(torch.as_tensor(static), X4 * 3)
    with raises(TypeError, "in_axes must be an int", "True"):  # a bool is still no axis
        tp.pmap(lambda v: v, in_axes=np.bool_(True))


def test_a_function_returning_none_returns_none_as_in_jax(placement):
    assert tp.pmap(lambda v: None)(X4) is None
    assert tp.vmap(lambda v: None)(X4) is None
    none, doubled = tp.pmap(lambda v: (None, v * 2))(X4)
    assert none is None and torch.equal(torch.as_tensor(doubled), X4 * 2)


def test_a_mesh_that_is_no_mesh_is_refused_naming_it():
    with raises(
        TypeError, "mesh must be a torchpmap.Mesh", "got str 'notamesh'", "torchpmap.Mesh(devices, axis_names)"
    ):
        tp.pmap(lambda v: v, axis_name="i", mesh="notamesh")


def test_an_empty_mesh_is_refused_at_once():
    import numpy as np

    with raises(ValueError, "Mesh: the device grid is empty", "(0,)", "at least one device"):
        tp.Mesh(np.array([]), ("i",))
    with raises(ValueError, "the device grid is empty", "(0, 2)"):
        tp.Mesh(np.empty((0, 2), dtype=object), ("a", "b"))


def test_an_absurd_cpu_device_count_is_refused_at_once(monkeypatch):
    import time

    from torchpmap._placement import devices as _devices

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("TORCHPMAP_NUM_CPU_DEVICES", str(10**12))
    _devices._local_devices.cache_clear()
    try:
        start = time.monotonic()
        with raises(ValueError, "TORCHPMAP_NUM_CPU_DEVICES=1000000000000", "between 1 and 4096"):
            tp.devices()
        assert time.monotonic() - start < 1
        monkeypatch.setenv("TORCHPMAP_NUM_CPU_DEVICES", "4096")  # the most there may be
        _devices._local_devices.cache_clear()
        assert len(_devices._local_devices()) == 4096
    finally:
        monkeypatch.undo()
        _devices._local_devices.cache_clear()


@pytest.mark.parametrize("dtype", [torch.complex128, torch.complex64])
def test_complex_values_travel_through_all_gather_and_ppermute(placement, dtype):
    x = torch.randn(4, 3, dtype=dtype, generator=torch.Generator().manual_seed(0))
    ring = [(i, (i + 1) % 4) for i in range(4)]
    gathered = tp.pmap(lambda v: tp.all_gather(v, "i"), axis_name="i")(x)
    shifted = tp.pmap(lambda v: tp.ppermute(v, "i", ring), axis_name="i")(x)
    assert torch.equal(torch.as_tensor(gathered), x.expand(4, 4, 3))
    assert torch.equal(torch.as_tensor(shifted), x.roll(1, 0))
    leaf = x.clone().requires_grad_()
    tp.pmap(lambda v: tp.ppermute(v, "i", ring), axis_name="i")(leaf).abs().sum().backward()
    assert torch.allclose(leaf.grad, x / x.abs())


# ------------------------------------------------------------------ errors independent of the placement (issue 27)


def _error_of(fn):
    with pytest.raises(Exception) as info:
        fn()
    return info.value


@pytest.mark.parametrize("size", [4, 8])
def test_an_error_of_the_function_is_the_same_on_every_placement(placement, size):
    """torch.vdot of 2-D tensors said "Got wrong shapes for dot" vectorized on one
    device, naming no instance, and torch's "1D tensors expected" with the instance on 4."""
    x = torch.zeros(size, 3, 3)
    errors = {}
    for where, devices in (("one", placement[:1]), ("all", placement)):
        errors[where] = _error_of(lambda: tp.pmap(lambda v: torch.vdot(v, v), devices=devices)(x))
    for where, error in errors.items():
        assert type(error) is RuntimeError and str(error) == "1D tensors expected, but got 2D and 2D tensors", (
            where,
            error,
        )
    for error in errors.values():
        assert "torchpmap: raised by instance 0 (on device cpu:0)" in error.__notes__, error.__notes__


def test_the_instance_that_raises_is_named_with_its_device(placement):
    """Only instance 2's matrix is not positive-definite: every placement names instance 2
    and the device it runs on (on 4 devices with 8 instances: cpu:1)."""
    x = torch.eye(3).repeat(8, 1, 1)
    x[2] = -x[2]
    for devices in (placement[:1], placement):
        error = _error_of(lambda: tp.pmap(torch.linalg.cholesky, devices=devices)(x))
        device = devices[2 // (8 // len(devices))]
        assert isinstance(error, RuntimeError) and "not positive-definite" in str(error), error
        assert f"torchpmap: raised by instance 2 (on device {device})" in error.__notes__, error.__notes__


def test_an_error_only_vectorization_raises_falls_back(placement):
    """When every instance succeeds one at a time, vmap is what failed: the call returns
    what the instances computed (a loop's numbers, and those of a device running one
    instance), and they run one at a time from then on, with a warning naming vmap's
    error. Before, one device raised where 4 devices computed it: ``flip(0)`` of a 0-d
    instance ("Dimension out of range" under vmap) is such a case."""

    def fails_when_batched(v):
        if torch._C._functorch.is_batchedtensor(v):  # a limit of vmap alone, not of the function
            raise RuntimeError("a failure of vmap alone")
        return v * 2

    f = tp.pmap(fails_when_batched, devices=placement[:1])
    with pytest.warns(tp.VectorizationFallbackWarning, match="a failure of vmap alone"):
        got = f(torch.arange(4.0))
    torch.testing.assert_close(torch.as_tensor(got).cpu(), torch.arange(4.0) * 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # remembered: no second attempt, no second warning
        torch.testing.assert_close(torch.as_tensor(f(torch.ones(4))).cpu(), torch.full((4,), 2.0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tp.VectorizationFallbackWarning)
        flipped = tp.pmap(lambda t: t.flip(0))(torch.arange(8.0))
    torch.testing.assert_close(torch.as_tensor(flipped).cpu(), torch.arange(8.0))


def test_a_transform_around_a_map_run_one_at_a_time_gives_the_vectorized_gradient(placement):
    """torch.func.grad/vjp around a pmap whose instances run one at a time (debug mode,
    or a function vmap cannot run): the backward ran every instance's collective node in
    one thread (the first waited for the others until the collective timeout; later it
    raised, where 4 devices, one instance each, gave numbers). Each instance now runs in a
    vmap of one under such a transform, and its collectives transpose as a vectorized
    map's: the vectorized gradient, on every placement."""
    x = torch.tensor([[1.0, 2.0], [3.0, -1.0], [0.5, 4.0], [-2.0, 1.0]])

    def branching(v):  # vmap cannot run it: it falls back to one instance at a time
        v = v * 2 if v.sum().item() > 0 else v * 3
        return tp.ppermute(tp.psum(v, "i") * v, "i", [(0, 1), (1, 3), (3, 0)])

    programs = (lambda v: v.sin() * 2, lambda v: tp.psum(v.sin(), "i"), branching)
    for fun in programs:
        f = tp.pmap(fun, axis_name="i", devices=placement)
        with tp.disable_vectorization():  # the oracle: instance by instance, .backward()
            y = x.clone().requires_grad_()
            (torch.as_tensor(f(y)) ** 2).sum().backward()
        for debug in (False, True):
            with tp.disable_vectorization() if debug else contextlib.nullcontext(), warnings.catch_warnings():
                warnings.simplefilter("ignore", tp.VectorizationFallbackWarning)
                got = torch.func.grad(lambda v: (torch.as_tensor(f(v)) ** 2).sum())(x)
                out, pull = torch.func.vjp(lambda v: torch.as_tensor(f(v)), x)
                (pulled,) = pull(2 * out)
            torch.testing.assert_close(got, y.grad)
            torch.testing.assert_close(pulled, y.grad)
