"""NVTX ranges around the cache's copies, gathers and waits, for Nsight Systems profiles.

Off by default. Set the environment variable ``OMNI_CACHE_NVTX=1`` before the manager is
created to turn them on: an operator profiling a server (``OMNI_CACHE_NVTX=1 nsys profile ...``)
switches them without touching the engine integration that builds the manager, and the seed
contract's `PrefixCacheConfig` and the manager's signature stay as they are.

Ranges are emitted only by a manager on a CUDA device (``torch.cuda.nvtx`` needs a CUDA build);
elsewhere the flag is accepted and every range is a shared no-op context manager. The names:

=============================  ===================================================================
``omni_cache.step_copy``       `save_outputs`: the step's rows into its staging page (on CUDA the
                               clones and the issue of the asynchronous copy)
``omni_cache.deferred_copy``   the committer: a deferred write's device clones to host rows
``omni_cache.pool_write``      the committer: a write's rows into the host pool
``omni_cache.hit_gather``      `materialize`: one hit's prefix rows gathered into its output (or,
                               without a prefetch, several hit requests' rows gathered together)
``omni_cache.hit_prefetch``    the prefetch worker: a hit's committed rows gathered early
``omni_cache.wait.<what>``     a bounded wait: ``page`` (a staging page claim), ``save_barrier``,
                               ``budget_flush``, ``hit_join`` (a hit waiting for its write),
                               ``step_copy`` (the device-to-host copy of a step or write)
=============================  ===================================================================
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch

__all__ = ["ENV_VAR", "RangeFn", "flag_set", "no_ranges", "nvtx_ranges", "ranges_for"]

#: The environment variable that switches the ranges on ("1", "true", "yes" or "on").
ENV_VAR = "OMNI_CACHE_NVTX"

#: A function that opens a named range: ``with rng("omni_cache.pool_write"): ...``.
RangeFn = Callable[[str], AbstractContextManager[None]]

_OFF: AbstractContextManager[None] = contextlib.nullcontext()


def flag_set() -> bool:
    """Whether ``OMNI_CACHE_NVTX`` asks for ranges."""
    return os.environ.get(ENV_VAR, "").strip().lower() in ("1", "true", "yes", "on")


def no_ranges(name: str) -> AbstractContextManager[None]:
    """The range function when ranges are off: one shared no-op context, nothing allocated."""
    return _OFF


class _Range:
    """One NVTX range: pushed on this thread at entry, popped at exit (exceptions included)."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __enter__(self) -> None:
        # torch leaves these untyped. Looked up at every call, not bound once: tests and
        # bench/nvtx_cost.py replace them on torch.cuda.nvtx.
        torch.cuda.nvtx.range_push(self.name)  # type: ignore[no-untyped-call]

    def __exit__(self, *exc: object) -> None:
        torch.cuda.nvtx.range_pop()  # type: ignore[no-untyped-call]


def nvtx_ranges(name: str) -> AbstractContextManager[None]:
    """The range function when ranges are on: an NVTX range named ``name``."""
    return _Range(name)


def ranges_for(device: torch.device) -> RangeFn:
    """The range function of a manager on ``device``: NVTX on CUDA when the flag is set."""
    if device.type == "cuda" and flag_set():
        return nvtx_ranges
    return no_ranges
