"""Draft rows: the rows of a step that count only once the engine accepts them (SPEC).

With speculative decoding a step computes, for a decoding request, its next position and ``k``
draft positions after it: rows ``[c, c + 1 + k)``, of which the last ``k`` are drafts
(`SaveBegin.drafts`). The engine's sampler accepts ``a <= k`` of them; the request's computed
count becomes ``c' = c + 1 + a`` and its next step recomputes from ``c'``, writing the same
slots again. Until the cache learns ``c'`` the drafts are *unconfirmed*.

This unit keeps, per admission entry with unconfirmed drafts, which step carries them, their
first position (the step's confirmed end at save) and their slots, and checks each
confirmation against them. It decides:

- whether a save may carry a request (not while its drafts wait for a confirmation: the
  save's positions would be wrong, SPEC-2);
- whether a reported computed count is legal (``base <= c' <= end``, and the same count
  wherever it is reported);
- which slots are accepted and which rejected when a confirmation arrives.

It does not mark slots, plan reads or move cursors: the router does that with what `confirm`
and `drop` return (SPEC-3, SPEC-4, SPEC-5).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from omni_cache_core._contract import ReqId, StepId
from omni_cache_core._errors import BadInputError, InvariantError
from omni_cache_core._values import SlotArray

__all__ = ["Drafts", "PendingDrafts"]

Int64Array = npt.NDArray[np.int64]


class PendingDrafts:
    """One admission's unconfirmed draft rows: the step, their positions and slots."""

    __slots__ = ("base", "end", "index", "reported", "slots", "step_id")

    def __init__(self, step_id: StepId, index: int, base: int, end: int, slots: SlotArray) -> None:
        self.step_id = step_id
        #: The request's index in that step's layout.
        self.index = index
        #: First draft position: every position below it is confirmed.
        self.base = base
        #: One past the last draft position (the admission's next position until confirmed).
        self.end = end
        #: The slots of positions ``[base, end)``.
        self.slots = slots
        #: A computed count a consume reported already (SPEC-2), which a later one must equal.
        self.reported: int | None = None

    def canonical(self) -> tuple[Any, ...]:
        return (self.step_id, self.index, self.base, self.end, tuple(self.slots.tolist()))


class Drafts:
    """Per admission entry, the unconfirmed drafts of its last step."""

    __slots__ = ("_pending",)

    def __init__(self) -> None:
        self._pending: dict[int, PendingDrafts] = {}

    def __bool__(self) -> bool:
        return bool(self._pending)

    def pending_of(self, entry: int) -> PendingDrafts | None:
        """The entry's unconfirmed drafts, or None."""
        return self._pending.get(entry)

    # -----------------------------------------------------------------------------------------
    # Saves.

    def check_layout(self, req_ids: tuple[ReqId, ...], entries: Int64Array) -> None:
        """SPEC-2: a request waiting for the confirmation of its drafts cannot be saved.

        Raises:
            BadInputError: One is in the layout; nothing changes.
        """
        if not self._pending:
            return
        waiting = self._pending.keys() & set(entries.tolist())
        if waiting:
            i = min(int(np.flatnonzero(entries == e)[0]) for e in waiting)
            p = self._pending[int(entries[i])]
            raise BadInputError(
                what=f"write layout request {req_ids[i]!r}",
                expected=f"its computed-token count in the step's computed_tokens first: the "
                f"drafts of step {p.step_id} (positions {p.base}..{p.end - 1}) were never "
                "confirmed (SPEC-2)",
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
        for i in np.flatnonzero(drafts).tolist():
            end = int(row_bounds[i + 1])
            k = int(drafts[i])
            self._pending[int(entries[i])] = PendingDrafts(
                step_id, i, int(valid[i]), int(hi[i]), slots[end - k : end]
            )
        return valid

    # -----------------------------------------------------------------------------------------
    # Confirmations.

    def check_confirm(
        self, computed: Mapping[str, int], entry_of: Mapping[ReqId, int]
    ) -> list[tuple[ReqId, int, int]]:
        """Check a step's computed counts against the drafts waiting (SPEC-2).

        `entry_of`: live requests and their entries. Returns ``(request, entry, count)`` per
        request whose drafts it confirms; counts of other requests are ignored.

        Raises:
            BadInputError: A count outside its drafts' range, or unlike one reported before;
                nothing changes.
        """
        out: list[tuple[ReqId, int, int]] = []
        pending = self._pending
        for req_id, count in computed.items():
            entry = entry_of.get(req_id)  # type: ignore[call-overload]
            p = pending.get(entry) if entry is not None else None
            if p is None:
                continue
            self.check_count(req_id, p, count)
            out.append((ReqId(req_id), entry, count))
        return out

    @staticmethod
    def check_count(req_id: str, p: PendingDrafts, count: int) -> None:
        """Raise `BadInputError` unless `count` may confirm `p`'s drafts."""
        if not p.base <= count <= p.end or (p.reported is not None and count != p.reported):
            expected = (
                f"the count {p.reported} reported before"
                if p.reported is not None
                else f"a count in [{p.base}, {p.end}] (step {p.step_id}'s drafts)"
            )
            raise BadInputError(
                what=f"computed-token count of request {req_id!r}",
                expected=expected,
                got=str(count),
            )

    def confirm(self, entry: int) -> PendingDrafts:
        """The entry's drafts are confirmed: forget them and return them (SPEC-2)."""
        return self._pending.pop(entry)

    def drop(self, entries: Iterable[int]) -> list[PendingDrafts]:
        """The requests ended or were preempted: their unconfirmed drafts, forgotten (SPEC-5)."""
        return [p for e in entries if (p := self._pending.pop(e, None)) is not None]

    # -----------------------------------------------------------------------------------------
    # State.

    def snapshot(self, entry_of: Mapping[ReqId, int]) -> tuple[Any, ...]:
        """A canonical value, by request id (pending drafts belong to live requests)."""
        req_of = {e: r for r, e in entry_of.items()}
        return tuple(
            sorted((req_of.get(e, ""), p.canonical(), p.reported) for e, p in self._pending.items())
        )

    def check_invariants(self, live_entries: set[int]) -> None:
        """Pending drafts belong to live admissions and positions are ordered.

        Raises:
            InvariantError: One does not hold (a bug in this library).
        """
        for entry, p in self._pending.items():
            if entry not in live_entries:
                raise InvariantError(f"drafts of entry {entry}, which is not live")
            if not 0 <= p.base < p.end or len(p.slots) != p.end - p.base:
                raise InvariantError(f"drafts of entry {entry}: positions and slots disagree")
