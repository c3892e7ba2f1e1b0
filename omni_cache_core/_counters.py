"""The core's plain counters for `stats()`: not state, never in a snapshot."""

from __future__ import annotations

import numpy as np

from omni_cache_core._values import SlotSource

__all__ = ["CoreCounters"]


class CoreCounters:
    """Plain counters the core keeps for `stats()`; not part of the snapshot."""

    __slots__ = (
        "budget_flushes",
        "draft_rows",
        "draft_rows_accepted",
        "draft_rows_read_back",
        "draft_rows_rejected",
        "draft_rows_unconfirmed",
        "hit_requests",
        "hit_rows",
        "page_timeouts",
        "steps_consumed",
        "steps_discarded",
        "steps_saved",
        "wait_timeouts",
        "writes_failed",
    )

    def __init__(self) -> None:
        self.steps_saved = 0
        self.steps_consumed = 0
        self.steps_discarded = 0
        self.hit_requests = 0
        #: Hit rows handed out, indexed by `SlotSource` value.
        self.hit_rows = np.zeros(len(SlotSource), dtype=np.int64)
        self.budget_flushes = 0
        self.page_timeouts = 0
        self.wait_timeouts = 0
        self.writes_failed = 0
        #: Draft rows saved, and what became of them (SPEC): accepted, rejected, left
        #: unconfirmed by an end or a preemption, and accepted rows read back by a later save.
        self.draft_rows = 0
        self.draft_rows_accepted = 0
        self.draft_rows_rejected = 0
        self.draft_rows_unconfirmed = 0
        self.draft_rows_read_back = 0
