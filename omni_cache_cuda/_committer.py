"""Write jobs and the committer that runs them: copy to host, then write to the pool.

The committer never takes the manager's state lock (CONC-2). It reports each stage as a core
report appended to a queue, and only then wakes waiters (TASK-6): a waiter drains the queue into
the core under the state lock before it looks again. In threaded mode one daemon thread runs the
jobs; in inline mode the same `run` executes in the caller's thread, outside the state lock
(CONC-1). Either way the pool has a single writer at a time (CONC-4): the engine thread is the
only caller that runs inline jobs.

Lock order: manager state lock -> committer queue lock -> job lock; the signal lock is a leaf
taken alone. The committer takes the queue lock, a job lock or the signal lock, never two.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import logging
import math
import threading
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch

from omni_cache_core import (
    CopyLanded,
    CopyStarted,
    Report,
    TensorName,
    Tid,
    WriteFailed,
    WriteLanded,
)
from omni_cache_cuda._faults import Faults
from omni_cache_cuda._log import log
from omni_cache_cuda._nvtx import RangeFn, no_ranges
from omni_cache_cuda._storage import (
    HostPool,
    StagingPages,
    row_bytes,
    scatter_rows,
    write_blocks,
)

__all__ = ["Chunk", "Committer", "JobStage", "Signal", "WriteJob"]


class Signal:
    """A generation counter waiters sleep on; bumped after every published report."""

    def __init__(self) -> None:
        self._cv = threading.Condition(threading.Lock())
        self.generation = 0

    def bump(self) -> None:
        """Wake every waiter."""
        with self._cv:
            self.generation += 1
            self._cv.notify_all()

    def wait(self, seen: int, timeout_s: float) -> None:
        """Sleep until the generation moves past ``seen`` or the timeout passes."""
        with self._cv:
            if self.generation == seen and timeout_s > 0:
                self._cv.wait(timeout_s)


class JobStage(enum.Enum):
    """Where a job is on the adapter side; only the queue lock changes it (TASK-2)."""

    #: An open deferred write: takes chunks, not queued.
    PENDING = 0
    #: Queued (or about to run inline).
    QUEUED = 1
    #: Claimed by the one thread that runs its copy stage; never re-queued.
    RUNNING = 2
    #: Finished (written or failed).
    DONE = 3


class Chunk:
    """One step's rows of a deferred write: slots and a device clone per key (then host rows)."""

    __slots__ = ("device", "host", "slots")

    def __init__(self, slots: torch.Tensor, device: dict[TensorName, torch.Tensor]) -> None:
        self.slots = slots
        self.device: dict[TensorName, torch.Tensor] | None = device
        self.host: dict[TensorName, torch.Tensor] | None = None

    def rows(self, key: TensorName) -> torch.Tensor | None:
        """This chunk's rows of ``key``: host rows once copied, else the device clone."""
        host = self.host  # read once: the committer sets host before it drops device
        if host is not None:
            return host.get(key)
        device = self.device
        return device.get(key) if device is not None else None


