"""Requests and delivery: who is admitted, at which position, and what was handed out (LIFE, DLV).

One *admission* is a request id from its STARTED to its FINISHED or ABORTED; an id started again
after it ended is a new admission (LIFE-1). Each admission has an entry in a few dense arrays, so
a save or a consume of hundreds of requests costs a handful of numpy calls, not a Python loop:

- `computed`: the next position the request's rows will be (DLV-1): ``hit_end`` at STARTED or
  RESUMED, advanced by the request's rows at every save.
- `cursor`: the delivery cursor ``d`` (DLV-2): every position below it was handed out, or passed
  over after a discard (DLV-4). It never moves back.
- `state`: free, running, preempted or ended.

An entry outlives its admission's end while an unended step carries it, since a late builder may
still materialize that step; it is freed when the last such step ends. Ended entries are few, so
the save and consume of a decode step pay nothing for this.

This unit decides nothing about steps, pages or slots; `CacheCore` composes it and asks it for
positions at save and for the delivered range at consume.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from omni_cache_core._errors import InvariantError
from omni_cache_core._occupancy import any_true

__all__ = ["Admissions", "carried_by"]

Int64Array = npt.NDArray[np.int64]

FREE: Final = 0
RUNNING: Final = 1
PREEMPTED: Final = 2
ENDED: Final = 3
STATE_NAMES: Final = {FREE: "free", RUNNING: "running", PREEMPTED: "preempted", ENDED: "ended"}

_INITIAL_ENTRIES: Final = 64


class Admissions:
    """The per-admission position and delivery state (LIFE-1, DLV-1, DLV-2)."""

    __slots__ = ("_free", "computed", "cursor", "ended", "state")

    def __init__(self) -> None:
        self.computed: Int64Array = np.zeros(_INITIAL_ENTRIES, dtype=np.int64)
        self.cursor: Int64Array = np.zeros(_INITIAL_ENTRIES, dtype=np.int64)
        self.state = np.zeros(_INITIAL_ENTRIES, dtype=np.int8)
        #: Entries whose admission ended while unended steps still carry them.
        self.ended: set[int] = set()
        # Lowest entries first, so a run reuses a small prefix of the arrays.
        self._free: list[int] = list(range(_INITIAL_ENTRIES - 1, -1, -1))

    # ---------------------------------------------------------------------------------------
    # Lifecycle (LIFE-1..4).

    def admit(self, hit_end: int) -> int:
        """Open an admission whose positions start at `hit_end`; return its entry."""
        if not self._free:
            self._grow()
        entry = self._free.pop()
        self.state[entry] = RUNNING
        self.computed[entry] = hit_end
        self.cursor[entry] = 0
        return entry

    def preempt(self, entry: int) -> None:
        """LIFE-3: the admission keeps its cursor; its positions restart at the resume."""
        self.state[entry] = PREEMPTED

    def resume(self, entry: int, hit_end: int) -> int:
        """LIFE-4: positions restart at `hit_end`. Returns the delivery cursor (DLV-3)."""
        self.state[entry] = RUNNING
        self.computed[entry] = hit_end
        return int(self.cursor[entry])

    def end(self, entry: int, carried: bool) -> None:
        """The admission ended; its entry is freed now, or once no unended step carries it."""
        if carried:
            self.state[entry] = ENDED
            self.ended.add(entry)
        else:
            self._release_entry(entry)

    # ---------------------------------------------------------------------------------------
    # Steps.

    def on_save(self, entries: Int64Array, rows: Int64Array) -> tuple[Int64Array, Int64Array]:
        """A step carries `rows` rows of each admission: return their positions (DLV-1).

        Returns each admission's first and one-past-last position. `entries` are distinct (a
        layout names a request once).
        """
        first = self.computed[entries]
        end = first + rows
        self.computed[entries] = end
        return first, end

    def on_step_end(self, carried: list[Int64Array]) -> None:
        """A step ended: free the ended entries that no unended step (`carried`) holds now."""
        for entry in list(self.ended):
            if not carried_by(entry, carried):
                self.ended.discard(entry)
                self._release_entry(entry)

    def deliver(
        self, entries: Int64Array, cursor: Int64Array, lo: Int64Array, hi: Int64Array
    ) -> tuple[Int64Array, Int64Array, Int64Array | None]:
        """Hand out positions ``[max(lo, d), hi)`` and move each cursor to ``hi`` (DLV-2, DLV-4).

        `cursor` is ``self.cursor[entries]``, as the caller read it for its DLV-5 check. Returns
        the delivered start and end per entry (``start == end`` when nothing is new) and how many
        of the rows the step carries come before the start, or None when none do.
        """
        if not any_true(cursor > lo):
            # The usual step: nothing at or above its first row was delivered yet.
            self.cursor[entries] = hi
            return lo, hi, None
        start = np.maximum(lo, cursor)
        end = np.maximum(hi, start)
        self.cursor[entries] = end
        return start, end, np.minimum(start, hi) - lo

    def undeliver(self, entries: Int64Array, before: Int64Array, after: Int64Array) -> None:
        """A delivery never reached the caller: put back each cursor `deliver` moved from
        `before` to `after`, unless another consume moved it on since (D19)."""
        back = self.cursor[entries] == after
        self.cursor[entries[back]] = before[back]

    # ---------------------------------------------------------------------------------------
    # State.

    def canonical(self, live: dict[Any, int], steps: list[Int64Array]) -> tuple[Any, ...]:
        """A value of this state independent of how entries happen to be numbered.

        Entries are renamed in order of first appearance: live requests sorted by id, then the
        steps' entries in step order.
        """
        names: dict[int, int] = {}
        for entry in [*(live[r] for r in sorted(live)), *(e for s in steps for e in s.tolist())]:
            names.setdefault(int(entry), len(names))
        return (
            tuple((r, names[live[r]]) for r in sorted(live)),
            tuple(tuple(names[int(e)] for e in s.tolist()) for s in steps),
            tuple(
                (
                    name,
                    int(self.state[entry]),
                    int(self.computed[entry]),
                    int(self.cursor[entry]),
                )
                for entry, name in names.items()
            ),
        )

    def check(self, live: dict[Any, int], preempted: set[Any], steps: list[Int64Array]) -> None:
        """Check this unit's invariants against the live requests and the unended steps.

        Raises:
            InvariantError: One does not hold (a bug in this library).
        """
        carried: set[int] = set()
        for entries in steps:
            if len(np.unique(entries)) != len(entries):
                raise InvariantError("a step carries one admission twice")
            carried.update(entries.tolist())
        used = set(np.flatnonzero(self.state != FREE).tolist())
        if used & set(self._free) or len(used) + len(self._free) != len(self.state):
            raise InvariantError("the free list and the entry states disagree")
        if not carried <= used:
            raise InvariantError("a step carries a freed admission entry")
        live_entries = set(live.values())
        if len(live_entries) != len(live):
            raise InvariantError("two live requests share an admission entry")
        for req_id, entry in live.items():
            want = PREEMPTED if req_id in preempted else RUNNING
            if self.state[entry] != want:
                raise InvariantError(
                    f"request {req_id!r}: entry {entry} is {STATE_NAMES[int(self.state[entry])]}"
                    f", expected {STATE_NAMES[want]}"
                )
        if used - live_entries != self.ended:
            raise InvariantError("ended entries do not match those of no live request")
        if not self.ended <= carried:
            raise InvariantError("an ended entry outlived the steps that carry it")
        if (self.cursor < 0).any() or (self.computed < 0).any():
            raise InvariantError("a negative position or cursor")

    # ---------------------------------------------------------------------------------------
    # Internals.

    def _release_entry(self, entry: int) -> None:
        self.state[entry] = FREE
        self._free.append(entry)

    def _grow(self) -> None:
        size = len(self.state)
        self.computed = np.concatenate([self.computed, np.zeros(size, dtype=np.int64)])
        self.cursor = np.concatenate([self.cursor, np.zeros(size, dtype=np.int64)])
        self.state = np.concatenate([self.state, np.zeros(size, dtype=np.int8)])
        self._free.extend(range(2 * size - 1, size - 1, -1))


def carried_by(entry: int, step_entries: Iterable[Int64Array]) -> bool:
    """Whether any unended step, given by its entry array, carries admission `entry`."""
    return any(any_true(entries == entry) for entries in step_entries)
