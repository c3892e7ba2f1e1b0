"""Probes of what a process holds: resident memory, OS threads, the library's live threads.

The soak (`omni_cache_cuda.soak`) samples them over its run and checks that they stay flat after
warm-up; the leak and fault tests use the same functions, so both measure in one way. They read
only the process's own state (Linux ``/proc`` and `threading`): no torch, no device, nothing
they start or allocate.
"""

from __future__ import annotations

import os
import threading

__all__ = ["library_threads", "os_threads", "resident_bytes"]


def resident_bytes() -> int:
    """This process's resident memory (Linux ``/proc``)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def os_threads() -> int:
    """This process's OS threads (Linux ``/proc``), Python's and native ones alike."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("Threads:"):
                return int(line.split()[1])
    return 0


def library_threads() -> list[str]:
    """Names of the library's threads still alive (the committer's and the prefetch pool's)."""
    return [t.name for t in threading.enumerate() if t.name.startswith("omni-prefix-cache")]
