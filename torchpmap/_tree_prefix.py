"""Matching ``in_axes``/``out_axes`` prefixes against argument and output pytrees.

A prefix is a pytree whose leaves are ints or None; each of its leaves applies to the
whole subtree at the same place in the full tree. torch's own
``_broadcast_to_and_flatten`` only returns None on a mismatch, so this module walks the
two trees itself and names the key path where they part.
"""
from __future__ import annotations

from typing import Any, Iterator

import torch.utils._pytree as pytree


def is_axis_spec_leaf(x: Any) -> bool:
    return x is None or (isinstance(x, int) and not isinstance(x, bool))


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
    """One level of ``node``: (children, context, key strings)."""
    node_def = pytree.SUPPORTED_NODES[pytree._get_node_type(node)]
    if node_def.flatten_with_keys_fn is not None:
        keyed, context = node_def.flatten_with_keys_fn(node)
        return [c for _, c in keyed], context, [pytree.keystr((k,)) for k, _ in keyed]
    children, context = node_def.flatten_fn(node)
    return list(children), context, [f"[{i}]" for i in range(len(children))]


def _describe(x: Any) -> str:
    if pytree.tree_is_leaf(x):
        return f"a leaf of type {type(x).__name__}"
    kind = pytree._get_node_type(x)
    if isinstance(x, dict):
        return f"a {kind.__name__} with keys {list(x.keys())}"
    return f"a {getattr(kind, '__name__', kind)} of {len(_children(x)[0])} entries"


def broadcast_prefix(prefix: Any, tree: Any, what: str, path: str = "") -> Iterator[tuple[Any, str]]:
    """Yields ``(axis, key path)`` for every leaf of ``tree``, in pytree flatten order.

    ``prefix`` must be a pytree prefix of ``tree`` (its leaves ints or None); a mismatch
    raises ValueError naming ``what`` and the key path where the structures differ.
    """
    if is_axis_spec_leaf(prefix):
        for sub, _ in pytree.tree_leaves_with_path(tree):
            yield prefix, path + pytree.keystr(sub)
        return
    same_kind = not pytree.tree_is_leaf(tree) and pytree._get_node_type(tree) == pytree._get_node_type(prefix)
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
        yield from broadcast_prefix(p_child, t_child, what, path + key)