class WriteJob:
    """The adapter side of one write task: where its rows are and which slots it lost."""

    __slots__ = (
        "_blocks",
        "_blocks_found",
        "chunks",
        "d2h_event",
        "freeze_event",
        "hold",
        "keys",
        "lock",
        "n",
        "page",
        "rows",
        "slots",
        "stage",
        "tid",
        "tombstones",
    )

    def __init__(
        self,
        tid: Tid,
        keys: tuple[TensorName, ...],
        *,
        page: int | None = None,
        slots: torch.Tensor | None = None,
        d2h_event: Any = None,
        freeze_event: Any = None,
    ) -> None:
        self.tid = tid
        self.keys = keys
        self.page = page  # a step write's page; None for a deferred write
        #: A step write's rows when they go to the pool straight from the caller's tensors
        #: (the CPU's one copy, D27): ``(n, width)`` views per key, else None (the page).
        self.rows: dict[TensorName, torch.Tensor] | None = None
        self.slots = slots  # a step write's slots (one per row)
        # shape, not len(): Tensor.__len__ is a Python function, a microsecond a call.
        self.n = 0 if slots is None else slots.shape[0]
        self.d2h_event = d2h_event
        self.freeze_event = freeze_event
        self.chunks: list[Chunk] = []
        #: Device clones kept alive until the copy that reads them is done.
        self.hold: list[torch.Tensor] = []
        self.stage = JobStage.QUEUED if page is not None else JobStage.PENDING
        self.lock = threading.Lock()
        self.tombstones: dict[TensorName, list[torch.Tensor]] = {}
        self._blocks: np.ndarray | None = None
        self._blocks_found = False

    @property
    def deferred(self) -> bool:
        """Whether this is a deferred (JOIN_ON_FINISH) write."""
        return self.page is None

    def add_tombstone(self, key: TensorName, slots: torch.Tensor) -> None:
        """Record slots a newer write took (SLOT-2)."""
        with self.lock:
            self.tombstones.setdefault(key, []).append(slots)

    def write_blocks(self, block_size: int) -> np.ndarray | None:
        """The KV blocks a step write's pool write goes by (`_storage.write_blocks`), or None.

        Found at the first call and kept: every key of the step is written at the same slots,
        and the save's check for repeated slots reads them too (D33). Only the thread running
        the job calls it (a save that writes its own step calls it just before the write).
        """
        if not self._blocks_found:
            if self.slots is not None:
                self._blocks = write_blocks(self.slots.numpy(), block_size)
            self._blocks_found = True
        return self._blocks

    def lost(self, key: TensorName) -> torch.Tensor | None:
        """Every slot of ``key`` this job lost so far, or None."""
        with self.lock:
            parts = self.tombstones.get(key)
            if not parts:
                return None
            return parts[0] if len(parts) == 1 else torch.cat(parts)


