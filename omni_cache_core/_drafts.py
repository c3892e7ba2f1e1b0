"""Draft rows: the rows of a step that count only once the engine accepts them (SPEC).

With speculative decoding a step computes, for a decoding request, its next position and ``k``
draft positions after it: rows ``[c, c + 1 + k)``, of which the last ``k`` are drafts
(`SaveBegin.drafts`). The engine's sampler accepts ``a <= k`` of them; the request's computed
count becomes ``c' = c + 1 + a`` and its next step recomputes from ``c'``, writing the same
slots again. Until the cache learns ``c'`` the drafts are *unconfirmed*.

This unit is the one home of that fact: per admission entry, in arrays indexed by entry, the
step that carries its unconfirmed drafts, the request's index in that step's layout, the
drafts' first position (the step's confirmed end at save) and end, where their slots lie in
the step's slot array, and a count a consume reported. A step's drafts are unconfirmed for
its delivery while their entry names the step and no count was reported. It decides:

- whether a save may carry a request (not while its drafts wait for a confirmation: the
  save's positions would be wrong, SPEC-2);
- whether a reported computed count is legal (``base <= c' <= end``, and the same count
  wherever it is reported);
- which slots are accepted and which rejected when a confirmation arrives.

An entry whose request ended or was preempted before any count is *orphaned* (SPEC-5): no
start will confirm it, and it stays only so that its step's consume may still report the
count; it goes when that step ends. It does not mark slots, plan reads or move cursors: the
router does that with what `take` and `settle_at_end` return (SPEC-3, SPEC-4, SPEC-5).
"""

from __future__ import annotations

from collections.abc import Mapping
from itertools import repeat
from typing import Any, cast

import numpy as np
import numpy.typing as npt

from omni_cache_core._contract import ReqId, StepId
from omni_cache_core._errors import BadInputError, InvariantError
from omni_cache_core._values import SlotArray

__all__ = ["Confirmed", "Drafts", "distinct_counts"]

Int64Array = npt.NDArray[np.int64]
_EMPTY = np.zeros(0, dtype=np.int64)


class Confirmed:
    """Counts of one start or consume that confirm drafts: per request, its entry and count."""

    __slots__ = ("counts", "entries", "req_ids")

    def __init__(self, req_ids: list[ReqId], entries: Int64Array, counts: Int64Array) -> None:
        self.req_ids = req_ids
        self.entries = entries
        self.counts = counts

    def __len__(self) -> int:
        return len(self.entries)


def distinct_counts(values: Int64Array) -> list[tuple[int, int]]:
    """The distinct values and how often each occurs (most calls see one value)."""
    if not len(values):
        return []
    if (values == values[0]).all():
        return [(int(values[0]), len(values))]
    distinct, counts = np.unique(values, return_counts=True)
    return list(zip(distinct.tolist(), counts.tolist(), strict=True))


def _ranges(starts: Int64Array, lengths: Int64Array) -> Int64Array:
    """The concatenation of ``range(s, s + n)`` for each start and length."""
    total = int(lengths.sum())
    if not total:
        return _EMPTY
    offsets = np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.repeat(starts, lengths) + np.arange(total, dtype=np.int64) - offsets


