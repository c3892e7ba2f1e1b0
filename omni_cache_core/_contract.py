"""Contract types shared by the engine, the core state machine and the adapter.

These are the public names of the interface contract: identities, the reserved hidden-state key,
the write schedules, the configuration, the per-model cache policy and the request lifecycle
records the engine feeds in each step. Every value is a frozen attrs class validated on
construction; a wrong field raises a `ValueError` subclass naming it (`ConfigError`,
`RequestEventError`). Nothing here needs torch.
"""

from __future__ import annotations

import enum
import math
import operator
from collections.abc import Iterable, Mapping
from typing import Any, Final, NewType, cast

import attrs
from attrs import field, frozen

from omni_cache_core._errors import ConfigError, InvariantError, RequestEventError

__all__ = [
    "HIDDEN_KEY",
    "ModelCachePolicy",
    "PrefixCacheConfig",
    "PrefixCacheEventKind",
    "PrefixCacheRequestEvent",
    "PrefixCacheStep",
    "ReqId",
    "StepId",
    "TensorName",
    "Tid",
    "WriteSchedule",
    "is_hidden_key",
    "without_hidden",
]

# Four identities. At run time they are plain str/int; the type checker keeps them apart, so a
# step id passed where a task id is expected is caught before it runs.
#: Which cached tensor (hidden states or an mm output name); not a prefix hash.
TensorName = NewType("TensorName", str)
#: The engine's request id.
ReqId = NewType("ReqId", str)
#: A write task id, allocated from 1.
Tid = NewType("Tid", int)
#: A step id returned by a save and consumed exactly once (STEP-1), allocated from 1.
StepId = NewType("StepId", int)

#: Reserved pool key for hidden states (mm keys are flat dotted names). It is only an identity:
#: whether a model caches hidden states is `ModelCachePolicy.needs_full_hidden_states`.
HIDDEN_KEY: Final[TensorName] = TensorName("__hidden_states__")


def is_hidden_key(key: str) -> bool:
    """Tell whether `key` is the reserved hidden-state key."""
    return key == HIDDEN_KEY


def without_hidden(keys: Iterable[str]) -> set[TensorName]:
    """Drop the reserved hidden-state key; the rest are mm names."""
    # NewType is the identity at run time; the cast avoids a call per key.
    return cast(set[TensorName], {k for k in keys if k != HIDDEN_KEY})


class _CodeRepr(enum.Enum):
    """Enum whose repr pastes back as code (hypothesis prints failing programs with it)."""

    # Members are singletons compared by identity; Enum's own hash is a Python-level call, and
    # the core looks states up in dicts on every report.
    __hash__ = object.__hash__

    def __repr__(self) -> str:
        return f"{type(self).__name__}.{self.name}"


class WriteSchedule(_CodeRepr):
    """When a write task's rows must reach the host pool."""

    #: Immediate keys: the device-to-host copy is launched at save into the step's staging page,
    #: and the next save waits until the rows are in the pool (TASK-3), because a reused slot
    #: must not leave a pending pool write behind.
    JOIN_NEXT_STEP = "join_next_step"
    #: Deferred mm keys: rows stay on a device clone until the request finishes or aborts, or the
    #: GPU-byte budget forces an earlier copy (BUDGET-2). At most one open task per request.
    JOIN_ON_FINISH = "join_on_finish"


# ---------------------------------------------------------------------------------------------
# Configuration.


def _is_plain_int(value: object) -> bool:
    # bool is an int subclass, but True is never a meaningful size.
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_int(_instance: object, attribute: attrs.Attribute[int], value: object) -> None:
    """Validate that a sizing field is an int > 0 (FAIL-5)."""
    if not _is_plain_int(value) or cast(int, value) <= 0:
        raise ConfigError(field=attribute.name, value=value, expected="an int > 0")


def _timeout_seconds(_instance: object, attribute: attrs.Attribute[float], value: object) -> None:
    """Validate a timeout: a real number of seconds, finite and >= 0 (PAGE-4, FAIL-5)."""
    expected = "a finite number of seconds >= 0 (int or float; 0 means never wait)"
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise ConfigError(field=attribute.name, value=value, expected=expected)
    # The nanosecond form must be finite too, or `staging_claim_timeout_ns` could not be built.
    if not math.isfinite(value * 1e9) or value < 0:
        raise ConfigError(field=attribute.name, value=value, expected=expected)


