"""The driver interface: what `CacheMachine` asks of the system under test, and in what terms.

A driver is anything with the methods of `CacheDriver`. The machine only talks to it through:

- ``start(events)``: one `new_step_starts` with these lifecycle records (finishes, aborts,
  preemptions, resumes and starts, with or without hits). Raises what the cache raises.
- ``save(spec, *, stall=False, on_page_wait=None) -> StepId``: one `save_outputs` of `SaveSpec`
  (requests in batch order, their slots, one integer per row per emitted key). With
  ``stall=True`` the committer does no work while the save waits, so time runs to the deadline;
  otherwise the awaited tasks are landed. ``on_page_wait`` is called once if the save has to wait
  for a page (another thread consuming a step meanwhile, CONC-3); without it time runs out.
- ``materialize(step_id, req_ids) -> Delivered``: its ``rows``, per key (hidden first when
  cached, then the step's mm keys) and request, are the rows of the positions handed out: hit
  rows then this step's rows, less those below the delivery cursor (DLV-2); zeros read as
  ``0``. Its ``positions`` are each request's ``(start, end)`` (DLV-7).
- ``discard(step_id)``, ``shutdown()``, ``register_policy(policy)``.
- ``in_flight() -> tuple[Tid, ...]``: write tasks the committer holds and has not finished;
  ``land(tid)`` moves one of them one stage (copy started, copy landed, rows in the pool);
  ``fail(tid)`` fails it (FAIL-1).
- ``advance_clock(ns)``, ``snapshot()``, ``check_invariants()`` (the core's and the driver's own),
  ``open_step_ids``, ``sync()`` (feed pending committer reports in) and ``save_touched`` (the
  last save fed reports in or escalated tasks: committer progress, not a trace of the save).

A driver that cannot pause its committer may land work as soon as it is queued; the machine then
explores fewer interleavings but every check still holds.

Besides `CacheDriver` this module holds the terms of those calls: `SaveSpec` (one save as the
engine lays it out), `Delivered` and `Rows` (what a materialize handed out), `row_value` (the
write identity of each saved row) and the two mm keys the machine emits, `MM_KEY` (immediate)
and `DEFERRED_KEY` (deferred).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol, TypeAlias

import attrs

from omni_cache_core._contract import (
    HIDDEN_KEY,
    ModelCachePolicy,
    PrefixCacheRequestEvent,
    ReqId,
    StepId,
    TensorName,
    Tid,
)

__all__ = [
    "DEFERRED_KEY",
    "MM_KEY",
    "CacheDriver",
    "Delivered",
    "Rows",
    "SaveSpec",
    "row_value",
]

#: An immediate mm key (copied at save).
MM_KEY = TensorName("talker.h")
#: A deferred mm key (copied at finish, abort or budget flush).
DEFERRED_KEY = TensorName("codes.audio")

#: Per key (hidden first when cached, then mm keys sorted), per request: the row values.
Rows: TypeAlias = dict[TensorName, dict[ReqId, tuple[int, ...]]]


class Delivered(NamedTuple):
    """What one materialize handed out.

    Attributes:
        rows: Per key, per request, the rows of the positions handed out, in position order.
        positions: Per request, the ``(start, end)`` of those positions (DLV-7).
    """

    rows: Rows
    positions: dict[ReqId, tuple[int, int]]


_KEY_CODE: dict[TensorName, int] = {HIDDEN_KEY: 1, MM_KEY: 2, DEFERRED_KEY: 3}


def row_value(attempt: int, row: int, key: TensorName) -> int:
    """The write identity of one saved row: save attempt, row in the step, and key.

    Never 0, so a zero read back always means "zeros" (HIT-3), never a real row.
    """
    return attempt * 1000 + row * 10 + _KEY_CODE.get(key, 9)


@attrs.frozen(kw_only=True)
class SaveSpec:
    """One save as the engine lays it out.

    Attributes:
        req_ids: Requests in batch order.
        slots: Per request, the KV slot of each of its rows in this step.
        values: ``(key, row values)`` per key the step emits; one value per step row.
    """

    req_ids: tuple[ReqId, ...]
    slots: tuple[tuple[int, ...], ...]
    values: tuple[tuple[TensorName, tuple[int, ...]], ...] = ()

    @property
    def num_tokens(self) -> int:
        """Rows of the step."""
        return sum(len(s) for s in self.slots)

    @property
    def flat_slots(self) -> tuple[int, ...]:
        """Every row's slot, in batch order."""
        return tuple(slot for run in self.slots for slot in run)

    @property
    def bounds(self) -> dict[ReqId, tuple[int, int]]:
        """Row range ``[start, end)`` of each request."""
        out: dict[ReqId, tuple[int, int]] = {}
        start = 0
        for req_id, run in zip(self.req_ids, self.slots, strict=True):
            out[req_id] = (start, start + len(run))
            start += len(run)
        return out

    def value_map(self) -> dict[TensorName, tuple[int, ...]]:
        """The emitted keys and their row values."""
        return dict(self.values)


class CacheDriver(Protocol):
    """What `CacheMachine` needs from the system under test (see the module docstring)."""

    now_ns: int
    save_touched: bool

    @property
    def open_step_ids(self) -> tuple[StepId, ...]: ...

    def sync(self) -> None: ...

    def start(self, events: Sequence[PrefixCacheRequestEvent]) -> None: ...

    def save(
        self,
        spec: SaveSpec,
        *,
        stall: bool = False,
        on_page_wait: Callable[[], None] | None = None,
    ) -> StepId: ...

    def materialize(self, step_id: StepId, req_ids: Sequence[ReqId]) -> Delivered: ...

    def discard(self, step_id: StepId) -> None: ...

    def register_policy(self, policy: ModelCachePolicy) -> None: ...

    def shutdown(self) -> None: ...

    def in_flight(self) -> tuple[Tid, ...]: ...

    def land(self, tid: Tid) -> None: ...

    def fail(self, tid: Tid) -> None: ...

    def advance_clock(self, ns: int) -> None: ...

    def snapshot(self) -> Any: ...

    def check_invariants(self) -> None: ...
