"""A tiny engine and an oracle for testing `OmniPrefixCacheManager` on the CPU.

`Engine` plays a model runner with a paged KV cache: it keeps each request's block table and
computed-token count, sends the step's lifecycle records (started, finished, aborted, preempted,
resumed), builds the write layout from the block tables and saves tensors whose values encode
``(slot, key, write id)``, so a stale, shifted or torn row reads as a different value. A request
started with its tokens gets rows that are a pure function of its token prefix instead, ``(prefix
id, key, position)``: what a model computes, so a recompute after a preemption gives the same
rows, a hit on another request's blocks of the same tokens gives them too, and a recycled block's
old tenant (other tokens) gives different ones.

`Oracle` keeps what the engine last wrote to every (slot, key), written differently from the
library: one dense tensor per key, overwritten in step order, with explicit zeros where a step did
not emit a key (SLOT-4). At every save the engine computes what `materialize` must return for that
step from the oracle *at save time*, so a later (delayed) materialize is checked against the rows
of that moment (HIT-6).

Delivery is modelled apart from the library (SPEC section 12): per admission of a request id the
engine counts positions (DLV-1), keeps the delivery cursor and the unconsumed steps that carry
it, predicts the positions every `materialize` hands out (DLV-2, DLV-4) or its
`DeliveryOrderError` (DLV-5), and checks the returned `positions` (DLV-7), the rows against the
oracle cut to those positions, and for token-bearing requests the rows against the recomputed
value at each position (DLV-6). `Engine.delivery_violations` then checks each admission's whole
life: every position delivered at most once and in order, and every position never delivered
carried only by steps that were discarded or materialized without the request.

`Workload` drives an engine with the simulated scheduler the demo and the soak run too
(`omni_cache_cuda.sim.Scheduler`): prompts share prefixes from a few families, full blocks of the
token sequence are registered in a hash table when they are scheduled, new requests hit the
longest registered prompt prefix, blocks are recycled least-recently-freed first, requests
finish, abort, are preempted (their blocks go back to the free list and stay registered) and
resumed with a new hit, and ids come back. Nothing here decides a rule of the library; the
helpers only feed inputs and remember what was written.
"""

from __future__ import annotations

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

from omni_cache_core import TaskState
from omni_cache_cuda import (
    HIDDEN_KEY,
    CacheStats,
    DeliveryOrderError,
    HostAllocationError,
    ModelCachePolicy,
    OmniPrefixCacheManager,
    OmniPrefixCacheUnmatchError,
    PrefixCacheConfig,
    PrefixCacheEventKind,
    PrefixCacheRequestEvent,
    PrefixCacheStep,
    PrefixCacheWriteLayout,
    StageCacheOutputs,
    StagingCopyError,
    UnknownStepError,
)
from omni_cache_cuda.sim import Knobs, RecordQueue, Scheduler, SchedulerCounts

