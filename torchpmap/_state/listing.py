"""How an error message names a few of many: the first three, then ``...``."""
from __future__ import annotations

from collections.abc import Sequence


def first_few(names: Sequence[str], shown: int = 3) -> str:
    """``names`` joined by commas, the first ``shown`` of them and ``...`` for the rest.

    Example:
        >>> first_few(["'a'", "'b'", "'c'", "'d'"])
        "'a', 'b', 'c', ..."
    """
    return ", ".join(names[:shown]) + (", ..." if len(names) > shown else "")