class Drafts:
    """Per admission entry, the unconfirmed drafts of its last drafted step."""

    __slots__ = (
        "_base",
        "_end",
        "_index",
        "_num",
        "_orphan",
        "_refs",
        "_reported",
        "_row_end",
        "_step",
        "_step_slots",
    )

    def __init__(self) -> None:
        self._step = np.zeros(0, dtype=np.int64)  # 0: no drafts
        self._index = np.zeros(0, dtype=np.int64)
        self._base = np.zeros(0, dtype=np.int64)
        self._end = np.zeros(0, dtype=np.int64)
        #: One past the entry's last row in its step's slot array: the drafts' slots are
        #: ``slots[row_end - (end - base):row_end]``.
        self._row_end = np.zeros(0, dtype=np.int64)
        self._reported = np.zeros(0, dtype=np.int64)  # -1: none
        self._orphan = np.zeros(0, dtype=np.bool_)
        self._num = 0
        #: Per step with pending drafts: its slot array, and how many entries point at it.
        self._step_slots: dict[StepId, SlotArray] = {}
        self._refs: dict[StepId, int] = {}

    def __bool__(self) -> bool:
        return self._num > 0

    def _grow(self, size: int) -> None:
        old = len(self._step)
        if size <= old:
            return
        new = max(size, 2 * old, 64)
        for name in ("_step", "_index", "_base", "_end", "_row_end", "_reported", "_orphan"):
            a = getattr(self, name)
            b = np.zeros(new, dtype=a.dtype)
            b[:old] = a
            setattr(self, name, b)
        self._reported[old:] = -1

    def _pending(self, entries: Int64Array) -> npt.NDArray[np.bool_]:
        """Which of `entries` have drafts waiting, orphaned or not."""
        inside: npt.NDArray[np.bool_] = entries < len(self._step)
        inside &= self._step[np.where(inside, entries, 0)] != 0
        return inside

    def _slots_of(self, entries: Int64Array, first: Int64Array) -> SlotArray:
        """The slots of positions ``[first, end)`` of each entry's drafts."""
        steps = self._step[entries]
        lengths = self._end[entries] - first
        starts = self._row_end[entries] - lengths
        if len(steps) and (steps == steps[0]).all():
            return self._step_slots[StepId(int(steps[0]))][_ranges(starts, lengths)]
        return np.concatenate(
            [
                self._step_slots[StepId(int(s))][_ranges(starts[steps == s], lengths[steps == s])]
                for s in np.unique(steps).tolist()
            ]
        )

    def _clear(self, entries: Int64Array) -> None:
        for s, n in distinct_counts(self._step[entries]):
            sid = StepId(s)
            left = self._refs[sid] - int(n)
            if left:
                self._refs[sid] = left
            else:
                del self._refs[sid], self._step_slots[sid]
        self._step[entries] = 0
        self._reported[entries] = -1
        self._orphan[entries] = False
        self._num -= len(entries)

    # -----------------------------------------------------------------------------------------
    # Saves.

    def check_layout(self, req_ids: tuple[ReqId, ...], entries: Int64Array) -> None:
        """SPEC-2: a request waiting for the confirmation of its drafts cannot be saved.

        Raises:
            BadInputError: One is in the layout; nothing changes.
        """
        if not self._num:
            return
        waiting = self._pending(entries)
        waiting[waiting] = ~self._orphan[entries[waiting]]
        if waiting.any():
            i = int(np.flatnonzero(waiting)[0])
            e = int(entries[i])
            raise BadInputError(
                what=f"write layout request {req_ids[i]!r}",
                expected=f"its computed-token count in the step's computed_tokens first: the "
                f"drafts of step {int(self._step[e])} (positions {int(self._base[e])}.."
                f"{int(self._end[e]) - 1}) were never confirmed (SPEC-2)",
                got="a save of the request",
            )

    def on_save(
        self,
        step_id: StepId,
        entries: Int64Array,
        hi: Int64Array,
        drafts: SlotArray,
        row_bounds: SlotArray,
        slots: SlotArray,
    ) -> Int64Array:
        """Keep the step's draft rows; return each request's confirmed end (SPEC-1)."""
        valid = hi - drafts
        at = np.flatnonzero(drafts)
        ents = entries[at]
        self._grow(int(ents.max()) + 1)
        stale = ents[self._pending(ents)]  # orphans of a step not ended yet: superseded
        if len(stale):
            self._clear(stale)
        self._step[ents] = step_id
        self._index[ents] = at
        self._base[ents] = valid[at]
        self._end[ents] = hi[at]
        self._row_end[ents] = row_bounds[at + 1]
        self._num += len(ents)
        self._step_slots[step_id] = slots
        self._refs[step_id] = len(ents)
        return valid

    # -----------------------------------------------------------------------------------------
    # Confirmations.

    def _check_counts(
        self, req_ids: list[ReqId], entries: Int64Array, counts: Int64Array, step_id: StepId
    ) -> None:
        """Raise `BadInputError` unless each count may confirm its entry's drafts (SPEC-2)."""
        base, end, reported = self._base[entries], self._end[entries], self._reported[entries]
        bad = (counts < base) | (counts > end) | ((reported >= 0) & (counts != reported))
        if not bad.any():
            return
        i = int(np.flatnonzero(bad)[0])
        step = step_id or int(self._step[entries[i]])
        expected = (
            f"the count {int(reported[i])} reported before"
            if reported[i] >= 0
            else f"a count in [{int(base[i])}, {int(end[i])}] (step {step}'s drafts)"
        )
        raise BadInputError(
            what=f"computed-token count of request {req_ids[i]!r}",
            expected=expected,
            got=str(int(counts[i])),
        )

    def check_confirm(
        self, computed: Mapping[str, int], entry_of: Mapping[ReqId, int]
    ) -> Confirmed:
        """Check a start's computed counts against the drafts waiting (SPEC-2).

        `entry_of`: live requests and their entries. Returns the requests whose drafts the
        counts confirm; counts of other requests, and of orphaned entries, are ignored.

        Raises:
            BadInputError: A count outside its drafts' range, or unlike one reported before;
                nothing changes.
        """
        n = len(computed)
        by_id = cast(Mapping[str, int], entry_of)
        entries = np.fromiter(map(by_id.get, computed, repeat(-1)), np.int64, n)
        counts = np.fromiter(computed.values(), np.int64, n)
        take = (entries >= 0) & self._pending(np.maximum(entries, 0))
        take[take] = ~self._orphan[entries[take]]
        if take.all():
            req_ids = cast(list[ReqId], list(computed))
        else:
            req_ids = [ReqId(r) for r, t in zip(computed, take.tolist(), strict=True) if t]
            entries, counts = entries[take], counts[take]
        self._check_counts(req_ids, entries, counts, StepId(0))
        return Confirmed(req_ids, entries, counts)

    def check_report(
        self, step_id: StepId, req_ids: list[ReqId], entries: Int64Array, counts: Int64Array
    ) -> npt.NDArray[np.bool_]:
        """Check counts a consume of `step_id` reports (SPEC-2); return which of them report
        drafts of that step not reported before (the others are ignored).

        Raises:
            BadInputError: A count outside its drafts' range; nothing changes.
        """
        fresh = self._pending(entries)
        fresh[fresh] = self._step[entries[fresh]] == step_id
        fresh[fresh] = self._reported[entries[fresh]] < 0
        self._check_counts(
            [r for r, f in zip(req_ids, fresh.tolist(), strict=True) if f],
            entries[fresh],
            counts[fresh],
            step_id,
        )
        return fresh

    def report(self, entries: Int64Array, counts: Int64Array) -> None:
        """A consume reported these counts: a later one must agree (SPEC-2)."""
        self._reported[entries] = counts

    def step_of(self, entry: int) -> StepId | None:
        """The step whose drafts the entry waits on (orphaned or not), or None."""
        if entry >= len(self._step) or not self._step[entry]:
            return None
        return StepId(int(self._step[entry]))

    def where(self, entries: Int64Array) -> tuple[Int64Array, Int64Array, Int64Array]:
        """Per entry with drafts waiting: its step id, layout index and first draft position."""
        return self._step[entries], self._index[entries], self._base[entries]

    def take(self, confirmed: Confirmed) -> SlotArray:
        """The confirmed entries' drafts are settled: forget them and return the rejected
        slots of all (SPEC-2, SPEC-3)."""
        rejected = self._slots_of(confirmed.entries, confirmed.counts)
        self._clear(confirmed.entries)
        return rejected

    def accepted_slots(self, entry: int, count: int) -> SlotArray:
        """The slots of the entry's drafts below `count` (read before `take`)."""
        first = np.array([self._base[entry]], dtype=np.int64)
        slots = self._slots_of(np.array([entry], dtype=np.int64), first)
        return slots[: count - int(first[0])]

    def settle_at_end(self, entry: int, step_open: bool) -> tuple[int, SlotArray] | None:
        """SPEC-5: the entry's request ends or is preempted. Returns None when it has no
        drafts waiting; else the accepted count and the rejected slots when a consume reported
        its count, or ``(-1, drafts' slots)`` when none did. Without a count the entry stays,
        orphaned, while its step is open (`step_open`: saved and not consumed), so that the
        step's consume may still report it."""
        if self.step_of(entry) is None or self._orphan[entry]:
            return None
        ent = np.array([entry], dtype=np.int64)
        reported = int(self._reported[entry])
        if reported >= 0:
            first = np.array([reported], dtype=np.int64)
            out = (reported - int(self._base[entry]), self._slots_of(ent, first))
            self._clear(ent)
            return out
        slots = self._slots_of(ent, self._base[ent])
        if step_open:
            self._orphan[entry] = True
        else:
            self._clear(ent)
        return -1, slots

    def on_step_end(self, step_id: StepId, entries: Int64Array) -> None:
        """The step ended: orphaned drafts it carried can no longer be reported (SPEC-5)."""
        if step_id not in self._refs:
            return
        mine = self._pending(entries)
        mine[mine] = self._step[entries[mine]] == step_id
        mine[mine] = self._orphan[entries[mine]]
        if mine.any():
            self._clear(entries[mine])

    # -----------------------------------------------------------------------------------------
    # State.

    def snapshot(self, entry_of: Mapping[ReqId, int]) -> tuple[Any, ...]:
        """A canonical value, by request id (an orphan of an ended request has id "")."""
        req_of = {e: r for r, e in entry_of.items()}
        out = []
        for e in np.flatnonzero(self._step).tolist():
            ent = np.array([e], dtype=np.int64)
            out.append(
                (
                    req_of.get(e, ""),
                    int(self._step[e]),
                    int(self._index[e]),
                    int(self._base[e]),
                    int(self._end[e]),
                    tuple(self._slots_of(ent, self._base[ent]).tolist()),
                    int(self._reported[e]),
                    bool(self._orphan[e]),
                )
            )
        return tuple(sorted(out))

    def check_invariants(self, live_entries: set[int]) -> None:
        """Pending drafts belong to live admissions (or are orphans), their positions are
        ordered and their step's slots are kept.

        Raises:
            InvariantError: One does not hold (a bug in this library).
        """
        pending = np.flatnonzero(self._step).tolist()
        if len(pending) != self._num:
            raise InvariantError(f"drafts: {len(pending)} entries pending, {self._num} counted")
        refs: dict[int, int] = {}
        for e in pending:
            s = int(self._step[e])
            refs[s] = refs.get(s, 0) + 1
            if e not in live_entries and not self._orphan[e]:
                raise InvariantError(f"drafts of entry {e}, which is not live")
            if not 0 <= self._base[e] < self._end[e]:
                raise InvariantError(f"drafts of entry {e}: positions out of order")
            if self._row_end[e] - (self._end[e] - self._base[e]) < 0:
                raise InvariantError(f"drafts of entry {e}: slots out of its step's rows")
        if refs != {int(s): n for s, n in self._refs.items()} or refs.keys() != {
            int(s) for s in self._step_slots
        }:
            raise InvariantError("drafts: step references disagree with the entries")
