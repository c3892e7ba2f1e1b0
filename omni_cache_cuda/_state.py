"""The adapter's shared state: the core, the locks and storage, and the per-step tables.

`OmniPrefixCacheManager` builds one `AdapterState` and hands it to the paths that share it:
the effect interpreter (`_effects`), the save path (`_save_path`), the consume path
(`_consume_path`) and the host storage (`_host_memory`). Everything those paths both read or
write lives here, named; nothing else is shared between them.

The paths call one another's steps through the objects that own them (``self.stage``,
``state.wait_for_signal``, ...), never through the manager, so a test that replaces a step on a
path object or on its class changes what the real path does.

Locking (CONC-1, CONC-2): ``lock`` guards the core and the tables (``jobs``, ``steps``,
``reads``, ``start_reads``) and is held only for table work. A `ReadRecord` has its own lock,
since a save's preserve and a consume's gather meet on it outside the state lock (HIT-6).
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

from omni_cache_core import (
    CacheCore,
    PrefixCacheConfig,
    Report,
    ShutDownError,
    StepId,
    TensorName,
    Tid,
    WriteFailed,
    WriteLanded,
)
from omni_cache_cuda._committer import Committer, Signal, WriteJob
from omni_cache_cuda._faults import Faults
from omni_cache_cuda._log import RateLimit
from omni_cache_cuda._nvtx import RangeFn
from omni_cache_cuda._storage import HostPool, KeyShape, OutputMemory, StagingPages

__all__ = ["AdapterState", "ReadRecord", "StepContext"]


class ReadRecord:
    """The adapter side of one planned hit read: its prefetch and its preserved rows (HIT-6)."""

    __slots__ = ("closed", "lock", "prefetch", "prefetch_tail", "preserved")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.closed = False
        # (positions, future of the gathered rows), from a PrefetchRead effect (HIT-7).
        # The future's buffer has ``prefetch_tail`` more rows than positions, for the rows the
        # request computes in the step (filled by the consume, D27).
        self.prefetch: tuple[np.ndarray, concurrent.futures.Future[torch.Tensor]] | None = None
        self.prefetch_tail = 0
        self.preserved: list[tuple[np.ndarray, torch.Tensor]] = []


#: The slots of a step whose rows are in its page: none (shared, read-only).
_NO_SLOTS = np.zeros(0, dtype=np.int64)
_NO_SLOTS.flags.writeable = False


class StepContext:
    """Everything a consume of one step reads, captured at save (STEP-3).

    On the CPU a step's immediate rows have no page copy (D27): ``own`` holds a record per
    immediate key whose rows live in the pool at ``slots``; a later write over those slots first
    copies the rows still to be read into that record (copy-on-write, as HIT-6 does for hits),
    and the rows that never reached the pool at their slot (a slot repeated later in the step,
    a slot lost before the write) are kept there from the save on.
    """

    __slots__ = (
        "_req_rows",
        "bounds",
        "d2h_event",
        "deferred_rows",
        "freeze_event",
        "immediate_keys",
        "leftover",
        "leftover_event",
        "n",
        "own",
        "page",
        "read_ids",
        "req_ids",
        "shapes",
        "slots",
        "task_jobs",
    )

    def __init__(self) -> None:
        self.n = 0
        self.page = 0
        # The layout's request ids and row bounds; `req_rows` is made from them when a consume
        # first asks (off the engine thread: a decode step's save skips a 256-entry dict).
        self.req_ids: tuple[str, ...] = ()
        self.bounds: Sequence[int] = (0,)
        self._req_rows: dict[str, tuple[int, int]] | None = None
        self.immediate_keys: tuple[TensorName, ...] = ()
        self.deferred_rows: dict[TensorName, torch.Tensor] = {}
        self.leftover: dict[str, Any] = {}
        self.leftover_event: Any = None
        self.d2h_event: Any = None
        self.freeze_event: Any = None
        self.shapes: dict[TensorName, KeyShape] = {}
        self.read_ids: tuple[int, ...] = ()
        self.task_jobs: dict[Tid, WriteJob] = {}
        # D27: the step's slots (one per row) and a record per immediate key whose rows are
        # read from the pool; empty where the rows are in the page.
        self.slots: np.ndarray = _NO_SLOTS
        self.own: dict[TensorName, ReadRecord] = {}

    @property
    def req_rows(self) -> dict[str, tuple[int, int]]:
        """Each request's row range ``(start, end)`` in the step, in layout order."""
        rows = self._req_rows
        if rows is None:
            # Two consumers racing here build equal dicts; either one may stay.
            rows = dict(zip(self.req_ids, itertools.pairwise(self.bounds), strict=True))
            self._req_rows = rows
        return rows


