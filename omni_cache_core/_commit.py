"""The claims of a commit: every cached key's slots for the step (SLOT-2, SLOT-4, TASK-1, D1, D2).

A commit gives the step's slots, for every key seen so far, to one owner each: the step write
for immediate keys (D1), each request's deferred write for deferred keys (D2, SLOT-5), explicit
absence for keys the step did not emit (SLOT-4). An owner displaced from a slot it had in flight
gets a tombstone (SLOT-2). This spans two machines, the write tasks and the slot tables, and
nothing else: the router calls it between the save's copy-on-write (HIT-6) and the planning of
its reads (D4), and hands the page to the step and its write (PAGE-3).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from omni_cache_core._contract import StepId, TensorName, Tid
from omni_cache_core._occupancy import ABSENT, SlotTables
from omni_cache_core._tasks import WriteTasks
from omni_cache_core._values import CommitEffect, SaveBegin, SlotArray, Tombstone

__all__ = ["claim_step", "mark_absent"]


def claim_step(
    sv: SaveBegin,
    charged: int,
    step_id: StepId,
    page: int,
    writes: WriteTasks,
    tables: SlotTables,
    effects: list[CommitEffect],
) -> Tid | None:
    """Claim the step's slots for every key; return the step write's tid, if it has one.

    `charged`: the bytes the save reserved (BUDGET-2); what no write's clone views is given back.
    Appends to `effects`, in order, the `Tombstone` of each displaced write (SLOT-2) and the
    `DeferredChunk` of each request's rows (D2). Every key of the save has its table already.
    """
    step_tid: Tid | None = None
    tickets_left = charged
    if sv.num_tokens:
        slots = sv.slots
        # Only a registered write owns slots (SLOT-1): a key no write holds has nothing in
        # flight. Read before this commit registers its own writes.
        busy = writes.busy_keys()
        if sv.immediate_keys:
            step_tid = writes.register_step_write(
                step_id, page, sv.immediate_keys, slots, sv.immediate_bytes
            ).tid
            tickets_left -= sv.immediate_bytes
            _claim(sv.immediate_keys, slots, step_tid, busy, writes, tables, effects)
        if sv.deferred_keys:
            row_owner, deferred_tids = writes.stage_deferred(sv, effects)
            _claim(sv.deferred_keys, slots, row_owner, busy, writes, tables, effects)
            if sv.deferred_bytes:
                writes.add_ticket(sv.deferred_bytes, deferred_tids)
                tickets_left -= sv.deferred_bytes
        # Every key the save emits has its table, and its keys are distinct (`KeySets.check`):
        # as many tables as keys means none is absent, the usual step once the keys are known.
        absent: list[TensorName] = []
        if len(tables.by_key) != len(sv.immediate_keys) + len(sv.deferred_keys):
            emitted = {*sv.immediate_keys, *sv.deferred_keys}
            absent = [key for key in tables.by_key if key not in emitted]
        if absent:
            # SLOT-4: the step's requests wrote nothing for these keys: explicit absence.
            _claim(absent, slots, ABSENT, busy, writes, tables, effects)
    if tickets_left:
        # Charges with no viewer (nothing was cloned after all) are given back at once.
        writes.unreserve(tickets_left)
    return step_tid


def mark_absent(
    slots: SlotArray, writes: WriteTasks, tables: SlotTables, effects: list[Tombstone]
) -> None:
    """SPEC-3: rejected draft rows: every key's slots become ABSENT with a new version, and a
    write still carrying them gets a tombstone, so those rows never reach the pool."""
    _claim(list(tables.by_key), slots, ABSENT, writes.busy_keys(), writes, tables, effects)


def _claim(
    keys: tuple[TensorName, ...] | list[TensorName],
    slots: SlotArray,
    owner: int | npt.NDArray[np.int32],
    busy: set[TensorName],
    writes: WriteTasks,
    tables: SlotTables,
    effects: list[CommitEffect] | list[Tombstone],
) -> None:
    """Claim (or mark absent) `slots` of each key for `owner`; tombstone displaced writes (SLOT-2).

    `busy`: the keys a write registered before this commit holds slots of; for any other key
    no earlier owner can be in flight, and none is looked for.
    """
    by_key = tables.by_key
    for key in keys:
        for tid, lost in by_key[key].take(slots, owner, writes_in_flight=key in busy):
            writes.tombstone(Tid(tid), key, lost)
            effects.append(Tombstone(tid=Tid(tid), key=key, slots=lost))
