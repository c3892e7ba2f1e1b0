"""`OmniPrefixCacheManager`: the object an engine's model runner calls.

It executes the effects of the core (`omni_cache_core.CacheCore`) with real tensors and reports
their outcomes back; it never decides a rule the core owns (SPEC section 11).

Threads and locks (CONC-1..4):
- the engine thread calls `new_step_starts` and `save_outputs`; `materialize` and
  `discard_step` may run on any thread, one step late (CONC-3);
- one state lock guards the core and the adapter's tables. It is held only for table work:
  never while waiting, copying, gathering or running an inline write (CONC-1);
- the committer (threaded mode) never takes it (CONC-2); its reports are drained into the core
  under the lock at every public entry (D8);
- a prefetch worker gathers committed hit rows while the forward runs (HIT-7).

Device ordering (DEV-1..3), on CUDA: the save clones the step's rows on the compute stream and
records a freeze event; the copy stream waits that event before copying the clones into the page,
and the read stream waits it before reading a deferred clone. The engine thread waits on the host
only for the save barrier, a page claim and a budget flush.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import itertools
import logging
import threading
import time
import weakref
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, cast

import numpy as np
import torch

from omni_cache_core import (
    HIDDEN_KEY,
    BadInputError,
    HitUnreadableError,
    HostAllocationError,
    ModelCachePolicy,
    OmniPrefixCacheUnmatchError,
    PageTimeoutError,
    PrefixCacheConfig,
    PrefixCacheStep,
    ReqId,
    ShutDownError,
    StagingCopyError,
    StepId,
    TensorName,
    Tid,
    WaitTimeoutError,
)
from omni_cache_core._core import CacheCore
from omni_cache_core._values import (
    AwaitPage,
    ConsumeBegin,
    ConsumeEnd,
    ConsumePlan,
    DeferredChunk,
    EscalateTasks,
    PageClaimed,
    PrefetchRead,
    Preserve,
    ReadPlan,
    Report,
    SaveAbort,
    SaveBegin,
    SaveCommit,
    SaveProceed,
    ShutDown,
    SlotSource,
    StartStep,
    StepWrite,
    Tombstone,
    WriteFailed,
    WriteLanded,
)
from omni_cache_cuda._committer import Chunk, Committer, Signal, WriteJob
from omni_cache_cuda._faults import Faults
from omni_cache_cuda._layout import PrefixCacheWriteLayout
from omni_cache_cuda._log import BUDGET_FLUSH_LOG_INTERVAL_S, RateLimit, log, next_id
from omni_cache_cuda._nvtx import ranges_for
from omni_cache_cuda._outputs import (
    DeliveredPositions,
    StageCacheOutputs,
    classify,
    snapshot_leftover,
    split_leftover,
    unpin,
)
from omni_cache_cuda._stats import CacheStats, HostBytes
from omni_cache_cuda._storage import HostPool, KeyShape, StagingPages

__all__ = ["OmniPrefixCacheManager"]

_POOL = SlotSource.POOL.value
_AFTER_WRITE = SlotSource.AFTER_WRITE.value
_TASK = SlotSource.TASK.value
_ZEROS = SlotSource.ZEROS.value
_THIS_STEP = SlotSource.THIS_STEP.value

#: How long `shutdown` waits for the committer thread (FAIL-4).
_SHUTDOWN_JOIN_S = 5.0

#: NVTX range of each wait, by the name the core gives it.
_WAIT_RANGES = {
    "save barrier": "omni_cache.wait.save_barrier",
    "budget flush": "omni_cache.wait.budget_flush",
    "hit join": "omni_cache.wait.hit_join",
}


class _ReadRecord:
    """The adapter side of one planned hit read: its prefetch and its preserved rows (HIT-6)."""

    __slots__ = ("closed", "lock", "prefetch", "preserved")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.closed = False
        # (positions, future of the gathered rows), from a PrefetchRead effect (HIT-7).
        self.prefetch: tuple[np.ndarray, concurrent.futures.Future[torch.Tensor]] | None = None
        self.preserved: list[tuple[np.ndarray, torch.Tensor]] = []


class _StepContext:
    """Everything a consume of one step reads, captured at save (STEP-3)."""

    __slots__ = (
        "d2h_event",
        "deferred_rows",
        "freeze_event",
        "immediate_keys",
        "leftover",
        "leftover_event",
        "n",
        "page",
        "read_ids",
        "req_rows",
        "shapes",
        "task_jobs",
    )

    def __init__(self) -> None:
        self.n = 0
        self.page = 0
        self.req_rows: dict[str, tuple[int, int]] = {}
        self.immediate_keys: tuple[TensorName, ...] = ()
        self.deferred_rows: dict[TensorName, torch.Tensor] = {}
        self.leftover: dict[str, Any] = {}
        self.leftover_event: Any = None
        self.d2h_event: Any = None
        self.freeze_event: Any = None
        self.shapes: dict[TensorName, KeyShape] = {}
        self.read_ids: tuple[int, ...] = ()
        self.task_jobs: dict[Tid, WriteJob] = {}


class OmniPrefixCacheManager:
    """Keeps a host mirror of per-token stage outputs indexed by KV slot and serves prefix hits.

    Per engine step, on the engine thread: `new_step_starts`, the forward, `save_outputs`; then
    exactly one of `materialize` or `discard_step` per step id, on any thread, in any order.

    Args:
        config: Sizes, budget and the wait bound.
        policy: What the model caches; `register_policy` may set it before the first step.
        device: Where the step tensors live: None means CUDA when available, else the CPU.
        threaded: Run writes on a committer thread (True) or inline in the engine thread
            (False). None: threaded on CUDA, inline on the CPU. Both give identical results.
        prefetch: Start hit gathers at `new_step_starts`, overlapping the forward (HIT-7).
            Results are identical either way.

    Observability: `stats` returns the counters (`omni_cache_cuda.metrics` exports them to
    Prometheus); the ``omni_cache`` logger gets a line for each cached key's first allocation,
    each timeout, budget flushes (rate-limited), the first failed write and the shutdown, never
    one on a normal step; with the environment variable ``OMNI_CACHE_NVTX=1`` set when the
    manager is created, a manager on CUDA marks its copies, gathers and waits with NVTX ranges
    for Nsight Systems (``omni_cache.step_copy``, ``omni_cache.pool_write``,
    ``omni_cache.hit_gather``, ``omni_cache.wait.*``; the flag costs nothing elsewhere).

    Raises:
        BadInputError: ``config`` or ``policy`` has the wrong type; nothing is created.
    """

    def __init__(
        self,
        config: PrefixCacheConfig,
        *,
        policy: ModelCachePolicy | None = None,
        device: str | torch.device | None = None,
        threaded: bool | None = None,
        prefetch: bool = True,
    ) -> None:
        if not isinstance(config, PrefixCacheConfig):
            raise BadInputError(
                what="config", expected="a PrefixCacheConfig", got=type(config).__name__
            )
        if policy is not None and not isinstance(policy, ModelCachePolicy):
            raise BadInputError(
                what="policy", expected="a ModelCachePolicy", got=type(policy).__name__
            )
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        self.threaded = self._cuda if threaded is None else bool(threaded)
        self.config = config
        self._id = next_id()
        self._range = ranges_for(self.device)
        self._flush_log = RateLimit(BUDGET_FLUSH_LOG_INTERVAL_S)
        self._core = CacheCore(config, policy)
        self._lock = threading.Lock()
        self._signal = Signal()
        self._reports: collections.deque[Report] = collections.deque()
        # Test hooks at the fault points (`omni_cache_cuda._faults`); empty in normal use.
        self._faults = Faults()
        self._pool = HostPool(config.num_slots, pin=self._cuda, faults=self._faults)
        self._pages = StagingPages(
            config.staging_depth,
            config.staging_capacity_tokens,
            pin=self._cuda,
            faults=self._faults,
        )
        self._copy_stream = torch.cuda.Stream(self.device) if self._cuda else None
        self._read_stream = torch.cuda.Stream(self.device) if self._cuda else None
        self._committer = Committer(
            self._pool,
            self._pages,
            self._reports,
            self._signal,
            threaded=self.threaded,
            copy_stream=self._copy_stream,
            copy_chunk_bytes=config.copy_chunk_bytes,
            cache_id=self._id,
            ranges=self._range,
            faults=self._faults,
        )
        self._jobs: dict[Tid, WriteJob] = {}
        self._steps: dict[StepId, _StepContext] = {}
        self._reads: dict[int, _ReadRecord] = {}
        # Records the last start created for its hits' prefetches; the save drops those it does
        # not plan (keys the step does not emit, hits outside the layout), or they would leak.
        self._start_reads: set[int] = set()
        self._prefetcher = (
            concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="omni-prefix-cache-prefetch"
            )
            if prefetch
            else None
        )
        self._page_waits = 0
        self._page_wait_ns = 0
        self._bytes_d2h = 0
        self._closed = False
        # A manager dropped without shutdown() still stops its threads.
        weakref.finalize(self, Committer.shutdown, self._committer, 0.0)

    # -----------------------------------------------------------------------------------------
    # Context manager and lifecycle.

    def __enter__(self) -> OmniPrefixCacheManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    @property
    def policy(self) -> ModelCachePolicy:
        """The model's cache policy."""
        return self._core.policy

    def register_policy(self, policy: ModelCachePolicy) -> None:
        """Set the model's cache policy; once, before the first step. Does not block.

        Raises:
            BadInputError: Not a policy, or a step already started; the cache is unchanged.
        """
        if not isinstance(policy, ModelCachePolicy):
            raise BadInputError(
                what="policy", expected="a ModelCachePolicy", got=type(policy).__name__
            )
        with self._lock:
            self._core.register_policy(policy)

    def shutdown(self) -> None:
        """Close the cache: wake every waiter with an error, stop the threads (FAIL-4).

        Idempotent. Blocks at most a few seconds for the committer thread to stop. Later calls
        raise `ShutDownError`; the cache must be discarded.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._drain(raise_fatal=False)
            open_steps = self._core.open_step_ids
            writes = sorted(self._jobs)
            self._core.shut_down(ShutDown())
        self._signal.bump()
        stopped = self._committer.shutdown(_SHUTDOWN_JOIN_S)
        if self._prefetcher is not None:
            self._prefetcher.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            # Nothing is read or written from here on: let the host storage (pinned or not),
            # the device clones and the snapshots go now, not when the manager is collected.
            self._jobs.clear()
            self._steps.clear()
            self._reads.clear()
            self._start_reads = set()
            self._pool.release()
            self._pages.release()
        log(
            logging.INFO if stopped else logging.WARNING,
            "shutdown",
            self._id,
            "shut down; step ids still open: %s; writes not landed (tids): %s%s",
            list(open_steps) or "none",
            writes or "none",
            "" if stopped else f"; the committer thread did not stop within {_SHUTDOWN_JOIN_S}s",
            step_ids=list(open_steps),
            tids=writes,
            committer_stopped=stopped,
        )

    # -----------------------------------------------------------------------------------------
    # Host memory, planned and reserved up front (D20).

    def host_bytes(
        self, keys: Mapping[str, tuple[int | Sequence[int], torch.dtype]]
    ) -> dict[str, HostBytes]:
        """Say how many host bytes each cached key takes once allocated (D20).

        ``keys`` maps a key's name (`HIDDEN_KEY` for the hidden states, an mm name as the model
        emits it) to ``(width, dtype)``: the width is the number of elements in one row, or the
        row's shape as a tuple (a ``(tokens, 2, 4)`` tensor has rows of shape ``(2, 4)``).
        Returns per key the pool (one row per KV slot), the staging pages (none for a key the
        policy defers) and the occupancy table (8 bytes per slot). Allocates nothing, never
        blocks, and works in any state.

        Raises:
            BadInputError: Not a mapping, an empty name, a width that is not a positive int or
                a tuple of them, a dtype that is not a ``torch.dtype``, the hidden key when the
                policy does not cache it, or a key the cache has with another row shape.
        """
        shapes = self._key_shapes(keys, "host_bytes")
        deferred = self._core.policy.deferred_keys
        occupancy = self._core.occupancy_bytes_per_key()
        return {
            key: HostBytes(
                pool=self._pool.nbytes_for(shape),
                pages=0 if key in deferred else self._pages.nbytes_for(shape),
                occupancy=occupancy,
            )
            for key, shape in shapes.items()
        }

    def reserve(self, keys: Mapping[str, tuple[int | Sequence[int], torch.dtype]]) -> None:
        """Allocate cached keys' host storage now, off the hot path (D20).

        Takes what `host_bytes` takes. For each key not allocated yet: its host pool, its
        staging pages unless the policy defers it, and its occupancy table, pinned on CUDA, so
        the key's first save allocates nothing (without it, that save allocates and zero-fills
        the pool on the engine thread). A key keeps this row shape: a save with another one
        raises (FAIL-5). Call it after `register_policy`, before the first step, on the thread
        that saves. Blocks for the allocation (seconds for a pool of gigabytes).

        Raises:
            BadInputError: Bad keys, as for `host_bytes`; nothing is allocated.
            HostAllocationError: An allocation or a pin failed. This call keeps nothing it
                allocated (nothing stays pinned for it); keys the cache had stay usable.
            WriteFailedError: A write failed (FAIL-1); the cache must be discarded.
            ShutDownError: The cache is shut down.
        """
        self._refuse_if_unusable("reserve")
        shapes = self._key_shapes(keys, "reserve")
        deferred = self._core.policy.deferred_keys
        self._install_keys(shapes, {k for k in shapes if k not in deferred}, tables=True)

    def _key_shapes(self, keys: object, operation: str) -> dict[TensorName, KeyShape]:
        """Check `host_bytes` and `reserve` input; return each key's row shape."""
        if not isinstance(keys, Mapping):
            raise BadInputError(
                what=operation,
                expected="a mapping of cached key name to (width, dtype)",
                got=type(keys).__name__,
            )
        caches_hidden = self._core.policy.needs_full_hidden_states
        shapes: dict[TensorName, KeyShape] = {}
        for name, spec in keys.items():
            if not isinstance(name, str) or not name:
                raise BadInputError(
                    what=f"{operation} key name", expected="a non-empty str", got=repr(name)
                )
            if not isinstance(spec, (tuple, list)) or len(spec) != 2:
                raise BadInputError(
                    what=f"{operation} entry of key {name!r}",
                    expected="a (width, dtype) pair",
                    got=repr(spec),
                )
            width, dtype = spec
            features = (width,) if isinstance(width, int) else width
            if (
                not isinstance(features, (tuple, list))
                or not features
                or not all(type(d) is int and d > 0 for d in features)
            ):
                raise BadInputError(
                    what=f"width of key {name!r}",
                    expected="an int > 0, or a tuple of them (the row shape)",
                    got=repr(width),
                )
            if not isinstance(dtype, torch.dtype):
                raise BadInputError(
                    what=f"dtype of key {name!r}", expected="a torch.dtype", got=repr(dtype)
                )
            if name == HIDDEN_KEY and not caches_hidden:
                raise BadInputError(
                    what=f"{operation} key {name!r}",
                    expected="a key the policy caches (this policy caches no hidden states, OUT-7)",
                    got="the hidden-state key",
                )
            shape = KeyShape(tuple(features), dtype)
            self._check_first_shape(f"{operation} key {name!r}", TensorName(name), shape)
            shapes[TensorName(name)] = shape
        return shapes

    def _check_first_shape(self, what: str, key: TensorName, shape: KeyShape) -> None:
        """A key keeps the row shape and dtype it was first installed with (FAIL-5)."""
        known = self._pool.shapes.get(key)
        if known is not None:
            known.require(what, shape)

    def _inject_write_fault(self, fault: Any) -> None:
        """Test hook: ``fault(job)`` runs before every pool write; raising fails that write."""
        self._inject_fault("pool_write", fault)

    def _inject_fault(self, point: str, hook: Any) -> None:
        """Test hook (not public API): ``hook(detail)`` runs at a fault point; None removes it.

        What the hook raises stands for that piece of work failing; `omni_cache_cuda._faults`
        lists the points, their details and the error each ends in (D19).

        Raises:
            ValueError: Not a fault point.
        """
        self._faults.set(point, hook)

    # -----------------------------------------------------------------------------------------
    # Engine thread: step start.

    def new_step_starts(self, step: PrefixCacheStep) -> None:
        """Feed a step's request lifecycle records in, before the forward.

        Finishes and aborts escalate the requests' deferred writes (TASK-4): queued on the
        committer, or run now in inline mode (outside the state lock). Hits start their
        prefetch gathers on the prefetch worker (HIT-7). Blocks only for inline writes.

        Raises:
            BadInputError: Not a PrefixCacheStep, an unaligned hit or a hit without blocks
                (HIT-1, FAIL-5); the cache is unchanged.
            WriteFailedError: A write failed earlier (FAIL-1); the cache must be discarded.
            ShutDownError: The cache is shut down.
        """
        if not isinstance(step, PrefixCacheStep):
            raise BadInputError(
                what="new_step_starts", expected="a PrefixCacheStep", got=type(step).__name__
            )
        with self._lock:
            self._drain()
            effects = self._core.start_step(StartStep(step=step, now_ns=time.monotonic_ns()))
            # The core forgot the previous start's hits; a start never followed by a save
            # leaves its prefetch records behind.
            self._close_records(self._start_reads)
            self._start_reads = {e.read_id for e in effects if isinstance(e, PrefetchRead)}
            escalate: list[WriteJob] = []
            prefetch: list[tuple[_ReadRecord, PrefetchRead]] = []
            for effect in effects:
                if isinstance(effect, EscalateTasks):
                    escalate.extend(self._jobs[tid] for tid in effect.tids if tid in self._jobs)
                elif isinstance(effect, PrefetchRead):
                    if self._prefetcher is not None:
                        prefetch.append((self._record(effect.read_id), effect))
                else:  # pragma: no cover - start_step returns only these two
                    raise AssertionError(f"unexpected effect {effect!r}")
        if escalate:
            self._committer.escalate(escalate)
        for record, effect in prefetch:
            assert self._prefetcher is not None
            future = self._prefetcher.submit(
                self._prefetch_gather, effect, self._pool.tensors[effect.key]
            )
            record.prefetch = (effect.positions, future)
        if escalate and not self.threaded:
            with self._lock:
                self._drain()

    def _prefetch_gather(self, effect: PrefetchRead, pool_rows: torch.Tensor) -> torch.Tensor:
        """On the prefetch worker: gather a hit's committed pool rows (HIT-7)."""
        self._faults.fire("prefetch", effect)
        with self._range("omni_cache.hit_prefetch"):
            return pool_rows.index_select(0, torch.from_numpy(effect.slots))

    # -----------------------------------------------------------------------------------------
    # Engine thread: save.

    def save_outputs(
        self,
        hidden: torch.Tensor | None,
        mm: Mapping[str, Any] | None,
        *,
        num_tokens_unpadded: int,
        num_tokens_padded: int | None = None,
        write_layout: PrefixCacheWriteLayout,
    ) -> StepId:
        """Save a step's outputs after its forward; return the step id to consume exactly once.

        Copies the cached rows into a staging page (on CUDA: clones on the compute stream, a
        freeze event, and a non-blocking copy on the copy stream), registers the step's write
        and queues it (threaded) or runs it (inline), and snapshots the leftover mm values.
        Blocks only for the save barrier (TASK-3), a budget flush (BUDGET-2) and a page claim
        (PAGE-4), each at most ``staging_claim_timeout_s`` (DEV-3).

        Raises:
            BadInputError: Bad input: types, a slot count not matching the rows, hidden with
                fewer rows than tokens, a width or dtype change of a cached key, a request that
                did not start (OUT-3, FAIL-5). The cache is unchanged.
            OversizeStepError: More rows than a page holds (PAGE-5). The cache is unchanged.
            OmniPrefixCacheStagingTimeoutError: No page freed up in time (PAGE-4). Unchanged.
            WaitTimeoutError: The barrier or a budget flush ran out of time. Unchanged (writes
                already forced out by a flush stay written).
            HostAllocationError: A key seen for the first time could not get its host storage
                (D20). Unchanged: nothing of it is kept.
            StagingCopyError: Copying the step's rows into its page failed (D19). Unchanged.
            WriteFailedError: A write failed (FAIL-1); the cache must be discarded.
            ShutDownError: The cache is shut down.
        """
        try:
            n, padded = self._check_save_args(
                hidden, mm, num_tokens_unpadded, num_tokens_padded, write_layout
            )
            policy = self._core.policy
            if (policy.needs_full_hidden_states and n) and (
                not isinstance(hidden, torch.Tensor) or hidden.ndim < 2 or hidden.shape[0] < n
            ):
                got = "None" if hidden is None else f"shape {tuple(getattr(hidden, 'shape', ()))}"
                raise BadInputError(
                    what="hidden states",
                    expected=f"a tensor with ndim >= 2 and at least {n} rows (OUT-3)",
                    got=got,
                )
            parts = classify(hidden, mm or {}, n, padded, policy)
            cached = {**parts.immediate, **parts.deferred}
            shapes: dict[TensorName, KeyShape] = {}
            for key, rows in cached.items():
                # An early check: `_install_keys` checks again under the lock (a reserve on
                # another thread may install the key meanwhile).
                known = self._pool.shapes.get(key)
                if known is None:
                    shapes[key] = KeyShape.of(rows)
                else:
                    known.check(key, rows)  # FAIL-5: a width or dtype change raises
                    shapes[key] = known
        except BadInputError:
            # FAIL-1, FAIL-4: a failed or shut-down cache refuses every call with that error,
            # bad input included, as the core does for the checks it makes itself.
            self._refuse_if_unusable("save_outputs")
            raise
        req_ids = cast(tuple[ReqId, ...], write_layout.req_ids)
        bounds = np.array(write_layout.bounds, dtype=np.int64)
        # STEP-3: engines refill one slot-mapping buffer every step, while this step's writes
        # and reads are still pending; the tables and the writes keep a private copy.
        slot_ids = write_layout.slots_cpu.clone() if n else torch.zeros(0, dtype=torch.int64)
        slots = slot_ids.numpy()
        deferred_bytes = sum(t.numel() * t.element_size() for t in parts.deferred.values())
        immediate_bytes = sum(
            t.numel() * t.element_size() for t in parts.immediate.values() if t.is_cuda
        )
        begin = SaveBegin(
            now_ns=time.monotonic_ns(),
            req_ids=req_ids,
            row_bounds=bounds,
            slots=slots,
            num_tokens=n,
            immediate_keys=tuple(parts.immediate),
            deferred_keys=tuple(parts.deferred),
            immediate_bytes=immediate_bytes,
            deferred_bytes=deferred_bytes,
        )
        with self._lock:
            self._drain()
            self._core.save_begin(begin)
        try:
            page = self._proceed()
            self._install_keys(shapes, set(parts.immediate))
            ctx, step_job = self._stage(parts, n, page, write_layout, slot_ids)
            with self._lock:
                self._drain()
                published = self._core.save_commit(SaveCommit(now_ns=time.monotonic_ns()))
                preserves = self._apply_commit(
                    published.step_id, published.effects, ctx, step_job, slot_ids
                )
        except BaseException:
            with self._lock:
                self._core.save_abort(SaveAbort())
            self._signal.bump()
            raise
        # HIT-6: preserve rows older reads planned on before the new write can land.
        for record, effect in preserves:
            self._preserve(record, effect)
        if step_job is not None:
            self._committer.submit(step_job)
            if not self.threaded:
                with self._lock:
                    self._drain()
        return published.step_id

    def _refuse_if_unusable(self, operation: str) -> None:
        """Raise `ShutDownError` or the sticky `WriteFailedError` when the cache has either."""
        with self._lock:
            if self._core.closed:
                raise ShutDownError(operation=operation)
            self._drain()

    def _check_save_args(
        self,
        hidden: object,
        mm: object,
        n: object,
        padded: object,
        layout: object,
    ) -> tuple[int, int]:
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise BadInputError(what="num_tokens_unpadded", expected="an int >= 0", got=repr(n))
        if padded is None:
            padded = n
        if isinstance(padded, bool) or not isinstance(padded, int) or padded < n:
            raise BadInputError(
                what="num_tokens_padded",
                expected=f"None or an int >= num_tokens_unpadded ({n})",
                got=repr(padded),
            )
        if not isinstance(layout, PrefixCacheWriteLayout):
            raise BadInputError(
                what="write_layout", expected="a PrefixCacheWriteLayout", got=type(layout).__name__
            )
        if mm is not None and not isinstance(mm, Mapping):
            raise BadInputError(
                what="mm", expected="a mapping of name to value", got=type(mm).__name__
            )
        if hidden is not None and not isinstance(hidden, torch.Tensor):
            raise BadInputError(
                what="hidden", expected="a tensor or None", got=type(hidden).__name__
            )
        rows = layout.num_rows
        if (n and len(layout.slots_cpu) != n) or rows != n:
            # OUT-3: fail at the cause; skipping rows would leave holes behind published hashes.
            raise BadInputError(
                what="write layout",
                expected=f"rows and slots covering the {n} unpadded tokens",
                got=f"{rows} rows and {len(layout.slots_cpu)} slots",
            )
        return n, padded

    def _proceed(self) -> int:
        """Drive the pending save through barrier, budget and page claim; return the page."""
        waited_since: int | None = None
        while True:
            seen = self._signal.generation
            escalate: list[WriteJob] = []
            try:
                with self._lock:
                    self._drain()
                    effect = self._core.save_proceed(SaveProceed(now_ns=time.monotonic_ns()))
                    if isinstance(effect, EscalateTasks):
                        escalate = [self._jobs[t] for t in effect.tids if t in self._jobs]
                        budget = (self._core.budget_used, self._core.counters.budget_flushes)
            except (WaitTimeoutError, PageTimeoutError) as exc:
                self._log_timeout(exc, None)
                raise
            if isinstance(effect, PageClaimed):
                if waited_since is not None:
                    self._page_wait_ns += time.monotonic_ns() - waited_since
                return effect.page
            if isinstance(effect, EscalateTasks):
                self._log_flush(effect.tids, *budget)
                self._committer.escalate(escalate)  # BUDGET-2: a flush, outside the lock
                continue
            if isinstance(effect, AwaitPage):
                name = "omni_cache.wait.page"
                if waited_since is None:
                    waited_since = time.monotonic_ns()
                    self._page_waits += 1
            else:
                name = _WAIT_RANGES.get(effect.what, "omni_cache.wait.other")
            with self._range(name):
                self._wait(seen, effect.deadline_ns)

    def _log_flush(self, tids: Sequence[Tid], budget_used: int, flushes: int) -> None:
        """Log a budget flush (BUDGET-2), at most one line per interval."""
        held = self._flush_log.ready()
        if held is None:
            return
        log(
            logging.INFO,
            "budget_flush",
            self._id,
            "budget flush: deferred writes %s forced out early; %d of %d GPU budget bytes in "
            "use; flushes so far: %d (%d since the previous line)",
            list(tids),
            budget_used,
            self.config.gpu_staging_bytes,
            flushes,
            held + 1,
            tids=list(tids),
            budget_bytes_in_use=budget_used,
            budget_flushes=flushes,
        )

    def _log_timeout(
        self, exc: WaitTimeoutError | PageTimeoutError, step_id: StepId | None
    ) -> None:
        """Log a wait that ran out (FAIL-3, PAGE-4) before its error reaches the caller."""
        if isinstance(exc, PageTimeoutError):
            tids = [tid for tid, _ in exc.tasks_in_flight]
            log(
                logging.WARNING,
                "wait_timeout",
                self._id,
                "save_outputs timed out after %ss waiting for a staging page; open step ids %s "
                "hold pages, writes in flight %s",
                exc.timeout_s,
                list(exc.open_step_ids),
                [f"{tid}:{state}" for tid, state in exc.tasks_in_flight],
                wait="page",
                step_ids=list(exc.open_step_ids),
                tids=tids,
                timeout_s=exc.timeout_s,
            )
            return
        where = "save_outputs" if step_id is None else f"materialize of step {step_id}"
        log(
            logging.WARNING,
            "wait_timeout",
            self._id,
            "%s timed out after %ss in the %s, waiting for write tid %d (%s)",
            where,
            exc.timeout_s,
            exc.what,
            exc.tid,
            exc.state,
            wait=exc.what,
            step_ids=[] if step_id is None else [step_id],
            tids=[exc.tid],
            timeout_s=exc.timeout_s,
        )

    def _wait(self, seen: int, deadline_ns: int) -> None:
        remaining = (deadline_ns - time.monotonic_ns()) / 1e9
        self._signal.wait(seen, max(remaining, 0.0) + 1e-4)

    def _install_keys(
        self,
        shapes: Mapping[TensorName, KeyShape],
        immediate: set[TensorName],
        *,
        tables: bool = False,
    ) -> None:
        """Allocate storage for keys seen for the first time outside the lock; install under it.

        With ``tables`` the core's occupancy tables are allocated too (`reserve`). All or
        nothing (D20): an allocation that fails raises `HostAllocationError` and this call keeps
        nothing it allocated; the keys installed before stay.
        """
        new_pool = {k: s for k, s in shapes.items() if k not in self._pool.tensors}
        new_pages = {k: shapes[k] for k in immediate if k not in self._pages.buffers}
        if not new_pool and not new_pages and not tables:
            return
        pool_storage: dict[TensorName, torch.Tensor] = {}
        page_storage: dict[TensorName, torch.Tensor] = {}
        failed: tuple[HostPool | StagingPages, TensorName, KeyShape] | None = None
        try:
            for key, shape in new_pool.items():
                failed = (self._pool, key, shape)
                pool_storage[key] = self._pool.allocate(shape, key)
            for key, shape in new_pages.items():
                failed = (self._pages, key, shape)
                page_storage[key] = self._pages.allocate(shape, key)
        except Exception as exc:
            # Keep nothing: storage pinned for this call is unpinned as it is freed here.
            pool_storage.clear()
            page_storage.clear()
            assert failed is not None
            storage, key, shape = failed
            raise HostAllocationError(
                key=key,
                part="pool" if storage is self._pool else "pages",
                nbytes=storage.nbytes_for(shape),
                pinned=storage.pin,
                reason=f"{type(exc).__name__}: {exc}",
            ) from exc
        try:
            with self._lock:
                if self._closed:
                    raise ShutDownError(operation="allocate host storage")
                for key, shape in shapes.items():
                    # A reserve on another thread may have installed the key first (first wins).
                    self._check_first_shape(f"rows of cached key {key!r}", key, shape)
                if tables:
                    try:
                        self._core.reserve_tables(shapes)
                    except MemoryError as exc:
                        raise HostAllocationError(
                            key=", ".join(shapes),
                            part="occupancy",
                            nbytes=len(shapes) * self._core.occupancy_bytes_per_key(),
                            pinned=False,
                            reason=f"{type(exc).__name__}: {exc}",
                        ) from exc
                for key, storage in pool_storage.items():
                    self._pool.install(key, new_pool[key], storage)
                for key, buffer in page_storage.items():
                    self._pages.install(key, buffer)
        except BaseException:
            # Keep nothing this call allocated: the raised error's frames would hold it alive.
            pool_storage.clear()
            page_storage.clear()
            raise
        for key in dict.fromkeys((*pool_storage, *page_storage)):
            self._log_allocation(key, shapes[key], pool_storage.get(key), page_storage.get(key))

    def _log_allocation(
        self,
        key: TensorName,
        shape: KeyShape,
        pool: torch.Tensor | None,
        pages: torch.Tensor | None,
    ) -> None:
        """Log a key's first allocation: the host bytes it holds from now on."""
        pool_bytes = 0 if pool is None else pool.untyped_storage().nbytes()
        page_bytes = 0 if pages is None else pages.untyped_storage().nbytes()
        kind = "deferred" if key in self._core.policy.deferred_keys else "immediate"
        log(
            logging.INFO,
            "key_allocated",
            self._id,
            "allocated %s key %r (rows %s %s, %d bytes each): host pool %d bytes (%d slots), "
            "staging pages %d bytes (%d pages of %d rows), %s",
            kind,
            key,
            list(shape.features),
            str(shape.dtype).removeprefix("torch."),
            shape.row_bytes,
            pool_bytes,
            self.config.num_slots,
            page_bytes,
            self.config.staging_depth if pages is not None else 0,
            self.config.staging_capacity_tokens,
            "pinned" if self._cuda else "not pinned",
            key=key,
            pool_bytes=pool_bytes,
            staging_bytes=page_bytes,
            row_bytes=shape.row_bytes,
        )

    def _stage(
        self,
        parts: Any,
        n: int,
        page: int,
        layout: PrefixCacheWriteLayout,
        slot_ids: torch.Tensor,
    ) -> tuple[_StepContext, WriteJob | None]:
        """Copy the step's rows into its page and take its clones and leftover snapshot."""
        ctx = _StepContext()
        ctx.n = n
        ctx.page = page
        ctx.immediate_keys = tuple(parts.immediate)
        bounds = layout.bounds
        ctx.req_rows = dict(zip(layout.req_ids, itertools.pairwise(bounds), strict=True))
        ctx.shapes = {k: self._pool.shapes[k] for k in (*parts.immediate, *parts.deferred)}
        on_device = self._cuda and (
            any(t.is_cuda for t in (*parts.immediate.values(), *parts.deferred.values()))
            or _has_cuda_tensor(parts.leftover)
        )
        hold: list[torch.Tensor] = []
        with self._range("omni_cache.step_copy"):
            try:
                ctx.deferred_rows = self._copy_step(parts, n, page, ctx, on_device, hold)
            except Exception as exc:
                # D19: part of the save's transaction, which aborts and leaves no trace. A copy
                # already launched must be over before the page goes back.
                if self._copy_stream is not None:
                    with contextlib.suppress(Exception):
                        self._copy_stream.synchronize()
                if isinstance(exc, StagingCopyError):
                    raise
                reason = f"{type(exc).__name__}: {exc}"
                raise StagingCopyError(key=None, reason=reason) from exc
        step_job = None
        if parts.immediate:
            step_job = WriteJob(
                Tid(0),  # the real tid comes with the StepWrite effect
                tuple(parts.immediate),
                page=page,
                slots=slot_ids,
                d2h_event=ctx.d2h_event,
                freeze_event=ctx.freeze_event,
            )
            step_job.hold = hold
        return ctx, step_job

    def _copy_step(
        self,
        parts: Any,
        n: int,
        page: int,
        ctx: _StepContext,
        on_device: bool,
        hold: list[torch.Tensor],
    ) -> dict[TensorName, torch.Tensor]:
        """Copy the immediate rows into the page; return the deferred clones (DEV-1)."""
        if on_device:
            # DEV-1: clones on the compute stream, then the freeze event.
            immediate = {k: v.clone() for k, v in parts.immediate.items()}
            deferred = {k: v.clone() for k, v in parts.deferred.items()}
            ctx.leftover = {k: snapshot_leftover(v, n, pin=True) for k, v in parts.leftover.items()}
            freeze = torch.cuda.Event()
            freeze.record()
            ctx.leftover_event = freeze
            assert self._copy_stream is not None
            with torch.cuda.stream(self._copy_stream):
                self._copy_stream.wait_event(freeze)
                for key, rows in immediate.items():
                    self._copy_into_page(key, rows, page, n, non_blocking=True)
                    self._bytes_d2h += rows.numel() * rows.element_size()
                d2h = torch.cuda.Event()
                d2h.record(self._copy_stream)
            ctx.d2h_event = d2h
            ctx.freeze_event = freeze
            hold.extend(immediate.values())
        else:
            for key, rows in parts.immediate.items():
                self._copy_into_page(key, rows, page, n, non_blocking=False)
            deferred = {k: v.detach().clone() for k, v in parts.deferred.items()}
            # A deferred key's leftover is the same rows as its clone: one copy serves both.
            ctx.leftover = {
                k: deferred[k] if k in deferred else snapshot_leftover(v, n, pin=False)
                for k, v in parts.leftover.items()
            }
        return deferred

    def _copy_into_page(
        self, key: TensorName, rows: torch.Tensor, page: int, n: int, *, non_blocking: bool
    ) -> None:
        """Copy one key's rows of the step into its page (the ``page_copy`` fault point)."""
        try:
            self._faults.fire("page_copy", key)
            self._pages.rows(key, page, n).copy_(rows.reshape(n, -1), non_blocking=non_blocking)
        except Exception as exc:
            raise StagingCopyError(key=key, reason=f"{type(exc).__name__}: {exc}") from exc

    def _apply_commit(
        self,
        step_id: StepId,
        effects: Iterable[Any],
        ctx: _StepContext,
        step_job: WriteJob | None,
        slots: torch.Tensor,
    ) -> list[tuple[_ReadRecord, Preserve]]:
        """Under the lock: register the step's jobs and context from the commit's effects."""
        preserves: list[tuple[_ReadRecord, Preserve]] = []
        for effect in effects:
            if isinstance(effect, StepWrite):
                assert step_job is not None
                step_job.tid = effect.tid
                self._jobs[effect.tid] = step_job
            elif isinstance(effect, DeferredChunk):
                job = self._jobs.get(effect.tid)
                if job is None:
                    job = WriteJob(effect.tid, tuple(ctx.deferred_rows))
                    self._jobs[effect.tid] = job
                rows = slice(effect.row_start, effect.row_end)
                job.chunks.append(
                    Chunk(slots[rows], {k: v[rows] for k, v in ctx.deferred_rows.items()})
                )
                job.keys = tuple(dict.fromkeys((*job.keys, *ctx.deferred_rows)))
                # Events on one stream are ordered: the newest freeze covers every chunk.
                job.freeze_event = ctx.freeze_event or job.freeze_event
            elif isinstance(effect, Tombstone):
                job = self._jobs.get(effect.tid)
                if job is not None:
                    job.add_tombstone(effect.key, torch.from_numpy(effect.slots))
            elif isinstance(effect, Preserve):
                preserves.append((self._record(effect.read_id), effect))
            else:  # pragma: no cover - save_commit returns only these
                raise AssertionError(f"unexpected effect {effect!r}")
        reads = self._core.reads_of(step_id)
        ctx.read_ids = tuple(read_id for read_id, _ in reads)
        # D4: the save dropped the start's reads it did not plan; their records go too.
        self._close_records(self._start_reads.difference(ctx.read_ids))
        self._start_reads = set()
        ctx.task_jobs = {
            tid: self._jobs[tid] for _, tids in reads for tid in tids if tid in self._jobs
        }
        self._steps[step_id] = ctx
        return preserves

    def _record(self, read_id: int) -> _ReadRecord:
        record = self._reads.get(read_id)
        if record is None:
            record = self._reads[read_id] = _ReadRecord()
        return record

    def _close_records(self, read_ids: Iterable[int]) -> None:
        """Forget the records of reads no step will consume (under the state lock)."""
        for read_id in read_ids:
            record = self._reads.pop(read_id, None)
            if record is not None:
                with record.lock:
                    record.closed = True

    def _preserve(self, record: _ReadRecord, effect: Preserve) -> None:
        """Copy pool rows into a read before a newer write overwrites them (HIT-6)."""
        with record.lock:
            if record.closed:
                return  # the read finished gathering before the new write was dispatched
            rows = self._pool.tensors[effect.key].index_select(0, torch.from_numpy(effect.slots))
            record.preserved.append((effect.positions, rows))

    # -----------------------------------------------------------------------------------------
    # Any thread: consume.

    def materialize(self, step_id: StepId, req_ids: Sequence[str]) -> StageCacheOutputs:
        """Return the requests' merged outputs of a saved step, consuming its id (STEP-1).

        Reads only what the save captured (STEP-3). Blocks while the immediate writes its hits
        read are still landing (HIT-3, bounded by ``staging_claim_timeout_s``) and for the
        gathers; never under the state lock.

        Raises:
            UnknownStepError: The id was never issued; the cache is unchanged (STEP-2).
            StepAlreadyConsumedError: The id was consumed; the cache is unchanged (STEP-2).
            BadInputError: A request outside the step's layout (STEP-4); the step is consumed.
            HitUnreadableError: A hit cannot be served (HIT-4, HIT-6), or its gather failed
                (D19); the step is consumed and nothing was delivered.
            WaitTimeoutError: A write a hit reads did not land in time; the step is consumed.
            WriteFailedError: A write failed (FAIL-1); the cache must be discarded.
            ShutDownError: The cache is shut down.
        """
        step_id = self._step_id(step_id, "materialize")
        wanted = None if isinstance(req_ids, str) else _as_tuple(req_ids)
        if wanted is None:
            self._refuse_if_unusable("materialize")
            raise BadInputError(
                what="materialize req_ids",
                expected="a sequence of request ids",
                got="a str" if isinstance(req_ids, str) else type(req_ids).__name__,
            )
        plan, ctx, records = self._consume(step_id, wanted)
        delivered = False
        try:
            out = self._build(plan, ctx, records, wanted)
            delivered = True
            return out
        except Exception as exc:
            if self._closed and not isinstance(exc, OmniPrefixCacheUnmatchError):
                # The cache shut down while this materialize was reading (FAIL-4).
                raise ShutDownError(operation="materialize") from exc
            raise
        finally:
            with self._lock:
                # D19: outputs that never reached the caller were not delivered.
                self._core.consume_end(ConsumeEnd(step_id=step_id, delivered=delivered))
                self._forget_step(step_id)
            self._signal.bump()  # a page may be free now

    def discard_step(self, step_id: StepId) -> None:
        """Consume a step id without reading it (STEP-1); its writes go on. Does not block.

        Raises:
            UnknownStepError: The id was never issued; the cache is unchanged (STEP-2).
            StepAlreadyConsumedError: The id was consumed; the cache is unchanged (STEP-2).
            BadInputError: The step id is not an int; the cache is unchanged.
            WriteFailedError: A write failed (FAIL-1); the cache must be discarded.
            ShutDownError: The cache is shut down.
        """
        self._consume(self._step_id(step_id, "discard_step"), None)
        self._signal.bump()

    def _step_id(self, step_id: object, operation: str) -> StepId:
        """A step id given to a consume, or `BadInputError` (FAIL-5)."""
        if isinstance(step_id, (int, np.integer)) and not isinstance(step_id, bool):
            return StepId(int(step_id))
        self._refuse_if_unusable(operation)
        raise BadInputError(
            what=f"{operation} step_id",
            expected="an int step id returned by save_outputs",
            got=repr(step_id),
        )

    def _consume(
        self, step_id: StepId, wanted: tuple[str, ...] | None
    ) -> tuple[ConsumePlan, _StepContext, dict[int, _ReadRecord]]:
        inp_req = cast(tuple[ReqId, ...] | None, wanted)
        while True:
            seen = self._signal.generation
            try:
                with self._lock:
                    self._drain()
                    try:
                        effect = self._core.consume_begin(
                            ConsumeBegin(
                                step_id=step_id, req_ids=inp_req, now_ns=time.monotonic_ns()
                            )
                        )
                    except OmniPrefixCacheUnmatchError:
                        if step_id in self._steps and not self._core.has_step(step_id):
                            self._forget_step(step_id)  # STEP-4: a failed consume still consumes
                            self._signal.bump()
                        raise
                    if isinstance(effect, ConsumePlan):
                        if effect.discard:
                            return effect, self._forget_step(step_id), {}
                        # Records stay registered until the consume ends, so a concurrent save's
                        # Preserve lands in the record this consume reads (HIT-6).
                        records = {r.read_id: self._record(r.read_id) for r in effect.reads}
                        return effect, self._steps[step_id], records
            except WaitTimeoutError as exc:
                self._log_timeout(exc, step_id)
                raise
            with self._range("omni_cache.wait.hit_join"):
                self._wait(seen, effect.deadline_ns)

    def _forget_step(self, step_id: StepId) -> _StepContext:
        ctx = self._steps.pop(step_id, None)
        if ctx is None:  # shutdown dropped every step context
            return _StepContext()
        for read_id in ctx.read_ids:
            record = self._reads.pop(read_id, None)
            if record is not None:
                with record.lock:
                    record.closed = True
        return ctx

    def _build(
        self,
        plan: ConsumePlan,
        ctx: _StepContext,
        records: Mapping[int, _ReadRecord],
        wanted: tuple[str, ...],
    ) -> StageCacheOutputs:
        """Merge hit prefix rows with the step's rows, per request and key (HIT-3, OUT-5)."""
        if ctx.d2h_event is not None or ctx.leftover_event is not None:
            with self._range("omni_cache.wait.step_copy"):
                if ctx.d2h_event is not None:
                    ctx.d2h_event.synchronize()
                if ctx.leftover_event is not None:
                    ctx.leftover_event.synchronize()
        leftover = ctx.leftover
        if ctx.leftover_event is not None:
            leftover = unpin(leftover)  # OUT-4: the payload holds no pinned pages
        n = ctx.n
        # This step's rows per cached key, copied out of the page once (the page is released
        # right after this call), shaped back to the key's row shape.
        current: dict[TensorName, torch.Tensor] = {}
        for key in ctx.immediate_keys:
            current[key] = (
                self._pages.rows(key, ctx.page, n).clone().reshape(n, *ctx.shapes[key].features)
            )
        for key, rows in ctx.deferred_rows.items():
            host = leftover.get(key)
            current[key] = host[:n] if isinstance(host, torch.Tensor) else rows.cpu()
        reads = {(r.req_id, r.key): r for r in plan.reads}
        rows_of = {req: ctx.req_rows[req] for req in wanted}
        # DLV-2: rows of positions already delivered (after a preemption) are cut off the front.
        skips: dict[str, int] = {}
        if plan.skip is not None:
            skips = {r: k for r, k in zip(wanted, plan.skip.tolist(), strict=True) if k}
            hit_len = {r.req_id: len(r.slots) for r in plan.reads}
            for req, k in skips.items():
                start, end = rows_of[req]
                rows_of[req] = (min(end, start + max(0, k - hit_len.get(req, 0))), end)

        # One split per key makes every request's view at once (a decode step has hundreds).
        sizes = [end - start for start, end in ctx.req_rows.values()]

        def merged(key: TensorName) -> dict[str, torch.Tensor]:
            base = current[key]
            pieces = dict(zip(ctx.req_rows, torch.split(base, sizes), strict=True))
            out = {req: pieces[req] for req in wanted}
            for (req, read_key), read in reads.items():
                if read_key == key and req in out:
                    # One buffer per hit request: the prefix is gathered straight into it.
                    tail = out[req]
                    hit = len(read.slots)
                    full = torch.empty((hit + len(tail), *tail.shape[1:]), dtype=tail.dtype)
                    flat = full.view(len(full), -1)
                    self._gather(flat[:hit], read, records.get(read.read_id), ctx, current)
                    # An explicit width: a request with 0 rows this step has an empty tail.
                    flat[hit:].copy_(tail.reshape(len(tail), flat.shape[1]))
                    out[req] = full
            for req, k in skips.items():
                out[req] = out[req][k:]
            return out

        hidden_states = None
        mm_outputs: dict[str, dict[str, Any]] = {}
        for key in plan.keys:
            if key == HIDDEN_KEY:
                hidden_states = (
                    merged(key)
                    if key in current
                    else {
                        req: self._hit_only(
                            reads.get((cast(ReqId, req), key)), records, ctx, current, key
                        )[skips.get(req, 0) :]
                        for req in rows_of
                    }
                )
            elif key in current:
                mm_outputs[key] = merged(key)
        cached = set(plan.keys)
        for name, value in leftover.items():
            if name not in cached:
                mm_outputs[name] = split_leftover(value, rows_of, n)
        return StageCacheOutputs(
            hidden_states, mm_outputs, DeliveredPositions(wanted, plan.starts, plan.ends)
        )

    def _hit_only(
        self,
        read: ReadPlan | None,
        records: Mapping[int, _ReadRecord],
        ctx: _StepContext,
        current: Mapping[TensorName, torch.Tensor],
        key: TensorName,
    ) -> torch.Tensor:
        """Hidden rows of a step with no rows of its own: the hit prefix, or nothing."""
        shape = self._pool.shapes.get(key)
        if read is None:
            if shape is None:
                return torch.empty((0, 0))
            return torch.empty((0, *shape.features), dtype=shape.dtype)
        assert shape is not None
        out = torch.empty((len(read.slots), shape.width), dtype=shape.dtype)
        self._gather(out, read, records.get(read.read_id), ctx, current)
        return out.reshape(len(out), *shape.features)

    def _gather(
        self,
        out: torch.Tensor,
        read: ReadPlan,
        record: _ReadRecord | None,
        ctx: _StepContext,
        current: Mapping[TensorName, torch.Tensor],
    ) -> None:
        """Fill ``out`` (one row per hit slot) from the sources the core planned (HIT-3).

        A gather that fails (here or in its prefetch) raises `HitUnreadableError`: the rows
        cannot be served, and the materialize that needed them fails (D19).
        """
        with self._range("omni_cache.hit_gather"):
            try:
                self._faults.fire("gather", read)
                self._gather_rows(out, read, record, ctx, current)
            except OmniPrefixCacheUnmatchError:
                raise
            except (Exception, concurrent.futures.CancelledError) as exc:
                if self._closed:
                    raise ShutDownError(operation="materialize") from exc
                raise HitUnreadableError(
                    req_id=read.req_id,
                    key=read.key,
                    reason=f"gathering the hit rows failed: {type(exc).__name__}: {exc}",
                    slot_count=len(read.slots),
                ) from exc

    def _gather_rows(
        self,
        out: torch.Tensor,
        read: ReadPlan,
        record: _ReadRecord | None,
        ctx: _StepContext,
        current: Mapping[TensorName, torch.Tensor],
    ) -> None:
        key = read.key
        pool = self._pool.tensors[key]
        source = read.source
        pooled = (source == _POOL) | (source == _AFTER_WRITE)
        prefetched = record.prefetch if record is not None else None
        if prefetched is not None:
            positions, future = prefetched
            rows = future.result()
            if len(positions) == len(source):
                out.copy_(rows)  # HIT-7: the prefetch covered every row
                pooled = np.zeros(len(source), dtype=np.bool_)
            elif len(positions):
                out[torch.from_numpy(positions)] = rows
                pooled[positions] = False
        if pooled.all():
            torch.index_select(pool, 0, torch.from_numpy(read.slots), out=out)
        else:
            if pooled.any():
                todo = np.flatnonzero(pooled)
                out[torch.from_numpy(todo)] = pool.index_select(
                    0, torch.from_numpy(read.slots[todo])
                )
            zeros = np.flatnonzero(source == _ZEROS)
            if len(zeros):
                out[torch.from_numpy(zeros)] = 0
            tasked = np.flatnonzero(source == _TASK)
            if len(tasked):
                limits = dict(read.chunk_limit)
                for tid in np.unique(read.writer[tasked]).tolist():
                    mine = tasked[read.writer[tasked] == tid]
                    out[torch.from_numpy(mine)] = self._task_rows(
                        ctx.task_jobs[Tid(tid)], key, read.slots[mine], limits[Tid(tid)]
                    )
            own = np.flatnonzero(source == _THIS_STEP)
            if len(own):
                rows = current[key].reshape(len(current[key]), -1)
                index = torch.from_numpy(read.step_row[own].astype(np.int64))
                out[torch.from_numpy(own)] = rows[index]
        if record is not None:
            # HIT-6: rows preserved before a newer write landed win over what was gathered.
            # Closing under the lock means a later Preserve skips: the gather is done.
            with record.lock:
                for positions, rows in record.preserved:
                    out[torch.from_numpy(positions)] = rows
                record.closed = True

    def _task_rows(
        self, job: WriteJob, key: TensorName, slots: np.ndarray, limit: int
    ) -> torch.Tensor:
        """Rows of a deferred write for ``slots``, from its first ``limit`` chunks (last wins)."""
        with job.lock:  # the committer swaps device clones for host rows under this lock
            sources = [(c.slots.numpy(), c.rows(key)) for c in job.chunks[:limit]]
        sources = [(s, r) for s, r in sources if r is not None]
        all_slots = np.concatenate([s for s, _ in sources])
        order = np.argsort(all_slots, kind="stable")
        at = np.searchsorted(all_slots[order], slots, side="right") - 1
        index = torch.from_numpy(order[at])
        parts = [r.reshape(len(r), -1) for _, r in sources]
        if not parts[0].is_cuda:
            rows = parts[0] if len(parts) == 1 else torch.cat(parts)
            return rows.index_select(0, index)
        stream = self._read_stream
        assert stream is not None
        with torch.cuda.stream(stream):
            # DEV-1: the clones are read only after the compute stream finished writing them;
            # everything here, the concatenation included, runs on the read stream.
            if job.freeze_event is not None:
                stream.wait_event(job.freeze_event)
            rows = parts[0] if len(parts) == 1 else torch.cat(parts)
            picked = rows.index_select(0, index.to(rows.device, non_blocking=False)).to("cpu")
        stream.synchronize()
        return picked

    # -----------------------------------------------------------------------------------------
    # Reports and stats.

    def _drain(self, *, raise_fatal: bool = True) -> None:
        """Feed the committer's reports into the core, then raise a sticky failure (FAIL-1).

        Called under the state lock at every public entry; `stats` drains without raising.
        """
        reports = self._reports
        while reports:
            report = reports.popleft()
            self._core.report(report)
            if isinstance(report, (WriteLanded, WriteFailed)):
                self._jobs.pop(report.tid, None)
        fatal = self._core.fatal
        # FAIL-4 over FAIL-1: a cache shut down after a failure says it is shut down; the core
        # input that follows every raising drain raises that.
        if fatal is not None and raise_fatal and not self._core.closed:
            raise type(fatal)(tids=fatal.tids, reason=fatal.reason)

    def stats(self) -> CacheStats:
        """Return a frozen snapshot of the counters. Does not block on writes.

        Folds in the committer's reports first, so pages, budget and failures are current even
        when no other call follows (D8); it works after a failure and after shutdown.
        """
        with self._lock:
            self._drain(raise_fatal=False)
            core = self._core
            counters = core.counters
            pool_bytes, staging_bytes = self._pool.nbytes(), self._pages.nbytes()
            # On CUDA every key's storage is pinned (a pin that fails raises); on the CPU none.
            pinned = pool_bytes + staging_bytes if self._cuda else 0
            return CacheStats(
                steps_saved=counters.steps_saved,
                steps_consumed=counters.steps_consumed,
                steps_discarded=counters.steps_discarded,
                hit_requests=counters.hit_requests,
                hit_rows={s.name: int(counters.hit_rows[s.value]) for s in SlotSource},
                rows_written=dict(self._committer.rows_written),
                bytes_device_to_host=self._bytes_d2h + self._committer.bytes_to_host,
                bytes_to_pool=self._committer.bytes_to_pool,
                page_waits=self._page_waits,
                page_wait_s=self._page_wait_ns / 1e9,
                budget_flushes=counters.budget_flushes,
                timeouts=counters.page_timeouts + counters.wait_timeouts,
                writes_failed=counters.writes_failed,
                pages_in_use=core.pages_in_use,
                budget_bytes_in_use=core.budget_used,
                occupancy_bytes=core.occupancy_metadata_bytes(),
                pool_bytes=pool_bytes,
                staging_bytes=staging_bytes,
                host_pinned_bytes=pinned,
                host_unpinned_bytes=pool_bytes + staging_bytes - pinned,
            )


def _has_cuda_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.is_cuda
    if isinstance(value, Mapping):
        return any(_has_cuda_tensor(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_has_cuda_tensor(v) for v in value)
    return False


def _as_tuple(items: Any) -> tuple[Any, ...] | None:
    """``tuple(items)``, or None when `items` is not iterable."""
    try:
        return tuple(items)
    except TypeError:
        return None
