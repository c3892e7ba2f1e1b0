"""A vLLM scheduler output read into a step's request records.

`TranslationState.translate` reads one ``SchedulerOutput`` in named parts, one method each:
finished (and aborted) requests, preempted ones, new requests (a start, or the v2 runner's
resume), the v1 runner's resumed cached requests, and the running cached requests (their added
blocks and where their tokens start). Each part adds its records and its planned changes to a
`StepTranslation`; nothing changes until `TranslationState.commit`, which the glue calls once
the cache took the step's records, so a refused step leaves everything as it was.

The fields read and both model runners' conventions are in the module docstring of
`omni_cache_cuda.vllm._glue`.

What the state keeps, and why it is not a copy of the cache's request lifecycle: the cache's
core keeps each request's lifecycle (started, preempted, resumed, ended, what is left to
deliver) and refuses a record that does not fit it. What this state keeps is what vLLM tells
only once and a later step's translation needs again:

- each running request's block list: vLLM sends a request's whole block list when it starts or
  resumes and afterwards only the blocks a step adds, while the write layout of every step
  needs the whole list (the core never holds block lists; it gets a layout per save);
- the ids vLLM preempted and has not resumed or ended: the v2 runner announces a resume as a
  new request under the old id, and ``finished_req_ids`` also names aborted requests that never
  ran, so telling RESUMED from STARTED, and a FINISHED to send from an id to skip, needs them;
- the requests the steps still in flight scheduled, for `RequestIdReuseError`.

Where a request's tokens start is not kept across steps: every step's output carries it for
each scheduled request, so it lives in the step's translation only.
"""

from __future__ import annotations

import collections
import operator
from collections.abc import Collection, Iterable, Mapping, Sequence
from itertools import compress
from typing import Any, ClassVar

import numpy as np

from omni_cache_core import BadInputError, PrefixCacheEventKind, PrefixCacheRequestEvent

__all__ = ["RequestIdReuseError", "StepTranslation", "TranslationState"]

_STARTED = PrefixCacheEventKind.STARTED
_RESUMED = PrefixCacheEventKind.RESUMED
_FINISHED = PrefixCacheEventKind.FINISHED
_PREEMPTED = PrefixCacheEventKind.PREEMPTED


class RequestIdReuseError(BadInputError):
    """A request id was started again while the engine may still process a step naming it.

    Raised by `VllmPrefixCache.step_begin` before anything changes: the cache and this object's
    tracking are as they were. vLLM's own state is already wrong at that point; the engine must
    not go on.

    Attributes:
        req_id: The reused request id.
        detail: What was seen, in words.
    """

    # BadInputError's own three-name tuple is inferred as its type; the base declares any length.
    _FIELDS: ClassVar[tuple[str, ...]] = ("req_id", "detail")  # type: ignore[assignment]

    def __init__(self, *, req_id: str, detail: str) -> None:
        self.req_id = req_id
        self.detail = detail
        super().__init__(
            what=f"request id {req_id!r}",
            expected="a request id not in use by a step still in flight (give every admission "
            "a fresh id)",
            got=detail,
        )


