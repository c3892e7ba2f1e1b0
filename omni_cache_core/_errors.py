"""Error classes of the prefix cache.

The contract's two public roots stay the roots of every runtime contract violation:
`OmniPrefixCacheUnmatchError` (anything that must raise rather than pass as a miss) and its
subclass `OmniPrefixCacheStagingTimeoutError`. The precise subclasses below carry structured
fields, stored as attributes, and a message naming the ids and states involved. Each class
docstring says what state survives the error.

Construction parameters that are wrong raise `ValueError` subclasses (`ConfigError`,
`RequestEventError`) when the value is built. A broken internal invariant raises `InvariantError`,
an `AssertionError`: it is a bug in this library, never the caller's fault.

Structured errors are rebuilt from their fields when pickled, so they survive the trip from a
model worker process back to the engine with every field intact.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, ClassVar

__all__ = [
    "BadInputError",
    "ConfigError",
    "DeliveryOrderError",
    "HitUnreadableError",
    "HostAllocationError",
    "IllegalTransitionError",
    "InvariantError",
    "LifecycleError",
    "OmniPrefixCacheStagingTimeoutError",
    "OmniPrefixCacheUnmatchError",
    "OversizeStepError",
    "PageTimeoutError",
    "RequestEventError",
    "ShutDownError",
    "StagingCopyError",
    "StepAlreadyConsumedError",
    "UnknownStepError",
    "WaitTimeoutError",
    "WriteFailedError",
]


def _rebuild(cls: type[BaseException], fields: dict[str, Any]) -> BaseException:
    """Rebuild a structured error from its fields (the pickle path)."""
    return cls(**fields)


class _Structured(BaseException):
    """Mixin for errors whose keyword-only fields fully describe them.

    `BaseException` pickles as `cls(*self.args)`, which fails for keyword-only constructors;
    `__reduce__` rebuilds from the fields instead.
    """

    _FIELDS: ClassVar[tuple[str, ...]] = ()

    def __reduce__(self) -> tuple[Callable[..., BaseException], tuple[Any, ...]]:
        fields = {name: getattr(self, name) for name in self._FIELDS}
        return (_rebuild, (type(self), fields))


def _sorted_ids(ids: Iterable[int]) -> tuple[int, ...]:
    return tuple(sorted(ids))


def _fmt_ids(ids: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(i) for i in ids) + "]"


# ---------------------------------------------------------------------------------------------
# Contract roots.


class OmniPrefixCacheUnmatchError(RuntimeError):
    """Contract, configuration or KV-occupancy error that must raise.

    Covers hit spans that resolve to absent slots (the cache diverged from the engine's KV
    state), a step id consumed twice or never saved, a step larger than a staging page, and a
    failed write. These are never to be treated as a cache miss. What state survives depends on
    the subclass: each one says whether the cache is unchanged or must be discarded.
    """


class OmniPrefixCacheStagingTimeoutError(OmniPrefixCacheUnmatchError):
    """A save waited for a free staging page and timed out.

    The save issued no step id and left no trace (STEP-5): the cache is unchanged.
    """


# ---------------------------------------------------------------------------------------------
# Construction errors.


class ConfigError(_Structured, ValueError):
    """A configuration or policy field has a wrong value.

    Raised when the value object is built; nothing was created, so no state exists.

    Attributes:
        field: Name of the offending field, for example ``"block_size"``.
        value: The rejected value.
        expected: What the field accepts, in words.
    """

    _FIELDS = ("field", "value", "expected")

    def __init__(self, *, field: str, value: object, expected: str) -> None:
        self.field = field
        self.value = value
        self.expected = expected
        super().__init__(f"bad config field {field!r}: expected {expected}, got {value!r}")


class RequestEventError(_Structured, ValueError):
    """A request lifecycle record or a step record has a wrong field.

    Raised when the record is built; nothing reached the cache, which is unchanged.

    Attributes:
        req_id: The request the record is about, or ``None`` when it cannot be told (for example
            an item of a step's event list that is not an event at all).
        field: Name of the offending field, for example ``"block_ids"``.
        value: The rejected value.
        expected: What the field accepts, in words.
    """

    _FIELDS = ("req_id", "field", "value", "expected")

    def __init__(self, *, req_id: str | None, field: str, value: object, expected: str) -> None:
        self.req_id = req_id
        self.field = field
        self.value = value
        self.expected = expected
        who = "request record" if req_id is None else f"request {req_id!r}"
        super().__init__(f"{who}: bad field {field!r}: expected {expected}, got {value!r}")


# ---------------------------------------------------------------------------------------------
# Steps (STEP).


class UnknownStepError(_Structured, OmniPrefixCacheUnmatchError):
    """A step id given to materialize or discard was never issued (STEP-2).

    The cache is unchanged: every open step stays open.

    Attributes:
        step_id: The id that was given.
        open_step_ids: The ids still waiting to be consumed, sorted.
    """

    _FIELDS = ("step_id", "open_step_ids")
    _WHAT: ClassVar[str] = "is unknown (no save returned it)"

    def __init__(self, *, step_id: int, open_step_ids: Iterable[int]) -> None:
        self.step_id = step_id
        self.open_step_ids = _sorted_ids(open_step_ids)
        super().__init__(f"step {step_id} {self._WHAT}; open steps: {_fmt_ids(self.open_step_ids)}")


class StepAlreadyConsumedError(UnknownStepError):
    """A step id was materialized or discarded a second time (STEP-1, STEP-2).

    The cache is unchanged: the first consume stands and every open step stays open.

    Attributes:
        step_id: The id that was given.
        open_step_ids: The ids still waiting to be consumed, sorted.
    """

    _WHAT = "was already consumed"


# ---------------------------------------------------------------------------------------------
# Waits and timeouts (PAGE-4, TASK-3, FAIL-3).


class PageTimeoutError(_Structured, OmniPrefixCacheStagingTimeoutError):
    """A save found no free staging page within the timeout (PAGE-4).

    The save issued no step id and left no trace (STEP-5): the cache is unchanged, and a save
    after the open steps are consumed works.

    Attributes:
        timeout_s: The bound that ran out, in seconds.
        open_step_ids: Step ids saved but not yet consumed, sorted; each holds a page.
        tasks_in_flight: ``(tid, state name)`` of every write still holding a page, by tid.
    """

    _FIELDS = ("timeout_s", "open_step_ids", "tasks_in_flight")

    def __init__(
        self,
        *,
        timeout_s: float,
        open_step_ids: Iterable[int],
        tasks_in_flight: Iterable[tuple[int, str]],
    ) -> None:
        self.timeout_s = timeout_s
        self.open_step_ids = _sorted_ids(open_step_ids)
        self.tasks_in_flight = tuple(sorted(tasks_in_flight))
        writes = ", ".join(f"task {tid} {state}" for tid, state in self.tasks_in_flight)
        super().__init__(
            f"no free staging page within {timeout_s}s; "
            f"unconsumed steps: {_fmt_ids(self.open_step_ids)} "
            f"(materialize or discard them); writes in flight: [{writes}]"
        )


class WaitTimeoutError(_Structured, OmniPrefixCacheUnmatchError):
    """A bounded wait on a write task ran out (TASK-3, FAIL-3).

    The call that waited made no change (a waiting save is rolled back, STEP-5); the write it
    waited on stays in flight and is not cancelled, so a later call may succeed.

    Attributes:
        what: Which wait: ``"save barrier"``, ``"hit join"`` or ``"budget flush"``.
        tid: The write task waited on.
        state: That task's state name when the wait ended, for example ``"COPYING"``.
        timeout_s: The bound that ran out, in seconds.
    """

    _FIELDS = ("what", "tid", "state", "timeout_s")

    def __init__(self, *, what: str, tid: int, state: str, timeout_s: float) -> None:
        self.what = what
        self.tid = tid
        self.state = state
        self.timeout_s = timeout_s
        super().__init__(
            f"{what} timed out after {timeout_s}s waiting on write task {tid} (state {state})"
        )


# ---------------------------------------------------------------------------------------------
# Writes and hits (FAIL-1, HIT-4).


class WriteFailedError(_Structured, OmniPrefixCacheUnmatchError):
    """A write to the host pool failed; the failure is sticky (FAIL-1).

    The cache is closed and must be discarded: rows behind prefix hashes the engine already
    published are lost, so every later public call raises this error again.

    Attributes:
        tids: The write tasks that failed, sorted.
        reason: What went wrong, in words (usually the underlying exception).
    """

    _FIELDS = ("tids", "reason")

    def __init__(self, *, tids: Iterable[int], reason: str) -> None:
        self.tids = _sorted_ids(tids)
        self.reason = reason
        super().__init__(
            f"write tasks {_fmt_ids(self.tids)} failed: {reason}; rows behind published "
            "prefix hashes are lost, so the cache must be discarded"
        )


class HitUnreadableError(_Structured, OmniPrefixCacheUnmatchError):
    """A prefix hit cannot be served correctly (HIT-4, HIT-6).

    The cache and the engine's KV state have diverged for this request: it is never served as
    a miss. The cache's tables are unchanged.

    Attributes:
        req_id: The request whose hit failed.
        key: The cached tensor name that could not be read.
        reason: Why, in words (for example "slots are ABSENT", "writer 7 failed").
        slot_count: How many hit slots are affected.
    """

    _FIELDS = ("req_id", "key", "reason", "slot_count")

    def __init__(self, *, req_id: str, key: str, reason: str, slot_count: int) -> None:
        self.req_id = req_id
        self.key = key
        self.reason = reason
        self.slot_count = slot_count
        super().__init__(
            f"hit for request {req_id!r} cannot read key {key!r}: {reason} "
            f"({slot_count} slots); the cache and the engine's KV state have diverged"
        )


# ---------------------------------------------------------------------------------------------
# Input and lifecycle errors (FAIL-5, PAGE-5, FAIL-4, TASK-2).


class BadInputError(_Structured, OmniPrefixCacheUnmatchError, ValueError):
    """A runtime call got bad input (FAIL-5).

    Covers an unaligned hit, a hit without blocks, a slot count not matching the rows, an
    unknown request id in materialize, a width or dtype change of a cached key and out-of-range
    slot ids. The cache is unchanged and stays usable, except that a materialize with a bad
    request id still consumes its step (STEP-4).

    Attributes:
        what: The input that was wrong, for example ``"write_layout slot count"``.
        expected: What was expected, in words.
        got: What was given, in words.
    """

    _FIELDS = ("what", "expected", "got")

    def __init__(self, *, what: str, expected: str, got: str) -> None:
        self.what = what
        self.expected = expected
        self.got = got
        super().__init__(f"bad input: {what}: expected {expected}, got {got}")


class LifecycleError(BadInputError):
    """A request lifecycle record is illegal in the request's state (LIFE-2).

    For example RESUMED of a request that is not preempted, PREEMPTED twice, or STARTED of a
    preempted request. The whole step's records are refused: the cache is unchanged.

    Attributes:
        req_id: The request.
        event: The record's kind (``"resumed"``, ``"preempted"``, ...).
        state: The request's state when the record arrived (``"running"``, ``"preempted"``,
            ``"not live"``).
    """

    _FIELDS = ("req_id", "event", "state")

    def __init__(self, *, req_id: str, event: str, state: str) -> None:
        self.req_id = req_id
        self.event = event
        self.state = state
        legal = {
            "started": "a request that is not live",
            "preempted": "a running request",
            "resumed": "a preempted request",
        }.get(event, "a live request")
        super().__init__(
            what=f"{event.upper()} record of request {req_id!r}",
            expected=f"{event.upper()} only for {legal} (LIFE-2)",
            got=f"a request that is {state}",
        )


class DeliveryOrderError(_Structured, OmniPrefixCacheUnmatchError):
    """A materialize would hand out rows while an earlier, unconsumed step still owes some (DLV-5).

    The earlier step carries positions of the same admission that were not delivered yet;
    handing out this step's rows first would deliver them out of position order, or pass them
    over. The cache is unchanged: the step stays open, so the caller can consume the earlier
    step first and then this one (or discard either).

    Attributes:
        req_id: The request.
        step_id: The step whose materialize was refused.
        earlier_step_id: The unconsumed earlier step that still owes rows.
        gap: ``(start, end)``: the positions not yet delivered that the earlier step carries.
    """

    _FIELDS = ("req_id", "step_id", "earlier_step_id", "gap")

    def __init__(
        self, *, req_id: str, step_id: int, earlier_step_id: int, gap: tuple[int, int]
    ) -> None:
        self.req_id = req_id
        self.step_id = step_id
        self.earlier_step_id = earlier_step_id
        self.gap = (int(gap[0]), int(gap[1]))
        super().__init__(
            f"materialize(step {step_id}) would hand request {req_id!r} rows before positions "
            f"[{self.gap[0]}, {self.gap[1]}), which unconsumed step {earlier_step_id} still "
            "owes it; consume that step first (DLV-5). The step stays open."
        )


class HostAllocationError(_Structured, OmniPrefixCacheUnmatchError, MemoryError):
    """Host storage of a cached key could not be allocated or pinned.

    Raised by the call that needed it: `reserve`, or the key's first save. The cache is
    unchanged: keys it already had stay usable, and the call keeps nothing it allocated (a save
    issues no step id and leaves no trace, STEP-5), so nothing stays pinned for it. Free host
    memory, lower ``num_blocks`` or drop keys (README, host memory) and try again.

    Attributes:
        key: The cached tensor name.
        part: ``"pool"`` (one row per KV slot) or ``"pages"`` (the staging pages).
        nbytes: The bytes asked for.
        pinned: Whether the storage was to be pinned (on CUDA).
        reason: What went wrong, in words (usually the underlying exception).
    """

    _FIELDS = ("key", "part", "nbytes", "pinned", "reason")

    def __init__(self, *, key: str, part: str, nbytes: int, pinned: bool, reason: str) -> None:
        self.key = key
        self.part = part
        self.nbytes = nbytes
        self.pinned = pinned
        self.reason = reason
        kind = "pinned " if pinned else ""
        super().__init__(
            f"could not allocate {nbytes} bytes of {kind}host {part} for key {key!r}: {reason}"
        )


class StagingCopyError(_Structured, OmniPrefixCacheUnmatchError):
    """Copying a step's rows at save failed (the device clones or the copy into its page).

    The save issued no step id and left no trace (STEP-5): the cache is unchanged and the next
    save works once the cause is gone. As for a failed forward pass, the engine must not publish
    the step's block hashes (DESIGN.md D6).

    Attributes:
        key: The cached tensor name being copied, or ``None`` when it cannot be told.
        reason: What went wrong, in words (usually the underlying exception).
    """

    _FIELDS = ("key", "reason")

    def __init__(self, *, key: str | None, reason: str) -> None:
        self.key = key
        self.reason = reason
        what = "the step's rows" if key is None else f"the step's rows of key {key!r}"
        super().__init__(
            f"copying {what} at save failed: {reason}; the save issued no step id (STEP-5)"
        )


class OversizeStepError(_Structured, OmniPrefixCacheUnmatchError):
    """A step has more immediate rows than one staging page holds (PAGE-5).

    Raised before anything is claimed: the cache is unchanged. This is a sizing error, not a
    wait; build the config with a larger ``staging_capacity_tokens``.

    Attributes:
        rows: The step's immediate row count.
        capacity: Rows per staging page (``staging_capacity_tokens``).
    """

    _FIELDS = ("rows", "capacity")

    def __init__(self, *, rows: int, capacity: int) -> None:
        self.rows = rows
        self.capacity = capacity
        super().__init__(
            f"step has {rows} immediate rows but a staging page holds {capacity} "
            "(staging_capacity_tokens); size it from max_num_batched_tokens"
        )


class ShutDownError(_Structured, OmniPrefixCacheUnmatchError):
    """A call reached a cache that was shut down (FAIL-4).

    The cache is closed and must be discarded; every later call raises this error.

    Attributes:
        operation: The call that was refused, or ``None`` when a waiter was woken by shutdown.
    """

    _FIELDS = ("operation",)

    def __init__(self, *, operation: str | None = None) -> None:
        self.operation = operation
        prefix = "" if operation is None else f"cannot {operation}: "
        super().__init__(f"{prefix}the prefix cache is shut down")


class IllegalTransitionError(_Structured, OmniPrefixCacheUnmatchError):
    """A write task was asked to move along a path that TASK-2 does not allow.

    The move is rejected: the task keeps its state and the cache is unchanged.

    Attributes:
        tid: The write task.
        from_state: Its current state name.
        to_state: The state name it was asked to move to.
    """

    _FIELDS = ("tid", "from_state", "to_state")

    def __init__(self, *, tid: int, from_state: str, to_state: str) -> None:
        self.tid = tid
        self.from_state = from_state
        self.to_state = to_state
        super().__init__(
            f"write task {tid}: illegal transition {from_state} -> {to_state} "
            "(allowed: PENDING -> QUEUED -> COPYING -> HOST_READY -> WRITTEN, "
            "or any non-terminal state -> FAILED)"
        )


class InvariantError(AssertionError):
    """An internal invariant is broken: a bug in this library.

    The cache's state is not trustworthy any more and must be discarded.
    """
