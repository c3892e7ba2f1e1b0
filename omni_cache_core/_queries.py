"""The read-only queries of `CacheCore`: what the adapter, tests and diagnostics may ask.

Every query answers from the machines the router composes and changes nothing; none hands out
a machine's own registry (arrays come as read-only views, registries as copies).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import numpy.typing as npt

from omni_cache_core._contract import ReqId, StepId, TensorName, Tid
from omni_cache_core._delivery import Admissions, RequestState
from omni_cache_core._errors import WriteFailedError
from omni_cache_core._occupancy import SlotTables
from omni_cache_core._pages import PageHolders
from omni_cache_core._reads import HitReads
from omni_cache_core._save import SaveInProgress
from omni_cache_core._steps import Steps
from omni_cache_core._tasks import TaskClaims, WriteTasks
from omni_cache_core._values import SlotArray, TaskState

__all__ = ["CoreQueries"]


class CoreQueries:
    """The queries of `CacheCore`, over the machines it sets up in its constructor."""

    _closed: bool
    _fatal: WriteFailedError | None
    _pages: PageHolders
    _slots: SlotTables
    _writes: WriteTasks
    _requests: Admissions
    _hits: HitReads
    _saved: Steps
    _save: SaveInProgress

    @property
    def closed(self) -> bool:
        """Whether `ShutDown` was fed in."""
        return self._closed

    @property
    def fatal(self) -> WriteFailedError | None:
        """The sticky write failure (FAIL-1), if any."""
        return self._fatal

    @property
    def budget_used(self) -> int:
        """Device clone bytes currently charged (BUDGET-1)."""
        return self._writes.budget_used

    @property
    def pages_in_use(self) -> int:
        """Pages with at least one holder."""
        return self._pages.in_use

    @property
    def open_step_ids(self) -> tuple[StepId, ...]:
        """Saved steps not yet consumed, by id."""
        return self._saved.open_ids()

    def unended_step_ids(self) -> tuple[StepId, ...]:
        """Saved steps whose consume has not ended, by id (those being consumed included)."""
        return tuple(self._saved.by_id)

    @property
    def installed_keys(self) -> tuple[TensorName, ...]:
        """Cached keys seen so far, in first-seen order."""
        return tuple(self._slots.by_key)

    @property
    def save_in_progress(self) -> bool:
        """Whether a save began and was neither committed nor aborted."""
        return self._save.pending is not None

    def request_states(self) -> dict[ReqId, RequestState]:
        """Every live request's lifecycle state, by id in sorted order (LIFE-1)."""
        return self._requests.live()

    def slot_owners(self, key: TensorName) -> npt.NDArray[np.int32] | None:
        """A read-only view of a cached key's owner codes per slot (SLOT-1), or None."""
        table = self._slots.get(key)
        return None if table is None else _read_only(table.owner)

    def slot_versions(self, key: TensorName) -> npt.NDArray[np.uint32] | None:
        """A read-only view of a cached key's slot versions (D3), or None."""
        table = self._slots.get(key)
        return None if table is None else _read_only(table.version)

    def presence(self, key: TensorName, slot: int) -> tuple[int, int]:
        """Owner code and version of one (slot, key)."""
        table = self._slots.get(key)
        if table is None:
            return (-2, 0)
        return (int(table.owner[slot]), int(table.version[slot]))

    def occupancy_metadata_bytes(self) -> int:
        """Bytes of every occupancy table (SLOT-6), spare tables (`reserve_tables`) included."""
        return self._slots.metadata_bytes()

    def occupancy_bytes_per_key(self) -> int:
        """Bytes one cached key's occupancy table takes (SLOT-6, D3): 8 per slot."""
        return 8 * self._slots.num_slots

    @property
    def occupancy_tables_allocated(self) -> int:
        """How many occupancy tables were allocated so far, spare ones included."""
        return self._slots.allocated

    def reserved_keys(self) -> tuple[TensorName, ...]:
        """Keys whose spare table `reserve_tables` allocated and no save took yet."""
        return tuple(self._slots.spare)

    def reserve_tables(self, keys: Iterable[TensorName]) -> None:
        """Allocate the occupancy tables of keys not seen yet, ahead of their first save.

        An allocation hint, not an input: the state (and `snapshot`) is unchanged, and a key's
        first save takes its spare table. Keys seen or reserved already are skipped.

        Raises:
            MemoryError: A table could not be allocated; no table of this call is kept.
        """
        self._slots.reserve(keys)

    def task_state(self, tid: Tid) -> TaskState | None:
        """State of a registered task, or None once it left the registry (WRITTEN or FAILED)."""
        return self._writes.state_of(tid)

    def task_states(self) -> dict[Tid, TaskState]:
        """Every registered task's state, by tid (oldest first)."""
        return {tid: task.state for tid, task in self._writes.tasks.items()}

    def task_claims(self, tid: Tid) -> TaskClaims | None:
        """A registered task's chunks, slots and tombstones (copies), or None once it retired."""
        return self._writes.claims_of(tid)

    def open_write(self, req_id: ReqId) -> Tid | None:
        """The request's open deferred write (D2), or None."""
        return self._writes.open_write(req_id)

    def step_slots_of(self, step_id: StepId) -> tuple[tuple[ReqId, ...], SlotArray]:
        """Requests and row bounds of an unended step."""
        step = self._saved.by_id[step_id]
        return step.req_ids, step.row_bounds

    def has_step(self, step_id: StepId) -> bool:
        """Whether a step is saved and its consume has not ended."""
        return step_id in self._saved.by_id

    def next_deadline_ns(self) -> int | None:
        """The earliest deadline of any wait in progress, or None."""
        deadlines = self._saved.deadlines()
        save = self._save.pending
        if save is not None and save.deadline_ns is not None:
            deadlines.append(save.deadline_ns)
        return min(deadlines) if deadlines else None


def _read_only(values: npt.NDArray[Any]) -> npt.NDArray[Any]:
    view = values.view()
    view.setflags(write=False)
    return view