@frozen(kw_only=True)
class PrefixCacheConfig:
    """Sizing and flow-control knobs of one cache (one per model worker).

    Prefer `from_vllm_config`, so that a staging page holds the scheduler's largest step.

    Attributes:
        num_blocks: KV blocks of the engine's cache; the mirror has one row per KV slot.
        block_size: Tokens per KV block; ``slot = block_id * block_size + offset``.
        gpu_staging_bytes: Device-clone byte budget for deferred (`JOIN_ON_FINISH`) keys and for
            immediate clones until their copy is done; exceeding it forces a copy (BUDGET-2).
        staging_depth: Number of device-to-host staging pages. A page holds one whole step (not
            one request), so this is how many step ids may be unconsumed at once (PAGE-2).
            Host memory per immediate key is about
            ``staging_depth * staging_capacity_tokens * width * itemsize``.
        staging_capacity_tokens: Rows per staging page; a step with more immediate rows raises
            (PAGE-5). There is no clamp.
        staging_claim_timeout_s: Bound of every wait (page claim, save barrier, hit join, budget
            flush), in seconds (FAIL-3). ``0`` means never wait: fail at once.
        copy_chunk_bytes: Deferred rows are copied device-to-host in pieces of at most this many
            bytes (BUDGET-3).

    Raises:
        ConfigError: A field has a wrong type or value; the error names the field. No config
            is built.
    """

    num_blocks: int = field(validator=_positive_int)
    block_size: int = field(validator=_positive_int)
    gpu_staging_bytes: int = field(default=512 * 1024 * 1024, validator=_positive_int)
    staging_depth: int = field(default=4, validator=_positive_int)
    staging_capacity_tokens: int = field(default=1024, validator=_positive_int)
    staging_claim_timeout_s: float = field(default=30.0, validator=_timeout_seconds)
    copy_chunk_bytes: int = field(default=16 * 1024 * 1024, validator=_positive_int)

    @property
    def num_slots(self) -> int:
        """Rows of every host mirror: one per KV slot (``num_blocks * block_size``)."""
        return self.num_blocks * self.block_size

    @property
    def staging_claim_timeout_ns(self) -> int:
        """The wait bound in integer nanoseconds, the unit the core's deadlines use."""
        timeout = self.staging_claim_timeout_s
        if isinstance(timeout, int):
            return timeout * 1_000_000_000
        return round(timeout * 1e9)

    @classmethod
    def from_vllm_config(
        cls,
        *,
        num_blocks: int,
        block_size: int,
        scheduler_config: Any = None,
        model_config: Any = None,
    ) -> PrefixCacheConfig:
        """Size the staging pages from the running scheduler.

        A page holds one step (the whole batch), so ``staging_capacity_tokens`` is the
        scheduler's ``max_num_batched_tokens``; without it, the scheduler's ``max_model_len``,
        then the model config's ``max_model_len``, then 1024. A value that is not a number
        falls back to 1024, and the result is at least 1. ``staging_depth`` keeps its default:
        it is how many step ids may be unconsumed at once, not ``max_num_seqs``.

        Args:
            num_blocks: KV blocks of the engine's cache.
            block_size: Tokens per KV block.
            scheduler_config: The engine's scheduler config, or None.
            model_config: The engine's model config, or None.

        Returns:
            A config with every other field at its default.

        Raises:
            ConfigError: `num_blocks` or `block_size` is not an int > 0. No config is built.
        """
        batched = getattr(scheduler_config, "max_num_batched_tokens", None)
        model_len = getattr(scheduler_config, "max_model_len", None)
        if not model_len and model_config is not None:
            model_len = getattr(model_config, "max_model_len", None)
        try:
            capacity = int(batched or model_len or 1024)
        # OverflowError: int(float("inf")); it falls back like any other non-number.
        except (TypeError, ValueError, OverflowError):
            capacity = 1024
        return cls(
            num_blocks=num_blocks,
            block_size=block_size,
            staging_capacity_tokens=max(1, capacity),
        )


