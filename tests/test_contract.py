"""Contract types: identities, enums, config, policy and request lifecycle records."""

from __future__ import annotations

import math
import types
from typing import Any

import attrs
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import omni_cache_core
from omni_cache_core import (
    HIDDEN_KEY,
    ConfigError,
    ModelCachePolicy,
    PrefixCacheConfig,
    PrefixCacheEventKind,
    PrefixCacheRequestEvent,
    PrefixCacheStep,
    RequestEventError,
    StepId,
    TensorName,
    Tid,
    WriteSchedule,
    is_hidden_key,
    without_hidden,
)

MiB = 1024 * 1024
INT_FIELDS = [
    "num_blocks",
    "block_size",
    "gpu_staging_bytes",
    "staging_depth",
    "staging_capacity_tokens",
    "copy_chunk_bytes",
]


def _config(**overrides: Any) -> PrefixCacheConfig:
    fields: dict[str, Any] = {"num_blocks": 8, "block_size": 4}
    fields.update(overrides)
    return PrefixCacheConfig(**fields)


# ---------------------------------------------------------------------------------------------
# Identities and the hidden key.


def test_identities_are_plain_values_at_run_time() -> None:
    """The id types wrap nothing at run time: a TensorName is a str and a StepId an int."""
    assert TensorName("talker.h") == "talker.h"
    assert type(TensorName("talker.h")) is str
    assert StepId(3) == 3
    assert type(Tid(3)) is int


def test_hidden_key_value() -> None:
    """The reserved hidden-state key keeps the contract's name."""
    assert HIDDEN_KEY == "__hidden_states__"


def test_is_hidden_key() -> None:
    """Only the reserved name is the hidden-state key."""
    assert is_hidden_key(HIDDEN_KEY)
    assert is_hidden_key("__hidden_states__")
    assert not is_hidden_key("talker.h")
    assert not is_hidden_key("")


@given(st.lists(st.sampled_from([HIDDEN_KEY, "a", "b.c", "codes.audio", ""])))
def test_without_hidden_drops_only_the_hidden_key(keys: list[str]) -> None:
    """without_hidden returns the set of the given names minus the hidden-state key."""
    result = without_hidden(keys)
    assert isinstance(result, set)
    assert HIDDEN_KEY not in result
    assert result | ({HIDDEN_KEY} & set(keys)) == set(keys)


# ---------------------------------------------------------------------------------------------
# Enums.


@pytest.mark.parametrize("member", [*WriteSchedule, *PrefixCacheEventKind])
def test_enum_repr_pastes_back_as_code(member: WriteSchedule | PrefixCacheEventKind) -> None:
    """An enum member's repr evaluates back to the same member."""
    assert eval(repr(member), vars(omni_cache_core)) is member


def test_write_schedule_values() -> None:
    """The write schedules keep the contract's values."""
    assert WriteSchedule.JOIN_NEXT_STEP.value == "join_next_step"
    assert WriteSchedule.JOIN_ON_FINISH.value == "join_on_finish"
    assert len(WriteSchedule) == 2


def test_event_kind_values() -> None:
    """The request event kinds: the seed's three, then preempted and resumed (LIFE-2)."""
    assert [k.value for k in PrefixCacheEventKind] == [
        "started",
        "finished",
        "aborted",
        "preempted",
        "resumed",
    ]


# ---------------------------------------------------------------------------------------------
# PrefixCacheConfig.


def test_config_defaults() -> None:
    """A config built from the two required fields has the contract's defaults."""
    cfg = PrefixCacheConfig(num_blocks=10, block_size=16)
    assert cfg.num_blocks == 10
    assert cfg.block_size == 16
    assert cfg.gpu_staging_bytes == 512 * MiB
    assert cfg.staging_depth == 4
    assert cfg.staging_capacity_tokens == 1024
    assert cfg.staging_claim_timeout_s == 30.0
    assert cfg.copy_chunk_bytes == 16 * MiB


@pytest.mark.parametrize("missing", ["num_blocks", "block_size"])
def test_config_requires_blocks(missing: str) -> None:
    """num_blocks and block_size have no default."""
    fields = {"num_blocks": 1, "block_size": 1}
    del fields[missing]
    with pytest.raises(TypeError, match=missing):
        PrefixCacheConfig(**fields)


