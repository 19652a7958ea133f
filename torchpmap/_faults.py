"""Faults that cross layers: a peer (device thread or process) that failed."""
from __future__ import annotations


class PeerFailed(RuntimeError):
    """Raised in the threads (or processes) that were waiting when another instance failed."""