# ---------------------------------------------------------------------------------------------
# Per-model cache policy.


def _deferred_keys(value: Iterable[str]) -> frozenset[TensorName]:
    """Convert any iterable of mm names to a frozenset, rejecting what cannot be deferred."""
    expected = "an iterable of non-empty mm tensor names (str), without the hidden-state key"
    # A bare string is iterable, but deferring each of its characters is never what was meant.
    if isinstance(value, str | bytes):
        raise ConfigError(field="deferred_keys", value=value, expected=expected)
    try:
        keys = frozenset(value)
    except TypeError:
        raise ConfigError(field="deferred_keys", value=value, expected=expected) from None
    for key in keys:
        if not isinstance(key, str) or not key or key == HIDDEN_KEY:
            raise ConfigError(field="deferred_keys", value=value, expected=expected)
    return cast(frozenset[TensorName], keys)


def _is_bool(_instance: object, attribute: attrs.Attribute[bool], value: object) -> None:
    if not isinstance(value, bool):
        raise ConfigError(field=attribute.name, value=value, expected="a bool")


@frozen(kw_only=True)
class ModelCachePolicy:
    """What one model caches: hidden states or not, and which mm keys are deferred.

    The hidden-state key's name is always `HIDDEN_KEY`; this object only answers whether this
    model caches it, and which mm keys wait for the request's end.

    Attributes:
        needs_full_hidden_states: Cache and return hidden states. When False, hidden states
            are neither cached nor returned and mm outputs still are (OUT-7).
        deferred_keys: Per-token mm keys that stay on a device clone until the request
            finishes or aborts (`WriteSchedule.JOIN_ON_FINISH`). Any iterable of names is
            accepted and stored as a frozenset.

    Raises:
        ConfigError: A field has a wrong value (a non-bool flag, a non-str or empty key, or
            the hidden-state key among the deferred keys); the error names the field.
    """

    needs_full_hidden_states: bool = field(default=True, validator=_is_bool)
    deferred_keys: frozenset[TensorName] = field(default=frozenset(), converter=_deferred_keys)

    @property
    def hidden_key(self) -> TensorName | None:
        """The pool key of hidden states, or None when this model does not cache them."""
        return HIDDEN_KEY if self.needs_full_hidden_states else None

    def get_hit_keys(self, keys: Iterable[str]) -> list[TensorName]:
        """List the keys to plan for a hit: hidden states first (if cached), then mm, sorted.

        Args:
            keys: Cached key names; the hidden-state key among them is ignored and re-added
                first only when this policy caches hidden states.
        """
        mm = sorted(without_hidden(keys))
        return [HIDDEN_KEY, *mm] if self.needs_full_hidden_states else mm

    def skip_immediate_mm(self, key: str) -> bool:
        """Tell whether the immediate mm path must skip `key` (hidden or deferred)."""
        return is_hidden_key(key) or key in self.deferred_keys

    @classmethod
    def from_model(cls, model: Any) -> ModelCachePolicy:
        """Build the policy from a model's legacy attributes.

        Reads ``requires_full_prefix_cached_hidden_states`` (default True) and
        ``deferred_prefix_cache_mm_keys`` (default none).

        Raises:
            ConfigError: The deferred keys are not valid names.
        """
        deferred = getattr(model, "deferred_prefix_cache_mm_keys", ()) or ()
        return cls(
            needs_full_hidden_states=bool(
                getattr(model, "requires_full_prefix_cached_hidden_states", True)
            ),
            deferred_keys=deferred,
        )


# ---------------------------------------------------------------------------------------------
# Request lifecycle records (the engine feeds these in at the start of every step).


class PrefixCacheEventKind(_CodeRepr):
    """What happened to a request at the start of a step."""

    #: The request was admitted: it may carry a prefix hit (HIT-1).
    STARTED = "started"
    #: The request finished normally; its open writes are escalated (TASK-4).
    FINISHED = "finished"
    #: The request was aborted; treated exactly like FINISHED (TASK-4).
    ABORTED = "aborted"
    #: The engine took the request's KV blocks back; it will come back RESUMED, or end. Its
    #: open writes are escalated as at a finish, and its unconsumed steps can still be
    #: materialized (LIFE-3).
    PREEMPTED = "preempted"
    #: A preempted request runs again, with a fresh block list and its new prefix hit
    #: (``hit_end`` may be 0, or beyond the prompt). Only rows not delivered yet are served
    #: again (LIFE-4, DLV-3).
    RESUMED = "resumed"