def test_config_is_keyword_only_and_frozen() -> None:
    """A config takes keywords only and cannot be changed after construction."""
    with pytest.raises(TypeError):
        PrefixCacheConfig(8, 4)  # type: ignore[misc]
    cfg = _config()
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        cfg.block_size = 8  # type: ignore[misc]


@pytest.mark.parametrize("name", INT_FIELDS)
@pytest.mark.parametrize("bad", [0, -1, 2.0, True, False, "4", None, np.int64(4)])
def test_config_int_fields_reject_bad_values(name: str, bad: object) -> None:
    """Every sizing field rejects values that are not an int > 0 with an error naming it."""
    with pytest.raises(ConfigError) as info:
        _config(**{name: bad})
    assert info.value.field == name
    assert info.value.value is bad
    assert name in str(info.value)
    assert repr(bad) in str(info.value)


@pytest.mark.parametrize("name", INT_FIELDS)
def test_config_int_fields_accept_one(name: str) -> None:
    """Every sizing field accepts the smallest legal value, 1."""
    assert getattr(_config(**{name: 1}), name) == 1


@pytest.mark.parametrize("good", [0, 0.0, 0.5, 7, 1e6])
def test_config_timeout_accepts_finite_non_negative(good: float) -> None:
    """The claim timeout accepts any finite number of seconds >= 0, int or float."""
    assert _config(staging_claim_timeout_s=good).staging_claim_timeout_s == good


@pytest.mark.parametrize(
    "bad", [-0.001, -1, math.nan, math.inf, -math.inf, 1e300, True, "1", None, [1.0]]
)
def test_config_timeout_rejects_bad_values(bad: object) -> None:
    """The claim timeout rejects negative, non-finite and non-number values, naming the field."""
    with pytest.raises(ConfigError) as info:
        _config(staging_claim_timeout_s=bad)
    assert info.value.field == "staging_claim_timeout_s"
    assert "staging_claim_timeout_s" in str(info.value)


@pytest.mark.parametrize(
    ("seconds", "nanoseconds"),
    [(30.0, 30_000_000_000), (0, 0), (0.0, 0), (7, 7_000_000_000), (0.001, 1_000_000)],
)
def test_config_timeout_ns(seconds: float, nanoseconds: int) -> None:
    """The claim timeout converts to whole nanoseconds."""
    ns = _config(staging_claim_timeout_s=seconds).staging_claim_timeout_ns
    assert ns == nanoseconds
    assert type(ns) is int


@given(st.integers(1, 10_000), st.integers(1, 512))
def test_config_num_slots(num_blocks: int, block_size: int) -> None:
    """num_slots counts one row per KV slot of every block."""
    cfg = PrefixCacheConfig(num_blocks=num_blocks, block_size=block_size)
    assert cfg.num_slots == num_blocks * block_size


def test_config_evolve_revalidates() -> None:
    """attrs.evolve runs the same validation as construction."""
    with pytest.raises(ConfigError, match="staging_depth"):
        attrs.evolve(_config(), staging_depth=0)


def test_config_equality_and_hash() -> None:
    """Configs with equal fields are equal and hash alike."""
    assert _config(staging_depth=2) == _config(staging_depth=2)
    assert hash(_config(staging_depth=2)) == hash(_config(staging_depth=2))
    assert _config(staging_depth=2) != _config(staging_depth=3)


NS = types.SimpleNamespace


