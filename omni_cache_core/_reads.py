"""Hit reads: the hits a start registers, their plans at commit, and their protection (HIT, D4).

A hit is registered at `StartStep` (HIT-1): one read per cached key, and a `PrefetchRead` for
its committed rows (HIT-7). It waits there for the next save, which plans it finally against
the state after the step's own claims (D4): each row's `SlotSource`, the writer it waits for and
the slot version it saw. The plan is final then, except the rows copy-on-write preserves before
a newer tenant changes them (HIT-6); a row it cannot preserve marks the read violated.

This unit decides:

- which requests carry a hit into the next save (D10: a hit no save followed is lost, and its
  request must end or be preempted and resumed before it is saved again);
- each read's plan, its error (HIT-4) and its protection (HIT-6);
- the reads each unended step carries, and their rows per `SlotSource` (for `stats()`).

It reads slot owners through `SlotTables` and a write's chunk count through a query; it does not
decide slot ownership, task states, positions (DLV) or when a step ends.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from omni_cache_core._contract import HIDDEN_KEY, ReqId, StepId, TensorName, Tid
from omni_cache_core._errors import BadInputError, HitUnreadableError, InvariantError
from omni_cache_core._occupancy import COMMITTED, SlotTables, any_true
from omni_cache_core._values import (
    PrefetchRead,
    Preserve,
    ReadPlan,
    SaveBegin,
    SlotArray,
    SlotSource,
    TaskState,
)

__all__ = ["HitReads", "Read"]

_POOL: Final = np.int8(SlotSource.POOL.value)
_AFTER_WRITE: Final = np.int8(SlotSource.AFTER_WRITE.value)
_TASK: Final = np.int8(SlotSource.TASK.value)
_ZEROS: Final = np.int8(SlotSource.ZEROS.value)
_THIS_STEP: Final = np.int8(SlotSource.THIS_STEP.value)
# The usual hit's sources are all POOL, made as zeros (`HitReads._plan`).
assert _POOL == 0

_EMPTY_SLOTS: Final = np.zeros(0, dtype=np.int64)
#: The deferred writes of a read of none (most reads): one shared value.
_NO_TIDS: Final[frozenset[Tid]] = frozenset()


class Read:
    """A planned hit read: its plan, final at planning (D4), and what may still change.

    The plan is built once, when the read is planned, and handed out as is at consume: its
    arrays are final then except `preserved`, which copy-on-write marks in place (HIT-6).
    """

    __slots__ = ("error", "has_writers", "plan", "step_id", "version", "violated")

    def __init__(
        self, plan: ReadPlan, step_id: StepId, version: npt.NDArray[np.uint32], has_writers: bool
    ) -> None:
        self.plan = plan
        self.step_id = step_id
        #: Per hit row, the slot version it was planned at.
        self.version = version
        #: Whether any row is owned by an in-flight write (AFTER_WRITE or TASK).
        self.has_writers = has_writers
        self.error: str | None = None
        self.violated = 0

    def canonical(self) -> tuple[Any, ...]:
        plan = self.plan
        return (
            plan.read_id,
            plan.req_id,
            plan.key,
            self.step_id,
            tuple(plan.slots.tolist()),
            tuple(plan.source.tolist()),
            tuple(plan.writer.tolist()),
            tuple(self.version.tolist()),
            tuple(plan.step_row.tolist()),
            tuple(plan.preserved.tolist()),
            plan.chunk_limit,
            self.error,
            self.violated,
        )


class HitReads:
    """Registered hits, planned reads per unended step, and read ids.

    Args:
        num_slots: Slots per key (for the scratch membership marks).
        block_size: Slots per block.
        num_blocks: Blocks in the KV cache.
    """

    __slots__ = (
        "_blank_rows",
        "_block_offsets",
        "_block_size",
        "_by_step",
        "_hit_rows",
        "_lost_hits",
        "_next_read_id",
        "_num_blocks",
        "_slot_mark",
        "_start_hit_keys",
        "_start_hit_lo",
        "_start_hit_slots",
        "_start_hits",
        "_step_hits",
    )

    def __init__(self, num_slots: int, block_size: int, num_blocks: int) -> None:
        self._block_size = block_size
        self._num_blocks = num_blocks
        #: Scratch membership marks, all False between calls (`plan_step`).
        self._slot_mark = np.zeros(num_slots, dtype=np.bool_)
        #: Scratch: each slot's offset in its block, over the most blocks a start hit so far.
        self._block_offsets: SlotArray = _EMPTY_SLOTS
        #: Scratch: read-only step rows (all -1) and writers (all 0) of hit rows, over the most
        #: hit rows a save planned so far; plans of rows with neither share slices of them.
        self._blank_rows: tuple[npt.NDArray[np.int32], npt.NDArray[np.int32]] = _blank_rows(0)
        self._next_read_id = 1
        # Hits registered by the last start, waiting for the next save: req -> (slots, first
        # read id). A hit's read of key k has id ``first + _start_hit_keys[k]``.
        self._start_hits: dict[ReqId, tuple[SlotArray, int]] = {}
        #: Each key the last start's hits read, and its read id's offset from a hit's first.
        self._start_hit_keys: dict[TensorName, int] = {}
        #: All of those hits' slots in one array, with each hit's bounds in it (derived).
        self._start_hit_slots: tuple[SlotArray, list[int]] = (_EMPTY_SLOTS, [0])
        #: First hit position of those hits that do not start at 0 (a resume reads from the
        #: block of its delivery cursor on: DLV-3).
        self._start_hit_lo: dict[ReqId, int] = {}
        # Live requests whose hit was registered by a start that no save followed (D10).
        self._lost_hits: set[ReqId] = set()
        #: Per unended step that planned reads, in planning order: all its hits' slots in one
        #: array, each hit's bounds in it, and its reads in planning order, key by key and each
        #: key's in the hits' order. A write tests each step's slots at once (`_touched`), not
        #: each read's. These are the planned reads of saved, not yet ended steps.
        self._step_hits: dict[StepId, tuple[SlotArray, list[int], list[Read]]] = {}
        #: The same reads per step and request (derived).
        self._by_step: dict[StepId, dict[ReqId, list[Read]]] = {}
        #: Per unended step: rows of all its reads per `SlotSource`, counted when a consume
        #: takes them all.
        self._hit_rows: dict[StepId, npt.NDArray[np.int64]] = {}

    # -----------------------------------------------------------------------------------------
    # Queries.

    def start_hit_requests(self) -> frozenset[ReqId]:
        """Requests whose hit waits for the next save."""
        return frozenset(self._start_hits)

    def lost_hit_requests(self) -> frozenset[ReqId]:
        """Requests that lost their hit (D10)."""
        return frozenset(self._lost_hits)

    def step_ids(self) -> set[StepId]:
        """Steps that carry planned reads."""
        return {read.step_id for _, _, reads in self._step_hits.values() for read in reads}

    def reads_of(self, step_id: StepId) -> tuple[tuple[int, frozenset[Tid]], ...]:
        """The reads a step planned, each with the deferred writes whose own rows it reads."""
        reads = self._by_step.get(step_id)
        if reads is None:
            return ()
        # Most reads name no deferred write: the shared empty set, with no call per read.
        return tuple(
            [
                (
                    read.plan.read_id,
                    frozenset(tid for tid, _ in limit)
                    if (limit := read.plan.chunk_limit)
                    else _NO_TIDS,
                )
                for rs in reads.values()
                for read in rs
            ]
        )

    def read_ids_by_request(self, step_id: StepId) -> tuple[tuple[ReqId, tuple[int, ...]], ...]:
        """The read ids of a step per request (for snapshots)."""
        reads = self._by_step.get(step_id, {})
        return tuple((r, tuple(x.plan.read_id for x in rs)) for r, rs in sorted(reads.items()))

    # -----------------------------------------------------------------------------------------
    # Starts.

    def check_hit(self, req_id: ReqId, hit_end: int, block_ids: tuple[int, ...]) -> None:
        """HIT-1: a hit is block aligned and names enough blocks in range.

        Raises:
            BadInputError: It is not; nothing changes.
        """
        block_size = self._block_size
        if not block_ids:
            raise BadInputError(
                what=_hit_what(req_id, hit_end, block_size),
                expected="the request's block ids",
                got="no block ids",
            )
        if hit_end % block_size:
            raise BadInputError(
                what=_hit_what(req_id, hit_end, block_size),
                expected=f"hit_end a multiple of block_size={block_size}",
                got=f"hit_end={hit_end}",
            )
        if hit_end > len(block_ids) * block_size:
            raise BadInputError(
                what=_hit_what(req_id, hit_end, block_size),
                expected=f"at least {hit_end // block_size} blocks for hit_end={hit_end}",
                got=f"{len(block_ids)} blocks",
            )
        hit_blocks = block_ids[: hit_end // block_size]
        if min(hit_blocks) < 0 or max(hit_blocks) >= self._num_blocks:
            raise BadInputError(
                what=f"block ids of request {req_id!r}",
                expected=f"ids in [0, {self._num_blocks})",
                got=f"{list(hit_blocks)[:8]}",
            )

    def on_start(self) -> None:
        """D10: a new step starts, so the last start's hits that no save followed are lost."""
        if self._start_hits:
            self._lost_hits |= self._start_hits.keys()
            self.clear_start_hits()

    def forget_requests(self, req_ids: Iterable[ReqId]) -> None:
        """The requests ended or were preempted: they may be saved again after their next start."""
        if self._lost_hits:
            self._lost_hits.difference_update(req_ids)

    def clear_start_hits(self) -> None:
        """Forget the registered hits (the save planned them, or the next start lost them)."""
        self._start_hits = {}
        self._start_hit_slots = (_EMPTY_SLOTS, [0])
        if self._start_hit_lo:
            self._start_hit_lo = {}

    def register(
        self,
        hits: list[tuple[ReqId, tuple[int, ...], int]],
        tables: SlotTables,
        hit_keys: list[TensorName],
        catch_up: Sequence[tuple[ReqId, SlotArray, int]] = (),
        *,
        prefetch: bool = True,
    ) -> list[PrefetchRead]:
        """Open one read per hit and cached key; ask to prefetch its committed rows (HIT-7),
        unless ``prefetch`` is off (the adapter does not prefetch: nothing to ask).

        `hits`: per request, its hit's block ids and first position (above 0 for a resume:
        DLV-3). `catch_up`: per request, the slots of accepted draft rows its last step did
        not hand out, and their first position (SPEC-4); they are read like a hit. Every hit's
        slots come from one array and one gather per key, so a step with many hits costs a few
        numpy calls per key, not per hit.
        """
        block_size = self._block_size
        sizes = [len(b) * block_size for _, b, _ in hits]
        every = self._block_slots(
            itertools.chain.from_iterable(b for _, b, _ in hits), sum(sizes) // block_size
        )
        if catch_up:
            every = np.concatenate([every, *(slots for _, slots, _ in catch_up)])
            sizes += [len(slots) for _, slots, _ in catch_up]
            hits = [*hits, *((r, (), first) for r, _, first in catch_up)]
        bounds = [0, *itertools.accumulate(sizes)]
        first_id = self._next_read_id
        self._next_read_id += len(hits) * len(hit_keys)
        # The usual hit: every row is in the pool (owner COMMITTED, code 0), and one count of
        # the gathered owners says so; only the other keys build a mask of their pending rows.
        owners = [(key, tables.by_key[key].owner[every]) for key in hit_keys] if prefetch else []
        pending = {key: owner != COMMITTED for key, owner in owners if np.count_nonzero(owner)}
        # Without prefetches a hit's reads need nothing here but its slots and first read id.
        numbered = tuple(enumerate(hit_keys))
        per_key = numbered if prefetch else ()
        effects: list[PrefetchRead] = []
        ranges: dict[int, npt.NDArray[np.int64]] = {}  # hits are mostly of one length
        start_hits = self._start_hits
        for (req_id, _, first), lo, hi, ids in zip(
            hits, bounds, bounds[1:], itertools.count(first_id, len(hit_keys))
        ):
            if first:
                self._start_hit_lo[req_id] = first
            hit_slots = every[lo:hi]
            start_hits[req_id] = (hit_slots, ids)
            if not per_key:
                continue
            every_row = ranges.get(hi - lo)  # a hit's rows, read by each key with none pending
            if every_row is None:
                every_row = ranges[hi - lo] = np.arange(hi - lo)
            for j, key in per_key:
                if key not in pending:
                    positions = every_row
                    slots = hit_slots
                else:
                    positions = np.flatnonzero(~pending[key][lo:hi])
                    if not len(positions):
                        continue
                    slots = hit_slots[positions]
                effects.append(PrefetchRead._of_registered(ids + j, req_id, key, positions, slots))
        self._start_hit_slots = (every, bounds)
        self._start_hit_keys = {key: j for j, key in numbered}
        return effects

    # -----------------------------------------------------------------------------------------
    # Saves.

    def check_layout(self, req_ids: tuple[ReqId, ...]) -> None:
        """D10, SPEC section 14: a save carries every pending hit and no lost one.

        Raises:
            BadInputError: It does not; nothing changes.
        """
        if not self._lost_hits and not self._start_hits:
            return  # the usual decode step: no set of the layout to build
        unique = frozenset(req_ids)
        if self._lost_hits and not self._lost_hits.isdisjoint(unique):
            lost = sorted(self._lost_hits & unique)[:4]
            raise BadInputError(
                what="write layout requests",
                expected="requests whose hit can be served (abort a request whose start was "
                "not followed by a save)",
                got=f"requests that lost their hit: {lost}",
            )
        if self._start_hits and not self._start_hits.keys() <= unique:
            # SPEC section 14: a hit that cannot be served must raise, never vanish. A request
            # that starts with a hit is scheduled in that very step by every engine we know.
            dropped = sorted(self._start_hits.keys() - unique)[:4]
            raise BadInputError(
                what="write layout requests",
                expected="every request that started with a hit this step",
                got=f"hit requests missing from the layout: {dropped}",
            )

    def invalidate(self, slots: SlotArray, tables: SlotTables) -> None:
        """SPEC-3: a planned read of rows that are now rejected drafts can never be served.

        Rows it planned on at their current version are the rejected rows themselves (older
        versions were preserved or counted when the drafts claimed them: HIT-6); each counts
        as a violation, so its consume raises instead of serving them.
        """
        for read, touched in self._touched(slots):
            plan = read.plan
            table = tables.get(plan.key)
            if table is None:
                continue
            hit = touched & ~plan.preserved
            if not any_true(hit):
                continue
            positions = np.flatnonzero(hit)
            same = table.version[plan.slots[positions]] == read.version[positions]
            read.violated += int(np.count_nonzero(same))

    def copy_on_write(self, slots: SlotArray, tables: SlotTables) -> list[Preserve]:
        """HIT-6: preserve committed rows older reads planned on, before `slots` change."""
        effects: list[Preserve] = []
        for read, touched in self._touched(slots):
            plan = read.plan
            table = tables.get(plan.key)
            if table is None:
                continue
            hit = touched & ~plan.preserved
            hit &= (plan.source == _POOL) | (plan.source == _AFTER_WRITE)
            if not any_true(hit):
                continue
            positions = np.flatnonzero(hit)
            planned = plan.slots[positions]
            intact = (table.owner[planned] == COMMITTED) & (
                table.version[planned] == read.version[positions]
            )
            if any_true(intact):
                keep = positions[intact]
                plan.preserved[keep] = True
                effects.append(
                    Preserve(
                        read_id=plan.read_id, key=plan.key, positions=keep, slots=plan.slots[keep]
                    )
                )
            read.violated += len(intact) - int(np.count_nonzero(intact))
        return effects

    def _touched(self, slots: SlotArray) -> list[tuple[Read, npt.NDArray[np.bool_]]]:
        """The planned reads some of `slots` fall in, in planning order, each with a mask of its
        rows that do (a view into its step's marks, shared by its other keys' reads: read it,
        do not change it).

        Each unended step's slots are tested at once against one membership mark of `slots`: a
        write that touches no step's hit rows, the usual one, costs a gather per step, however
        many reads the steps carry.
        """
        if not self._step_hits:
            return []
        mark = self._slot_mark
        mark[slots] = True
        try:
            touched: list[tuple[Read, npt.NDArray[np.bool_]]] = []
            for every, bounds, reads in self._step_hits.values():
                rows = mark[every]
                if not any_true(rows):
                    continue
                hits = len(bounds) - 1
                for i, read in enumerate(reads):
                    hit = rows[bounds[i % hits] : bounds[i % hits + 1]]
                    if any_true(hit):
                        touched.append((read, hit))
            return touched
        finally:
            mark[slots] = False

    def plan_step(
        self,
        step_id: StepId,
        sv: SaveBegin,
        keys: tuple[TensorName, ...],
        step_tid: Tid | None,
        tables: SlotTables,
        deferred_keys: frozenset[TensorName],
        chunks_of: Callable[[Tid], int | None],
        own_first: npt.NDArray[np.int64],
    ) -> npt.NDArray[np.int64]:
        """Plan the hits of this save's requests against the post-claim state (D4).

        All hit slots of the step are planned together, one gather per key, and each read gets
        its slice: a prefill with many hits costs a few numpy calls per key, not per read.

        Returns each request's first position in the step (DLV-1, DLV-3): `own_first`, its own
        rows' first, except that a request with a hit carries the hit rows before them. The
        start's hits are planned then, and forgotten.
        """
        if not self._start_hits:
            return own_first
        self._plan(step_id, sv, keys, step_tid, tables, deferred_keys, chunks_of)
        lo = own_first.copy()
        # One pass over the layout finds every hit's row; a hit starts at 0 but for a resume.
        start_hits, hit_lo = self._start_hits, self._start_hit_lo
        rows = [i for i, r in enumerate(sv.req_ids) if r in start_hits]
        lo[rows] = [hit_lo.get(sv.req_ids[i], 0) for i in rows] if hit_lo else 0
        self.clear_start_hits()
        return lo

    def _plan(
        self,
        step_id: StepId,
        sv: SaveBegin,
        keys: tuple[TensorName, ...],
        step_tid: Tid | None,
        tables: SlotTables,
        deferred_keys: frozenset[TensorName],
        chunks_of: Callable[[Tid], int | None],
    ) -> None:
        hits = list(self._start_hits.items())  # save_begin checked they are all in the layout
        every, bounds = self._start_hit_slots
        owners = {key: tables.owners_at(key, every) for key in keys}
        # HIT-5: a producer of this very step wins over any older tenant. The step write just
        # claimed all of the step's slots, so its fresh tid marks them; without one, a
        # membership mark costs far less than sorting the step.
        if step_tid is not None:
            # `keys` holds every key the save passed, so the step key's owners are gathered.
            # Hit rows are mostly all committed (owner 0): one count settles it then.
            step_owner = owners[sv.immediate_keys[0]][0]
            any_mine = bool(np.count_nonzero(step_owner)) and any_true(step_owner == step_tid)
        else:
            mark = self._slot_mark
            mark[sv.slots] = True
            any_mine = any_true(mark[every])
            mark[sv.slots] = False
        n = len(every)
        if len(self._blank_rows[0]) < n:
            self._blank_rows = _blank_rows(n)
        no_step_row, no_writer = self._blank_rows
        no_writer = no_writer[:n]  # shared by every read of every key without writers
        if any_mine:
            order = np.argsort(sv.slots, kind="stable")
            step_row = _last_row(sv.slots[order], order, every).astype(np.int32)
            mine = step_row >= 0
        else:
            step_row = no_step_row[:n]  # shared by every read of the step
            mine = None
        reads: dict[ReqId, list[Read]] = {r: [] for r, _ in hits}
        hit_rows = np.zeros(len(SlotSource), dtype=np.int64)
        # Each read's bounds, list and step rows (a view its keys' plans share) are the same
        # for every key: paired once per step.
        spans = [
            (req_id, slots, first_id, lo, hi, reads[req_id], step_row[lo:hi])
            for (req_id, (slots, first_id)), lo, hi in zip(
                hits, bounds[:-1], bounds[1:], strict=True
            )
        ]
        step_reads: list[Read] = []
        offsets = self._start_hit_keys
        for key in keys:
            owner, version = owners[key]
            # The key's read ids are each hit's first plus this; a key no hit read gets new ones.
            offset = offsets.get(key)
            # The rows owned by an in-flight write (AFTER_WRITE or TASK), None without any.
            in_transit: npt.NDArray[np.bool_] | None = None
            missing = None
            if mine is None and not np.count_nonzero(owner):
                # The usual hit: every row committed, none of this step's. All read the pool.
                source = np.zeros(n, dtype=np.int8)
                writer = no_writer
                hit_rows[_POOL] += n
            else:
                source = np.where(owner == COMMITTED, _POOL, _ZEROS)
                transit = owner > 0
                if mine is not None:
                    transit &= ~mine
                    source[mine] = _THIS_STEP
                writer = no_writer
                if any_true(transit):
                    in_transit = transit
                    writer = np.where(transit, owner, 0).astype(np.int32)
                    source[transit] = _TASK if key in deferred_keys else _AFTER_WRITE
                counts = np.bincount(source, minlength=len(SlotSource))
                hit_rows += counts
                if key == HIDDEN_KEY and counts[_ZEROS]:
                    missing = np.add.reduceat(source == _ZEROS, bounds[:-1])
            preserved = np.zeros(n, dtype=np.bool_)  # sliced per read: one allocation
            for i, (req_id, slots, first_id, lo, hi, req_reads, read_step_row) in enumerate(spans):
                read_writer = writer[lo:hi]
                read_source = source[lo:hi]
                reads_writers = in_transit is not None and any_true(in_transit[lo:hi])
                if reads_writers:
                    chunk_limit, error = _limit_task_reads(read_writer, read_source, chunks_of)
                else:
                    chunk_limit, error = (), None
                read_id = first_id + offset if offset is not None else self._new_read_id()
                read = Read(
                    ReadPlan._of_planned(
                        read_id,
                        req_id,
                        key,
                        slots,
                        read_source,
                        read_writer,
                        chunk_limit,
                        read_step_row,
                        preserved[lo:hi],
                    ),
                    step_id,
                    version[lo:hi],
                    reads_writers,
                )
                if error is not None:
                    read.error = error
                if missing is not None and missing[i]:
                    # HIT-4: never a miss: the cache and the engine's KV state diverged.
                    read.error = (
                        f"{int(missing[i])} of {hi - lo} hidden-state rows are unknown or absent "
                        "(never written, or written by another tenant)"
                    )
                req_reads.append(read)
                step_reads.append(read)
        self._by_step[step_id] = reads
        self._step_hits[step_id] = (every, bounds, step_reads)
        self._hit_rows[step_id] = hit_rows

    # -----------------------------------------------------------------------------------------
    # Consumes.

    def of_step(self, step_id: StepId, requested: tuple[ReqId, ...] | None) -> list[Read]:
        """The reads of a step, all of them (`requested` None) or those of some requests."""
        by_request = self._by_step.get(step_id)
        if not by_request:
            return []
        if requested is None:
            return [r for rs in by_request.values() for r in rs]
        wanted = set(requested)
        return [r for req, rs in by_request.items() if req in wanted for r in rs]

    def hit_rows_of(self, step_id: StepId) -> npt.NDArray[np.int64] | None:
        """Rows of all of a step's reads per `SlotSource`, or None without reads."""
        return self._hit_rows.get(step_id)

    @staticmethod
    def writes_to_await(
        reads: list[Read], registered: Callable[[Tid], bool]
    ) -> list[tuple[Tid, TaskState]]:
        """The immediate writes a consume of `reads` must see WRITTEN first (HIT-3).

        Raises:
            HitUnreadableError: A read is unreadable (HIT-4) or violated (HIT-6).
        """
        waits: list[tuple[Tid, TaskState]] = []
        for read in reads:
            plan = read.plan
            if read.error is not None or read.violated:
                reason = read.error or (
                    f"{read.violated} hit slots reassigned before this delayed read (HIT-6)"
                )
                raise HitUnreadableError(
                    req_id=plan.req_id, key=plan.key, reason=reason, slot_count=len(plan.slots)
                )
            if read.has_writers:
                pending = plan.writer[(plan.source == _AFTER_WRITE) & ~plan.preserved]
                for tid in np.unique(pending).tolist():
                    if registered(Tid(tid)):
                        waits.append((Tid(tid), TaskState.WRITTEN))
        return waits

    def drop_step(self, step_id: StepId) -> None:
        """The step ended: its reads go."""
        self._hit_rows.pop(step_id, None)
        self._step_hits.pop(step_id, None)
        self._by_step.pop(step_id, None)

    # -----------------------------------------------------------------------------------------
    # State.

    def snapshot(self) -> tuple[Any, ...]:
        """A canonical, hashable value of this unit's state."""
        return (
            self._next_read_id,
            tuple(sorted(self._start_hit_lo.items())),
            tuple(
                (
                    r,
                    tuple(s.tolist()),
                    tuple(sorted((k, first + j) for k, j in self._start_hit_keys.items())),
                )
                for r, (s, first) in sorted(self._start_hits.items())
            ),
            tuple(sorted(self._lost_hits)),
            tuple(
                read.canonical()
                for read in sorted(
                    (read for _, _, reads in self._step_hits.values() for read in reads),
                    key=lambda read: read.plan.read_id,
                )
            ),
        )

    def check_invariants(self) -> None:
        """Check that the reads per step and per request agree, each filed under its own step.

        Raises:
            InvariantError: One does not hold (a bug in this library).
        """
        if self._by_step.keys() != self._step_hits.keys():
            raise InvariantError("the steps with reads per request and in order disagree")
        seen: set[int] = set()
        for step_id, (every, bounds, reads) in self._step_hits.items():
            by_request = [r.plan.read_id for rs in self._by_step[step_id].values() for r in rs]
            if sorted(by_request) != sorted(read.plan.read_id for read in reads):
                raise InvariantError(f"step {step_id}'s reads per request and in order disagree")
            hits = len(bounds) - 1
            for i, read in enumerate(reads):
                read_id = read.plan.read_id
                if read_id in seen:
                    raise InvariantError(f"read {read_id} filed under two steps")
                seen.add(read_id)
                if read.step_id != step_id:
                    raise InvariantError(f"read {read_id} filed under another step")
                lo, hi = bounds[i % hits], bounds[i % hits + 1]
                if not np.array_equal(every[lo:hi], read.plan.slots):
                    raise InvariantError(f"read {read_id}'s slots are not its step's")
        if not self._start_hit_lo.keys() <= self._start_hits.keys():
            raise InvariantError("a resume's first hit position without its hit")

    def _block_slots(self, block_ids: Iterable[int], count: int) -> SlotArray:
        """The slots of `count` blocks, block by block."""
        block_size = self._block_size
        blocks = np.fromiter(block_ids, dtype=np.int64, count=count)
        if len(self._block_offsets) < count * block_size:
            self._block_offsets = np.tile(np.arange(block_size, dtype=np.int64), count)
        # Each block's first slot repeated, plus each slot's offset in its block: far cheaper
        # than broadcasting the block's short row of offsets over every block.
        slots = (blocks * block_size).repeat(block_size)
        slots += self._block_offsets[: len(slots)]
        return slots

    def _new_read_id(self) -> int:
        read_id = self._next_read_id
        self._next_read_id += 1
        return read_id