class StepTranslation:
    """One step's records, and the changes they bring to `TranslationState` once accepted.

    Attributes:
        scheduled: The output's tokens per scheduled request.
        events: The step's request records, in the order the cache gets them.
        ended: Finished or aborted requests this state knew (running or preempted).
        preempting: Requests preempted by this step.
        joining: Requests starting or resuming in this step -> a copy of their block list.
        extending: Running requests and the block ids this step adds to their lists.
        starts: Where each scheduled request's tokens of this step start (a dict, the cached
            requests' entries merged in on first read: a decode step's layout reads arrays).
        decode: In a decode step (no request joins, the scheduled requests are exactly the
            cached ones, each once with one token counted by an int, none has drafts), the
            requests' table rows and starts as arrays and a private copy of their ids, all in
            the scheduler's order, for `TranslationState.decode_rows`; else None.
        drafts: Requests with draft tokens in this step and how many (the last of their
            scheduled tokens: SPEC-1).
        computed: Computed-token counts of the requests whose earlier drafts this step
            confirms (SPEC-2).
        resumed: How many of ``joining`` resume (the others start).
        started_with_hit, resumed_with_hit: How many of those start or resume on a prefix hit.
    """

    __slots__ = (
        "_cached_starts",
        "_starts",
        "computed",
        "decode",
        "drafts",
        "ended",
        "events",
        "extending",
        "joining",
        "preempting",
        "resumed",
        "resumed_with_hit",
        "scheduled",
        "started_with_hit",
    )

    def __init__(self, scheduled: Mapping[str, int]) -> None:
        self.scheduled = scheduled
        self.events: list[PrefixCacheRequestEvent] = []
        self.ended: list[str] = []
        self.preempting: list[str] = []
        self.joining: dict[str, list[int]] = {}
        self.extending: list[tuple[str, Sequence[int]]] = []
        self._starts: dict[str, int] = {}
        #: The cached requests' ids and starts, parallel, merged into ``starts`` when read.
        self._cached_starts: tuple[Sequence[str], Sequence[int]] | None = None
        self.decode: tuple[np.ndarray, np.ndarray, Sequence[str]] | None = None
        self.drafts: dict[str, int] = {}
        self.computed: dict[str, int] = {}
        self.resumed = 0
        self.started_with_hit = 0
        self.resumed_with_hit = 0

    @property
    def starts(self) -> dict[str, int]:
        """Where each scheduled request's tokens of this step start."""
        pending = self._cached_starts
        if pending is not None:
            self._cached_starts = None
            self._starts.update(zip(pending[0], pending[1], strict=True))
        return self._starts

    def join(self, req_id: str, kind: PrefixCacheEventKind, hit: int, blocks: list[int]) -> None:
        """Record a request that starts or resumes in this step, with its hit and blocks."""
        if req_id in self.joining:
            raise BadInputError(
                what=f"request {req_id!r}",
                expected="at most one new or resumed entry per step",
                got="two",
            )
        self.events.append(
            PrefixCacheRequestEvent(
                req_id=req_id,
                kind=kind,
                hit_end=hit,
                block_ids=blocks,
                scheduled_tokens=self.scheduled.get(req_id, 0),
            )
        )
        self.joining[req_id] = blocks
        self._starts[req_id] = hit
        if kind is _RESUMED:
            self.resumed += 1
            self.resumed_with_hit += hit > 0
        else:
            self.started_with_hit += hit > 0


class _CachedRequests:
    """``scheduled_cached_reqs`` read once, its parallel lists checked to line up."""

    __slots__ = ("_id_set", "computed", "new_block_ids", "req_ids", "resumed_ids")

    def __init__(self, cached: Any) -> None:
        self.req_ids: Sequence[str] = cached.req_ids
        self.new_block_ids: Sequence[Any] = cached.new_block_ids
        self.computed: Sequence[int] = cached.num_computed_tokens
        self.resumed_ids: Collection[str] = cached.resumed_req_ids or ()
        # Built on first use: a decode step's fast path reads no set of the ids.
        self._id_set: set[str] | None = None
        lengths = (len(self.req_ids), len(self.new_block_ids), len(self.computed))
        if not lengths[0] == lengths[1] == lengths[2] or (
            self.resumed_ids and not self.req_id_set.issuperset(self.resumed_ids)
        ):
            raise BadInputError(
                what="scheduled_cached_reqs",
                expected="req_ids, new_block_ids and num_computed_tokens of one length, and "
                "resumed_req_ids among req_ids",
                got=f"lengths {lengths[0]}, {lengths[1]}, {lengths[2]} and "
                f"{len(self.resumed_ids)} resumed",
            )

    @property
    def req_id_set(self) -> set[str]:
        """The cached request ids as a set (built once)."""
        if self._id_set is None:
            self._id_set = set(self.req_ids)
        return self._id_set


