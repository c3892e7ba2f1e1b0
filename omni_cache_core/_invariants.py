"""The invariants of the whole core: each machine's own, then those that span machines.

Each machine checks what it alone decides. What no single machine can see is checked here, over
all of them: a page holder names a live step, task or the save, on the page it names (PAGE-2,
PAGE-3); the tasks' budget reservation is the save's admitted charge (BUDGET-1); a slot owner is
a registered write that claimed that key (SLOT-1, D3); writes, lost and pending hits belong to
live requests, a pending hit to a running one (D10, LIFE-3); every read's step is unended.
"""

from __future__ import annotations

import numpy as np

from omni_cache_core._contract import StepId, Tid
from omni_cache_core._delivery import Admissions, RequestState
from omni_cache_core._errors import InvariantError
from omni_cache_core._occupancy import SlotTables
from omni_cache_core._pages import HolderKind, PageHolders
from omni_cache_core._reads import HitReads
from omni_cache_core._save import SaveInProgress
from omni_cache_core._steps import Steps
from omni_cache_core._tasks import WriteTasks

__all__ = ["check_machines"]


def _need(ok: bool, what: str) -> None:
    if not ok:
        raise InvariantError(what)


def check_machines(
    *,
    depth: int,
    pages: PageHolders,
    steps: Steps,
    writes: WriteTasks,
    slots: SlotTables,
    hits: HitReads,
    save: SaveInProgress,
    requests: Admissions,
) -> None:
    """Check every machine's invariants, then those across them.

    `depth`: the number of staging pages (at most that many steps are unended, PAGE-2).

    Raises:
        InvariantError: One does not hold; this is a bug in the library.
    """
    need = _need
    by_id, tasks, pending = steps.by_id, writes.tasks, save.pending
    pages.check_invariants()
    steps.check_invariants(depth)
    writes.check_invariants()
    slots.check_invariants()
    hits.check_invariants()
    save.check_invariants()
    requests.check_invariants(steps.entry_arrays())
    # PAGE-2/PAGE-3: holders name live things, on the page they name.
    held_by_steps = set()
    for index, (kind, ident) in pages.holders():
        if kind is HolderKind.STEP:
            step = by_id.get(StepId(ident))
            need(step is not None, f"page {index} held by dead step {ident}")
            need(step is not None and step.page == index, f"step {ident} on wrong page")
            held_by_steps.add(ident)
        elif kind is HolderKind.TASK:
            task = tasks.get(Tid(ident))
            need(task is not None, f"page {index} held by retired task {ident}")
            need(task is not None and task.page == index, f"task {ident} on wrong page")
        else:
            need(
                pending is not None and pending.page == index,
                f"page {index}: a stray save holder",
            )
    need(held_by_steps == set(by_id), "a step without its page holder")
    for task in tasks.values():
        if task.page is not None:
            holds = pages.holds(task.page, HolderKind.TASK, task.tid)
            need(holds, f"task {task.tid} lost page")
    if pending is not None and pending.page is not None:
        need(pages.holds(pending.page, HolderKind.SAVE), "pending save lost its page")
    # BUDGET-1: the tasks' reservation is the save's admitted charge.
    need(writes.reserved == save.reserved, "budget charge does not match live tickets")
    # SLOT-1/D3: an owner is a registered, non-terminal task that claimed that key.
    for key, table in slots.tables.items():
        for tid in np.unique(table.owner[table.owner > 0]).tolist():
            task = tasks.get(Tid(tid))
            need(task is not None, f"key {key}: slot owned by retired task {tid}")
            need(task is not None and key in task.slots, f"task {tid} owns an unclaimed key")
    live = requests.live()
    need(writes.requests_with_writes() <= live.keys(), "writes of a request not live")
    need(hits.lost_hit_requests() <= live.keys(), "a lost hit of a request that ended (D10)")
    need(
        all(live.get(r) is not RequestState.PREEMPTED for r in hits.start_hit_requests()),
        "a hit of a preempted request",
    )
    need(hits.step_ids() <= by_id.keys(), "a read outlived its step")