__all__ = [
    "BLOCK",
    "DEF",
    "MM",
    "WIDE",
    "Admission",
    "Carry",
    "Engine",
    "Oracle",
    "Saved",
    "Workload",
    "assert_rows",
    "config",
    "encode",
    "encode_content",
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
        states = manager._state.core.task_states().values()
        return all(state is TaskState.PENDING for state in states)

    assert wait_for(idle, timeout_s), "writes still in flight"
    return manager.stats()


def pool_mismatches(manager: OmniPrefixCacheManager, oracle: Oracle) -> list[str]:
    """Name every COMMITTED (slot, key) whose pool row differs from the engine's last write.

    Reads the core's occupancy and the pool under the state lock (a test-only peek): in-flight
    writes touch only slots they own, so the committed rows cannot change meanwhile.
    """
    bad: list[str] = []
    with manager._state.lock:
        manager._state.drain(raise_fatal=False)
        core = manager._state.core
        for key in core.installed_keys:
            owners = core.slot_owners(key)
            assert owners is not None
            committed = torch.from_numpy(np.flatnonzero(owners == 0))
            if not len(committed):
                continue
            pool = manager._state.pool.tensors[key][committed]
            want = oracle.rows[key][committed].reshape(len(committed), -1)
            wrong = (pool != want).any(dim=1)
            if wrong.any():
                bad.append(f"pool rows of {key} at slots {committed[wrong].tolist()[:8]}")
    return bad


def _encode(key: str, first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """Rows whose values spell out (first, key, second) per row, mixed in the later columns."""
    features, dtype = ROW_SHAPES.get(key, ((3,), torch.float32))
    width = math.prod(features)
    a = first.to(torch.float64)[:, None]
    b = second.to(torch.float64)[:, None]
    cols = torch.arange(width, dtype=torch.float64)[None, :]
    # Column 0 is `first`, 1 the key, 2 `second`; later columns mix all three so a row
    # stitched from two writes cannot match either.
    rows = a * 7 + b * 3 + cols * 11 + _KEY_CODES.get(key, 4) * 1000
    rows[:, 0:1] = a
    rows[:, 1] = _KEY_CODES.get(key, 4)
    if width > 2:
        rows[:, 2:3] = b
    return rows.to(dtype).reshape(len(first), *features)


def encode(key: str, slots: torch.Tensor, write: int) -> torch.Tensor:
    """Rows for ``slots`` whose values spell out (slot, key, write id) in every element."""
    return _encode(key, slots, torch.full((len(slots),), write, dtype=torch.int64))


def encode_content(key: str, prefix_ids: Sequence[int], start: int) -> torch.Tensor:
    """The rows a model computes at positions ``start, start + 1, ...`` (one per prefix id).

    ``prefix_ids[i]`` names the token prefix that ends at position ``start + i``
    (`Engine.prefix_ids`), so the value depends only on the tokens up to that position.
    """
    ids = torch.tensor(list(prefix_ids), dtype=torch.int64)
    return _encode(key, ids, torch.arange(start, start + len(ids), dtype=torch.int64))


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


@attrs.define(eq=False)
class Admission:
    """One admission of a request id (LIFE-1) as the engine's model of delivery sees it.

    Attributes:
        serial: Admissions are numbered in the order they start.
        req: The request id.
        prefix_ids: Per position, the id of the token prefix ending there, when the request
            was started with its tokens (its rows are then a pure function of them); else None.
        position: The next position a save gives the request (DLV-1).
        state: ``"running"``, ``"preempted"`` or ``"ended"``.
        cursor: Every position below it was handed out or passed over (DLV-2, DLV-4).
        top: One past the highest position any step carried for it.
        open: Unconsumed step id -> the positions ``(lo, hi)`` it carries for the admission.
        delivered: The ``(start, end)`` each materialize handed out, when not empty.
        dropped: The ``(lo, hi)`` of steps discarded or materialized without the request.
        external: A step of it was consumed behind the engine's back (a test calling the
            manager directly): its later positions are taken from the cache, not predicted.
    """

    serial: int
    req: str
    prefix_ids: tuple[int, ...] | None
    position: int
    state: str = "running"
    cursor: int = 0
    top: int = 0
    open: dict[int, tuple[int, int]] = attrs.Factory(dict)
    delivered: list[tuple[int, int]] = attrs.Factory(list)
    dropped: list[tuple[int, int]] = attrs.Factory(list)
    external: bool = False
    _recomputed: dict[str, torch.Tensor] = attrs.Factory(dict)

    def recomputed(self, key: str) -> torch.Tensor:
        """The rows a full recompute gives for `key` at every position (DLV-6)."""
        rows = self._recomputed.get(key)
        if rows is None:
            assert self.prefix_ids is not None, f"{self.req} was started without tokens"
            rows = self._recomputed[key] = encode_content(key, self.prefix_ids, 0)
        return rows


@attrs.frozen
class Carry:
    """What one saved step carries for one admission.

    Attributes:
        admission: The admission.
        lo: The first position the step carries (its hit rows, on the step that registered
            a hit, else its own rows). On a resume step 0: the cache reads its hit from the
            block of the cursor on (DLV-3), which is at or below the cursor whenever the step
            is consumed, so the delivered positions are the same.
        own: The first position of the step's own rows (after its hit rows).
        hi: One past the last position. The step's expected rows cover ``[lo, hi)``.
    """

    admission: Admission
    lo: int
    own: int
    hi: int


@attrs.define
class DeliveryCounts:
    """What the engine's delivery model saw (SPEC section 12)."""

    materialized: int = 0
    discarded: int = 0
    refused: int = 0  # DLV-5 refusals, each predicted by the model
    left_out: int = 0  # requests of a materialized step not asked for (DLV-4)
    delivered: int = 0  # positions handed out
    cut: int = 0  # rows a step computed below the cursor, not handed out again (DLV-2)
    passed_over: int = 0  # positions passed over by a step above the cursor (DLV-4)
    empty: int = 0  # requests handed nothing new by a materialize
    recomputed_checked: int = 0  # rows compared with the recomputed value (DLV-6)
    external: int = 0  # steps consumed behind the engine's back


@attrs.frozen(kw_only=True)
class Saved:
    """A saved step and what its materialize must return.

    Attributes:
        step_id: The id `save_outputs` returned.
        order: The step's requests in batch order.
        expected: Cached key -> request -> rows of every position the step carries (hit
            prefix, then this step's rows); a materialize returns their tail from the first
            position not delivered yet (DLV-2).
        unreadable: Requests whose hidden hit cannot be served (HIT-4).
        rows: This step's rows per emitted cached key, ``[:n]``.
        slots: The step's slot per row.
        spans: Request -> its row range in the step.
        write: The write id the step's values encode.
        carry: Request -> the positions the step carries for its admission (requests the
            engine did not start itself are missing).
    """

    step_id: int
    order: tuple[str, ...]
    expected: dict[str, dict[str, torch.Tensor]]
    unreadable: frozenset[str]
    rows: dict[str, torch.Tensor]
    slots: torch.Tensor
    spans: dict[str, tuple[int, int]]
    write: int
    carry: dict[str, Carry] = attrs.Factory(dict)


@attrs.define
class _Request:
    blocks: list[int]
    computed: int


@attrs.frozen
class _Plan:
    """The model's prediction for one materialize."""

    positions: dict[str, tuple[int, int]]
    #: The refusal due when a request would get new rows (request, earlier step, owed).
    refusal: tuple[str, int, tuple[int, int]] | None
    #: The refusal due when one counts requests that would only move their cursor too.
    moving_refusal: tuple[str, int, tuple[int, int]] | None
    hold: frozenset[str]  # requests whose cursor must not move if nothing is refused
    certain: bool  # False when a request is not tracked: any outcome is accepted


_ENDS = (PrefixCacheEventKind.FINISHED, PrefixCacheEventKind.ABORTED)


class Engine(RecordQueue):
    """A model runner in miniature: block tables, lifecycle records, layouts and saved tensors.

    Use `start`, `finish`, `preempt` and `resume` to queue lifecycle records, then `step` (or
    `begin` and `save`) to run a step, then `materialize` or `discard` to consume it:
    `materialize` predicts the delivered positions (or the refusal), checks them and every
    returned row. Consuming may happen on another thread than the engine's.
    """

    def __init__(self, manager: OmniPrefixCacheManager) -> None:
        super().__init__()
        self.m = manager
        self.block_size = manager.config.block_size
        self.oracle = Oracle(manager.config.num_slots)
        self.caches_hidden = manager.policy.needs_full_hidden_states
        self.reqs: dict[str, _Request] = {}
        self._pending_hits: dict[str, torch.Tensor] = {}
        self._hits: dict[str, torch.Tensor] = {}
        self._schedule: dict[str, int] = {}
        self.writes = 0
        # Like a model runner, the engine refills one CPU slot-mapping buffer every step and
        # hands the cache a view of it; it scribbles over it right after each save (STEP-3).
        self.slot_buffer = torch.zeros(manager.config.num_slots * 2, dtype=torch.int64)
        # The delivery model, shared by the engine thread and a consumer thread.
        self._model = threading.Lock()
        self.admissions: dict[str, Admission] = {}  # live ones: running or preempted
        self.history: list[Admission] = []
        self._latest: dict[str, Admission] = {}  # the latest admission of each id
        self.delivery = DeliveryCounts()
        #: Odd while a consume is running: a reader that sees the same even value before and
        #: after a look at the cursors saw the cursors the cache had meanwhile.
        self.consume_seq = 0
        self._tokens: dict[str, tuple[int, ...]] = {}
        self._marks: set[str] = set()  # requests whose next save carries positions from 0
        self._prefixes: dict[tuple[int, int], int] = {}

    # Tokens -----------------------------------------------------------------------------------

    def prefix_ids(self, tokens: Sequence[int]) -> tuple[int, ...]:
        """Per position, an id of the token prefix ending there: equal prefixes, equal ids."""
        ids: list[int] = []
        table = self._prefixes
        parent = 0
        for token in tokens:
            key = (parent, token)
            parent = table.get(key, 0)
            if not parent:
                parent = table[key] = len(table) + 1
            ids.append(parent)
        return tuple(ids)

    # Lifecycle records ------------------------------------------------------------------------

    def _hit_slots(self, blocks: Sequence[int], hit_end: int) -> torch.Tensor:
        hit_blocks = torch.tensor(list(blocks[: hit_end // self.block_size]), dtype=torch.int64)
        return (hit_blocks[:, None] * self.block_size + torch.arange(self.block_size)).reshape(-1)

    def start(
        self,
        req: str,
        blocks: Sequence[int],
        *,
        hit_end: int = 0,
        tokens: Sequence[int] | None = None,
    ) -> None:
        """Queue a STARTED record; a request already live is a continuation with no hit (HIT-1).

        With ``tokens`` (the whole sequence the request will compute) its rows are the values a
        model computes from them (`encode_content`) and checked against those (DLV-6).
        """
        super().start(req, blocks, hit_end=hit_end)
        if req in self.reqs:
            self.reqs[req].blocks = list(blocks)
            return
        self.reqs[req] = _Request(list(blocks), hit_end)
        if tokens is not None:
            self._tokens[req] = tuple(tokens)
        if hit_end:
            self._pending_hits[req] = self._hit_slots(blocks, hit_end)

    def finish(self, req: str, *, abort: bool = False) -> None:
        """Queue a FINISHED (or ABORTED) record; the request leaves the engine at once (HIT-2)."""
        super().finish(req, abort=abort)
        self.reqs.pop(req, None)
        self._pending_hits.pop(req, None)

    def preempt(self, req: str) -> None:
        """Queue a PREEMPTED record: the request's blocks are gone until it resumes (LIFE-3)."""
        super().preempt(req)
        self.reqs.pop(req, None)
        self._pending_hits.pop(req, None)

    def resume(self, req: str, blocks: Sequence[int], *, hit_end: int = 0) -> None:
        """Queue a RESUMED record: the request computes again from ``hit_end`` (LIFE-4)."""
        super().resume(req, blocks, hit_end=hit_end)
        self.reqs[req] = _Request(list(blocks), hit_end)
        if hit_end:
            self._pending_hits[req] = self._hit_slots(blocks, hit_end)

    def rewind(self, req: str, computed: int, blocks: Sequence[int] | None = None) -> None:
        """Move a live request's slots back (it recomputes rows), maybe on new blocks.

        The cache is not told: its positions go on counting (DLV-1).
        """
        self.reqs[req].computed = computed
        if blocks is not None:
            self.reqs[req].blocks = list(blocks)

    # Steps ------------------------------------------------------------------------------------

    def begin(self, schedule: Mapping[str, int]) -> None:
        """Send the queued records and the scheduled counts (`new_step_starts`)."""
        events = self.events
        step = PrefixCacheStep(events=list(events), scheduled_tokens=dict(schedule))
        self.events = []
        self._hits, self._pending_hits = self._pending_hits, {}
        self._schedule = dict(schedule)
        self.m.new_step_starts(step)
        self._apply_records(events)

    def _apply_records(self, events: Sequence[PrefixCacheRequestEvent]) -> None:
        """The model's side of a step's records: ends and preemptions first (LIFE-2)."""
        marks: set[str] = set()
        with self._model:
            for event in events:
                if event.kind in _ENDS:
                    ended = self.admissions.pop(event.req_id, None)
                    if ended is not None:
                        ended.state = "ended"
                elif event.kind is PrefixCacheEventKind.PREEMPTED:
                    preempted = self.admissions.get(event.req_id)
                    if preempted is not None:
                        preempted.state = "preempted"
            for event in events:
                req = event.req_id
                if event.kind is PrefixCacheEventKind.STARTED:
                    tokens = self._tokens.pop(req, None)
                    if req in self.admissions:
                        continue  # a continuation (HIT-1)
                    admission = Admission(
                        serial=len(self.history),
                        req=req,
                        prefix_ids=None if tokens is None else self.prefix_ids(tokens),
                        position=event.hit_end,
                    )
                    self.admissions[req] = admission
                    self._latest[req] = admission
                    self.history.append(admission)
                    if event.hit_end:
                        marks.add(req)
                elif event.kind is PrefixCacheEventKind.RESUMED:
                    resumed = self.admissions.get(req)
                    if resumed is not None:
                        resumed.state = "running"
                        resumed.position = event.hit_end
                        marks.add(req)
        self._marks = marks

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

    def _rows(self, key: str, slots: torch.Tensor, write: int) -> torch.Tensor:
        """The step's rows of `key`: what a model computes from the tokens of requests started
        with them (`encode_content`), else values that spell (slot, key, write)."""
        parts: list[torch.Tensor] = []
        row = 0
        for req, count in self._schedule.items():
            admission = self.admissions.get(req)
            if admission is None or admission.prefix_ids is None:
                part = encode(key, slots[row : row + count], write)
            else:
                at = self.reqs[req].computed
                part = admission.recomputed(key)[at : at + count]
                assert len(part) == count, f"{req}: no tokens beyond position {at + len(part)}"
            parts.append(part)
            row += count
        if len(parts) == 1:
            return parts[0].clone()
        return torch.cat(parts) if parts else encode(key, slots, write)

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
        rows = {key: self._rows(key, slots, write) for key in (HIDDEN_KEY, *emit)}

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
        carry: dict[str, Carry] = {}
        with self._model:
            for req, (start, end) in spans.items():
                admission = self.admissions.get(req)
                if admission is None:
                    continue  # started behind the engine's back: not tracked
                before = admission.position
                hi = before + end - start
                lo = 0 if req in self._marks else before
                admission.position = hi
                admission.top = max(admission.top, hi)
                admission.open[step_id] = (lo, hi)
                carry[req] = Carry(admission, lo, before, hi)
        self._marks = set()
        return Saved(
            step_id=step_id,
            order=tuple(spans),
            expected=expected,
            unreadable=frozenset(unreadable),
            rows=cached,
            slots=slots,
            spans=spans,
            write=write,
            carry=carry,
        )

    def step(self, schedule: Mapping[str, int], **save_args: Any) -> Saved:
        """Run one whole step: `begin` then `save`."""
        self.begin(schedule)
        return self.save(**save_args)

    # Consuming --------------------------------------------------------------------------------

    def cursor(self, req: str) -> int | None:
        """The model's delivery cursor of the request's live admission (None if not live)."""
        with self._model:
            admission = self.admissions.get(req)
            return None if admission is None else admission.cursor

    def open_steps_of(self, req: str) -> int:
        """How many steps of the request id's latest admission are still open."""
        with self._model:
            admission = self._latest.get(req)
            return 0 if admission is None else len(admission.open)

    def _core_open_steps(self) -> set[int]:
        """The step ids the cache still holds open (a test-only peek under its state lock)."""
        with self.m._state.lock:
            return set(self.m._state.core.unended_step_ids())

    def _plan(self, saved: Saved, reqs: Sequence[str]) -> _Plan:
        """Predict what materializing ``reqs`` of ``saved`` hands out (DLV-2, DLV-4, DLV-5).

        Each request gets ``[max(lo, d), max(hi, d))`` and its cursor moves to ``max(hi, d)``.
        The materialize is refused when it would hand a request new rows while an earlier open
        step of the same admission still owes it positions at or above ``d`` (rows come out in
        save order); the error names the earliest such step, the first request (in the order
        asked) it holds back, and the positions it owes.

        A request with no rows in the step, above its cursor, gets nothing new but would move
        its cursor past positions an earlier step owes. Whether that refuses the materialize or
        leaves the cursor where it is, both keep every position deliverable and are accepted;
        passing those positions over is not (the later materialize of the earlier step then
        hands them out, and the cache would not).
        """
        positions: dict[str, tuple[int, int]] = {}
        certain = True
        new: list[Carry] = []  # requests that get new rows
        moving: list[Carry] = []  # requests whose cursor would move
        with self._model:
            for req in reqs:
                carry = saved.carry.get(req)
                if carry is None or carry.admission.external:
                    certain = False
                    continue
                cursor = carry.admission.cursor
                start = max(carry.lo, cursor)
                positions[req] = (start, max(carry.hi, start))
                if carry.hi > cursor:
                    moving.append(carry)
                    if carry.hi > start:
                        new.append(carry)
            if self._blockers(saved.step_id, moving):
                self._forget_external(self._core_open_steps())
                if any(carry.admission.external for carry in moving):
                    certain = False
            refusal = self._refusal(saved.step_id, new)
            moving_refusal = self._refusal(saved.step_id, moving)
            hold = frozenset(
                carry.admission.req
                for carry in moving
                if carry not in new and self._blockers(saved.step_id, [carry])
            )
        return _Plan(positions, refusal, moving_refusal, hold, certain)

    def _refusal(
        self, step_id: int, carries: Sequence[Carry]
    ) -> tuple[str, int, tuple[int, int]] | None:
        blockers = self._blockers(step_id, carries)
        if not blockers:
            return None
        earliest = min(blockers)
        carry, owed = blockers[earliest]
        return (carry.admission.req, earliest, owed)

    @staticmethod
    def _blockers(
        step_id: int, carries: Sequence[Carry]
    ) -> dict[int, tuple[Carry, tuple[int, int]]]:
        """Earlier open step -> the first of `carries` it owes positions, and those (DLV-5)."""
        blockers: dict[int, tuple[Carry, tuple[int, int]]] = {}
        for carry in carries:
            cursor = carry.admission.cursor
            for other, (lo, hi) in carry.admission.open.items():
                if other < step_id and hi > max(lo, cursor) and other not in blockers:
                    blockers[other] = (carry, (max(lo, cursor), hi))
        return blockers

    def _forget_external(self, core_open: set[int]) -> None:
        """Steps the model holds open that the cache ended were consumed behind its back."""
        for admission in self.admissions.values():
            gone = [step_id for step_id in admission.open if step_id not in core_open]
            for step_id in gone:
                del admission.open[step_id]
                admission.external = True
                self.delivery.external += 1

    def _end(
        self,
        saved: Saved,
        positions: Mapping[str, tuple[int, int]] | None,
        *,
        hold: frozenset[str] = frozenset(),
    ) -> None:
        """The model's side of a consume: cursors move (not those in `hold`), the step is no
        longer open."""
        counts = self.delivery
        with self._model:
            for req in saved.order:
                carry = saved.carry.get(req)
                if carry is None:
                    continue
                admission = carry.admission
                admission.open.pop(saved.step_id, None)
                if req in hold:
                    continue  # nothing new, and the positions it passes are owed
                if positions is not None and req in positions:
                    start, end = positions[req]
                    counts.passed_over += max(0, carry.lo - admission.cursor)
                    if end > start:
                        admission.delivered.append((start, end))
                        counts.delivered += end - start
                    else:
                        counts.empty += 1
                    counts.cut += max(0, min(start, carry.hi) - carry.own)
                    admission.cursor = max(admission.cursor, carry.hi)
                else:
                    if positions is not None:
                        counts.left_out += 1
                    if carry.hi > carry.lo:
                        admission.dropped.append((carry.lo, carry.hi))

    def discard(self, saved: Saved) -> None:
        """Discard a saved step: not delivery, no cursor moves (DLV-4)."""
        self.consume_seq += 1
        try:
            self.m.discard_step(saved.step_id)
            self._end(saved, None)
            self.delivery.discarded += 1
        finally:
            self.consume_seq += 1

    def check(
        self,
        out: StageCacheOutputs,
        saved: Saved,
        req_ids: Sequence[str] | None = None,
        *,
        leftover: Iterable[str] = (),
        positions: Mapping[str, tuple[int, int]] | None = None,
    ) -> None:
        """Assert ``out`` holds exactly the expected rows of the requested requests.

        ``positions`` are the predicted delivered positions (DLV-7); each request's rows are the
        tail of its expected rows from its delivered start (DLV-2), and rows of a request with
        tokens equal the recomputed values at their positions (DLV-6).
        """
        reqs = list(saved.order if req_ids is None else req_ids)
        assert set(out.positions) == set(reqs), f"positions for {sorted(out.positions)}"
        got = {req: tuple(out.positions[req]) for req in reqs}
        for req, (start, end) in got.items():
            carry = saved.carry.get(req)
            if positions is not None and req in positions:
                assert got[req] == positions[req], (
                    f"step {saved.step_id}: {req} got positions {got[req]}, "
                    f"expected {positions[req]}"
                )
            if carry is not None and end > start:
                assert end == carry.hi and start >= carry.lo, (req, got[req], carry.lo, carry.hi)

        def want(key: str, req: str) -> torch.Tensor:
            rows = saved.expected[key][req]
            start, end = got[req]
            return rows[len(rows) - (end - start) :]

        hidden = saved.expected.get(HIDDEN_KEY)
        if hidden is None:
            assert out.hidden_states is None or not saved.rows, "hidden returned though not cached"
        else:
            assert out.hidden_states is not None, "hidden states missing"
            assert set(out.hidden_states) == set(reqs), sorted(out.hidden_states)
            for req in reqs:
                assert_rows(out.hidden_states[req], want(HIDDEN_KEY, req), f"hidden of {req}")
        mm_keys = {k for k in saved.expected if k != HIDDEN_KEY}
        assert set(out.mm_outputs) == mm_keys | set(leftover), sorted(out.mm_outputs)
        for key in mm_keys:
            assert set(out.mm_outputs[key]) == set(reqs), (key, sorted(out.mm_outputs[key]))
            for req in reqs:
                assert_rows(out.mm_outputs[key][req], want(key, req), f"{key} of {req}")
        for req in reqs:
            carry = saved.carry.get(req)
            if carry is not None and carry.admission.prefix_ids is not None:
                self._check_recomputed(out, carry.admission, req, *got[req], mm_keys)

    def _check_recomputed(
        self,
        out: StageCacheOutputs,
        admission: Admission,
        req: str,
        start: int,
        end: int,
        mm_keys: Iterable[str],
    ) -> None:
        """DLV-6: each delivered row is what a full recompute gives at its position.

        Hidden rows exactly; an mm row is that value or zeros (a sparse key its writer's step
        did not emit, SLOT-4).
        """
        if out.hidden_states is not None:
            assert_rows(
                out.hidden_states[req],
                admission.recomputed(HIDDEN_KEY)[start:end],
                f"recomputed hidden of {req} at {start}..{end}",
            )
        for key in mm_keys:
            got = out.mm_outputs[key][req]
            recomputed = admission.recomputed(key)[start:end]
            if torch.equal(got, recomputed):
                continue
            ok = (got == recomputed).flatten(1).all(dim=1) | (got == 0).flatten(1).all(dim=1)
            assert bool(ok.all()), f"{key} of {req} at {start}..{end}: not the recomputed rows"
        self.delivery.recomputed_checked += end - start

    def materialize(
        self, saved: Saved, req_ids: Sequence[str] | None = None, **check_args: Any
    ) -> StageCacheOutputs:
        """Materialize a saved step and check the positions and every returned row.

        Raises what the cache raises: a `DeliveryOrderError` only where the model predicted
        one, naming the same request, earlier step and owed positions (DLV-5).
        """
        reqs = list(saved.order if req_ids is None else req_ids)
        plan = self._plan(saved, reqs)
        self.consume_seq += 1
        try:
            try:
                out = self.m.materialize(saved.step_id, reqs)
            except DeliveryOrderError as exc:
                if plan.certain:
                    allowed = {plan.refusal, plan.moving_refusal} - {None}
                    got = (exc.req_id, exc.earlier_step_id, exc.gap)
                    assert got in allowed, f"step {saved.step_id}: {exc!r}, expected {allowed}"
                    assert exc.step_id == saved.step_id
                self.delivery.refused += 1
                raise
            except UnknownStepError:
                raise  # nothing changed (STEP-2)
            except OmniPrefixCacheUnmatchError:
                self._end(saved, None)  # consumed without delivery (STEP-4, HIT-4)
                raise
            if plan.certain:
                assert plan.refusal is None, (
                    f"step {saved.step_id}: expected DeliveryOrderError {plan.refusal}"
                )
            positions = dict(plan.positions)
            for req in reqs:
                positions.setdefault(req, tuple(out.positions[req]))  # untracked
            self._end(saved, positions, hold=plan.hold)
            self.delivery.materialized += 1
        finally:
            self.consume_seq += 1
        self.check(out, saved, reqs, positions=plan.positions, **check_args)
        return out

    def delivery_violations(self) -> list[str]:
        """Check every admission's whole life once all its steps are consumed (DLV-2, DLV-4).

        Each position was delivered at most once and in position order; a position never
        delivered was carried by a step that was discarded or materialized without the request;
        an admission none of whose steps was dropped got every position from 0 to its highest.
        """
        bad: list[str] = []
        with self._model:
            for admission in self.history:
                name = f"{admission.req}#{admission.serial}"
                if admission.open:
                    bad.append(f"{name}: steps {sorted(admission.open)} never consumed")
                if admission.external:
                    continue
                last = 0
                seen = np.zeros(admission.top, dtype=np.int64)
                for start, end in admission.delivered:
                    if start < last:
                        bad.append(f"{name}: {start, end} delivered after position {last}")
                    last = end
                    seen[start:end] += 1
                if (seen > 1).any():
                    bad.append(f"{name}: positions {np.flatnonzero(seen > 1)[:8]} twice")
                dropped = np.zeros(admission.top, dtype=bool)
                for lo, hi in admission.dropped:
                    dropped[lo:hi] = True
                missing = np.flatnonzero((seen == 0) & ~dropped)
                if len(missing):
                    bad.append(f"{name}: positions {missing[:8].tolist()} never delivered")
        return bad

    def lost_and_recovered(self) -> tuple[int, int]:
        """Positions never delivered, and positions of dropped steps delivered later (DLV-4)."""
        lost = recovered = 0
        with self._model:
            for admission in self.history:
                seen = np.zeros(admission.top, dtype=bool)
                for start, end in admission.delivered:
                    seen[start:end] = True
                dropped = np.zeros(admission.top, dtype=bool)
                for lo, hi in admission.dropped:
                    dropped[lo:hi] = True
                lost += int((~seen).sum())
                recovered += int((seen & dropped).sum())
        return lost, recovered


# ---------------------------------------------------------------------------------------------
# A scheduler with prefix caching, for long randomized runs.


@attrs.define
class WorkloadCounts(SchedulerCounts):
    """What a workload exercised, so a run can prove it covered the interesting cases.

    The scheduler's counts (`SchedulerCounts`: hits, ends, preemptions, resumes, recycled
    blocks, ...) plus what the engine side and the consumer saw.
    """

    steps: int = 0
    materialized: int = 0
    discarded: int = 0
    checked_rows: int = 0
    sparse_steps: int = 0
    #: Resumes by their hit against what was delivered when the cache applied the record:
    #: no hit, a hit below, at and above the delivery cursor (DLV-3), and resumes during which
    #: a consume ran (the cursor the cache saw is then not known exactly).
    resume_zero: int = 0
    resume_below: int = 0
    resume_equal: int = 0
    resume_above: int = 0
    resume_unclassified: int = 0
    #: Ids started again while a step of their previous admission was still open (LIFE-1).
    reuses_with_open_steps: int = 0
    #: Materializes refused for a gap an earlier unconsumed step carries (DLV-5), retried later.
    refusals: int = 0


_Item = tuple[Saved, list[str] | None, bool]


class _Records:
    """The scheduler's lifecycle records, queued on the engine; counts ids reused while a step of
    their previous admission is still open (LIFE-1)."""

    def __init__(self, engine: Engine, counts: WorkloadCounts) -> None:
        self.engine = engine
        self.counts = counts

    def start(
        self,
        req: str,
        blocks: Sequence[int],
        *,
        hit_end: int = 0,
        tokens: Sequence[int] | None = None,
    ) -> None:
        self.counts.reuses_with_open_steps += self.engine.open_steps_of(req) > 0
        self.engine.start(req, blocks, hit_end=hit_end, tokens=tokens)

    def finish(self, req: str, *, abort: bool = False) -> None:
        self.engine.finish(req, abort=abort)

    def preempt(self, req: str) -> None:
        self.engine.preempt(req)

    def resume(self, req: str, blocks: Sequence[int], *, hit_end: int = 0) -> None:
        self.engine.resume(req, blocks, hit_end=hit_end)


class Workload:
    """Drive an engine with the simulated vLLM-style scheduler (`omni_cache_cuda.sim`).

    Every step the scheduler (`Scheduler.plan`, its chances set by the keyword arguments of the
    same names as `Knobs`) finishes requests that are done and aborts a few at random; preempts
    running requests at random (``preempt_p``) and ends some preempted ones
    (``end_preempted_p``); schedules a prefill chunk or one decode token for each running
    request, now and then none; resumes preempted requests (``resume_p``) with the longest
    registered prefix of the tokens they know as their hit, or (``cut_hit_p``) a random shorter
    one, or (``aim_hit_p``) one ending where the builder has delivered, so resume hits fall
    below, at and above the delivery cursor; admits new requests, which hit the longest
    registered prefix of their full prompt blocks (also blocks another request computes in this
    very step, HIT-5); registers every full block a chunk computes (generated tokens too, so a
    resume can hit beyond the prompt). New blocks come from the free list's oldest end like vLLM,
    or (``mru_p``) its newest end, which reuses slots whose writes or delayed reads are still
    pending. The workload emits `MM` and `DEF` on most steps only (sparse keys, SLOT-4). Each
    request carries its whole token sequence, so its rows are functions of its token prefix.

    Each saved step is consumed one to ``max_lag`` steps late, on a builder thread when
    ``builder`` is set, by `materialize` (a random subset of its requests at times) or
    `discard_step`, and checked against the oracle and the engine's delivery model. A
    materialize refused with `DeliveryOrderError` changes nothing: the builder keeps the step
    and tries it again after consuming another (the earlier step it waits for arrives within
    ``max_lag`` steps). Every ``check_pool_every`` steps the committed pool rows are compared with
    the oracle too; `close` checks every admission's delivered positions.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        seed: int,
        max_running: int = 4,
        max_chunk: int = 6,
        max_decode: int = 4,
        families: int = 3,
        abort_p: float = 0.04,
        reuse_p: float = 0.1,
        sparse_p: float = 0.12,
        discard_p: float = 0.08,
        subset_p: float = 0.15,
        idle_p: float = 0.04,
        preempt_p: float = 0.0,
        resume_p: float = 0.5,
        end_preempted_p: float = 0.0,
        cut_hit_p: float = 0.0,
        aim_hit_p: float = 0.0,
        max_lag: int = 1,
        mru_p: float = 0.5,
        check_pool_every: int = 0,
        builder: bool = True,
    ) -> None:
        self.engine = engine
        self.rng = random.Random(seed)
        self.sparse_p = sparse_p
        self.discard_p = discard_p
        self.subset_p = subset_p
        self.max_lag = max_lag
        self.check_pool_every = check_pool_every
        self.counts = WorkloadCounts()
        knobs = Knobs(
            max_running=max_running,
            max_chunk=max_chunk,
            max_decode=max_decode,
            families=families,
            abort_p=abort_p,
            reuse_p=reuse_p,
            idle_p=idle_p,
            preempt_p=preempt_p,
            resume_p=resume_p,
            end_preempted_p=end_preempted_p,
            cut_hit_p=cut_hit_p,
            aim_hit_p=aim_hit_p,
            mru_p=mru_p,
        )
        self.scheduler = Scheduler(
            engine.m.config.num_blocks,
            engine.block_size,
            _Records(engine, self.counts),
            rng=self.rng,
            knobs=knobs,
            counts=self.counts,
            aim=self._delivered,
        )
        self.errors: list[str] = []
        #: Saves that failed with no trace (a fault: D19); their steps' requests were aborted.
        self.failed_saves: list[BaseException] = []
        self.outputs: list[tuple[int, dict[str, Any]]] = []
        # Saved steps waiting to be consumed, each with the step count at which it is due.
        self._late: list[tuple[int, _Item]] = []
        # Steps the consumer was handed and has not consumed (refused for now), oldest first.
        self._backlog: list[_Item] = []
        self._queue: queue.Queue[_Item | None] = queue.Queue()
        self._builder = (
            threading.Thread(target=self._build_loop, name="output-builder", daemon=True)
            if builder
            else None
        )
        if self._builder is not None:
            self._builder.start()

    def _delivered(self, req: str) -> int:
        """Where the builder has delivered the request, once it consumed what it was handed (an
        engine that knows its consumer's progress); a cursor inside a block gives a hit below it."""
        self._wait_for_builder()
        return self.engine.cursor(req) or 0

    # One step ---------------------------------------------------------------------------------

    def step(self) -> None:
        """Run one engine step and hand the steps that are due to the consumer."""
        rng = self.rng
        engine = self.engine
        plan = self.scheduler.plan()
        schedule, resumed = plan.schedule, list(plan.resumed)
        emit = [key for key in (MM, DEF) if rng.random() >= self.sparse_p]
        if len(emit) < 2:
            self.counts.sparse_steps += 1
        seq = engine.consume_seq
        cursors = [engine.cursor(req) for req, _ in resumed]
        engine.begin(schedule)
        if resumed:
            exact = seq % 2 == 0 and cursors == [engine.cursor(req) for req, _ in resumed]
            self._classify(resumed, cursors, exact and engine.consume_seq == seq)
        try:
            saved = engine.save(emit=emit)
        except (StagingCopyError, HostAllocationError) as exc:
            # A save failed with no trace (STEP-5): as after a failed forward, publish none of
            # the step's blocks and abort its requests (D6, D10).
            self.failed_saves.append(exc)
            self.scheduler.fail(schedule)
            return
        self.scheduler.commit(schedule)
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
            self.errors.extend(pool_mismatches(engine.m, engine.oracle))

    def _classify(
        self, resumed: list[tuple[str, int]], cursors: list[int | None], exact: bool
    ) -> None:
        """Count each resume's hit against the cursor the cache had when it applied it."""
        counts = self.counts
        for (_, hit_end), cursor in zip(resumed, cursors, strict=True):
            if not exact or cursor is None:
                counts.resume_unclassified += 1
            elif hit_end == 0:
                counts.resume_zero += 1
            elif hit_end < cursor:
                counts.resume_below += 1
            elif hit_end == cursor:
                counts.resume_equal += 1
            else:
                counts.resume_above += 1

    # Consuming --------------------------------------------------------------------------------

    def _wait_for_builder(self) -> None:
        """Wait until the builder thread consumed (or holds back) every step it was handed."""
        if self._builder is not None:
            assert wait_for(lambda: self._queue.unfinished_tasks == 0), "the builder is stuck"

    def _consume(self, item: _Item) -> None:
        if self._builder is not None:
            self._queue.put(item)
        else:
            self._take(item)

    def _take(self, item: _Item) -> None:
        """Consume a step, and every step a refusal held back that can go now (DLV-5)."""
        backlog = self._backlog
        backlog.append(item)
        at = 0
        while at < len(backlog):
            if self._run(backlog[at]):
                del backlog[at]
                at = 0  # an earlier refused step may go now
            else:
                at += 1

    def _run(self, item: _Item) -> bool:
        """Consume one step; False when the cache refused it for now (DLV-5)."""
        saved, subset, discard = item
        engine = self.engine
        try:
            if discard:
                engine.discard(saved)
                self.counts.discarded += 1
                return True
            out = engine.materialize(saved, subset)
        except DeliveryOrderError:
            self.counts.refusals += 1  # nothing changed: try again after another step
            return False
        except BaseException as exc:  # every failure is reported to the test
            self.errors.append(f"step {saved.step_id} (write {saved.write}): {exc!r}")
            return True
        self.counts.materialized += 1
        keys = len(out.mm_outputs) + (out.hidden_states is not None)
        self.counts.checked_rows += keys * sum(end - start for start, end in out.positions.values())
        self.outputs.append((saved.step_id, _plain(out)))
        return True

    def _build_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            try:
                self._take(item)
            finally:
                self._queue.task_done()

    def stop(self) -> None:
        """Stop the builder thread, consuming only what it was handed (a cache that failed)."""
        self._late = []
        if self._builder is not None:
            self._queue.put(None)
            self._builder.join(60)
            assert not self._builder.is_alive(), "the output builder did not stop"

    def close(self) -> None:
        """Consume what is left, stop the builder thread, check every admission's delivery."""
        late, self._late = self._late, []
        for _, item in late:
            self._consume(item)
        self.stop()
        if self._backlog:
            ids = [saved.step_id for saved, _, _ in self._backlog]
            self.errors.append(f"steps {ids} were refused and never consumed")
        self.errors.extend(self.engine.delivery_violations())
        if self.check_pool_every:
            self.errors.extend(pool_mismatches(self.engine.m, self.engine.oracle))


def _plain(out: StageCacheOutputs) -> dict[str, Any]:
    """A materialized output as nested dicts of lists, for comparing runs."""
    result: dict[str, Any] = {"positions": dict(out.positions)}
    if out.hidden_states is not None:
        result[HIDDEN_KEY] = {r: t.tolist() for r, t in out.hidden_states.items()}
    for key, per_req in out.mm_outputs.items():
        result[key] = {
            r: v.tolist() if isinstance(v, torch.Tensor) else v for r, v in per_req.items()
        }
    return result
