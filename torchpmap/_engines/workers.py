"""An elastic pool of worker threads.

Each multi-device call needs all its device threads running at once (they meet in
collectives), so a fixed-size pool could deadlock when several Python threads call
pmapped functions together. This pool hands a task to an idle worker or starts a new one.
"""
from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable


class _Worker(threading.Thread):
    def __init__(self, pool: "WorkerPool"):
        super().__init__(daemon=True, name="torchpmap-device")
        self.pool, self.inbox = pool, queue.SimpleQueue()

    def run(self) -> None:
        while True:
            fn, future = self.inbox.get()
            try:
                future.set_result(fn())
            except BaseException as exc:  # reaches the caller through the future
                future.set_exception(exc)
            del fn, future
            self.pool._idle.append(self)


class WorkerPool:
    def __init__(self) -> None:
        self._idle: list[_Worker] = []
        self._lock = threading.Lock()

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