@pytest.mark.parametrize(
    ("scheduler", "model", "capacity"),
    [
        (NS(max_num_batched_tokens=8192, max_model_len=4096), NS(max_model_len=2048), 8192),
        (NS(max_num_batched_tokens=None, max_model_len=4096), NS(max_model_len=2048), 4096),
        (NS(max_num_batched_tokens=0, max_model_len=4096), None, 4096),
        (NS(), NS(max_model_len=2048), 2048),
        (NS(max_model_len=0), NS(max_model_len=2048), 2048),
        (None, NS(max_model_len=3000), 3000),
        (None, None, 1024),
        (NS(), NS(), 1024),
        (NS(max_num_batched_tokens="512"), None, 512),
        (NS(max_num_batched_tokens=300.7), None, 300),
        (NS(max_num_batched_tokens="many"), None, 1024),
        (NS(max_num_batched_tokens=object()), None, 1024),
        (NS(max_num_batched_tokens=math.nan), None, 1024),
        (NS(max_num_batched_tokens=math.inf), None, 1024),
        (NS(max_num_batched_tokens=-5), None, 1),
    ],
)
def test_from_vllm_config_capacity(scheduler: object, model: object, capacity: int) -> None:
    """from_vllm_config sizes a page from batched tokens, then max_model_len, then 1024."""
    cfg = PrefixCacheConfig.from_vllm_config(
        num_blocks=32, block_size=16, scheduler_config=scheduler, model_config=model
    )
    assert cfg.staging_capacity_tokens == capacity


def test_from_vllm_config_keeps_other_defaults() -> None:
    """from_vllm_config passes the block geometry through and leaves the rest at defaults."""
    cfg = PrefixCacheConfig.from_vllm_config(
        num_blocks=32, block_size=16, scheduler_config=NS(max_num_batched_tokens=2048)
    )
    assert cfg == PrefixCacheConfig(num_blocks=32, block_size=16, staging_capacity_tokens=2048)


def test_from_vllm_config_validates_geometry() -> None:
    """from_vllm_config rejects a bad block geometry with an error naming the field."""
    with pytest.raises(ConfigError) as info:
        PrefixCacheConfig.from_vllm_config(num_blocks=32, block_size=0)
    assert info.value.field == "block_size"


# ---------------------------------------------------------------------------------------------
# ModelCachePolicy.


def test_policy_defaults() -> None:
    """A default policy caches hidden states and defers nothing."""
    policy = ModelCachePolicy()
    assert policy.needs_full_hidden_states is True
    assert policy.deferred_keys == frozenset()
    assert policy.hidden_key == HIDDEN_KEY


def test_policy_hidden_key_none_when_opted_out() -> None:
    """A policy that does not cache hidden states has no hidden key."""
    assert ModelCachePolicy(needs_full_hidden_states=False).hidden_key is None


@pytest.mark.parametrize(
    "keys", [["b", "a"], ("a", "b"), {"a", "b"}, iter(["a", "b", "a"]), frozenset("ab")]
)
def test_policy_deferred_keys_from_any_iterable(keys: Any) -> None:
    """Deferred keys given as any iterable of names are stored as a frozenset."""
    policy = ModelCachePolicy(deferred_keys=keys)
    assert policy.deferred_keys == frozenset({"a", "b"})
    assert type(policy.deferred_keys) is frozenset


@pytest.mark.parametrize("bad", ["codes", b"codes", [HIDDEN_KEY], ["a", 3], [""], 5, None])
def test_policy_deferred_keys_rejections(bad: object) -> None:
    """Deferred keys reject a bare string, the hidden key, non-str or empty names, non-iterables."""
    with pytest.raises(ConfigError) as info:
        ModelCachePolicy(deferred_keys=bad)  # type: ignore[arg-type]
    assert info.value.field == "deferred_keys"
    assert "deferred_keys" in str(info.value)


@pytest.mark.parametrize("bad", [1, 0, None, "yes"])
def test_policy_flag_must_be_bool(bad: object) -> None:
    """needs_full_hidden_states rejects non-bool values with an error naming the field."""
    with pytest.raises(ConfigError) as info:
        ModelCachePolicy(needs_full_hidden_states=bad)  # type: ignore[arg-type]
    assert info.value.field == "needs_full_hidden_states"


def test_policy_equality_ignores_input_container() -> None:
    """Policies built from equal key collections are equal and hash alike."""
    a = ModelCachePolicy(deferred_keys=["x", "y"])
    b = ModelCachePolicy(deferred_keys={"y", "x"})
    assert a == b
    assert hash(a) == hash(b)


def test_get_hit_keys_example() -> None:
    """get_hit_keys puts hidden first when cached, then the mm keys sorted and deduplicated."""
    keys = ["talker.h", HIDDEN_KEY, "codes.audio", "talker.h"]
    assert ModelCachePolicy().get_hit_keys(keys) == [HIDDEN_KEY, "codes.audio", "talker.h"]
    opted_out = ModelCachePolicy(needs_full_hidden_states=False)
    assert opted_out.get_hit_keys(keys) == ["codes.audio", "talker.h"]