def _all_plain_ints(items: tuple[object, ...]) -> bool:
    # One C-level pass; bool and numpy integers are not `int` by type, so they fail here.
    return set(map(type, items)) <= {int}


def _block_ids(value: Iterable[int]) -> tuple[int, ...]:
    """Convert block ids to a tuple of ints; leave anything unconvertible to the validator."""
    if isinstance(value, tuple) and _all_plain_ints(value):
        return value
    if isinstance(value, str | bytes):
        return cast(tuple[int, ...], value)
    try:
        items = tuple(value)
    except TypeError:
        # Not iterable: the validator raises with the request id, which a converter cannot see.
        return cast(tuple[int, ...], value)
    kinds = set(map(type, items))
    # A bool would pass `operator.index` as 0 or 1, but a block id of True is a caller bug.
    if kinds <= {int} or bool in kinds:
        return items
    try:
        # numpy integers and other integer-like values become plain ints.
        return tuple(map(operator.index, items))
    except TypeError:
        return items


def _event_kind(
    instance: PrefixCacheRequestEvent, attribute: attrs.Attribute[Any], value: object
) -> None:
    if not isinstance(value, PrefixCacheEventKind):
        raise RequestEventError(
            req_id=instance.req_id,
            field=attribute.name,
            value=value,
            expected="a PrefixCacheEventKind",
        )


def _req_id(instance: object, attribute: attrs.Attribute[str], value: object) -> None:
    if not isinstance(value, str) or not value:
        raise RequestEventError(
            req_id=None, field=attribute.name, value=value, expected="a non-empty str"
        )


def _non_negative_count(
    instance: PrefixCacheRequestEvent, attribute: attrs.Attribute[int], value: object
) -> None:
    if not _is_plain_int(value) or cast(int, value) < 0:
        raise RequestEventError(
            req_id=instance.req_id, field=attribute.name, value=value, expected="an int >= 0"
        )


def _block_id_tuple(
    instance: PrefixCacheRequestEvent, attribute: attrs.Attribute[tuple[int, ...]], value: object
) -> None:
    ok = isinstance(value, tuple) and (
        not value or (_all_plain_ints(value) and min(cast(tuple[int, ...], value)) >= 0)
    )
    if not ok:
        raise RequestEventError(
            req_id=instance.req_id,
            field=attribute.name,
            value=value,
            expected="a sequence of ints >= 0",
        )


@frozen(kw_only=True)
class PrefixCacheRequestEvent:
    """One request's lifecycle record for a step.

    Attributes:
        req_id: The engine's request id.
        kind: Started, finished, aborted, preempted or resumed.
        hit_end: Tokens already in the KV prefix cache when the request starts or resumes
            (0: no hit). The core checks it is block aligned (HIT-1). Read for STARTED and
            RESUMED only.
        block_ids: The request's KV block ids, in order (after a resume: its new block list).
            Any sequence of ints is accepted and stored as a tuple.
        scheduled_tokens: Tokens scheduled for the request in this step.

    Raises:
        RequestEventError: A field has a wrong type or value; the error names the request and
            the field. No record is built.
    """

    req_id: str = field(validator=_req_id)
    kind: PrefixCacheEventKind = field(validator=_event_kind)
    hit_end: int = field(default=0, validator=_non_negative_count)
    block_ids: tuple[int, ...] = field(default=(), converter=_block_ids, validator=_block_id_tuple)
    scheduled_tokens: int = field(default=0, validator=_non_negative_count)


def _events(value: Iterable[PrefixCacheRequestEvent]) -> tuple[PrefixCacheRequestEvent, ...]:
    if isinstance(value, tuple):
        return value
    try:
        return tuple(value)
    except TypeError:
        return cast(tuple[PrefixCacheRequestEvent, ...], value)


