"""The ``omni_cache`` logger and what the adapter logs.

Every line an operator must see, and none on the path of a normal step:

=======================  ========  =================================================================
event                    level     when
=======================  ========  =================================================================
``key_allocated``        INFO      a cached key is seen for the first time: its host pool and
                                   staging bytes
``wait_timeout``         WARNING   a page claim, save barrier, budget flush or hit join ran out of
                                   time (the call raises)
``budget_flush``         INFO      the GPU-byte budget forced deferred writes out early; at most one
                                   line per `BUDGET_FLUSH_LOG_INTERVAL_S`, counting those in between
``write_failed``         ERROR     the first write that failed, with its error and traceback (the
                                   cache is unusable from then on)
``shutdown``             INFO      the cache shut down: what was still open
=======================  ========  =================================================================

Each record carries structured fields as attributes (``extra``): ``omni_cache_event`` (the event
name above), ``omni_cache_id`` (the manager's number in this process, also in the message as
``cache N``) and the event's ids and figures (``omni_cache_key``, ``omni_cache_tids``,
``omni_cache_step_ids``, ...), so a JSON formatter can emit them as fields. The library adds no
handler: configure ``logging`` as the application does.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from typing import Any

__all__ = ["BUDGET_FLUSH_LOG_INTERVAL_S", "LOGGER_NAME", "RateLimit", "log", "logger", "next_id"]

#: The logger every line goes to.
LOGGER_NAME = "omni_cache"

logger = logging.getLogger(LOGGER_NAME)

#: Seconds between two budget-flush lines of one manager.
BUDGET_FLUSH_LOG_INTERVAL_S = 10.0

_ids = itertools.count(1)
_ids_lock = threading.Lock()


def next_id() -> int:
    """A fresh number for a manager, unique in this process, named in its log lines."""
    with _ids_lock:
        return next(_ids)


def log(level: int, event: str, cache_id: int, msg: str, *args: Any, **fields: Any) -> None:
    """Log ``msg % args`` prefixed with ``cache N:``, with the event's fields as attributes.

    ``exc_info`` among ``fields`` is passed to the logger rather than stored.
    """
    if not logger.isEnabledFor(level):
        return
    exc_info = fields.pop("exc_info", None)
    extra = {f"omni_cache_{name}": value for name, value in fields.items()}
    extra["omni_cache_event"] = event
    extra["omni_cache_id"] = cache_id
    logger.log(level, "cache %d: " + msg, cache_id, *args, extra=extra, exc_info=exc_info)


class RateLimit:
    """Lets one event through per interval and counts the ones held back in between."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._last: float | None = None
        self._held = 0
        self._lock = threading.Lock()

    def ready(self) -> int | None:
        """None to stay silent; else how many events were held back since the last line."""
        now = time.monotonic()
        with self._lock:
            if self._last is not None and now - self._last < self.interval_s:
                self._held += 1
                return None
            self._last = now
            held, self._held = self._held, 0
            return held
