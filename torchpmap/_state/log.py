"""The ``torchpmap`` logger: what the library decides, for ``logging`` to show.

Nothing is printed unless the application configures logging (the package adds a
``NullHandler``, as libraries should). Levels: DEBUG for the engine each call takes,
INFO for decisions that change how a function runs from then on (a fallback to running
instances one at a time, a fallback from compiled to eager, a recompilation) and for the
process group's set-up.

Example:
    >>> import logging
    >>> logging.basicConfig(level=logging.INFO)  # or logging.getLogger("torchpmap").setLevel(...)
"""
from __future__ import annotations

import logging

logger = logging.getLogger("torchpmap")
logger.addHandler(logging.NullHandler())