def test_get_hit_keys_adds_hidden_even_if_not_given() -> None:
    """A policy that caches hidden states always plans the hidden key first."""
    assert ModelCachePolicy().get_hit_keys(["m"]) == [HIDDEN_KEY, "m"]
    assert ModelCachePolicy().get_hit_keys([]) == [HIDDEN_KEY]


@given(st.lists(st.sampled_from([HIDDEN_KEY, "a", "b", "c.d", "z"])), st.booleans())
def test_get_hit_keys_properties(keys: list[str], hidden: bool) -> None:
    """get_hit_keys lists each mm key once, in order, with hidden first exactly when cached."""
    result = ModelCachePolicy(needs_full_hidden_states=hidden).get_hit_keys(keys)
    mm = result[1:] if hidden else result
    assert (result[:1] == [HIDDEN_KEY]) is hidden
    assert HIDDEN_KEY not in mm
    assert mm == sorted(mm)
    assert len(mm) == len(set(mm))
    assert set(mm) == set(keys) - {HIDDEN_KEY}


def test_skip_immediate_mm() -> None:
    """The immediate mm path skips the hidden key and deferred keys only."""
    policy = ModelCachePolicy(deferred_keys=["codes.audio"])
    assert policy.skip_immediate_mm(HIDDEN_KEY)
    assert policy.skip_immediate_mm("codes.audio")
    assert not policy.skip_immediate_mm("talker.h")


def test_from_model_defaults() -> None:
    """A model without the legacy attributes gets the default policy."""
    assert ModelCachePolicy.from_model(NS()) == ModelCachePolicy()
    assert ModelCachePolicy.from_model(object()) == ModelCachePolicy()


def test_from_model_reads_legacy_attributes() -> None:
    """from_model reads the legacy hidden-state flag and deferred key list."""
    model = NS(
        requires_full_prefix_cached_hidden_states=False,
        deferred_prefix_cache_mm_keys=["codes.audio", "codes.audio"],
    )
    policy = ModelCachePolicy.from_model(model)
    assert policy.needs_full_hidden_states is False
    assert policy.deferred_keys == frozenset({"codes.audio"})


@pytest.mark.parametrize(("flag", "expected"), [(0, False), (1, True), (None, False), ("", False)])
def test_from_model_coerces_flag(flag: object, expected: bool) -> None:
    """from_model takes the truth value of the legacy flag, and None deferred keys as none."""
    model = NS(requires_full_prefix_cached_hidden_states=flag, deferred_prefix_cache_mm_keys=None)
    policy = ModelCachePolicy.from_model(model)
    assert policy.needs_full_hidden_states is expected
    assert policy.deferred_keys == frozenset()


def test_from_model_rejects_hidden_deferred() -> None:
    """from_model rejects a model that defers the hidden-state key."""
    with pytest.raises(ConfigError, match="deferred_keys"):
        ModelCachePolicy.from_model(NS(deferred_prefix_cache_mm_keys=[HIDDEN_KEY]))


# ---------------------------------------------------------------------------------------------
# PrefixCacheRequestEvent.

STARTED = PrefixCacheEventKind.STARTED


def test_event_defaults() -> None:
    """An event needs only an id and a kind; the counts default to 0 and no blocks."""
    event = PrefixCacheRequestEvent(req_id="r", kind=PrefixCacheEventKind.FINISHED)
    assert (event.hit_end, event.block_ids, event.scheduled_tokens) == (0, (), 0)


@pytest.mark.parametrize(
    "block_ids",
    [
        [3, 1, 2],
        (3, 1, 2),
        np.array([3, 1, 2]),
        np.array([3, 1, 2], dtype=np.uint16),
        iter([3, 1, 2]),
    ],
)
def test_event_block_ids_from_any_sequence(block_ids: Any) -> None:
    """Block ids given as any sequence of ints are stored as a tuple of plain ints."""
    event = PrefixCacheRequestEvent(req_id="r", kind=STARTED, block_ids=block_ids)
    assert event.block_ids == (3, 1, 2)
    assert type(event.block_ids) is tuple
    assert all(type(b) is int for b in event.block_ids)


