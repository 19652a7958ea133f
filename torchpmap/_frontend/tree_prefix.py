"""Matching ``in_axes``/``out_axes`` prefixes against argument and output pytrees.

A prefix is a pytree whose leaves are ints or None; each of its leaves applies to the
whole subtree at the same place in the full tree. torch's own
``_broadcast_to_and_flatten`` only returns None on a mismatch, so this module walks the
two trees itself and names the key path where they part.
"""
from __future__ import annotations

import numbers
from collections.abc import Callable, Iterator
from typing import Any

from torchpmap._state.torch_private import pytree


def is_axis_spec_leaf(x: Any) -> bool:
    return x is None or (isinstance(x, int) and not isinstance(x, bool))


def as_index(x: Any) -> Any:
    """``x`` as a Python int when it is an integer of another type (``np.int64(1)``, as
    JAX accepts), else ``x`` unchanged; never a bool."""
    if isinstance(x, numbers.Integral) and not isinstance(x, (bool, int)):  # numpy's bool is no Integral
        return int(x)
    return x


def normalize_axis_spec(spec: Any) -> Any:
    """``spec`` with every integer leaf of another type (a numpy integer) as a Python int."""
    if spec is None or type(spec) is int:  # the common cases
        return spec
    return pytree.tree_map(as_index, spec, is_leaf=lambda x: x is None)


def check_axis_spec(spec: Any, what: str) -> None:
    """Raises TypeError unless every leaf of ``spec`` is an int or None."""
    leaves = pytree.tree_leaves_with_path(spec, is_leaf=lambda x: x is None)
    for path, leaf in leaves:
        if not is_axis_spec_leaf(leaf):
            raise TypeError(
                f"{what} must be an int, None, or a (nested) tuple/list/dict of those, but got "
                f"{leaf!r} of type {type(leaf).__name__} at {what}{pytree.keystr(path)}"
            )


def _children(node: Any) -> tuple[list[Any], Any, list[str]]:
    """One level of the pytree node ``node``: (children, (node kind, context), key strings).

    A one-level flatten (every child a leaf) gives what torch's node registry holds for
    the node, through the pytree module's public functions only.
    """
    children, spec = pytree.tree_flatten(node, is_leaf=lambda x: x is not node)
    try:
        keyed, _ = pytree.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)
        keys = [pytree.keystr(path) for path, _ in keyed]
    except ValueError:  # a node type registered without flatten_with_keys_fn
        keys = [f"[{i}]" for i in range(len(children))]
    return children, (spec.type, spec.context), keys


def _kind(node: Any) -> Any:
    """The registered kind of a pytree node (``namedtuple`` for every namedtuple class)."""
    return pytree.tree_flatten(node, is_leaf=lambda x: x is not node)[1].type


def _describe(x: Any) -> str:
    if pytree.tree_is_leaf(x):
        return f"a leaf of type {type(x).__name__}"
    kind = _kind(x)
    if isinstance(x, dict):
        return f"a {kind.__name__} with keys {list(x.keys())}"
    return f"a {getattr(kind, '__name__', kind)} of {len(_children(x)[0])} entries"


def broadcast_prefix(
    prefix: Any, tree: Any, what: str, path: str = "", is_leaf: Callable[[Any], bool] = is_axis_spec_leaf
) -> Iterator[tuple[Any, str]]:
    """Yields ``(axis, key path)`` for every leaf of ``tree``, in pytree flatten order.

    ``prefix`` must be a pytree prefix of ``tree`` (its leaves ints or None, or what
    ``is_leaf`` accepts: shard_map's PartitionSpecs); a mismatch raises ValueError naming
    ``what`` and the key path where the structures differ.
    """
    if is_leaf(prefix):
        for sub, _ in pytree.tree_leaves_with_path(tree):
            yield prefix, path + pytree.keystr(sub)
        return
    if type(prefix) is dict and type(tree) is dict and prefix.keys() == tree.keys():
        # a dict prefix matches by key, as in JAX (whose dicts flatten in sorted key order);
        # torch's pytree keeps insertion order, so the prefix follows the value's order
        prefix = {k: prefix[k] for k in tree}
    same_kind = not pytree.tree_is_leaf(tree)
    if same_kind:
        p_children, p_context, _ = _children(prefix)
        t_children, t_context, keys = _children(tree)
        same_kind = p_context == t_context and len(p_children) == len(t_children)
    if not same_kind:
        raise ValueError(
            f"{what} is not a pytree prefix of the value it describes: at key path "
            f"{path or '(the root)'} it is {_describe(prefix)}, but the value there is "
            f"{_describe(tree)}. Give an int or None there, or a container with exactly the "
            f"value's structure."
        )
    for p_child, t_child, key in zip(p_children, t_children, keys):
        yield from broadcast_prefix(p_child, t_child, what, path + key, is_leaf)