class Committer:
    """Runs write jobs: the copy stage, then the pool write, reporting each stage.

    Args:
        pool: The host pool it writes.
        pages: The staging pages step writes read from.
        reports: Where reports go, in order; the manager drains it into the core.
        signal: Bumped after reports are published.
        threaded: Run jobs on a daemon thread (True) or in the caller's thread (False).
        copy_stream: CUDA stream for deferred device-to-host copies, or None.
        copy_chunk_bytes: Largest piece of one deferred copy (BUDGET-3).
        cache_id: The manager's number in log lines.
        ranges: Opens the NVTX ranges of the copy, the pool write and the waits.
        faults: The fault points' hooks (tests): ``host_ready``, ``deferred_piece`` and
            ``pool_write`` run here; what a hook raises fails that job (FAIL-1).
    """

    def __init__(
        self,
        pool: HostPool,
        pages: StagingPages,
        reports: collections.deque[Report],
        signal: Signal,
        *,
        threaded: bool,
        copy_stream: Any = None,
        copy_chunk_bytes: int,
        cache_id: int = 0,
        ranges: RangeFn = no_ranges,
        faults: Faults | None = None,
    ) -> None:
        self.pool = pool
        self.pages = pages
        self.reports = reports
        self.signal = signal
        self.threaded = threaded
        self.copy_stream = copy_stream
        self.copy_chunk_bytes = copy_chunk_bytes
        self.cache_id = cache_id
        self.ranges = ranges
        self._failure_logged = False
        self.faults = faults if faults is not None else Faults()
        self.rows_written: collections.Counter[str] = collections.Counter()
        self.bytes_to_host = 0
        self.bytes_to_pool = 0
        self._cv = threading.Condition(threading.Lock())
        self._queue: collections.deque[WriteJob] = collections.deque()
        self._stopping = False
        self._thread: threading.Thread | None = None
        if threaded:
            self._thread = threading.Thread(
                target=self._loop, name="omni-prefix-cache-committer", daemon=True
            )
            self._thread.start()

    # -----------------------------------------------------------------------------------------
    # Called by the manager (never under the committer's own locks).

    def submit(self, job: WriteJob) -> None:
        """Queue a step write at the back, or run it now in inline mode."""
        if not self.threaded:
            if self._claim(job):
                self.run(job)
            return
        with self._cv:
            self._queue.append(job)
            self._cv.notify()

    def run_now(self, job: WriteJob) -> None:
        """Run a step write in the caller's thread now, in either mode (D27); never raises.

        For a CPU step written straight from the caller's tensors: its keys' pool rows have no
        other writer then (CONC-4), since the save barrier (TASK-3) saw every earlier step
        write land, and a committer thread may only be writing deferred keys, other tensors.
        """
        if self._claim(job):
            self.run(job)

    def escalate(self, jobs: Iterable[WriteJob]) -> None:
        """Move jobs to the front, the first listed first (TASK-4); running ones stay (TASK-2).

        Inline mode runs them now, in order, in the caller's thread.
        """
        jobs = list(jobs)
        if not self.threaded:
            for job in jobs:
                if self._claim(job):
                    self.run(job)
            return
        with self._cv:
            for job in reversed(jobs):
                if job.stage is JobStage.PENDING:
                    job.stage = JobStage.QUEUED
                elif job.stage is JobStage.QUEUED:
                    with contextlib.suppress(ValueError):
                        self._queue.remove(job)
                else:
                    continue  # TASK-2: a job that started copying is never queued again
                self._queue.appendleft(job)
            self._cv.notify()

    def shutdown(self, timeout_s: float) -> bool:
        """Stop the thread after the jobs already queued; wait at most ``timeout_s``.

        Returns False when the thread is still running after that.
        """
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)
            return not self._thread.is_alive()
        return True

    # -----------------------------------------------------------------------------------------
    # The job itself.

    def _claim(self, job: WriteJob) -> bool:
        """Take a job for running; False when another thread has it already (TASK-2)."""
        with self._cv:
            if job.stage in (JobStage.PENDING, JobStage.QUEUED):
                job.stage = JobStage.RUNNING
                return True
            return False

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._stopping:
                    self._cv.wait()
                if not self._queue:
                    return
                job = self._queue.popleft()
                # TASK-2: claimed in the same critical section as the pop, so an escalation
                # sees it running and never queues it again.
                job.stage = JobStage.RUNNING
            self.run(job)  # FAIL-2: run never raises; the loop goes on

    def run(self, job: WriteJob) -> None:
        """Copy a claimed job's rows to the host and write them to the pool; never raises.

        Reports CopyStarted, CopyLanded and WriteLanded, or WriteFailed at the first error
        (FAIL-1, FAIL-2), each published before the waiters are woken (TASK-6): after the copy
        stage where there is one (a deferred write, a step's device copy), and at the end.
        """
        self.reports.append(CopyStarted(tid=job.tid))
        try:
            if job.deferred:
                with self.ranges("omni_cache.deferred_copy"):
                    self._copy_deferred(job)
            else:
                self.faults.fire("host_ready", job)
                if job.d2h_event is not None:
                    with self.ranges("omni_cache.wait.step_copy"):
                        job.d2h_event.synchronize()  # the whole-step copy into the page (PAGE-6)
                    job.hold = []
            self.reports.append(CopyLanded(tid=job.tid))
            if job.deferred or job.d2h_event is not None:
                # Someone may wait for this copy stage (an escalated deferred write, TASK-3; a
                # step's device copy). A CPU step write has no copy stage: its CopyLanded is
                # published with its WriteLanded by the one wake below, so a waiter that
                # needs the write is not woken in between to find it still running.
                self.signal.bump()
            self.faults.fire("pool_write", job)
            with self.ranges("omni_cache.pool_write"):
                self._write_pool(job)
            self.reports.append(WriteLanded(tid=job.tid))
        except Exception as exc:  # FAIL-2: fail the task, keep the committer alive
            reason = f"{type(exc).__name__}: {exc}"
            self.reports.append(WriteFailed(tid=job.tid, reason=reason))
            self._log_failure(job, reason, exc)
        finally:
            if job.hold and job.d2h_event is not None:
                # The clones may be freed only once the copy that reads them is over, even on
                # a failure that came before the event was waited.
                with contextlib.suppress(Exception):
                    job.d2h_event.synchronize()
            job.hold = []
            with self._cv:
                job.stage = JobStage.DONE
            self.signal.bump()

    def _log_failure(self, job: WriteJob, reason: str, exc: Exception) -> None:
        """Log the first failed write with its traceback (FAIL-1); later ones only count."""
        with self._cv:
            if self._failure_logged:
                return
            self._failure_logged = True
        kind = "deferred write" if job.deferred else f"step write (page {job.page})"
        rows = sum(len(c.slots) for c in job.chunks) if job.deferred else job.n
        log(
            logging.ERROR,
            "write_failed",
            self.cache_id,
            "%s tid %d of keys %s (%d rows) failed: %s; the cache refuses every call from now "
            "on (WriteFailedError) and must be rebuilt",
            kind,
            job.tid,
            list(job.keys),
            rows,
            reason,
            tids=[job.tid],
            keys=list(job.keys),
            reason=reason,
            exc_info=exc,
        )

    def _copy_deferred(self, job: WriteJob) -> None:
        """Copy a deferred job's device clones to host rows, in pieces (BUDGET-3)."""
        stream = self.copy_stream
        if stream is None:
            # CPU: the clones already are host rows. The pieces' fault point still runs, over
            # the pieces a copy would take.
            if "deferred_piece" in self.faults.hooks:
                for key in job.keys:
                    rows = [c.device[key] for c in job.chunks if c.device and key in c.device]
                    if rows:
                        row_nbytes = math.prod(rows[0].shape[1:]) * rows[0].element_size()
                        count = sum(len(r) for r in rows)
                        for start, stop in piece_ranges(count, row_nbytes, self.copy_chunk_bytes):
                            self.faults.fire("deferred_piece", (job, key, start, stop))
            self.faults.fire("host_ready", job)
            with job.lock:
                for chunk in job.chunks:
                    chunk.host = chunk.device
                    chunk.device = None
            return
        try:
            with torch.cuda.stream(stream):
                if job.freeze_event is not None:
                    stream.wait_event(job.freeze_event)  # DEV-1
                hosts: list[dict[TensorName, torch.Tensor]] = [{} for _ in job.chunks]
                for key in job.keys:
                    parts = [
                        (i, c.device[key])
                        for i, c in enumerate(job.chunks)
                        if c.device and key in c.device
                    ]
                    if not parts:
                        continue
                    src = parts[0][1] if len(parts) == 1 else torch.cat([p for _, p in parts])
                    host = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
                    piece = None
                    if "deferred_piece" in self.faults.hooks:

                        def piece(start: int, stop: int, key: TensorName = key) -> None:
                            self.faults.fire("deferred_piece", (job, key, start, stop))

                    copy_in_pieces(
                        host, src, self.copy_chunk_bytes, non_blocking=True, before_piece=piece
                    )
                    offset = 0
                    for i, part in parts:
                        hosts[i][key] = host[offset : offset + len(part)]
                        offset += len(part)
                    self.bytes_to_host += host.numel() * host.element_size()
                done = torch.cuda.Event()  # type: ignore[no-untyped-call]
                done.record(stream)
            self.faults.fire("host_ready", job)
            done.synchronize()
        except BaseException:
            # Pieces already launched still read the clones and write the host rows: let them
            # finish before the failed job (and its clones) can be dropped.
            with contextlib.suppress(Exception):
                stream.synchronize()
            raise
        with job.lock:  # readers take every chunk's rows under this lock: all device or all host
            for chunk, host_rows in zip(job.chunks, hosts, strict=True):
                chunk.host = host_rows
                chunk.device = None

    def _write_pool(self, job: WriteJob) -> None:
        """Write the job's rows to the pool, skipping slots a newer write took (SLOT-2, TASK-5)."""
        for key in job.keys:
            if job.deferred:
                parts = [(c.slots, c.host[key]) for c in job.chunks if c.host and key in c.host]
                if not parts:
                    continue
                slots = parts[0][0] if len(parts) == 1 else torch.cat([s for s, _ in parts])
                rows = parts[0][1] if len(parts) == 1 else torch.cat([r for _, r in parts])
                if len(parts) > 1:
                    slots, rows = _last_rows(slots, rows)
                source = row_bytes(rows)
            else:
                assert job.slots is not None and job.page is not None
                slots = job.slots
                source = (
                    row_bytes(job.rows[key])
                    if job.rows is not None
                    else self.pages.byte_rows(key, job.page, job.n)
                )
            index = slots.numpy()
            target = self.pool.byte_rows[key]
            block = self.pool.block_size
            lost = job.lost(key)
            skip = np.flatnonzero(np.isin(index, lost.numpy())) if lost is not None else ()
            if len(skip) == len(index):
                continue  # SLOT-2: newer writes took every slot; nothing of ours remains
            # A row copy through byte views (whole blocks where the slots are) runs at memcpy
            # speed; torch's CPU index_copy_ is several times slower and splits repeated
            # indices across threads.
            if len(skip):
                # Rows between tombstoned positions go in runs: skipping a few copies nothing
                # extra.
                start = 0
                for stop in (*skip, len(index)):
                    if stop > start:
                        scatter_rows(target, index[start:stop], source[start:stop], block)
                    start = stop + 1
            elif job.deferred:
                scatter_rows(target, index, source, block)
            else:
                blocks = job.write_blocks(block)
                # Found or not, they are not looked for again: block size 1 is row by row.
                scatter_rows(target, index, source, block if blocks is not None else 1, blocks)
            written = len(index) - len(skip)
            self.rows_written[key] += written
            self.bytes_to_pool += written * source.shape[1]


