"""A tiny engine and an oracle for testing `OmniPrefixCacheManager` on the CPU.

`Engine` plays a model runner with a paged KV cache: it keeps each request's block table and
computed-token count, sends the step's lifecycle records, builds the write layout from the block
tables and saves tensors whose values encode ``(slot, key, write id)``, so a stale, shifted or
torn row reads as a different value. `Oracle` keeps what the engine last wrote to every
(slot, key), written differently from the library: one dense tensor per key, overwritten in
step order, with explicit zeros where a step did not emit a key (SLOT-4). At every save the engine
computes what `materialize` must return for that step from the oracle *at save time*, so a later
(delayed) materialize is checked against the rows of that moment (HIT-6).

`Workload` drives an engine like a scheduler with prefix caching: prompts share prefixes from a
few families, full prompt blocks are registered in a hash table when they are scheduled, new
requests hit the longest registered prefix, blocks are recycled least-recently-freed first, and
requests finish, abort and sometimes come back under the same id. Nothing here decides a rule of
the library; the helpers only feed inputs and remember what was written.
"""

from __future__ import annotations

import collections
import math
import queue
import random
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import attrs
import numpy as np
import torch

from omni_cache_core._values import TaskState
from omni_cache_cuda import (
    HIDDEN_KEY,
    CacheStats,
    ModelCachePolicy,
    OmniPrefixCacheManager,
    PrefixCacheConfig,
    PrefixCacheEventKind,
    PrefixCacheRequestEvent,
    PrefixCacheStep,
    PrefixCacheWriteLayout,
    StageCacheOutputs,
)

__all__ = [
    "BLOCK",
    "DEF",
    "MM",
    "WIDE",
    "Engine",
    "Oracle",
    "Saved",
    "Workload",
    "assert_rows",
    "config",
    "encode",
    "make_manager",
    "policy",
    "pool_mismatches",
    "settle",
    "wait_for",
]

#: Block size of the test configs: block ``b`` covers slots ``4b .. 4b + 3``.
BLOCK = 4
#: An immediate per-token mm key and a deferred one (JOIN_ON_FINISH).
MM = "talker.h"
DEF = "codes.audio"
#: A wide per-token key: a write of a few of its rows is large enough for the CPU to split an
#: indexed copy across threads.
WIDE = "codes.wide"

#: Row shape and dtype of each cached key; the deferred key has a 2-D row and integer codes.
ROW_SHAPES: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
    HIDDEN_KEY: ((4,), torch.float32),
    MM: ((3,), torch.float32),
    DEF: ((2, 2), torch.int64),
    WIDE: ((16384,), torch.float32),
}
_KEY_CODES = {HIDDEN_KEY: 1, MM: 2, DEF: 3, WIDE: 5}


def config(**overrides: Any) -> PrefixCacheConfig:
    """Build a small config: 16 blocks of 4 slots, 3 pages of 64 rows, 5 s waits."""
    fields: dict[str, Any] = {
        "num_blocks": 16,
        "block_size": BLOCK,
        "staging_depth": 3,
        "staging_capacity_tokens": 64,
        "staging_claim_timeout_s": 5.0,
    }
    fields.update(overrides)
    return PrefixCacheConfig(**fields)


def policy(*, hidden: bool = True) -> ModelCachePolicy:
    """A policy that defers `DEF` and caches hidden states unless told otherwise."""
    return ModelCachePolicy(needs_full_hidden_states=hidden, deferred_keys={DEF})


def make_manager(
    threaded: bool,
    *,
    cache_policy: ModelCachePolicy | None = None,
    prefetch: bool = True,
    **overrides: Any,
) -> OmniPrefixCacheManager:
    """Build a CPU manager in inline (``threaded=False``) or committer-thread mode."""
    return OmniPrefixCacheManager(
        config(**overrides),
        policy=cache_policy if cache_policy is not None else policy(),
        device="cpu",
        threaded=threaded,
        prefetch=prefetch,
    )