def _hit_what(req_id: ReqId, hit_end: int, block_size: int) -> str:
    """HIT-1: every refusal of a hit names the request, hit_end and the block size."""
    return f"hit of request {req_id!r} (hit_end={hit_end}, block_size={block_size})"


def _blank_rows(n: int) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int32]]:
    """Read-only step rows of none (-1) and writers of none (0), `n` of each."""
    step_rows = np.full(n, -1, dtype=np.int32)
    writers = np.zeros(n, dtype=np.int32)
    step_rows.setflags(write=False)
    writers.setflags(write=False)
    return step_rows, writers


def _limit_task_reads(
    writer: npt.NDArray[np.int32],
    source: npt.NDArray[np.int8],
    chunks_of: Callable[[Tid], int | None],
) -> tuple[tuple[tuple[Tid, int], ...], str | None]:
    """Pin TASK rows to the chunks that exist now; a vanished writer is an error (HIT-4).

    Returns the read's chunk limits, in tid order, and its error, if any.
    """
    limits: list[tuple[Tid, int]] = []
    error = None
    for tid in np.unique(writer[source == _TASK]).tolist():
        chunks = chunks_of(Tid(tid))
        if chunks is None:
            error = f"in-flight write {tid} cannot serve its rows"
        else:
            limits.append((Tid(tid), chunks))
    return tuple(limits), error


def _last_row(ordered: SlotArray, order: SlotArray, values: SlotArray) -> npt.NDArray[np.int64]:
    """Row of the last occurrence of each value in the step (TASK-5), or -1."""
    if not len(ordered):
        return np.full(len(values), -1, dtype=np.int64)
    at = np.searchsorted(ordered, values, side="right") - 1
    found = at >= 0
    found[found] = ordered[at[found]] == values[found]
    return np.where(found, order[np.maximum(at, 0)], -1)
