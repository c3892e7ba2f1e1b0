"""The save in progress: its validation, its phases and their deadlines (D6, TASK-3, BUDGET-2).

`SaveBegin` validates a save and opens it; `SaveProceed` runs it through its phases, in order,
each with its own deadline (D7); `SaveCommit` publishes it once READY; `SaveAbort` drops it. A
phase moves by `_SAVE_MOVES`, as (phase, outcome) -> next phase:

=======  ========  =======  ==================================================================
phase    outcome   next     why
=======  ========  =======  ==================================================================
BARRIER  WAIT      BARRIER  the last step write is not WRITTEN, or an escalated write is not
                            HOST_READY (TASK-3)
BARRIER  CLEAR     BUDGET
BUDGET   FLUSH     BUDGET   over budget: the oldest unfinished write is escalated (BUDGET-2)
BUDGET   WAIT      BUDGET   the flushed write is not WRITTEN yet
BUDGET   ADMITTED  PAGE     it fits, or nothing is left to flush: the bytes are reserved
PAGE     WAIT      PAGE     no page is free (PAGE-4)
PAGE     CLAIMED   READY    the save holds a page: the one free at its begin, if any (PAGE-7)
=======  ========  =======  ==================================================================

This unit decides the phase, its deadline, the bytes the save reserved and the page it holds,
and which keys a save may carry (a cache per key signature under the policy). It asks the write
tasks what the barrier and the budget wait for, and the pages for a free one; it never commits:
the core publishes a READY save.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final, NoReturn

import numpy as np
import numpy.typing as npt

from omni_cache_core._contract import (
    HIDDEN_KEY,
    ModelCachePolicy,
    StepId,
    TensorName,
    Tid,
    _CodeRepr,
)
from omni_cache_core._counters import CoreCounters
from omni_cache_core._errors import (
    BadInputError,
    InvariantError,
    OversizeStepError,
    PageTimeoutError,
    WaitTimeoutError,
)
from omni_cache_core._occupancy import any_true
from omni_cache_core._pages import HolderKind, PageHolders
from omni_cache_core._tasks import WriteTasks
from omni_cache_core._values import (
    AwaitPage,
    AwaitTasks,
    EscalateTasks,
    PageClaimed,
    SaveBegin,
    TaskState,
)

__all__ = [
    "KeySets",
    "PendingSave",
    "SaveInProgress",
    "SavePhase",
    "check_save_shape",
    "check_save_sizes",
]


class SavePhase(_CodeRepr):
    """Where the save in progress is."""

    #: Waiting for the last step's write and the escalated writes (TASK-3).
    BARRIER = 0
    #: Waiting for the GPU-byte budget (BUDGET-2).
    BUDGET = 1
    #: Waiting for a free staging page (PAGE-2).
    PAGE = 2
    #: Holding a page: ready to commit.
    READY = 3


class SaveOutcome(_CodeRepr):
    """What one phase found at one `SaveProceed`."""

    #: Something to wait for.
    WAIT = 0
    #: Nothing to wait for at the barrier.
    CLEAR = 1
    #: Over budget: a write was escalated.
    FLUSH = 2
    #: The bytes fit, or nothing is left to flush.
    ADMITTED = 3
    #: A page was claimed.
    CLAIMED = 4


_P, _O = SavePhase, SaveOutcome

# D6: the only legal phase moves. Anything else is a bug and raises.
_SAVE_MOVES: Final[dict[tuple[SavePhase, SaveOutcome], SavePhase]] = {
    (_P.BARRIER, _O.WAIT): _P.BARRIER,
    (_P.BARRIER, _O.CLEAR): _P.BUDGET,
    (_P.BUDGET, _O.FLUSH): _P.BUDGET,
    (_P.BUDGET, _O.WAIT): _P.BUDGET,
    (_P.BUDGET, _O.ADMITTED): _P.PAGE,
    (_P.PAGE, _O.WAIT): _P.PAGE,
    (_P.PAGE, _O.CLAIMED): _P.READY,
}

# The phase each waiting phase passes on to, read from the table once (a pair missing from it
# fails at import): a save that waits for nothing passes all three in one input, and these
# moves need no lookup then.
_AFTER_BARRIER: Final = _SAVE_MOVES[(_P.BARRIER, _O.CLEAR)]
_AFTER_BUDGET: Final = _SAVE_MOVES[(_P.BUDGET, _O.ADMITTED)]
_AFTER_PAGE: Final = _SAVE_MOVES[(_P.PAGE, _O.CLAIMED)]

# (immediate keys, deferred keys, has rows): what `KeySets.check` validates.
_KeySignature = tuple[tuple[TensorName, ...], tuple[TensorName, ...], bool]


class PendingSave:
    """The save in progress: its input and the progress of its phases."""

    __slots__ = (
        "charged",
        "deadline_ns",
        "entries",
        "flushing",
        "hint",
        "inp",
        "keys",
        "page",
        "phase",
        "rows",
    )

    def __init__(
        self,
        inp: SaveBegin,
        entries: npt.NDArray[np.int64],
        rows: npt.NDArray[np.int64],
        keys: tuple[TensorName, ...],
        hint: int | None = None,
    ) -> None:
        self.inp = inp
        #: Each request's row count, in layout order (`check_save_shape`).
        self.rows = rows
        #: The layout's admission entries, in layout order.
        self.entries = entries
        #: The keys a consume of the step returns.
        self.keys = keys
        self.phase = SavePhase.BARRIER
        self.deadline_ns: int | None = None
        self.charged = 0
        self.page: int | None = None
        #: The page the save claims (PAGE-7): the lowest free one at its begin, which nothing
        #: else can claim before this save does; None if no page was free then.
        self.hint = hint
        #: The write the budget flush escalated and now waits for until it is WRITTEN.
        self.flushing: Tid | None = None

    def move(self, outcome: SaveOutcome) -> None:
        """Move the phase by `_SAVE_MOVES`; a new phase starts without a deadline (D7)."""
        nxt = _SAVE_MOVES.get((self.phase, outcome))
        if nxt is None:
            raise InvariantError(f"save phase {self.phase!r} has no move for {outcome!r}")
        if nxt is not self.phase:
            self.phase, self.deadline_ns = nxt, None  # D7: each phase gets its own deadline


class SaveInProgress:
    """The one save in progress, if any (D6).

    Args:
        timeout_ns: How long each phase may wait.
        timeout_s: The same, for error messages.
    """

    __slots__ = ("_timeout_ns", "_timeout_s", "pending")

    def __init__(self, timeout_ns: int, timeout_s: float) -> None:
        self._timeout_ns = timeout_ns
        self._timeout_s = timeout_s
        #: The save in progress, or None; callers only read it.
        self.pending: PendingSave | None = None

    @property
    def reserved(self) -> int:
        """The bytes the save in progress reserved (0 without one)."""
        return self.pending.charged if self.pending is not None else 0

    def begin(self, save: PendingSave) -> None:
        """Open a validated save."""
        self.pending = save

    def require(self) -> PendingSave:
        """The save in progress.

        Raises:
            BadInputError: There is none; nothing changes.
        """
        if self.pending is None:
            raise BadInputError(what="save", expected="a save in progress", got="none")
        return self.pending

    def take_ready(self) -> tuple[PendingSave, int]:
        """Close the READY save for its commit and hand it over, with its page.

        Raises:
            BadInputError: No save, or its page is not claimed yet; nothing changes.
        """
        save = self.pending
        if save is None:
            save = self.require()  # raises
        page = save.page
        if save.phase is not SavePhase.READY or page is None:
            raise BadInputError(
                what="save commit",
                expected="a claimed page",
                got=f"phase {save.phase.name.lower()}",
            )
        self.pending = None
        return save, page

    def abort(self, tasks: WriteTasks, pages: PageHolders) -> None:
        """STEP-5: drop the save, its page claim and its reservation. Idempotent."""
        save = self.pending
        if save is None:
            return
        if save.page is not None:
            pages.let_go(save.page, HolderKind.SAVE)
        tasks.unreserve(save.charged)
        self.pending = None

    def proceed(
        self,
        now: int,
        tasks: WriteTasks,
        pages: PageHolders,
        counters: CoreCounters,
        open_step_ids: Callable[[], tuple[StepId, ...]],
    ) -> AwaitTasks | EscalateTasks | AwaitPage | PageClaimed:
        """Run the save's phases in order: barrier, budget, page (`save_proceed`).

        Raises:
            WaitTimeoutError: The barrier or a budget flush passed its deadline (FAIL-3).
            PageTimeoutError: No page freed up in time (PAGE-4).
            In both cases the save stays as this input found it.
        """
        save = self.pending
        if save is None:
            save = self.require()  # raises
        entry = (save.phase, save.deadline_ns, save.charged, save.flushing)
        try:
            return self._advance(save, now, tasks, pages, counters, open_step_ids)
        except (WaitTimeoutError, PageTimeoutError):
            # FAIL-3, STEP-5: a wait that ran out changes nothing, not even a phase passed or a
            # deadline set on the way in this same input (a zero bound fails at first sight).
            tasks.unreserve(save.charged - entry[2])
            save.phase, save.deadline_ns, save.charged, save.flushing = entry
            raise

    def _advance(
        self,
        save: PendingSave,
        now: int,
        tasks: WriteTasks,
        pages: PageHolders,
        counters: CoreCounters,
        open_step_ids: Callable[[], tuple[StepId, ...]],
    ) -> AwaitTasks | EscalateTasks | AwaitPage | PageClaimed:
        if save.phase is SavePhase.BARRIER:
            waits = tasks.barrier_waits()
            if waits:
                save.move(SaveOutcome.WAIT)
                return self._await(save, now, waits, "save barrier", tasks, counters)
            save.phase, save.deadline_ns = _AFTER_BARRIER, None  # D7: a deadline per phase
        if save.phase is SavePhase.BUDGET:
            flushing = save.flushing
            if flushing is not None and tasks.get(flushing) is not None:
                # BUDGET-2: a flushed write is awaited until WRITTEN ("copy and write"), even if
                # its copy alone released enough budget; the budget is checked again after.
                save.move(SaveOutcome.WAIT)
                waits = ((flushing, TaskState.WRITTEN),)
                return self._await(save, now, waits, "budget flush", tasks, counters)
            need = save.inp.immediate_bytes + save.inp.deferred_bytes
            victim = tasks.admit(need)
            if victim is not None:
                save.flushing = victim.tid
                if not victim.escalated:
                    save.move(SaveOutcome.FLUSH)
                    counters.budget_flushes += 1
                    tasks.escalate(victim)
                    return EscalateTasks(tids=(victim.tid,))
                save.move(SaveOutcome.WAIT)
                waits = ((victim.tid, TaskState.WRITTEN),)
                return self._await(save, now, waits, "budget flush", tasks, counters)
            save.flushing = None
            # BUDGET-2: fits, or nothing left to flush: admitted (an oversized step must not hang).
            save.charged = need
            save.phase, save.deadline_ns = _AFTER_BUDGET, None
        if save.phase is SavePhase.PAGE:
            if save.hint is not None:
                # PAGE-7: free since the begin, since only a save claims a page (D6: one at a
                # time); the adapter may have copied the step's rows into it meanwhile.
                pages.claim(save.hint, HolderKind.SAVE)
                free: int | None = save.hint
            else:
                free = pages.claim_free(HolderKind.SAVE)
            if free is None:
                save.move(SaveOutcome.WAIT)
                if save.deadline_ns is None:
                    save.deadline_ns = now + self._timeout_ns
                if now >= save.deadline_ns:
                    counters.page_timeouts += 1
                    raise PageTimeoutError(
                        timeout_s=self._timeout_s,
                        open_step_ids=open_step_ids(),
                        tasks_in_flight=tasks.with_pages(),
                    )
                return AwaitPage(deadline_ns=save.deadline_ns)
            save.page = free
            save.phase, save.deadline_ns = _AFTER_PAGE, None
            return PageClaimed(page=free)
        assert save.page is not None
        return PageClaimed(page=save.page)

    def _await(
        self,
        save: PendingSave,
        now_ns: int,
        waits: tuple[tuple[Tid, TaskState], ...],
        what: str,
        tasks: WriteTasks,
        counters: CoreCounters,
    ) -> AwaitTasks:
        if save.deadline_ns is None:
            save.deadline_ns = now_ns + self._timeout_ns
        if now_ns >= save.deadline_ns:
            counters.wait_timeouts += 1
            tid = waits[0][0]
            state = tasks.state_of(tid)
            raise WaitTimeoutError(
                what=what,
                tid=tid,
                state=state.name if state is not None else "RETIRED",
                timeout_s=self._timeout_s,
            )
        return AwaitTasks(waits=waits, deadline_ns=save.deadline_ns, what=what)

    def snapshot(self) -> tuple[Any, ...] | None:
        """A canonical, hashable value of the save in progress."""
        save = self.pending
        if save is None:
            return None
        return (
            save.phase.name,
            save.deadline_ns,
            save.charged,
            save.page,
            save.flushing,
            save.inp.req_ids,
            tuple(save.inp.row_bounds.tolist()),
            tuple(save.inp.slots.tolist()),
            save.inp.immediate_keys,
            save.inp.deferred_keys,
            save.inp.immediate_bytes,
            save.inp.deferred_bytes,
        )

    def check_invariants(self) -> None:
        """Check that the save holds a page exactly when READY.

        Raises:
            InvariantError: It does not (a bug in this library).
        """
        save = self.pending
        if save is not None and (save.page is not None) != (save.phase is SavePhase.READY):
            raise InvariantError(f"a save in phase {save.phase!r} with page {save.page}")
        if save is not None and save.charged < 0:
            raise InvariantError("a negative reservation")


def check_save_shape(inp: SaveBegin, num_slots: int) -> npt.NDArray[np.int64]:
    """OUT-3, FAIL-5: one slot per row, contiguous row ranges, slot ids in range.

    Returns each request's row count (``row_bounds[i + 1] - row_bounds[i]``), which the commit
    uses again (DLV-1).

    Raises:
        BadInputError: The layout is malformed; nothing changes.
    """
    n = inp.num_tokens
    bounds = inp.row_bounds
    slots = inp.slots
    if n < 0 or len(slots) != n:
        raise BadInputError(
            what="write layout slots",
            expected=f"one slot per unpadded token ({n})",
            got=f"{len(slots)} slots",
        )
    if len(bounds) != len(inp.req_ids) + 1 or bounds[0] != 0 or bounds[-1] != n:
        _refuse_bounds(inp)
    rows: npt.NDArray[np.int64] = bounds[1:] - bounds[:-1]
    # argmin: a fraction of a comparison and its reduction on a decode step's few requests.
    # Unsigned bounds wrap instead of going negative: those are compared.
    if len(rows) > 1 and (
        any_true(bounds[1:] < bounds[:-1]) if bounds.dtype.kind == "u" else rows[rows.argmin()] < 0
    ):
        _refuse_bounds(inp)
    drafts = inp.drafts
    if drafts is not None and (
        len(drafts) != len(inp.req_ids)
        or (len(drafts) and (drafts.min() < 0 or any_true(drafts >= np.maximum(rows, 1))))
    ):
        raise BadInputError(
            what="draft rows",
            expected="per request a count in [0, rows): a request's first row is its confirmed "
            "token (SPEC-1)",
            got=f"{drafts.tolist()[:8]} for rows {rows.tolist()[:8]}",
        )
    # argmin/argmax: a fraction of min()/max()'s fixed cost on a decode step's few slots.
    if n and (slots[slots.argmin()] < 0 or slots[slots.argmax()] >= num_slots):
        raise BadInputError(
            what="slot ids",
            expected=f"ids in [0, {num_slots})",
            got=f"ids in [{int(slots.min())}, {int(slots.max())}]",
        )
    return rows


def _refuse_bounds(inp: SaveBegin) -> NoReturn:
    """Raise the error of row bounds that are not contiguous ranges from 0 to ``num_tokens``.

    Raises:
        BadInputError: Always.
    """
    raise BadInputError(
        what="write layout rows",
        expected=f"contiguous row ranges from 0 to {inp.num_tokens} in batch order",
        got=f"bounds {inp.row_bounds.tolist()[:8]}... for {len(inp.req_ids)} requests",
    )


def check_save_sizes(inp: SaveBegin, capacity_tokens: int) -> None:
    """PAGE-5: immediate rows fit a page; clone byte counts are not negative.

    Raises:
        OversizeStepError: More immediate rows than a page holds; nothing changes.
        BadInputError: A negative byte count; nothing changes.
    """
    if inp.immediate_keys and inp.num_tokens > capacity_tokens:
        raise OversizeStepError(rows=inp.num_tokens, capacity=capacity_tokens)
    if inp.immediate_bytes < 0 or inp.deferred_bytes < 0:
        raise BadInputError(what="clone bytes", expected=">= 0", got="a negative count")


class KeySets:
    """The key sets a save may carry under the policy, each checked once (a cache: not state)."""

    __slots__ = ("_checked",)

    def __init__(self) -> None:
        #: Per accepted signature, the keys a consume returns.
        self._checked: dict[_KeySignature, tuple[TensorName, ...]] = {}

    def clear(self) -> None:
        """The policy changed: check every signature again."""
        self._checked.clear()

    def check(self, inp: SaveBegin, policy: ModelCachePolicy) -> tuple[TensorName, ...]:
        """Check a save's keys against the policy; return the keys a consume returns.

        Raises:
            BadInputError: A key the policy does not allow, hidden rows given or missing, keys
                for 0 rows, or a repeated key; nothing changes.
        """
        signature = (inp.immediate_keys, inp.deferred_keys, inp.num_tokens > 0)
        keys = self._checked.get(signature)
        if keys is not None:
            return keys  # every step of a model passes the same keys: checked once
        deferred = policy.deferred_keys
        if set(inp.deferred_keys) - deferred or set(inp.immediate_keys) & deferred:
            raise BadInputError(
                what="save keys",
                expected=f"deferred keys exactly those of the policy ({sorted(deferred)})",
                got=f"immediate {list(inp.immediate_keys)}, deferred {list(inp.deferred_keys)}",
            )
        caches_hidden = policy.needs_full_hidden_states
        has_hidden = HIDDEN_KEY in inp.immediate_keys
        if has_hidden != (caches_hidden and inp.num_tokens > 0):
            raise BadInputError(
                what="hidden states",
                expected="hidden rows exactly when the policy caches them and the step has rows",
                got="hidden given" if has_hidden else "no hidden rows",
            )
        if inp.num_tokens == 0 and (inp.immediate_keys or inp.deferred_keys):
            raise BadInputError(what="save keys", expected="no cached keys for 0 rows", got="keys")
        if len(set(inp.immediate_keys)) != len(inp.immediate_keys) or len(
            set(inp.deferred_keys)
        ) != len(inp.deferred_keys):
            raise BadInputError(what="save keys", expected="distinct keys", got="a repeat")
        # The keys a consume returns: hidden first (when cached), then mm keys sorted.
        mm = sorted(k for k in (*inp.immediate_keys, *inp.deferred_keys) if k != HIDDEN_KEY)
        keys = (HIDDEN_KEY, *mm) if caches_hidden else tuple(mm)
        self._checked[signature] = keys
        return keys
