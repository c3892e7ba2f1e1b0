"""Fault points: where a test can make the adapter's own work fail (a test hook, not an API).

`OmniPrefixCacheManager._inject_fault(point, hook)` installs ``hook`` at one point; the adapter
calls ``hook(detail)`` right before that piece of work, and an exception the hook raises stands
for that work failing. With no hook installed a point costs one dict lookup.

=================  ==========================================  ===============================
point              where (``detail``)                          the error it ends in (D19)
=================  ==========================================  ===============================
``page_copy``      the save's copy of a key's rows into its    `StagingCopyError` from that
                   page (the key)                              save; no trace (STEP-5)
``host_ready``     the committer's wait for a write's copy to  `WriteFailedError`, sticky
                   land on the host (the write job)            (FAIL-1)
``deferred_piece`` each piece of a deferred write's copy       `WriteFailedError`, sticky
                   (``(job, key, start, stop)``, BUDGET-3)     (FAIL-1)
``pool_write``     the committer's write of a job's rows into  `WriteFailedError`, sticky
                   the pool (the write job)                    (FAIL-1)
``prefetch``       a hit's gather started early on the         `HitUnreadableError` from the
                   prefetch worker (the `PrefetchRead`)        materialize that reads it
``gather``         a hit's gather in materialize (the          `HitUnreadableError` from that
                   `ReadPlan`)                                 materialize (step consumed)
``alloc``          the allocation of a key's host storage      `HostAllocationError` from
                   (``(part, key)``, part "pool" or "pages")   `reserve` or the save
``pin``            pinning that storage on CUDA (same)         `HostAllocationError`, as above
=================  ==========================================  ===============================
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from omni_cache_core import (
    HitUnreadableError,
    HostAllocationError,
    StagingCopyError,
    WriteFailedError,
)

__all__ = ["FAULT_ERRORS", "FAULT_POINTS", "Faults", "InjectedFault", "OneShot"]

#: Every fault point, in the order the work happens.
FAULT_POINTS = (
    "alloc",
    "pin",
    "page_copy",
    "prefetch",
    "host_ready",
    "deferred_piece",
    "pool_write",
    "gather",
)

#: The error a fault at each point ends in (the table above, D19). `WriteFailedError` is the
#: committer's: sticky (FAIL-1); the others fail only their call.
FAULT_ERRORS: dict[str, type[Exception]] = {
    "alloc": HostAllocationError,
    "pin": HostAllocationError,
    "page_copy": StagingCopyError,
    "prefetch": HitUnreadableError,
    "gather": HitUnreadableError,
    "host_ready": WriteFailedError,
    "deferred_piece": WriteFailedError,
    "pool_write": WriteFailedError,
}


class Faults:
    """The hooks installed at the fault points (see the module doc)."""

    __slots__ = ("hooks",)

    def __init__(self) -> None:
        self.hooks: dict[str, Callable[[Any], None]] = {}

    def set(self, point: str, hook: Callable[[Any], None] | None) -> None:
        """Install ``hook`` at ``point``, or remove the one there with None."""
        if point not in FAULT_POINTS:
            raise ValueError(f"unknown fault point {point!r}; one of {FAULT_POINTS}")
        if hook is None:
            self.hooks.pop(point, None)
        else:
            self.hooks[point] = hook

    def fire(self, point: str, detail: Any) -> None:
        """Run the hook at ``point``, if any; what it raises is the work's failure."""
        hook = self.hooks.get(point)
        if hook is not None:
            hook(detail)


class InjectedFault(RuntimeError):
    """The failure a fault hook raises (the tests' hooks and the soak's)."""


class OneShot:
    """A fault hook that raises `InjectedFault` at its ``skip + 1``-th call, once.

    `calls` holds the details of the calls up to the one that fired; later calls pass and are
    not kept (a hook left armed through a long run holds nothing alive). `fired` is 1 once it
    has fired.
    """

    def __init__(self, skip: int = 0) -> None:
        self.skip = skip
        self.calls: list[Any] = []
        self.fired = 0
        self._lock = threading.Lock()

    def __call__(self, detail: Any) -> None:
        with self._lock:
            if self.fired:
                return
            self.calls.append(detail)
            if len(self.calls) <= self.skip:
                return
            self.fired = 1
        raise InjectedFault(f"injected fault at call {self.skip + 1}")