class TranslationState:
    """What translating a scheduler output needs to remember from the steps before it.

    Args:
        kv_group: Which KV cache group's block ids to read (``block_ids[kv_group]``).
        max_concurrent_batches: Steps the engine keeps in flight; a request started again while
            one of the previous ``max_concurrent_batches - 1`` steps named its id is refused.

    Attributes:
        running: Each running request's block list (group ``kv_group``), a private copy.
        unconfirmed: Requests whose last saved step had draft tokens whose acceptance the
            cache has not been told yet (SPEC-2).
        preempted: Requests vLLM preempted and has not resumed or ended: no blocks.
        in_flight: The scheduled counts of the previous steps the engine may still have in
            flight (the last ``max_concurrent_batches - 1``).
        table_rows, table, table_lens: The same block lists as one int32 array, for a decode
            step's layout without a per-request lookup of a list: request -> its row of
            ``table``, whose first ``table_lens[row]`` entries are its block ids and the rest -1.
    """

    def __init__(self, *, kv_group: int, max_concurrent_batches: int) -> None:
        self.kv_group = kv_group
        self.max_concurrent_batches = max_concurrent_batches
        self.running: dict[str, list[int]] = {}
        self.preempted: set[str] = set()
        self.unconfirmed: set[str] = set()
        self.in_flight: collections.deque[Collection[str]] = collections.deque(
            maxlen=max_concurrent_batches - 1
        )
        self.table_rows: dict[str, int] = {}
        self.table = np.full((64, 128), -1, dtype=np.int32)
        self.table_lens = [0] * 64
        #: False once a block list did not fit the table (not ints, or beyond int32): the
        #: layout then reads the lists only.
        self.table_ok = True
        self._free_rows: list[int] = list(range(63, -1, -1))
        # Scratch per row of ``table``: marks (a fresh number per check) and positions (of the
        # repeat check, and of a decode step's requests in the scheduler's order).
        self._row_mark = np.zeros(64, dtype=np.int64)
        self._row_pos = np.zeros(64, dtype=np.intp)
        self._mark = 0
        # The last runner's order proved to be a decode step's requests: its rows, the step's
        # rows (both arrays of the memo below) and where each of the first sits in the second.
        self._order_proof: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        # Each row of ``table_rows`` as 8 little-endian bytes: the rows of hundreds of ids are
        # then one C-level join of their bytes, read as an array in place.
        self._row_bytes: dict[str, bytes] = {}
        self._bytes_of_row = [row.to_bytes(8, "little") for row in range(64)]
        # Per `rows_of` memo slot, the last id list looked up and its rows (the scheduler's and
        # the runner's orders mostly stay put between steps). Any change of ``table_rows``
        # drops them.
        self._memo: dict[str, tuple[list[str], np.ndarray]] = {}
        self._aranges: dict[int, np.ndarray] = {}

    def translate(self, scheduler_output: Any) -> StepTranslation:
        """Read a step's scheduler output into its records; change nothing.

        Raises:
            RequestIdReuseError, BadInputError: As for `VllmPrefixCache.step_begin`.
        """
        so = scheduler_output
        _refuse_unsupported(so)
        step = StepTranslation(so.num_scheduled_tokens)
        spec = getattr(so, "scheduled_spec_decode_tokens", None)
        if spec:
            step.drafts = drafts = {r: len(ids) for r, ids in spec.items() if ids}
            scheduled = step.scheduled
            if any(k >= scheduled.get(r, 0) for r, k in drafts.items()):
                raise BadInputError(
                    what="scheduled_spec_decode_tokens",
                    expected="fewer draft tokens than the request's scheduled tokens (SPEC-1)",
                    got=str({r: (k, scheduled.get(r, 0)) for r, k in drafts.items()})[:120],
                )
        self._finished(so.finished_req_ids, step)
        _preempted(getattr(so, "preempted_req_ids", None), step)
        self._new(so.scheduled_new_reqs, step)
        cached = _CachedRequests(so.scheduled_cached_reqs)
        self._resumed(cached, step)
        self._cached(cached, step)
        return step

    def commit(self, step: StepTranslation, scheduled: Collection[str]) -> None:
        """Apply an accepted step: ``scheduled`` is the step's own copy of its scheduled ids."""
        running, preempted = self.running, self.preempted
        if step.ended or step.preempting or step.joining:
            self._memo.clear()  # rows change: the looked-up lists' rows may no longer hold
        if self.unconfirmed or step.drafts:
            unconfirmed = self.unconfirmed
            unconfirmed.difference_update(step.computed, step.ended, step.preempting)
            unconfirmed.update(step.drafts)
        for req_id in step.ended:
            running.pop(req_id, None)
            preempted.discard(req_id)
            self._free_row(req_id)
        for req_id in step.preempting:
            running.pop(req_id, None)
            preempted.add(req_id)
            self._free_row(req_id)
        for req_id, blocks in step.joining.items():
            preempted.discard(req_id)
            running[req_id] = blocks
        for req_id, added in step.extending:
            running[req_id].extend(added)
        if self.table_ok:
            try:
                for req_id, blocks in step.joining.items():
                    self._set_row(req_id, blocks)
                if step.extending:
                    self._extend_rows(step.extending)
            except (TypeError, ValueError, OverflowError):
                self.table_ok = False
        if self.max_concurrent_batches > 1:
            self.in_flight.append(scheduled)

    def _set_row(self, req_id: str, blocks: Sequence[int]) -> None:
        """Write a joining request's block list into its row of the table."""
        row = self.table_rows.get(req_id)
        if row is None:
            if not self._free_rows:
                self._grow(rows=2 * len(self.table_lens))
            row = self._free_rows.pop()
            self.table_rows[req_id] = row
            self._row_bytes[req_id] = self._bytes_of_row[row]
        else:
            self.table[row, : self.table_lens[row]] = -1
        if len(blocks) > self.table.shape[1]:
            self._grow(cols=len(blocks))
        self.table[row, : len(blocks)] = blocks
        self.table_lens[row] = len(blocks)

    def _free_row(self, req_id: str) -> None:
        """Give an ended or preempted request's row back, its entries unused again."""
        row = self.table_rows.pop(req_id, None)
        if row is not None:
            del self._row_bytes[req_id]
            self.table[row, : self.table_lens[row]] = -1
            self.table_lens[row] = 0
            self._free_rows.append(row)

    def _extend_rows(self, extending: Sequence[tuple[str, Sequence[int]]]) -> None:
        """Append the step's added block ids to their rows (a decode step: a few, one each)."""
        table, lens, rows = self.table, self.table_lens, self.table_rows
        width = table.shape[1]
        for req_id, added in extending:
            row = rows[req_id]
            start = lens[row]
            end = start + len(added)
            if end > width:
                self._grow(cols=end)
                table = self.table
                width = table.shape[1]
            if end == start + 1:
                table[row, start] = added[0]
            else:
                table[row, start:end] = added
            lens[row] = end

    def _grow(self, *, rows: int = 0, cols: int = 0) -> None:
        """Make room for ``rows`` rows and ``cols`` columns, at least doubling what grows."""
        old_rows, old_cols = self.table.shape
        new_rows = max(rows, 2 * old_rows) if rows > old_rows else old_rows
        new_cols = max(cols, 2 * old_cols) if cols > old_cols else old_cols
        table = np.full((new_rows, new_cols), -1, dtype=np.int32)
        table[:old_rows, :old_cols] = self.table
        self.table = table
        if new_rows > old_rows:
            self.table_lens.extend([0] * (new_rows - old_rows))
            self._free_rows.extend(range(new_rows - 1, old_rows - 1, -1))
            self._bytes_of_row.extend(
                row.to_bytes(8, "little") for row in range(old_rows, new_rows)
            )
            self._row_mark = np.zeros(new_rows, dtype=np.int64)
            self._row_pos = np.zeros(new_rows, dtype=np.intp)

    # -----------------------------------------------------------------------------------------
    # The parts of a scheduler output, in the order their records go to the cache.

    def _finished(self, finished: Iterable[str], step: StepTranslation) -> None:
        """FINISHED for each finished or aborted request this state knows; skip the others."""
        if not finished:
            return
        for req_id in finished:
            if req_id in self.running or req_id in self.preempted:
                step.events.append(PrefixCacheRequestEvent(req_id=req_id, kind=_FINISHED))
                step.ended.append(req_id)

    def _new(self, new_reqs: Iterable[Any], step: StepTranslation) -> None:
        """STARTED for each new request, or RESUMED for a preempted id (the v2 runner)."""
        gone = set(step.ended)
        for new in new_reqs:
            req_id = new.req_id
            blocks = list(self._group_blocks(req_id, new.block_ids))
            if req_id in step.preempting or (req_id in self.preempted and req_id not in gone):
                kind = _RESUMED
            else:
                if req_id in self.running and req_id not in gone:
                    raise RequestIdReuseError(
                        req_id=req_id, detail="a new request under an id that is still running"
                    )
                self._refuse_in_flight_reuse(req_id)
                kind = _STARTED
            step.join(req_id, kind, new.num_computed_tokens, blocks)

    def _resumed(self, cached: _CachedRequests, step: StepTranslation) -> None:
        """RESUMED for the v1 runner's resumed requests: their block list is replaced."""
        for req_id in cached.resumed_ids:
            i = cached.req_ids.index(req_id)
            blocks = list(self._group_blocks(req_id, cached.new_block_ids[i] or ()))
            step.join(req_id, _RESUMED, cached.computed[i], blocks)

    def _cached(self, cached: _CachedRequests, step: StepTranslation) -> None:
        """Check the other cached requests are running; plan their added blocks and starts."""
        req_ids, new_block_ids = cached.req_ids, cached.new_block_ids
        if len(req_ids) == 0:
            return  # a step of new requests only: nothing to check or plan
        if not self._cached_by_rows(cached, step):
            # Every other cached request must be running here, and stay so through this step.
            running = (
                cached.req_id_set.difference(cached.resumed_ids)
                if cached.resumed_ids
                else cached.req_id_set
            )
            leaving = set(step.ended).union(step.preempting)
            # A keys view compared with a set looks each id up; set.issubset would copy the keys.
            if not self.running.keys() >= running or (leaving and not running.isdisjoint(leaving)):
                stray = sorted(r for r in running if r not in self.running or r in leaving)
                raise BadInputError(
                    what=f"scheduled_cached_reqs {stray[:5]}",
                    expected="requests this cache saw start or resume and that are still running",
                    got="requests it does not track as running",
                )
        if any(new_block_ids):
            pairs: Iterable[tuple[str, Any]] = zip(req_ids, new_block_ids, strict=True)
            if isinstance(new_block_ids, list):
                # A decode step adds blocks to a few of hundreds of requests: pick those in C.
                # An entry that is neither None nor truthy (an empty tuple) takes the full loop,
                # whose group lookup refuses it, as does a group lookup that fails here.
                picked = zip(
                    compress(req_ids, new_block_ids), filter(None, new_block_ids), strict=True
                )
                expected = len(new_block_ids) - new_block_ids.count(None)
                if step.joining:
                    pairs_picked = list(picked)
                    if len(pairs_picked) == expected:
                        pairs = pairs_picked
                else:
                    kv = self.kv_group
                    try:
                        extending = [(r, added[kv]) for r, added in picked]
                    except (IndexError, TypeError):
                        extending = []
                    if len(extending) == expected:
                        step.extending = extending
                        pairs = ()
            for req_id, added in pairs:
                if added is not None and req_id not in step.joining:
                    step.extending.append((req_id, self._group_blocks(req_id, added)))
        # Merged into the step's starts when read (copied: the caller's lists may change).
        ids = list(req_ids) if step.decode is None else step.decode[2]
        step._cached_starts = (ids, list(cached.computed))
        if self.unconfirmed:
            # SPEC-2: vLLM lowered these counts by the rejected drafts of the last step.
            running = cached.req_id_set.difference(cached.resumed_ids)
            starts = step.starts
            step.computed = {r: starts[r] for r in running if r in self.unconfirmed}

    def _cached_by_rows(self, cached: _CachedRequests, step: StepTranslation) -> bool:
        """The running check of `_cached` from the requests' table rows, one lookup each.

        True when every cached request has a row (it is running: the table's rows are the
        running requests while ``table_ok``), none repeats and none leaves in this step. In a
        decode step it also sets `StepTranslation.decode`. False: the set-based check
        decides, and names what is wrong. Only scratch arrays change.
        """
        req_ids = cached.req_ids
        n = len(req_ids)
        if not self.table_ok or cached.resumed_ids or n < 2:
            return False
        rows = self.rows_of(req_ids, "cached", distinct=True)
        if rows is None:
            return False
        if step.ended or step.preempting:
            mark = self._next_mark()
            self._row_mark[rows] = mark
            table_rows, row_mark = self.table_rows, self._row_mark
            for req_id in (*step.ended, *step.preempting):
                row = table_rows.get(req_id)
                if row is not None and row_mark[row] == mark:
                    return False
        sched = step.scheduled
        if step.joining or step.drafts or type(sched) is not dict or len(sched) != n:
            return True
        try:
            # Every cached request is scheduled with one token (1 or True, as the layouts
            # read them); with as many scheduled requests, they are all of them. vLLM lists
            # both in its running order: then one compare says the keys are the same.
            if list(sched) == req_ids:
                ones = operator.countOf(sched.values(), 1)
            else:
                ones = operator.itemgetter(*req_ids)(sched).count(1)
            # Counts equal to 1 whose sum is an int are ints (a float, a numpy integer or any
            # other number would make the sum one): the step's record needs no other check.
            if ones != n or type(sum(sched.values())) is not int:
                return True
            starts = np.fromiter(cached.computed, dtype=np.int64, count=n)
        except (KeyError, TypeError, ValueError, OverflowError):
            return True
        if starts[starts.argmin()] >= 0:  # argmin: ndarray.min is a Python-level wrapper
            # rows_of kept a copy of a list (the caller's list may change before the save).
            ids = self._memo["cached"][0] if type(req_ids) is list else tuple(req_ids)
            step.decode = (rows, starts, ids)
        return True

    def rows_of(self, req_ids: Sequence[str], memo: str, *, distinct: bool) -> np.ndarray | None:
        """The table rows of ``req_ids``, or None if one has no row (or, if ``distinct``,
        one repeats).

        ``memo`` names a slot keeping the last list looked up and its rows, so the same list
        again (the scheduler's and the runner's orders mostly stay put) costs one compare.
        """
        kept = self._memo.get(memo)
        if kept is not None and type(req_ids) is list and kept[0] == req_ids:
            return kept[1]
        n = len(req_ids)
        if n < 2:
            return None
        try:
            # One lookup per id in C (n >= 2: the getter returns a tuple).
            packed = b"".join(operator.itemgetter(*req_ids)(self._row_bytes))
        except (KeyError, TypeError):
            return None
        rows = np.frombuffer(packed, dtype="<i8")
        if distinct:
            positions = self._positions(n)
            # Each row takes its position; a repeated row keeps only one of them.
            scratch = self._row_pos
            scratch[rows] = positions
            if np.count_nonzero(scratch[rows] != positions):
                return None
        if type(req_ids) is list:
            self._memo[memo] = (list(req_ids), rows)
        return rows

    def decode_rows(
        self, order: Sequence[str], decode: tuple[np.ndarray, np.ndarray, Sequence[str]]
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """The table rows and starts of a decode step's requests in the runner's ``order``.

        ``decode`` is the step's `StepTranslation.decode`: its requests' distinct rows, their
        starts and their ids. Not None proves ``order`` is those requests, each once: the same
        ids in the same order, or as many ids, each with a row, that together mark every one of
        the step's rows. That proof, and where each of the runner's rows sits in the
        scheduler's order, is kept while both orders come back unchanged with no row changed
        (the same two memo arrays: a runner that keeps its rows in place). None when ``order``
        is not that (or the table went off): the general path then decides.
        """
        step_rows, step_starts, step_ids = decode
        if isinstance(order, str) or len(order) != len(step_rows) or not self.table_ok:
            return None
        if type(order) is type(step_ids) and order == step_ids:
            # The runner kept the scheduler's order (a steady decode batch): one compare, and
            # the step's own rows and starts are the answer.
            return step_rows, step_starts
        rows = self.rows_of(order, "order", distinct=False)
        if rows is None:
            return None
        proof = self._order_proof
        if proof is None or proof[0] is not rows or proof[1] is not step_rows:
            # The memo hands out the same arrays while the same lists come back and no row
            # changes, so a proof for these two arrays holds for as long as they do.
            mark = self._next_mark()
            row_mark = self._row_mark
            row_mark[rows] = mark
            if np.count_nonzero(row_mark[step_rows] != mark):
                return None
            # Where each of the runner's rows sits in the scheduler's order.
            scratch = self._row_pos
            scratch[step_rows] = self._positions(len(step_rows))
            proof = self._order_proof = (rows, step_rows, scratch[rows])
        return rows, step_starts[proof[2]]

    def _positions(self, n: int) -> np.ndarray:
        """``np.arange(n)``, one array per length (at most 64 lengths are kept)."""
        positions = self._aranges.get(n)
        if positions is None:
            if len(self._aranges) > 64:
                self._aranges.clear()
            positions = self._aranges[n] = np.arange(n, dtype=np.intp)
        return positions

    def _next_mark(self) -> int:
        self._mark += 1
        return self._mark

    # -----------------------------------------------------------------------------------------
    # Helpers.

    def _group_blocks(self, req_id: str, per_group: Any) -> Sequence[int]:
        """The block ids of group ``kv_group`` out of a per-group tuple of lists."""
        try:
            return per_group[self.kv_group]  # type: ignore[no-any-return]
        except (IndexError, TypeError):
            raise BadInputError(
                what=f"block ids of request {req_id!r}",
                expected=f"one list per KV cache group, group {self.kv_group} included",
                got=repr(per_group)[:80],
            ) from None

    def _refuse_in_flight_reuse(self, req_id: str) -> None:
        """Refuse a start under an id one of the steps still in flight scheduled."""
        for back, scheduled in enumerate(reversed(self.in_flight), start=1):
            if req_id in scheduled:
                raise RequestIdReuseError(
                    req_id=req_id,
                    detail=f"started while the step {back} before this one, which scheduled "
                    f"the previous request under that id, may still be in flight "
                    f"({self.max_concurrent_batches} batches in flight)",
                )


def _refuse_unsupported(so: Any) -> None:
    """Refuse copy-on-write KV block copies."""
    if getattr(so, "kv_cache_block_copies", None):
        raise BadInputError(
            what="kv_cache_block_copies",
            expected="none (a copied KV block would carry rows the cache does not move)",
            got=f"{len(so.kv_cache_block_copies)} block copies",
        )


def _preempted(preempted: Iterable[str] | None, step: StepTranslation) -> None:
    """PREEMPTED for each preempted request."""
    if not preempted:
        return
    for req_id in preempted:
        # An id this state never saw running goes on to the cache, which refuses it.
        step.events.append(PrefixCacheRequestEvent(req_id=req_id, kind=_PREEMPTED))
        step.preempting.append(req_id)
