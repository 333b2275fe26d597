"""The daemon's long-lived worker threads (demotion writer, write-through, ...), supervised: a loop that raises is
logged, counted and started again after a short back-off, so a bug or an unexpected error in one batch never leaves
a tier silently stuck. A loop that returns has stopped on purpose and is not restarted. `kvstore stats` shows each
worker's restarts (`workers`).

A loop must be safe to enter again after it raised: it keeps its progress in its owner's state, not in locals.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("kvstore")
BACKOFF_S = (0.05, 0.2, 1.0, 5.0)        # the pause before each restart in a row; then the last, again

_registry: dict[str, Worker] = {}
_registry_lock = threading.Lock()


class Worker:
    """A daemon thread running `loop` until it returns; restarted whenever it raises."""

    def __init__(self, name: str, loop: Callable[[], None]) -> None:
        self.name = name
        self.loop = loop
        self.restarts = 0
        self.last_error = ""
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        with _registry_lock:
            _registry[name] = self

    def start(self) -> Worker:
        self._thread.start()
        return self

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def _main(self) -> None:
        in_a_row = 0
        while True:
            started = time.monotonic()
            try:
                self.loop()
                return
            except Exception as e:  # a worker must outlive any one failure
                self.restarts += 1
                self.last_error = f"{type(e).__name__}: {e}"[:200]
                if time.monotonic() - started > 60:
                    in_a_row = 0
                pause = BACKOFF_S[min(in_a_row, len(BACKOFF_S) - 1)]
                in_a_row += 1
                log.exception("worker %s failed (restart %d, in %.2f s); if this repeats, report it with this "
                              "log", self.name, self.restarts, pause)
                time.sleep(pause)


def stats() -> dict[str, dict[str, Any]]:
    """Each worker: whether it runs, how often it was restarted, and its last error."""
    with _registry_lock:
        workers = list(_registry.values())
    return {w.name: {"alive": w.is_alive(), "restarts": w.restarts, "last_error": w.last_error} for w in workers}