@pytest.mark.parametrize(
    "bad",
    [[1, -1], [1.0], [True], [1, False], ["1"], "12", b"12", 5, None, [None], np.array([0.5])],
)
def test_event_block_ids_rejections(bad: object) -> None:
    """Block ids reject negatives and non-ints with an error naming the request and field."""
    with pytest.raises(RequestEventError) as info:
        PrefixCacheRequestEvent(req_id="req-9", kind=STARTED, block_ids=bad)  # type: ignore[arg-type]
    assert info.value.req_id == "req-9"
    assert info.value.field == "block_ids"
    assert "req-9" in str(info.value)
    assert "block_ids" in str(info.value)


@pytest.mark.parametrize("name", ["hit_end", "scheduled_tokens"])
@pytest.mark.parametrize("bad", [-1, 1.0, True, "3", None])
def test_event_counts_rejections(name: str, bad: object) -> None:
    """hit_end and scheduled_tokens reject values that are not an int >= 0, naming both ids."""
    with pytest.raises(RequestEventError) as info:
        PrefixCacheRequestEvent(req_id="req-3", kind=STARTED, **{name: bad})
    assert (info.value.req_id, info.value.field) == ("req-3", name)
    assert name in str(info.value)


@pytest.mark.parametrize("bad", ["started", None, WriteSchedule.JOIN_NEXT_STEP])
def test_event_kind_rejections(bad: object) -> None:
    """An event's kind must be a PrefixCacheEventKind member."""
    with pytest.raises(RequestEventError) as info:
        PrefixCacheRequestEvent(req_id="req-4", kind=bad)  # type: ignore[arg-type]
    assert (info.value.req_id, info.value.field) == ("req-4", "kind")


@pytest.mark.parametrize("bad", ["", 7, None])
def test_event_req_id_rejections(bad: object) -> None:
    """An event's request id must be a non-empty str."""
    with pytest.raises(RequestEventError) as info:
        PrefixCacheRequestEvent(req_id=bad, kind=STARTED)  # type: ignore[arg-type]
    assert info.value.field == "req_id"


def test_event_block_ids_from_range() -> None:
    """Block ids given as a range are stored as the tuple of its ints."""
    event = PrefixCacheRequestEvent(req_id="r", kind=STARTED, block_ids=range(4, 7))
    assert event.block_ids == (4, 5, 6)


def test_event_is_hashable_value() -> None:
    """Events with equal fields are equal and hash alike, whatever sequence held the blocks."""
    a = PrefixCacheRequestEvent(req_id="r", kind=STARTED, hit_end=16, block_ids=[1, 2])
    b = PrefixCacheRequestEvent(req_id="r", kind=STARTED, hit_end=16, block_ids=(1, 2))
    assert a == b
    assert hash(a) == hash(b)


# ---------------------------------------------------------------------------------------------
# PrefixCacheStep.


def _event(req_id: str) -> PrefixCacheRequestEvent:
    return PrefixCacheRequestEvent(req_id=req_id, kind=STARTED)


def test_step_defaults() -> None:
    """An empty step has no events and no scheduled tokens."""
    step = PrefixCacheStep()
    assert step.events == ()
    assert dict(step.scheduled_tokens) == {}


def test_step_events_from_any_sequence() -> None:
    """Step events given as a list or generator are stored as a tuple in order."""
    events = [_event("a"), _event("b")]
    assert PrefixCacheStep(events=events).events == tuple(events)
    assert PrefixCacheStep(events=(e for e in events)).events == tuple(events)


@pytest.mark.parametrize("bad", [[_event("a"), "b"], [None], 5, "ab"])
def test_step_events_rejections(bad: object) -> None:
    """Step events reject items that are not request events, naming the field."""
    with pytest.raises(RequestEventError) as info:
        PrefixCacheStep(events=bad)  # type: ignore[arg-type]
    assert info.value.field == "events"


def test_step_copies_scheduled_tokens() -> None:
    """A step keeps its own copy of the scheduled-token mapping."""
    source = {"a": 3, "b": 1}
    step = PrefixCacheStep(scheduled_tokens=source)
    source["a"] = 99
    source["c"] = 5
    assert dict(step.scheduled_tokens) == {"a": 3, "b": 1}
    assert type(step.scheduled_tokens) is dict