class AdapterState:
    """What the adapter's paths share: the core, its lock, the storage, threads and tables.

    The objects set at construction are never rebound, except ``lock``, which a test may
    replace with a recording lock before any work (the paths read ``state.lock`` at each use);
    the tables are emptied in place at shutdown.
    """

    def __init__(
        self,
        config: PrefixCacheConfig,
        core: CacheCore,
        *,
        device: torch.device,
        threaded: bool,
        cache_id: int,
        ranges: RangeFn,
        flush_log: RateLimit,
        prefetch: bool,
    ) -> None:
        cuda = device.type == "cuda"
        self.config = config
        self.core = core
        self.device = device
        self.cuda = cuda
        self.threaded = threaded
        self.cache_id = cache_id
        self.ranges = ranges
        self.flush_log = flush_log
        self.lock = threading.Lock()
        self.signal = Signal()
        self.reports: collections.deque[Report] = collections.deque()
        # Test hooks at the fault points (`omni_cache_cuda._faults`); empty in normal use.
        self.faults = Faults()
        self.pool = HostPool(
            config.num_slots, pin=cuda, faults=self.faults, block_size=config.block_size
        )
        self.pages = StagingPages(
            config.staging_depth,
            config.staging_capacity_tokens,
            pin=cuda,
            faults=self.faults,
        )
        # The rows consumes hand out, kept for reuse up to the pages' bytes (D40).
        self.outputs = OutputMemory(self.pages.nbytes)
        self.copy_stream = torch.cuda.Stream(device) if cuda else None  # type: ignore[no-untyped-call]
        self.read_stream = torch.cuda.Stream(device) if cuda else None  # type: ignore[no-untyped-call]
        self.committer = Committer(
            self.pool,
            self.pages,
            self.reports,
            self.signal,
            threaded=threaded,
            copy_stream=self.copy_stream,
            copy_chunk_bytes=config.copy_chunk_bytes,
            cache_id=cache_id,
            ranges=ranges,
            faults=self.faults,
        )
        self.prefetcher = (
            concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="omni-prefix-cache-prefetch"
            )
            if prefetch
            else None
        )
        # The tables, under ``lock``: registered writes by tid, saved steps' contexts, and the
        # records of planned hit reads.
        self.jobs: dict[Tid, WriteJob] = {}
        self.steps: dict[StepId, StepContext] = {}
        self.reads: dict[int, ReadRecord] = {}
        # Records the last start created for its hits' prefetches; the save drops those it does
        # not plan (keys the step does not emit, hits outside the layout), or they would leak.
        self.start_reads: set[int] = set()
        # Counters `stats` reports that the core does not keep.
        self.page_waits = 0
        self.page_wait_ns = 0
        self.bytes_d2h = 0
        self.closed = False

    def wait_for_signal(self, seen: int, deadline_ns: int) -> None:
        """Block until the signal moves past ``seen`` or ``deadline_ns`` passes (no lock held)."""
        remaining = (deadline_ns - time.monotonic_ns()) / 1e9
        self.signal.wait(seen, max(remaining, 0.0) + 1e-4)

    def drain(self, *, raise_fatal: bool = True) -> None:
        """Feed the committer's reports into the core, then raise a sticky failure (FAIL-1).

        Called under the state lock at every public entry; `stats` drains without raising.
        """
        reports = self.reports
        core = self.core
        while reports:
            report = reports.popleft()
            core.report(report)
            if isinstance(report, (WriteLanded, WriteFailed)):
                self.jobs.pop(report.tid, None)
        fatal = core.fatal
        # FAIL-4 over FAIL-1: a cache shut down after a failure says it is shut down; the core
        # input that follows every raising drain raises that.
        if fatal is not None and raise_fatal and not core.closed:
            raise type(fatal)(tids=fatal.tids, reason=fatal.reason)

    def refuse_if_unusable(self, operation: str) -> None:
        """Raise `ShutDownError` or the sticky `WriteFailedError` when the cache has either."""
        with self.lock:
            if self.core.closed:
                raise ShutDownError(operation=operation)
            self.drain()

    def record(self, read_id: int) -> ReadRecord:
        """The record of a planned read, created on first use (under the state lock)."""
        record = self.reads.get(read_id)
        if record is None:
            record = self.reads[read_id] = ReadRecord()
        return record

    def close_records(self, read_ids: Iterable[int]) -> None:
        """Forget the records of reads no step will consume (under the state lock)."""
        for read_id in read_ids:
            record = self.reads.pop(read_id, None)
            if record is not None:
                with record.lock:
                    record.closed = True

    def forget_step(self, step_id: StepId) -> StepContext:
        """Drop a consumed step's context and its reads' records (under the state lock)."""
        ctx = self.steps.pop(step_id, None)
        if ctx is None:  # shutdown dropped every step context
            return StepContext()
        self.close_records(ctx.read_ids)
        for record in ctx.own.values():
            with record.lock:
                record.closed = True  # D27: later writes no longer preserve its rows
        return ctx

    def open_pooled_steps(self) -> list[StepContext]:
        """The unconsumed steps whose rows are read from the pool (D27; under the state lock)."""
        return [ctx for ctx in self.steps.values() if ctx.own]
