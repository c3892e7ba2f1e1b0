"""The reference model: `ReferenceModel`, written differently from the core on purpose.

It keeps an append-only history of the saves that succeeded and answers every query by replaying
that history (the newest value of a (slot, key) as of a step's save, explicit absence, HIT-4,
HIT-5), plus which step ids are open and which error a call must raise. Per admission of a
request it keeps its next position, its delivery cursor and the positions handed out (LIFE,
DLV): which positions a materialize hands out, which rows are cut below the cursor, and when one
is refused (DLV-5).

Also here: `Outcome` (what a call may end in: an error class, or None for success), `Refusal` (a
DLV-5 refusal the model allows) and `ModelMismatch` (the system under test and the model
disagree).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeAlias

import attrs

from omni_cache_core._contract import (
    HIDDEN_KEY,
    ModelCachePolicy,
    PrefixCacheConfig,
    PrefixCacheEventKind,
    PrefixCacheRequestEvent,
    ReqId,
    StepId,
    TensorName,
)
from omni_cache_core._errors import (
    BadInputError,
    DeliveryOrderError,
    HitUnreadableError,
    LifecycleError,
    OversizeStepError,
    PageTimeoutError,
    ShutDownError,
    StepAlreadyConsumedError,
    UnknownStepError,
    WaitTimeoutError,
    WriteFailedError,
)
from omni_cache_core.testing._interface import Delivered, Rows, SaveSpec

__all__ = ["ModelMismatch", "Outcome", "ReferenceModel", "Refusal"]

#: An outcome the model allows: an error class, or None for success.
Outcome: TypeAlias = type[BaseException] | None


class ModelMismatch(AssertionError):
    """The system under test and the reference model disagree."""


@attrs.define
class _Admission:
    """One admission of a request id, from STARTED until FINISHED or ABORTED (LIFE-1)."""

    number: int
    req_id: ReqId
    #: The position the request's next row takes (DLV-1).
    computed: int
    #: The delivery cursor (DLV-2): no position below it is handed out again.
    cursor: int = 0
    preempted: bool = False
    ended: bool = False


@attrs.define
class _Carried:
    """What a step carries for one request: positions ``[lo, hi)``, its own rows from `own`."""

    admission: int
    lo: int
    own: int
    hi: int
    #: Whether its hit rows come from a RESUMED record (DLV-3).
    resumed: bool = False


@attrs.define
class _Saved:
    step_id: StepId
    spec: SaveSpec
    out_keys: tuple[TensorName, ...]
    hits: dict[ReqId, tuple[int, ...]]
    carried: dict[ReqId, _Carried]


#: A DLV-5 refusal the model allows: ``(request, earlier step, positions it owes)``.
Refusal: TypeAlias = tuple[ReqId, StepId, tuple[int, int]]


class ReferenceModel:
    """A deliberately naive model of what the cache must answer.

    It does not track slots, owners, versions, tasks, pages or budget. It keeps the saves that
    succeeded, in order, and answers a read of a (slot, key) by walking that history backwards
    from the consuming step's save: the last save whose layout holds the slot decides, with its
    last row for that slot (TASK-5); a save that held the slot but did not emit the key means
    explicit absence (SLOT-4). Absent or never written reads as 0 for mm keys and makes a hidden
    hit unreadable (HIT-3, HIT-4). The consuming step's own rows count (HIT-5), later saves do not
    (HIT-6: a delayed read never sees a newer tenant).

    Requests and delivery (SPEC section 12) are kept per admission: its next position, its
    delivery cursor, running or preempted (LIFE-1..4). A step carries, per request, the positions
    of its hit rows (from the block of the cursor on, for a resume: DLV-3) and of its own rows
    (DLV-1); a materialize hands out those at or above the cursor (DLV-2), a discard hands out
    nothing (DLV-4), and a materialize that would move a request's cursor while an earlier open
    step of the admission still owes it rows is refused (DLV-5: rows come out in save order).
    Every delivered row is the newest write, as of the step's save, of the slot that holds its
    position (DLV-6). `delivered` records the positions the system under test reported per
    admission, so that a position handed out twice shows (DLV-2, DLV-7).

    Args:
        config: The cache's sizes.
        policy: The cache's policy.
    """

    def __init__(self, config: PrefixCacheConfig, policy: ModelCachePolicy) -> None:
        self.config = config
        self.policy = policy
        self.history: list[_Saved] = []
        self.consumed: set[StepId] = set()
        #: Live requests: running or preempted (LIFE-1).
        self.live: set[ReqId] = set()
        self.preempted: set[ReqId] = set()
        #: Every admission so far, by number, and the live requests' current ones.
        self.admissions: list[_Admission] = []
        self.admission_of: dict[ReqId, _Admission] = {}
        #: Hits registered by the last start, served by the next save that succeeds: their slots
        #: and their first position (0, or a resume's cursor block: DLV-3).
        self.hits: dict[ReqId, tuple[int, ...]] = {}
        self.hit_lo: dict[ReqId, int] = {}
        self.resumed_hits: set[ReqId] = set()
        #: Live requests whose hit no save served: unsaveable until they end (D10).
        self.lost: set[ReqId] = set()
        #: Per admission: the positions the system under test handed out (DLV-2).
        self.delivered: dict[int, set[int]] = {}
        #: Per admission: positions carried by steps that were discarded (DLV-4).
        self.discarded: dict[int, set[int]] = {}
        #: The refusals the last `consume` allowed (DLV-5).
        self.refusals: frozenset[Refusal] = frozenset()
        #: What the last `consume` showed, for the machine's coverage counts.
        self.shown: list[str] = []
        self.closed = False
        self.failed = False
        self.started = False

    # -----------------------------------------------------------------------------------------
    # Queries.

    @property
    def next_step_id(self) -> StepId:
        """The id the next successful save returns (STEP-1: from 1, one per save)."""
        return StepId(len(self.history) + 1)

    @property
    def running(self) -> set[ReqId]:
        """Live requests that are not preempted."""
        return self.live - self.preempted

    def open_step_ids(self) -> tuple[StepId, ...]:
        """Saved, not yet consumed step ids (STEP-1)."""
        return tuple(s.step_id for s in self.history if s.step_id not in self.consumed)

    def saved(self, step_id: StepId) -> _Saved:
        """The record of a saved step."""
        return self.history[step_id - 1]

    def _refusal(self) -> Outcome:
        # FAIL-4 wins over FAIL-1: a closed cache says so first.
        if self.closed:
            return ShutDownError
        if self.failed:
            return WriteFailedError
        return None

    def newest(self, key: TensorName, slot: int, upto: StepId) -> int | None:
        """The newest value of (slot, key) as of step `upto`'s save, or None (absent, unknown)."""
        for saved in reversed(self.history[:upto]):
            flat = saved.spec.flat_slots
            if slot in flat:
                row = len(flat) - 1 - flat[::-1].index(slot)
                values = saved.spec.value_map().get(key)
                return None if values is None else values[row]
        return None

    def writer_of(self, slot: int, upto: StepId | None = None) -> tuple[int, int] | None:
        """``(admission, position)`` of the newest row in `slot` as of step `upto`'s save."""
        for saved in reversed(self.history[: len(self.history) if upto is None else upto]):
            flat = saved.spec.flat_slots
            if slot in flat:
                row = len(flat) - 1 - flat[::-1].index(slot)
                for req_id, (lo, hi) in saved.spec.bounds.items():
                    if lo <= row < hi:
                        carried = saved.carried[req_id]
                        return carried.admission, carried.own + row - lo
        return None

    def owed_by_earlier(self, step_id: StepId, req_ids: Sequence[ReqId]) -> frozenset[Refusal]:
        """The DLV-5 refusals a materialize of these requests allows; empty if it is in order.

        Per admission, rows come out in save order: a materialize that would move a request's
        cursor (hand it rows, or pass over positions below its rows: DLV-4) is held back while
        an earlier open step of the same admission still owes it rows (carries positions at or
        above the cursor). Each refusal names the earlier step and the positions it owes.
        """
        saved = self.saved(step_id)
        out: set[Refusal] = set()
        for req_id in req_ids:
            carried = saved.carried[req_id]
            cursor = self.admissions[carried.admission].cursor
            if carried.hi <= cursor:
                continue  # every position below the cursor: it moves nothing, never refused
            for earlier in self.history[: step_id - 1]:
                other = earlier.carried.get(req_id)
                if (
                    earlier.step_id not in self.consumed
                    and other is not None
                    and other.admission == carried.admission
                    and other.hi > max(other.lo, cursor)
                ):
                    out.add((req_id, earlier.step_id, (max(other.lo, cursor), other.hi)))
        return frozenset(out)

    # -----------------------------------------------------------------------------------------
    # Engine calls: each returns what must happen and applies it when it succeeds.

    def start(self, events: Sequence[PrefixCacheRequestEvent]) -> Outcome:
        """A `new_step_starts`: the error it must raise, else None (applied)."""
        refusal = self._refusal()
        if refusal is not None:
            return refusal
        bs = self.config.block_size
        seen: set[str] = set()
        ending: list[PrefixCacheRequestEvent] = []
        starting: list[PrefixCacheRequestEvent] = []
        for event in events:
            if event.kind not in (PrefixCacheEventKind.STARTED, PrefixCacheEventKind.RESUMED):
                ending.append(event)
                continue
            starting.append(event)
            if event.req_id in seen:
                return BadInputError  # one STARTED or RESUMED record per request and step
            seen.add(event.req_id)
            if event.hit_end:
                blocks = event.block_ids
                wanted = event.hit_end // bs
                # HIT-1, LIFE-4: aligned, with blocks, enough of them, each in range.
                if (
                    not blocks
                    or event.hit_end % bs
                    or wanted > len(blocks)
                    or not all(0 <= b < self.config.num_blocks for b in blocks[:wanted])
                ):
                    return BadInputError
        # LIFE-2: ends and preemptions first, in order, then starts and resumes.
        state: dict[str, str] = {}

        def state_of(req_id: str) -> str:
            if req_id in state:
                return state[req_id]
            if req_id in self.preempted:
                return "preempted"
            return "running" if req_id in self.live else "not live"

        for event in ending:
            if event.kind is PrefixCacheEventKind.PREEMPTED:
                if state_of(event.req_id) != "running":
                    return LifecycleError
                state[event.req_id] = "preempted"
            else:
                state[event.req_id] = "not live"  # FINISHED, ABORTED: any state, even unknown
        for event in starting:
            now = state_of(event.req_id)
            if (event.kind is PrefixCacheEventKind.RESUMED) != (now == "preempted"):
                return LifecycleError  # RESUMED only of a preempted request, STARTED never
        self.started = True
        # D10: a hit that the next save did not serve is lost for good.
        self.lost |= set(self.hits)
        for event in ending:
            req_id = ReqId(event.req_id)
            if req_id not in self.live:
                continue
            self.lost.discard(req_id)
            admission = self.admission_of[req_id]
            if event.kind is PrefixCacheEventKind.PREEMPTED:
                self.preempted.add(req_id)  # LIFE-3: live for delivery, not for saves
                admission.preempted = True
            else:
                self.live.discard(req_id)
                self.preempted.discard(req_id)
                del self.admission_of[req_id]
                admission.ended = True
        self.hits, self.hit_lo, self.resumed_hits = {}, {}, set()
        for event in starting:
            req_id = ReqId(event.req_id)
            if event.kind is PrefixCacheEventKind.RESUMED:
                self.preempted.discard(req_id)
                admission = self.admission_of[req_id]
                admission.preempted = False
                admission.computed = event.hit_end  # LIFE-4: positions restart at hit_end
                # DLV-3: only the blocks from the cursor's on are read again.
                first = admission.cursor // bs * bs
            elif req_id in self.live:
                continue  # HIT-1: a continuation opens no hit
            else:
                admission = _Admission(
                    number=len(self.admissions), req_id=req_id, computed=event.hit_end
                )
                self.admissions.append(admission)
                self.admission_of[req_id] = admission
                self.live.add(req_id)
                first = 0
            if event.hit_end > first:
                blocks = event.block_ids[first // bs : event.hit_end // bs]
                self.hits[req_id] = tuple(b * bs + o for b in blocks for o in range(bs))
                self.hit_lo[req_id] = first
                if event.kind is PrefixCacheEventKind.RESUMED:
                    self.resumed_hits.add(req_id)
        return None

    def save_outcomes(
        self, spec: SaveSpec, *, stall: bool = False, relief: bool = False
    ) -> frozenset[Outcome]:
        """The outcomes a `save_outputs` may have.

        Args:
            spec: The save.
            stall: The committer does no work while the save waits: a wait may time out.
            relief: A step is consumed while the save waits for a page.
        """
        refusal = self._refusal()
        if refusal is not None:
            return frozenset({refusal})
        n = spec.num_tokens
        keys = set(spec.value_map())
        caches_hidden = self.policy.needs_full_hidden_states
        if (
            any(not 0 <= s < self.config.num_slots for s in spec.flat_slots)
            or len(set(spec.req_ids)) != len(spec.req_ids)
            or not set(spec.req_ids) <= self.live  # D9
            or bool(set(spec.req_ids) & self.preempted)  # LIFE-3: its blocks are gone
            or bool(set(spec.req_ids) & self.lost)  # D10: its rows would miss their prefix
            or not set(self.hits) <= set(spec.req_ids)  # D10: a hit must never vanish
            or (HIDDEN_KEY in keys) != (caches_hidden and n > 0)
            or (n == 0 and keys)
        ):
            return frozenset({BadInputError})
        immediate = {k for k in keys if k not in self.policy.deferred_keys}
        if immediate and n > self.config.staging_capacity_tokens:
            return frozenset({OversizeStepError})  # PAGE-5
        # PAGE-2: every open step holds a page; nobody consumes while an inline save waits.
        full = len(self.open_step_ids()) >= self.config.staging_depth and not relief
        last: Outcome = PageTimeoutError if full else None
        if stall or self.config.staging_claim_timeout_s == 0:
            # TASK-3, BUDGET-2: with the committer stalled, or a zero bound that never waits
            # (PAGE-4), a wait on unfinished writes may run out first.
            return frozenset({WaitTimeoutError, last})
        return frozenset({last})

    def save(self, spec: SaveSpec) -> StepId:
        """Record a save that succeeded; return its step id."""
        step_id = self.next_step_id
        mm = sorted(k for k in spec.value_map() if k != HIDDEN_KEY)
        out_keys = ((HIDDEN_KEY,) if self.policy.needs_full_hidden_states else ()) + tuple(mm)
        carried: dict[ReqId, _Carried] = {}
        for req_id, run in zip(spec.req_ids, spec.slots, strict=True):
            # DLV-1: the request's rows take the next positions; a hit registered for this save
            # carries its rows first, from its first position on.
            admission = self.admission_of[req_id]
            own = admission.computed
            admission.computed = own + len(run)
            lo = self.hit_lo.get(req_id, own)
            if req_id in self.hits and own - lo != len(self.hits[req_id]):
                raise ModelMismatch(f"the model's hit of {req_id} does not end at its positions")
            carried[req_id] = _Carried(
                admission.number, lo, own, own + len(run), req_id in self.resumed_hits
            )
        hits = dict(self.hits)
        self.history.append(
            _Saved(step_id=step_id, spec=spec, out_keys=out_keys, hits=hits, carried=carried)
        )
        self.hits, self.hit_lo, self.resumed_hits = {}, {}, set()
        return step_id

    def consume(
        self, step_id: StepId, req_ids: Sequence[ReqId] | None
    ) -> tuple[Outcome, Delivered | None]:
        """A `materialize` (``req_ids``) or `discard_step` (None): the error or what it hands out.

        On a DLV-5 refusal `refusals` holds the ``(request, earlier step, positions it owes)``
        the error may name, and the step stays open.
        """
        self.refusals = frozenset()
        self.shown = []
        refusal = self._refusal()
        if refusal is not None:
            return refusal, None
        if not 0 < step_id <= len(self.history):
            return UnknownStepError, None  # STEP-2
        if step_id in self.consumed:
            return StepAlreadyConsumedError, None  # STEP-1, STEP-2
        saved = self.saved(step_id)
        if req_ids is None:
            self.consumed.add(step_id)
            # DLV-4: a discard is not delivery; the cursors stay where they are.
            for carried in saved.carried.values():
                self.discarded.setdefault(carried.admission, set()).update(
                    range(carried.lo, carried.hi)
                )
            return None, None
        if not set(req_ids) <= set(saved.spec.req_ids):
            self.consumed.add(step_id)
            return BadInputError, None  # STEP-4: and the step counts as consumed
        self.refusals = self.owed_by_earlier(step_id, req_ids)
        if self.refusals:
            return DeliveryOrderError, None  # DLV-5: nothing changes, the step stays open
        self.consumed.add(step_id)
        bounds = saved.spec.bounds
        values = saved.spec.value_map()
        rows: Rows = {}
        positions: dict[ReqId, tuple[int, int]] = {}
        for req_id in req_ids:
            carried = saved.carried[req_id]
            admission = self.admissions[carried.admission]
            start = max(carried.lo, admission.cursor)
            positions[req_id] = (start, max(carried.hi, start))
        for key in saved.out_keys:
            per: dict[ReqId, tuple[int, ...]] = {}
            for req_id in req_ids:
                prefix: list[int] = []
                for slot in saved.hits.get(req_id, ()):
                    value = self.newest(key, slot, step_id)
                    if value is None and key == HIDDEN_KEY:
                        return HitUnreadableError, None  # HIT-4: never a miss
                    prefix.append(0 if value is None else value)
                lo, hi = bounds[req_id]
                skip = positions[req_id][0] - saved.carried[req_id].lo
                per[req_id] = (*prefix, *values.get(key, ())[lo:hi])[skip:]
            rows[key] = per
        for req_id in req_ids:
            self._note_delivery(saved, req_id, positions[req_id])
        return None, Delivered(rows, positions)

    def _note_delivery(self, saved: _Saved, req_id: ReqId, delivered: tuple[int, int]) -> None:
        """Move the cursor (DLV-2) and note what the delivery showed (for coverage counts)."""
        carried = saved.carried[req_id]
        admission = self.admissions[carried.admission]
        start = delivered[0]
        if start > carried.lo:
            self.shown.append("rows cut below the cursor")
        if carried.lo > admission.cursor:
            self.shown.append("gap passed over")
        if admission.preempted:
            self.shown.append("late materialize of a preempted request")
        if admission.ended:
            self.shown.append("late materialize of an ended admission")
        # Hit rows of a resume that serve the request's own earlier rows (blocks that stayed
        # cached), and positions a discard left behind that a resume hit serves (DLV-4).
        hit_end = carried.own
        if carried.resumed and start < hit_end:
            self.shown.append("resume hit delivered")
            slots = saved.hits.get(req_id, ())
            own = [
                p
                for p in range(start, hit_end)
                if self.writer_of(slots[p - carried.lo], saved.step_id) == (carried.admission, p)
            ]
            if own:
                self.shown.append("resume hit serves the request's own rows")
            if set(range(start, hit_end)) & self.discarded.get(carried.admission, set()):
                self.shown.append("discarded positions served by a resume hit")
        admission.cursor = max(admission.cursor, carried.hi)

    def check_delivery(self, step_id: StepId, got: Delivered) -> None:
        """Check what a materialize handed out, before comparing it with the model's answer.

        Each request's positions are a range, every key has one row per position (in position
        order: DLV-7), and no position of an admission is handed out twice (DLV-2).

        Raises:
            ModelMismatch: One of these does not hold.
        """
        saved = self.saved(step_id)
        for req_id, (start, end) in got.positions.items():
            carried = saved.carried.get(req_id)
            if carried is None or not start <= end:
                raise ModelMismatch(f"step {step_id}: positions {start, end} for {req_id}")
            for key, per in got.rows.items():
                count = len(per.get(req_id, ()))
                if count != end - start:
                    raise ModelMismatch(
                        f"step {step_id}: {count} {key} rows for {req_id}, whose positions are "
                        f"[{start}, {end}) (DLV-7)"
                    )
            seen = self.delivered.setdefault(carried.admission, set())
            again = seen.intersection(range(start, end))
            if again:
                raise ModelMismatch(
                    f"step {step_id}: positions {sorted(again)} of {req_id} (admission "
                    f"{carried.admission}) handed out again (DLV-2)"
                )
            seen.update(range(start, end))