@pytest.mark.parametrize(
    ("bad", "req_id"),
    [
        ({"a": 1, "b": -2}, "b"),
        ({"a": 1, "b": -1, "c": 3}, "b"),  # they sum to their number, as a decode step's do
        ({"a": 1.5}, "a"),
        ({"a": 1, "b": 2.0}, "b"),
        ({"a": np.int64(3)}, "a"),
        ({"a": "3"}, "a"),
        ({"a": None}, "a"),
        ({"a": 1, 7: 1}, None),
        (5, None),
        (None, None),
    ],
)
def test_step_scheduled_tokens_rejections(bad: object, req_id: str | None) -> None:
    """Scheduled tokens reject non-str ids and counts that are not ints >= 0, naming the request."""
    with pytest.raises(RequestEventError) as info:
        PrefixCacheStep(scheduled_tokens=bad)  # type: ignore[arg-type]
    assert info.value.field == "scheduled_tokens"
    assert info.value.req_id == req_id


_counts = st.one_of(
    st.integers(-3, 300), st.booleans(), st.floats(allow_nan=True), st.none(), st.text(max_size=2)
)


@given(st.dictionaries(st.text(min_size=1, max_size=4), _counts, max_size=12))
def test_step_scheduled_tokens_validation_matches_rule(counts: dict[str, Any]) -> None:
    """A mapping is accepted exactly when every count is an int >= 0, and an error names a bad entry."""
    valid = all(isinstance(v, int) and v >= 0 for v in counts.values())
    if valid:
        assert dict(PrefixCacheStep(scheduled_tokens=counts).scheduled_tokens) == counts
        return
    with pytest.raises(RequestEventError) as info:
        PrefixCacheStep(scheduled_tokens=counts)
    bad = counts[info.value.req_id]  # type: ignore[index]
    assert not (isinstance(bad, int) and bad >= 0)


def test_step_compares_by_identity() -> None:
    """Steps compare and hash by identity, since their mapping cannot be hashed."""
    a = PrefixCacheStep(scheduled_tokens={"r": 1})
    b = PrefixCacheStep(scheduled_tokens={"r": 1})
    assert a != b
    assert len({a, b, a}) == 2


# ---------------------------------------------------------------------------------------------
# Exports.


def test_every_contract_name_is_exported() -> None:
    """Every public contract name is re-exported by the package and listed in __all__."""
    from omni_cache_core import _contract

    for name in _contract.__all__:
        assert name in omni_cache_core.__all__
        assert getattr(omni_cache_core, name) is getattr(_contract, name)
    assert sorted(set(omni_cache_core.__all__)) == sorted(omni_cache_core.__all__)


# ---------------------------------------------------------------------------------------------
# Fast constructors of values the core builds.


@pytest.mark.parametrize(
    "cls, fast", [("PrefetchRead", "_of_registered"), ("ReadPlan", "_of_planned")]
)
def test_fast_constructors_equal_the_constructors(cls: str, fast: str) -> None:
    """The core's positional constructors set every field as the keyword constructor does."""
    from omni_cache_core import _values

    klass = getattr(_values, cls)
    values = {field.name: object() for field in attrs.fields(klass)}
    built = getattr(klass, fast)(*values.values())
    expected = klass(**values)
    assert type(built) is klass
    for name, value in values.items():
        assert getattr(built, name) is value is getattr(expected, name)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        setattr(built, next(iter(values)), 0)


def test_a_hits_slots_are_each_blocks_run_of_slots() -> None:
    """A start's hit slots are each block's run of slots, in block order, whatever sizes of
    hits came before (the offsets behind them are kept between starts)."""
    from omni_cache_core._reads import HitReads

    hits = HitReads(num_slots=64 * 4, block_size=4, num_blocks=64)
    for block_ids in ([3], [5, 0, 7], [], list(range(20)), [9, 9], [63]):
        got = hits._block_slots(iter(block_ids), len(block_ids))
        assert got.dtype == np.int64
        assert got.tolist() == [b * 4 + i for b in block_ids for i in range(4)]