def wait_for(predicate: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    """Poll ``predicate`` until it holds or the timeout passes; return its last value."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return True


def settle(manager: OmniPrefixCacheManager, timeout_s: float = 10.0) -> CacheStats:
    """Wait until no write is queued or copying, then return the stats.

    Open deferred writes (PENDING) stay open. `stats()` folds the committer's reports in, so
    the core's view of the tasks is current when it is read here (test-only peek).
    """

    def idle() -> bool:
        manager.stats()
        tasks = list(manager._core._tasks.values())
        return all(task.state is TaskState.PENDING for task in tasks)

    assert wait_for(idle, timeout_s), "writes still in flight"
    return manager.stats()


def pool_mismatches(manager: OmniPrefixCacheManager, oracle: Oracle) -> list[str]:
    """Name every COMMITTED (slot, key) whose pool row differs from the engine's last write.

    Reads the core's occupancy and the pool under the state lock (a test-only peek): in-flight
    writes touch only slots they own, so the committed rows cannot change meanwhile.
    """
    bad: list[str] = []
    with manager._lock:
        manager._drain(raise_fatal=False)
        for key, table in manager._core._tables.items():
            committed = torch.from_numpy(np.flatnonzero(table.owner == 0))
            if not len(committed):
                continue
            pool = manager._pool.tensors[key][committed]
            want = oracle.rows[key][committed].reshape(len(committed), -1)
            wrong = (pool != want).any(dim=1)
            if wrong.any():
                bad.append(f"pool rows of {key} at slots {committed[wrong].tolist()[:8]}")
    return bad


def encode(key: str, slots: torch.Tensor, write: int) -> torch.Tensor:
    """Rows for ``slots`` whose values spell out (slot, key, write id) in every element."""
    features, dtype = ROW_SHAPES.get(key, ((3,), torch.float32))
    width = math.prod(features)
    slots64 = slots.to(torch.float64)[:, None]
    cols = torch.arange(width, dtype=torch.float64)[None, :]
    # Column 0 is the slot, 1 the key, 2 the write; later columns mix all three so a row
    # stitched from two writes cannot match either.
    rows = slots64 * 7 + write * 3 + cols * 11 + _KEY_CODES.get(key, 4) * 1000
    rows[:, 0:1] = slots64
    rows[:, 1] = _KEY_CODES.get(key, 4)
    if width > 2:
        rows[:, 2] = write
    return rows.to(dtype).reshape(len(slots), *features)


def assert_rows(actual: Any, expected: torch.Tensor, what: str) -> None:
    """Assert a returned tensor equals the expected rows exactly: dtype, shape and values."""
    assert isinstance(actual, torch.Tensor), f"{what}: got {type(actual).__name__}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, (
        f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    )
    assert torch.equal(actual, expected), (
        f"{what}: got {actual.reshape(len(actual), -1).tolist()} "
        f"expected {expected.reshape(len(expected), -1).tolist()}"
    )


class Oracle:
    """What the engine last wrote to every (slot, key): the reference the library must match."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.rows: dict[str, torch.Tensor] = {}
        #: Slots whose hidden rows were written by their current tenant.
        self.hidden_written = torch.zeros(num_slots, dtype=torch.bool)

    def apply(self, slots: torch.Tensor, emitted: Mapping[str, torch.Tensor]) -> None:
        """Record a step's writes; every known key the step did not emit reads zeros (SLOT-4)."""
        for key, rows in emitted.items():
            if key not in self.rows:
                features, dtype = ROW_SHAPES.get(key, ((3,), torch.float32))
                self.rows[key] = torch.zeros((self.num_slots, *features), dtype=dtype)
            self.rows[key][slots] = rows
        for key, table in self.rows.items():
            if key not in emitted:
                table[slots] = 0
        if HIDDEN_KEY in self.rows:
            self.hidden_written[slots] = HIDDEN_KEY in emitted

    def prefix(self, key: str, slots: torch.Tensor) -> torch.Tensor:
        """The rows a hit on ``slots`` must return for ``key`` (zeros where nothing is known)."""
        table = self.rows.get(key)
        if table is None:
            features, dtype = ROW_SHAPES.get(key, ((3,), torch.float32))
            return torch.zeros((len(slots), *features), dtype=dtype)
        return table[slots].clone()

    def readable(self, slots: torch.Tensor) -> bool:
        """Whether every slot holds hidden rows of its current tenant (else HIT-4 raises)."""
        return bool(self.hidden_written[slots].all())


@attrs.frozen(kw_only=True)
class Saved:
    """A saved step and what its materialize must return.

    Attributes:
        step_id: The id `save_outputs` returned.
        order: The step's requests in batch order.
        expected: Cached key -> request -> rows (hit prefix, then this step's rows).
        unreadable: Requests whose hidden hit cannot be served (HIT-4).
        rows: This step's rows per emitted cached key, ``[:n]``.
        slots: The step's slot per row.
        spans: Request -> its row range in the step.
        write: The write id the step's values encode.
    """

    step_id: int
    order: tuple[str, ...]
    expected: dict[str, dict[str, torch.Tensor]]
    unreadable: frozenset[str]
    rows: dict[str, torch.Tensor]
    slots: torch.Tensor
    spans: dict[str, tuple[int, int]]
    write: int


@attrs.define
class _Request:
    blocks: list[int]
    computed: int


class Engine:
    """A model runner in miniature: block tables, lifecycle records, layouts and saved tensors.

    Use `start`, `finish` and `abort` to queue lifecycle records, then `step` (or `begin` and
    `save`) to run a step, then `materialize` to consume it and check every returned row.
    """

    def __init__(self, manager: OmniPrefixCacheManager) -> None:
        self.m = manager
        self.block_size = manager.config.block_size
        self.oracle = Oracle(manager.config.num_slots)
        self.caches_hidden = manager.policy.needs_full_hidden_states
        self.reqs: dict[str, _Request] = {}
        self.events: list[PrefixCacheRequestEvent] = []
        self._pending_hits: dict[str, torch.Tensor] = {}
        self._hits: dict[str, torch.Tensor] = {}
        self._schedule: dict[str, int] = {}
        self.writes = 0
        # Like a model runner, the engine refills one CPU slot-mapping buffer every step and
        # hands the cache a view of it; it scribbles over it right after each save (STEP-3).
        self.slot_buffer = torch.zeros(manager.config.num_slots * 2, dtype=torch.int64)

    # Lifecycle records ------------------------------------------------------------------------

    def start(self, req: str, blocks: Sequence[int], *, hit_end: int = 0) -> None:
        """Queue a STARTED record; a request already live is a continuation with no hit (HIT-1)."""
        self.events.append(
            PrefixCacheRequestEvent(
                req_id=req,
                kind=PrefixCacheEventKind.STARTED,
                hit_end=hit_end,
                block_ids=tuple(blocks),
            )
        )
        if req in self.reqs:
            self.reqs[req].blocks = list(blocks)
            return
        self.reqs[req] = _Request(list(blocks), hit_end)
        if hit_end:
            hit_blocks = torch.tensor(blocks[: hit_end // self.block_size], dtype=torch.int64)
            slots = hit_blocks[:, None] * self.block_size + torch.arange(self.block_size)
            self._pending_hits[req] = slots.reshape(-1)

    def finish(self, req: str, *, abort: bool = False) -> None:
        """Queue a FINISHED (or ABORTED) record; the request leaves the engine at once (HIT-2)."""
        kind = PrefixCacheEventKind.ABORTED if abort else PrefixCacheEventKind.FINISHED
        self.events.append(PrefixCacheRequestEvent(req_id=req, kind=kind))
        self.reqs.pop(req, None)
        self._pending_hits.pop(req, None)

    def rewind(self, req: str, computed: int, blocks: Sequence[int] | None = None) -> None:
        """Move a live request back (a preempted request that recomputes), maybe on new blocks."""
        self.reqs[req].computed = computed
        if blocks is not None:
            self.reqs[req].blocks = list(blocks)

    # Steps ------------------------------------------------------------------------------------

    def begin(self, schedule: Mapping[str, int]) -> None:
        """Send the queued records and the scheduled counts (`new_step_starts`)."""
        step = PrefixCacheStep(events=list(self.events), scheduled_tokens=dict(schedule))
        self.events = []
        self._hits, self._pending_hits = self._pending_hits, {}
        self._schedule = dict(schedule)
        self.m.new_step_starts(step)

    def layout(self) -> tuple[PrefixCacheWriteLayout, torch.Tensor]:
        """The step's layout from the block tables, and the slots computed here independently."""
        order = list(self._schedule)
        layout = PrefixCacheWriteLayout.from_block_tables(
            order,
            self._schedule,
            {r: self.reqs[r].computed for r in order},
            {r: self.reqs[r].blocks for r in order},
            self.block_size,
        )
        slots: list[int] = []
        for req in order:
            state = self.reqs[req]
            for pos in range(state.computed, state.computed + self._schedule[req]):
                slots.append(state.blocks[pos // self.block_size] * self.block_size)
                slots[-1] += pos % self.block_size
        return layout, torch.tensor(slots, dtype=torch.int64)

    def save(
        self,
        *,
        emit: Iterable[str] = (MM, DEF),
        extra: Mapping[str, Any] | None = None,
        padded: int | None = None,
        pad: Iterable[str] = (),
        keep: dict[str, torch.Tensor] | None = None,
    ) -> Saved:
        """Save the step: hidden plus the ``emit`` keys (padded rows for ``pad`` keys).

        ``extra`` adds uncached values. ``keep`` receives the tensors handed to the cache so a
        test can overwrite them afterwards (STEP-3). The engine's state moves on only when the
        save succeeds.
        """
        layout, slots = self.layout()
        n = len(slots)
        self.writes += 1
        write = self.writes
        # A step without rows caches nothing; its mm values would all be leftover.
        emit = tuple(emit) if n else ()
        pad = set(pad)
        rows = {key: encode(key, slots, write) for key in (HIDDEN_KEY, *emit)}

        def padded_rows(key: str) -> torch.Tensor:
            if padded is None or (key != HIDDEN_KEY and key not in pad):
                return rows[key].clone()
            filler = torch.full((padded - n, *rows[key].shape[1:]), -7, dtype=rows[key].dtype)
            return torch.cat((rows[key], filler))

        hidden = padded_rows(HIDDEN_KEY)
        mm: dict[str, Any] = {key: padded_rows(key) for key in emit}
        mm.update(extra or {})
        if keep is not None:
            keep.update(mm)
            keep[HIDDEN_KEY] = hidden
        self.slot_buffer[:n] = layout.slots_cpu
        shared = PrefixCacheWriteLayout(layout.writes, self.slot_buffer[:n])
        step_id = self.m.save_outputs(
            hidden, mm, num_tokens_unpadded=n, num_tokens_padded=padded, write_layout=shared
        )
        self.slot_buffer.fill_(self.m.config.num_slots - 1)  # the next step's inputs
        # A step without rows still returns hidden: each hit request's prefix, else no rows.
        cached = dict(rows) if n else {HIDDEN_KEY: rows[HIDDEN_KEY]}
        if not self.caches_hidden:
            cached.pop(HIDDEN_KEY, None)
        if n:
            self.oracle.apply(slots, cached)
        spans = {w.req_id: (w.row_start, w.row_end) for w in layout.writes}
        expected: dict[str, dict[str, torch.Tensor]] = {key: {} for key in cached}
        unreadable: set[str] = set()
        for req, (start, end) in spans.items():
            hit = self._hits.get(req)
            for key, key_rows in cached.items():
                own = key_rows[start:end]
                if hit is None:
                    expected[key][req] = own
                    continue
                expected[key][req] = torch.cat((self.oracle.prefix(key, hit), own))
            if hit is not None and self.caches_hidden and not self.oracle.readable(hit):
                unreadable.add(req)
        for req, count in self._schedule.items():
            self.reqs[req].computed += count
        self._hits = {}
        return Saved(
            step_id=step_id,
            order=tuple(spans),
            expected=expected,
            unreadable=frozenset(unreadable),
            rows=cached,
            slots=slots,
            spans=spans,
            write=write,
        )

    def step(self, schedule: Mapping[str, int], **save_args: Any) -> Saved:
        """Run one whole step: `begin` then `save`."""
        self.begin(schedule)
        return self.save(**save_args)

    # Consuming --------------------------------------------------------------------------------

    def check(
        self,
        out: StageCacheOutputs,
        saved: Saved,
        req_ids: Sequence[str] | None = None,
        *,
        leftover: Iterable[str] = (),
    ) -> None:
        """Assert ``out`` holds exactly the expected rows of the requested requests."""
        reqs = list(saved.order if req_ids is None else req_ids)
        hidden = saved.expected.get(HIDDEN_KEY)
        if hidden is None:
            assert out.hidden_states is None or not saved.rows, "hidden returned though not cached"
        else:
            assert out.hidden_states is not None, "hidden states missing"
            assert set(out.hidden_states) == set(reqs), sorted(out.hidden_states)
            for req in reqs:
                assert_rows(out.hidden_states[req], hidden[req], f"hidden of {req}")
        mm_keys = {k for k in saved.expected if k != HIDDEN_KEY}
        assert set(out.mm_outputs) == mm_keys | set(leftover), sorted(out.mm_outputs)
        for key in mm_keys:
            assert set(out.mm_outputs[key]) == set(reqs), (key, sorted(out.mm_outputs[key]))
            for req in reqs:
                assert_rows(out.mm_outputs[key][req], saved.expected[key][req], f"{key} of {req}")

    def materialize(
        self, saved: Saved, req_ids: Sequence[str] | None = None, **check_args: Any
    ) -> StageCacheOutputs:
        """Materialize a saved step and check every returned row against the oracle."""
        reqs = list(saved.order if req_ids is None else req_ids)
        out = self.m.materialize(saved.step_id, reqs)
        self.check(out, saved, reqs, **check_args)
        return out


# ---------------------------------------------------------------------------------------------
# A scheduler with prefix caching, for long randomized runs.


@attrs.define
class _Live:
    prompt: tuple[int, ...]
    total: int  # prompt plus decode tokens
    blocks: list[int]
    hit_blocks: int


@attrs.define
class WorkloadCounts:
    """What a workload exercised, so a run can prove it covered the interesting cases."""

    steps: int = 0
    hit_requests: int = 0
    hit_rows: int = 0
    same_step_hits: int = 0
    finishes: int = 0
    aborts: int = 0
    id_reuses: int = 0
    recycled_blocks: int = 0
    materialized: int = 0
    discarded: int = 0
    checked_rows: int = 0
    sparse_steps: int = 0


class Workload:
    """Drive an engine like a vLLM-style scheduler with prefix caching (see the module doc).

    Every step: finish requests that are done and abort a few at random (their blocks go back to
    the free list); schedule a prefill chunk or one decode token for each running request, now
    and then none (the request stays in the layout with no rows); admit new requests, which hit
    the longest prefix of full prompt blocks registered in the hash table (also blocks another
    request computes in this very step, HIT-5), capped so at least one prompt token is computed;
    register the full prompt blocks a chunk computes; emit `MM` and `DEF` on most steps only
    (sparse keys, SLOT-4). New blocks come from the free list's oldest end like vLLM, or
    (``mru_p``) its newest end, which reuses slots whose writes or delayed reads are still
    pending. Each saved step is consumed one to ``max_lag`` steps late, on a builder thread when
    ``builder`` is set, by `materialize` (a random subset of its requests at times) or
    `discard_step`, and checked against the oracle; every ``check_pool_every`` steps the
    committed pool rows are compared with it too.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        seed: int,
        max_running: int = 4,
        max_chunk: int = 6,
        families: int = 3,
        abort_p: float = 0.04,
        reuse_p: float = 0.1,
        sparse_p: float = 0.12,
        discard_p: float = 0.08,
        subset_p: float = 0.15,
        idle_p: float = 0.04,
        max_lag: int = 1,
        mru_p: float = 0.5,
        check_pool_every: int = 0,
        builder: bool = True,
    ) -> None:
        self.engine = engine
        self.rng = random.Random(seed)
        self.block_size = engine.block_size
        self.max_running = max_running
        self.max_chunk = max_chunk
        self.abort_p = abort_p
        self.reuse_p = reuse_p
        self.sparse_p = sparse_p
        self.discard_p = discard_p
        self.subset_p = subset_p
        self.idle_p = idle_p
        self.max_lag = max_lag
        self.mru_p = mru_p
        self.check_pool_every = check_pool_every
        self.families = [
            tuple(f * 10_000 + i for i in range(3 * self.block_size)) for f in range(families)
        ]
        num_blocks = engine.m.config.num_blocks
        self.free: collections.deque[int] = collections.deque(range(num_blocks))
        self.ref = [0] * num_blocks
        self.block_hash: dict[int, tuple[int, ...]] = {}
        self.hash_block: dict[tuple[int, ...], int] = {}
        self.written = [False] * num_blocks
        self.live: dict[str, _Live] = {}
        self.counts = WorkloadCounts()
        self.errors: list[str] = []
        self.outputs: list[tuple[int, dict[str, Any]]] = []
        self._next_req = 0
        self._next_token = 1_000_000
        # Saved steps waiting to be consumed, each with the step count at which it is due.
        self._late: list[tuple[int, tuple[Saved, list[str] | None, bool]]] = []
        self._queue: queue.Queue[tuple[Saved, list[str] | None, bool] | None] = queue.Queue()
        self._builder = (
            threading.Thread(target=self._build_loop, name="output-builder", daemon=True)
            if builder
            else None
        )
        if self._builder is not None:
            self._builder.start()

    # Blocks -----------------------------------------------------------------------------------

    def _alloc(self) -> int:
        # Least recently freed first, like vLLM; but the cache must hold under any recycling
        # order, and taking the block freed last reuses slots while their writes are in flight.
        block = self.free.pop() if self.rng.random() < self.mru_p else self.free.popleft()
        old = self.block_hash.pop(block, None)
        if old is not None and self.hash_block.get(old) == block:
            del self.hash_block[old]
        if self.written[block]:
            self.counts.recycled_blocks += 1
        self.ref[block] = 1
        return block

    def _release(self, blocks: Iterable[int]) -> None:
        for block in blocks:
            self.ref[block] -= 1
            if self.ref[block] == 0:
                self.free.append(block)

    def _hashes(self, prompt: tuple[int, ...]) -> list[tuple[int, ...]]:
        full = len(prompt) // self.block_size
        return [prompt[: (i + 1) * self.block_size] for i in range(full)]

    # One step ---------------------------------------------------------------------------------

    def _end_requests(self) -> list[str]:
        ended = []
        engine = self.engine
        for req in list(self.live):
            state = self.live[req]
            done = engine.reqs[req].computed >= state.total
            if done or self.rng.random() < self.abort_p:
                engine.finish(req, abort=not done)
                self._release(state.blocks)
                del self.live[req]
                ended.append(req)
                if done:
                    self.counts.finishes += 1
                else:
                    self.counts.aborts += 1
        return ended

    def _admit(self, req: str, schedule: dict[str, int]) -> bool:
        rng = self.rng
        family = self.families[rng.randrange(len(self.families))]
        shared = rng.randrange(0, len(family) // self.block_size + 1) * self.block_size
        tail = rng.randint(1, 2 * self.block_size + 1)
        prompt = family[:shared] + tuple(range(self._next_token, self._next_token + tail))
        total = len(prompt) + rng.randint(0, 4)
        hashes = self._hashes(prompt)
        hit: list[int] = []
        for h in hashes[: (len(prompt) - 1) // self.block_size]:
            block = self.hash_block.get(h)
            if block is None:
                break
            hit.append(block)
        needed = -(-total // self.block_size) - len(hit)
        free_for_new = len(self.free) - sum(1 for b in hit if self.ref[b] == 0)
        if needed > free_for_new:
            return False
        self._next_token += tail
        for block in hit:
            if self.ref[block] == 0:
                self.free.remove(block)
            self.ref[block] += 1
        blocks = hit + [self._alloc() for _ in range(needed)]
        hit_end = len(hit) * self.block_size
        self.engine.start(req, blocks, hit_end=hit_end)
        self.live[req] = _Live(prompt, total, blocks, len(hit))
        if hit:
            self.counts.hit_requests += 1
            self.counts.hit_rows += hit_end
            if any(b in self._producing for b in hit):
                self.counts.same_step_hits += 1
        self._schedule_one(req, schedule)
        return True

    def _schedule_one(self, req: str, schedule: dict[str, int]) -> None:
        state = self.live[req]
        computed = self.engine.reqs[req].computed
        if self.rng.random() < self.idle_p:
            count = 0  # in the layout with no rows this step
        elif computed < len(state.prompt):
            count = min(self.rng.randint(1, self.max_chunk), len(state.prompt) - computed)
        else:
            count = 1
        schedule[req] = count
        hashes = self._hashes(state.prompt)
        for i in range(computed // self.block_size, (computed + count) // self.block_size):
            block = state.blocks[i]
            self._producing.add(block)
            if i < len(hashes) and hashes[i] not in self.hash_block:
                self.hash_block[hashes[i]] = block
                self.block_hash[block] = hashes[i]
        for pos in range(computed, computed + count):
            self.written[state.blocks[pos // self.block_size]] = True

    def step(self) -> None:
        """Run one engine step and hand the previous step to the consumer."""
        rng = self.rng
        ended = self._end_requests()
        self._producing: set[int] = set()
        schedule: dict[str, int] = {}
        for req in self.live:
            self._schedule_one(req, schedule)
        while len(self.live) < self.max_running and rng.random() < 0.7:
            if ended and rng.random() < self.reuse_p:
                req = ended.pop()  # HIT-2: finished and admitted again in one step
                self.counts.id_reuses += 1
            else:
                req = f"r{self._next_req}"
                self._next_req += 1
            if not self._admit(req, schedule):
                break
        emit = [key for key in (MM, DEF) if rng.random() >= self.sparse_p]
        if len(emit) < 2:
            self.counts.sparse_steps += 1
        self.engine.begin(schedule)
        saved = self.engine.save(emit=emit)
        self.counts.steps += 1
        subset: list[str] | None = None
        discard = rng.random() < self.discard_p
        if not discard and saved.order and rng.random() < self.subset_p:
            subset = rng.sample(list(saved.order), rng.randint(0, len(saved.order)))
        due = [item for at, item in self._late if at <= self.counts.steps]
        self._late = [(at, item) for at, item in self._late if at > self.counts.steps]
        # Consumed one to `max_lag` steps late, so not always in id order (STEP-1).
        self._late.append(
            (self.counts.steps + rng.randint(1, self.max_lag), (saved, subset, discard))
        )
        for item in due:
            self._consume(item)
        if self.check_pool_every and self.counts.steps % self.check_pool_every == 0:
            self.errors.extend(pool_mismatches(self.engine.m, self.engine.oracle))

    def _consume(self, item: tuple[Saved, list[str] | None, bool]) -> None:
        if self._builder is not None:
            self._queue.put(item)
        else:
            self._run(item)

    def _run(self, item: tuple[Saved, list[str] | None, bool]) -> None:
        saved, subset, discard = item
        engine = self.engine
        try:
            if discard:
                engine.m.discard_step(saved.step_id)
                self.counts.discarded += 1
                return
            out = engine.materialize(saved, subset)
            reqs = saved.order if subset is None else subset
            self.counts.materialized += 1
            self.counts.checked_rows += sum(
                len(rows[r]) for rows in saved.expected.values() for r in reqs
            )
            self.outputs.append((saved.step_id, _plain(out)))
        except BaseException as exc:  # every failure is reported to the test
            self.errors.append(f"step {saved.step_id} (write {saved.write}): {exc!r}")

    def _build_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            self._run(item)

    def close(self) -> None:
        """Consume what is left and stop the builder thread."""
        late, self._late = self._late, []
        for _, item in late:
            self._consume(item)
        if self._builder is not None:
            self._queue.put(None)
            self._builder.join(60)
            assert not self._builder.is_alive(), "the output builder did not stop"
        if self.check_pool_every:
            self.errors.extend(pool_mismatches(self.engine.m, self.engine.oracle))


def _plain(out: StageCacheOutputs) -> dict[str, Any]:
    """A materialized output as nested dicts of lists, for comparing runs."""
    result: dict[str, Any] = {}
    if out.hidden_states is not None:
        result[HIDDEN_KEY] = {r: t.tolist() for r, t in out.hidden_states.items()}
    for key, per_req in out.mm_outputs.items():
        result[key] = {
            r: v.tolist() if isinstance(v, torch.Tensor) else v for r, v in per_req.items()
        }
    return result