def piece_ranges(num_rows: int, row_nbytes: int, max_bytes: int) -> list[tuple[int, int]]:
    """The ``(start, stop)`` row ranges of a copy in pieces of at most ``max_bytes`` (BUDGET-3).

    A row wider than ``max_bytes`` goes alone; the ranges tile ``[0, num_rows)`` in order.
    """
    rows_per_piece = max(1, max_bytes // max(1, row_nbytes))
    return [
        (start, min(start + rows_per_piece, num_rows))
        for start in range(0, num_rows, rows_per_piece)
    ]


def copy_in_pieces(
    dst: torch.Tensor,
    src: torch.Tensor,
    max_bytes: int,
    *,
    non_blocking: bool = False,
    before_piece: Callable[[int, int], None] | None = None,
) -> list[tuple[int, int]]:
    """Copy ``src`` into ``dst`` row range by row range, each at most ``max_bytes`` (BUDGET-3).

    A row wider than ``max_bytes`` goes alone. ``before_piece(start, stop)`` runs before each
    piece (the ``deferred_piece`` fault point). Returns the ``(start, stop)`` row ranges
    copied, in order; they tile ``[0, len(src))``.
    """
    if len(src) == 0:
        return []
    pieces = piece_ranges(len(src), src[0].numel() * src.element_size(), max_bytes)
    for start, stop in pieces:
        if before_piece is not None:
            before_piece(start, stop)
        dst[start:stop].copy_(src[start:stop], non_blocking=non_blocking)
    return pieces


def _last_rows(slots: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep each slot's last row only (TASK-5: the last chunk wins).

    ``index_copy_`` leaves the winner of a repeated index unspecified: the CPU kernel splits
    large copies across threads, so a slot written by two chunks could get either row, or a
    mix of both.
    """
    unique, inverse = torch.unique(slots, return_inverse=True)
    if len(unique) == len(slots):
        return slots, rows
    positions = torch.arange(len(slots), dtype=torch.int64)
    last = torch.full((len(unique),), -1, dtype=torch.int64)
    last.scatter_reduce_(0, inverse, positions, reduce="amax")
    return slots[last], rows[last]
