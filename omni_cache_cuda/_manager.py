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

The manager composes the paths that share one `AdapterState` (`_state`): the effect
interpreter (`_effects`, one input's effects per method), the save path (`_save_path`), the
consume path (`_consume_path`) and the host storage (`_host_memory`).

Device ordering (DEV-1..3), on CUDA: the save clones the step's rows on the compute stream and
records a freeze event; the copy stream waits that event before copying the clones into the page,
and the read stream waits it before reading a deferred clone. The engine thread waits on the host
only for the save barrier, a page claim and a budget flush.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from omni_cache_core import (
    BadInputError,
    CacheCore,
    ModelCachePolicy,
    PrefixCacheConfig,
    PrefixCacheStep,
    ShutDown,
    SlotSource,
    StepId,
)
from omni_cache_cuda._committer import Committer
from omni_cache_cuda._consume_path import ConsumePath
from omni_cache_cuda._effects import EffectInterpreter
from omni_cache_cuda._host_memory import HostMemory
from omni_cache_cuda._layout import PrefixCacheWriteLayout
from omni_cache_cuda._log import BUDGET_FLUSH_LOG_INTERVAL_S, RateLimit, log, next_id
from omni_cache_cuda._nvtx import ranges_for
from omni_cache_cuda._outputs import StageCacheOutputs
from omni_cache_cuda._save_path import SavePath
from omni_cache_cuda._state import AdapterState
from omni_cache_cuda._stats import CacheStats, HostBytes

__all__ = ["OmniPrefixCacheManager"]

#: How long `shutdown` waits for the committer thread (FAIL-4).
_SHUTDOWN_JOIN_S = 5.0
#: Whether a CPU manager prefetches hits when not told (D38). The tests set it, so that every
#: manager they build on the CPU exercises the prefetch's paths as a CUDA manager would.
PREFETCH_ON_CPU = False


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
        prefetch: Start hit gathers at `new_step_starts`, overlapping the forward (HIT-7),
            for each hit read of at least 512 KiB (one request's prefix rows of one key);
            smaller reads cost the engine thread less gathered at the consume. None: on
            CUDA only (on the CPU the forward has the cores a gather thread would take,
            DESIGN D38). Results are identical either way.

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
        prefetch: bool | None = None,
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
        cuda = self.device.type == "cuda"
        self.threaded = cuda if threaded is None else bool(threaded)
        self.config = config
        cache_id = next_id()
        state = AdapterState(
            config,
            CacheCore(config, policy),
            device=self.device,
            threaded=self.threaded,
            cache_id=cache_id,
            ranges=ranges_for(self.device),
            flush_log=RateLimit(BUDGET_FLUSH_LOG_INTERVAL_S),
            prefetch=(cuda or PREFETCH_ON_CPU) if prefetch is None else bool(prefetch),
        )
        self._state = state
        # The paths hold the state, never the manager: a dropped manager is collected at once.
        self._effects = EffectInterpreter(state)
        self._host_memory = HostMemory(state)
        self._save = SavePath(state, self._effects, self._host_memory)
        self._consume = ConsumePath(state, self._effects)
        # A manager dropped without shutdown() still stops its threads.
        weakref.finalize(self, Committer.shutdown, state.committer, 0.0)

    # -----------------------------------------------------------------------------------------
    # Context manager and lifecycle.

    def __enter__(self) -> OmniPrefixCacheManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    @property
    def policy(self) -> ModelCachePolicy:
        """The model's cache policy."""
        return self._state.core.policy

    def register_policy(self, policy: ModelCachePolicy) -> None:
        """Set the model's cache policy; once, before the first step. Does not block.

        Raises:
            BadInputError: Not a policy, or a step already started; the cache is unchanged.
        """
        if not isinstance(policy, ModelCachePolicy):
            raise BadInputError(
                what="policy", expected="a ModelCachePolicy", got=type(policy).__name__
            )
        state = self._state
        with state.lock:
            state.core.register_policy(policy)

    def shutdown(self) -> None:
        """Close the cache: wake every waiter with an error, stop the threads (FAIL-4).

        Idempotent. Blocks at most a few seconds for the committer thread to stop. Later calls
        raise `ShutDownError`; the cache must be discarded.
        """
        state = self._state
        with state.lock:
            if state.closed:
                return
            state.closed = True
            state.drain(raise_fatal=False)
            open_steps = state.core.open_step_ids
            writes = sorted(state.jobs)
            state.core.shut_down(ShutDown())
        state.signal.bump()
        stopped = state.committer.shutdown(_SHUTDOWN_JOIN_S)
        if state.prefetcher is not None:
            state.prefetcher.shutdown(wait=True, cancel_futures=True)
        with state.lock:
            # Nothing is read or written from here on: let the host storage (pinned or not),
            # the device clones and the snapshots go now, not when the manager is collected.
            state.jobs.clear()
            state.steps.clear()
            state.reads.clear()
            state.start_reads = set()
            state.pool.release()
            state.pages.release()
            state.outputs.release()
        log(
            logging.INFO if stopped else logging.WARNING,
            "shutdown",
            state.cache_id,
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
        return self._host_memory.host_bytes(keys)

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
        self._host_memory.reserve(keys)

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
        self._state.faults.set(point, hook)

    # -----------------------------------------------------------------------------------------
    # Engine thread: step start and save.

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
        self._effects.start(step)

    def save_outputs(
        self,
        hidden: torch.Tensor | None,
        mm: Mapping[str, Any] | None,
        *,
        num_tokens_unpadded: int,
        num_tokens_padded: int | None = None,
        write_layout: PrefixCacheWriteLayout,
        draft_tokens: Mapping[str, int] | None = None,
    ) -> StepId:
        """Save a step's outputs after its forward; return the step id to consume exactly once.

        ``draft_tokens``: with speculative decoding, how many of each request's rows, at the
        end of its range, are draft tokens (SPEC-1). They are handed out only once a
        computed-token count confirms them (``PrefixCacheStep.computed_tokens``, or
        ``computed_tokens`` of `materialize`); a request absent from it has none.

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
        return self._save.save(
            hidden, mm, num_tokens_unpadded, num_tokens_padded, write_layout, draft_tokens
        )

    # -----------------------------------------------------------------------------------------
    # Any thread: consume.

    def materialize(
        self,
        step_id: StepId,
        req_ids: Sequence[str],
        *,
        computed_tokens: Mapping[str, int] | None = None,
    ) -> StageCacheOutputs:
        """Return the requests' merged outputs of a saved step, consuming its id (STEP-1).

        ``computed_tokens``: per request, its computed-token count after this step's sampler,
        when the caller knows it: it confirms the step's draft rows below it, which are then
        handed out now (SPEC-2). Without it a draft row is handed out once the next step's
        ``PrefixCacheStep.computed_tokens`` confirms it: by this call if it comes after that
        step starts, else by the request's next step (SPEC-4).

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
        return self._consume.materialize(step_id, req_ids, computed_tokens)

    def discard_step(self, step_id: StepId) -> None:
        """Consume a step id without reading it (STEP-1); its writes go on. Does not block.

        Raises:
            UnknownStepError: The id was never issued; the cache is unchanged (STEP-2).
            StepAlreadyConsumedError: The id was consumed; the cache is unchanged (STEP-2).
            BadInputError: The step id is not an int; the cache is unchanged.
            WriteFailedError: A write failed (FAIL-1); the cache must be discarded.
            ShutDownError: The cache is shut down.
        """
        self._consume.discard(step_id)

    # -----------------------------------------------------------------------------------------
    # Reports and stats.

    def stats(self) -> CacheStats:
        """Return a frozen snapshot of the counters. Does not block on writes.

        Folds in the committer's reports first, so pages, budget and failures are current even
        when no other call follows (D8); it works after a failure and after shutdown.
        """
        state = self._state
        with state.lock:
            state.drain(raise_fatal=False)
            core = state.core
            counters = core.counters
            committer = state.committer
            pool_bytes, staging_bytes = state.pool.nbytes(), state.pages.nbytes()
            # On CUDA every key's storage is pinned (a pin that fails raises); on the CPU none.
            pinned = pool_bytes + staging_bytes if state.cuda else 0
            return CacheStats(
                steps_saved=counters.steps_saved,
                steps_consumed=counters.steps_consumed,
                steps_discarded=counters.steps_discarded,
                hit_requests=counters.hit_requests,
                hit_rows={s.name: int(counters.hit_rows[s.value]) for s in SlotSource},
                rows_written=dict(committer.rows_written),
                bytes_device_to_host=state.bytes_d2h + committer.bytes_to_host,
                bytes_to_pool=committer.bytes_to_pool,
                page_waits=state.page_waits,
                page_wait_s=state.page_wait_ns / 1e9,
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
                output_bytes_kept=state.outputs.nbytes(),
            )
