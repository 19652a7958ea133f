"""An elastic pool of worker threads.

Each multi-device call needs all its device threads running at once (they meet in
collectives), so a fixed-size pool could deadlock when several Python threads call
pmapped functions together. This pool hands a task to an idle worker or starts a new one;
a worker left idle for ``config.worker_idle_timeout`` seconds exits, so the pool shrinks
back after a burst of calls.
"""
from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from torchpmap._state.config import config


class _Worker(threading.Thread):
    def __init__(self, pool: WorkerPool):
        super().__init__(daemon=True, name="torchpmap-device")
        self.pool = pool
        self.inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()

    def run(self) -> None:
        while True:
            try:
                fn, future = self.inbox.get(timeout=config.worker_idle_timeout)
            except queue.Empty:
                if self.pool._retire(self):
                    return
                continue  # handed a task just as the wait ran out: it is in the inbox
            try:
                future.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - reaches the caller through the future
                future.set_exception(exc)
            del fn, future
            with self.pool._lock:
                self.pool._idle.append(self)


class WorkerPool:
    def __init__(self) -> None:
        self._idle: list[_Worker] = []
        self._lock = threading.Lock()

    def _retire(self, worker: _Worker) -> bool:
        """Takes an idle worker out of the pool (True), unless a task was just handed to it."""
        with self._lock:
            if worker in self._idle:
                self._idle.remove(worker)
                return True
            return False

    def submit(self, fn: Callable[[], Any]) -> Future:
        future: Future = Future()
        with self._lock:
            worker = self._idle.pop() if self._idle else None
        if worker is None:
            worker = _Worker(self)
            worker.start()
        worker.inbox.put((fn, future))
        return future


pool = WorkerPool()