def _event_tuple(_instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if isinstance(value, tuple) and set(map(type, value)) <= {PrefixCacheRequestEvent}:
        return
    bad = value
    if isinstance(value, tuple):
        bad = next(v for v in value if not isinstance(v, PrefixCacheRequestEvent))
    raise RequestEventError(
        req_id=None,
        field=attribute.name,
        value=bad,
        expected="a sequence of PrefixCacheRequestEvent",
    )


def _scheduled_tokens(value: Mapping[str, int]) -> dict[str, int]:
    try:
        return dict(value)
    except (TypeError, ValueError):
        return cast(dict[str, int], value)


def _counts_look_valid(counts: dict[Any, Any]) -> bool:
    """Check a scheduled-token mapping in a few C-level passes (the happy path).

    A decode step carries one entry per running request (256 and more) and the whole core
    budget per step is about 150 microseconds, so there is no per-entry Python loop here:
    ``str.join`` fails on a non-str key, ``sum`` fails or stops being an ``int`` on a float,
    a numpy integer or any non-number, and ``min`` finds a negative count. A bool passes as
    the int 0 or 1 it is. Any failure falls to a slow pass that names the culprit.
    """
    if not counts:
        return True
    try:
        "".join(counts)
        return type(sum(counts.values())) is int and min(counts.values()) >= 0
    except TypeError:
        return False


def _scheduled_map(_instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if isinstance(value, dict) and _counts_look_valid(value):
        return
    if not isinstance(value, dict):
        raise RequestEventError(
            req_id=None, field=attribute.name, value=value, expected="a mapping of req_id to int"
        )
    for req_id, count in value.items():
        if not isinstance(req_id, str):
            raise RequestEventError(
                req_id=None, field=attribute.name, value=req_id, expected="str request ids"
            )
        # Any int passes, bool included, as in the fast path: both accept the same mappings.
        if not isinstance(count, int) or count < 0:
            raise RequestEventError(
                req_id=req_id, field=attribute.name, value=count, expected="an int >= 0"
            )
    raise InvariantError(f"{attribute.name} failed the fast check, but no entry is wrong")


@frozen(kw_only=True, eq=False)
class PrefixCacheStep:
    """The request lifecycle records and token counts of one engine step.

    Steps compare and hash by identity (``eq=False``): the token-count mapping is a dict, which
    cannot be hashed, and a step record is a one-shot input that is never looked up by value.

    Attributes:
        events: Requests that start, finish or abort at this step. Any sequence is accepted and
            stored as a tuple.
        scheduled_tokens: Tokens scheduled per request id in this step. Stored as a private
            dict copy, so later changes to the caller's mapping do not reach the cache.
        computed_tokens: Per request id, its computed-token count as the engine knows it at
            this step (vLLM's ``num_computed_tokens``). With speculative decoding it says how
            many of a request's draft rows were accepted: the ones below it; the rest are
            rejected and rolled back (SPEC-2, SPEC-3). Entries of requests without unconfirmed
            drafts are ignored. A private dict copy, like ``scheduled_tokens``.

    Raises:
        RequestEventError: An item is not an event, a request id is not a str, or a count is
            not an int >= 0; the error names the request (when known) and the field.
    """

    events: tuple[PrefixCacheRequestEvent, ...] = field(
        default=(), converter=_events, validator=_event_tuple
    )
    scheduled_tokens: Mapping[str, int] = field(
        factory=dict, converter=_scheduled_tokens, validator=_scheduled_map
    )
    computed_tokens: Mapping[str, int] = field(
        factory=dict, converter=_scheduled_tokens, validator=_scheduled_map
    )

    @classmethod
    def _of_checked_counts(cls, scheduled_tokens: Mapping[str, int]) -> PrefixCacheStep:
        """A step without records or computed counts, whose scheduled counts the caller checked.

        The caller guarantees what the validator would check: every id a str and every count
        an int >= 0. The vLLM glue's decode step has proved it on its way (its ids are the
        running requests', its counts ints equal to 1), and the validator's passes over
        hundreds of entries would cost more than the rest of the step's records. The counts
        are copied, as the constructor copies them.
        """
        step = object.__new__(cls)
        _set = object.__setattr__
        _set(step, "events", ())
        _set(step, "scheduled_tokens", dict(scheduled_tokens))
        _set(step, "computed_tokens", {})
        return step
