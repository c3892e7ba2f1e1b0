"""Error classes: roots, structured fields, messages and pickling."""

from __future__ import annotations

import inspect
import pickle
from typing import Any

import pytest

import omni_cache_core
from omni_cache_core import (
    BadInputError,
    ConfigError,
    HitUnreadableError,
    HostAllocationError,
    IllegalTransitionError,
    InvariantError,
    OmniPrefixCacheStagingTimeoutError,
    OmniPrefixCacheUnmatchError,
    OversizeStepError,
    PageTimeoutError,
    RequestEventError,
    ShutDownError,
    StagingCopyError,
    StepAlreadyConsumedError,
    UnknownStepError,
    WaitTimeoutError,
    WriteFailedError,
    _errors,
)

# (class, constructor kwargs, expected field values, roots, substrings the message must name)
CASES: list[tuple[type[BaseException], dict[str, Any], dict[str, Any], tuple[type, ...], list[str]]]
CASES = [
    (
        ConfigError,
        {"field": "block_size", "value": 0, "expected": "an int > 0"},
        {"field": "block_size", "value": 0, "expected": "an int > 0"},
        (ValueError,),
        ["block_size", "an int > 0", "0"],
    ),
    (
        RequestEventError,
        {"req_id": "req-7", "field": "block_ids", "value": (-1,), "expected": "ints >= 0"},
        {"req_id": "req-7", "field": "block_ids", "value": (-1,), "expected": "ints >= 0"},
        (ValueError,),
        ["req-7", "block_ids", "(-1,)", "ints >= 0"],
    ),
    (
        UnknownStepError,
        {"step_id": 9, "open_step_ids": [5, 2, 3]},
        {"step_id": 9, "open_step_ids": (2, 3, 5)},
        (OmniPrefixCacheUnmatchError,),
        ["step 9", "[2, 3, 5]", "unknown"],
    ),
    (
        StepAlreadyConsumedError,
        {"step_id": 4, "open_step_ids": (6, 5)},
        {"step_id": 4, "open_step_ids": (5, 6)},
        (UnknownStepError, OmniPrefixCacheUnmatchError),
        ["step 4", "[5, 6]", "already consumed"],
    ),
    (
        PageTimeoutError,
        {
            "timeout_s": 0.25,
            "open_step_ids": [12, 11],
            "tasks_in_flight": [(31, "COPYING"), (30, "QUEUED")],
        },
        {
            "timeout_s": 0.25,
            "open_step_ids": (11, 12),
            "tasks_in_flight": ((30, "QUEUED"), (31, "COPYING")),
        },
        (OmniPrefixCacheStagingTimeoutError, OmniPrefixCacheUnmatchError),
        ["0.25", "[11, 12]", "task 30 QUEUED", "task 31 COPYING"],
    ),
    (
        WaitTimeoutError,
        {"what": "save barrier", "tid": 17, "state": "HOST_READY", "timeout_s": 2.0},
        {"what": "save barrier", "tid": 17, "state": "HOST_READY", "timeout_s": 2.0},
        (OmniPrefixCacheUnmatchError,),
        ["save barrier", "17", "HOST_READY", "2.0"],
    ),
    (
        WriteFailedError,
        {"tids": [8, 3], "reason": "RuntimeError('copy failed')"},
        {"tids": (3, 8), "reason": "RuntimeError('copy failed')"},
        (OmniPrefixCacheUnmatchError,),
        ["[3, 8]", "copy failed", "discarded"],
    ),
    (
        HitUnreadableError,
        {"req_id": "req-2", "key": "talker.h", "reason": "slots are ABSENT", "slot_count": 16},
        {"req_id": "req-2", "key": "talker.h", "reason": "slots are ABSENT", "slot_count": 16},
        (OmniPrefixCacheUnmatchError,),
        ["req-2", "talker.h", "slots are ABSENT", "16"],
    ),
    (
        BadInputError,
        {"what": "write_layout slot count", "expected": "12 slots", "got": "10 slots"},
        {"what": "write_layout slot count", "expected": "12 slots", "got": "10 slots"},
        (OmniPrefixCacheUnmatchError, ValueError),
        ["write_layout slot count", "12 slots", "10 slots"],
    ),
    (
        HostAllocationError,
        {"key": "talker.h", "part": "pool", "nbytes": 4096, "pinned": True, "reason": "refused"},
        {"key": "talker.h", "part": "pool", "nbytes": 4096, "pinned": True, "reason": "refused"},
        (OmniPrefixCacheUnmatchError, MemoryError),
        ["talker.h", "pool", "4096", "pinned", "refused"],
    ),
    (
        StagingCopyError,
        {"key": "hidden", "reason": "RuntimeError('copy failed')"},
        {"key": "hidden", "reason": "RuntimeError('copy failed')"},
        (OmniPrefixCacheUnmatchError,),
        ["hidden", "copy failed", "no step id"],
    ),
    (
        OversizeStepError,
        {"rows": 2048, "capacity": 1024},
        {"rows": 2048, "capacity": 1024},
        (OmniPrefixCacheUnmatchError,),
        ["2048", "1024", "staging_capacity_tokens"],
    ),
    (
        ShutDownError,
        {"operation": "materialize"},
        {"operation": "materialize"},
        (OmniPrefixCacheUnmatchError,),
        ["materialize", "shut down"],
    ),
    (
        IllegalTransitionError,
        {"tid": 5, "from_state": "WRITTEN", "to_state": "QUEUED"},
        {"tid": 5, "from_state": "WRITTEN", "to_state": "QUEUED"},
        (OmniPrefixCacheUnmatchError,),
        ["task 5", "WRITTEN -> QUEUED"],
    ),
]
CASE_IDS = [case[0].__name__ for case in CASES]


@pytest.mark.parametrize(("cls", "kwargs", "fields", "roots", "named"), CASES, ids=CASE_IDS)
def test_error_roots(
    cls: type[BaseException],
    kwargs: dict[str, Any],
    fields: dict[str, Any],
    roots: tuple[type, ...],
    named: list[str],
) -> None:
    """Each structured error derives from its documented roots."""
    err = cls(**kwargs)
    for root in roots:
        assert isinstance(err, root), root


@pytest.mark.parametrize(("cls", "kwargs", "fields", "roots", "named"), CASES, ids=CASE_IDS)
def test_error_fields(
    cls: type[BaseException],
    kwargs: dict[str, Any],
    fields: dict[str, Any],
    roots: tuple[type, ...],
    named: list[str],
) -> None:
    """Each structured error stores its fields, with id collections as sorted tuples."""
    err = cls(**kwargs)
    for name, value in fields.items():
        assert getattr(err, name) == value, name
        assert type(getattr(err, name)) is type(value), name


@pytest.mark.parametrize(("cls", "kwargs", "fields", "roots", "named"), CASES, ids=CASE_IDS)
def test_error_message_names_ids(
    cls: type[BaseException],
    kwargs: dict[str, Any],
    fields: dict[str, Any],
    roots: tuple[type, ...],
    named: list[str],
) -> None:
    """Each structured error's message names the ids and states it carries."""
    message = str(cls(**kwargs))
    for text in named:
        assert text in message, (text, message)


@pytest.mark.parametrize(("cls", "kwargs", "fields", "roots", "named"), CASES, ids=CASE_IDS)
def test_error_pickles_with_fields(
    cls: type[BaseException],
    kwargs: dict[str, Any],
    fields: dict[str, Any],
    roots: tuple[type, ...],
    named: list[str],
) -> None:
    """A pickled error comes back as the same class with the same fields and message."""
    err = cls(**kwargs)
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is cls
    assert str(back) == str(err)
    for name, value in fields.items():
        assert getattr(back, name) == value, name


def test_unknown_step_message_does_not_say_consumed() -> None:
    """An unknown step's message says unknown, not already consumed."""
    message = str(UnknownStepError(step_id=3, open_step_ids=()))
    assert "already consumed" not in message
    assert "open steps: []" in message


def test_id_collections_accept_any_iterable() -> None:
    """Id collections given as generators are stored as sorted tuples."""
    err = WriteFailedError(tids=(t for t in (9, 1, 4)), reason="x")
    assert err.tids == (1, 4, 9)
    step = UnknownStepError(step_id=1, open_step_ids=iter({3, 2}))
    assert step.open_step_ids == (2, 3)


def test_already_consumed_is_caught_as_unknown_step() -> None:
    """A handler for unknown steps also catches a step consumed twice."""
    with pytest.raises(UnknownStepError) as info:
        raise StepAlreadyConsumedError(step_id=1, open_step_ids=[2])
    assert info.value.step_id == 1


def test_page_timeout_is_caught_as_staging_timeout() -> None:
    """The contract's staging-timeout handler catches a page timeout."""
    with pytest.raises(OmniPrefixCacheStagingTimeoutError):
        raise PageTimeoutError(timeout_s=0, open_step_ids=[1], tasks_in_flight=[])


def test_bad_input_message_format() -> None:
    """A bad-input message reads exactly 'bad input: what: expected X, got Y'."""
    err = BadInputError(what="slot id", expected="an id in [0, 64)", got="64")
    assert str(err) == "bad input: slot id: expected an id in [0, 64), got 64"


def test_shut_down_without_operation() -> None:
    """A shutdown error without an operation still says the cache is shut down."""
    err = ShutDownError()
    assert err.operation is None
    assert str(err) == "the prefix cache is shut down"


def test_contract_roots_take_a_plain_message() -> None:
    """The contract's two roots accept a plain message, as the interface contract does."""
    assert str(OmniPrefixCacheUnmatchError("diverged")) == "diverged"
    assert isinstance(OmniPrefixCacheUnmatchError("x"), RuntimeError)
    timeout = OmniPrefixCacheStagingTimeoutError("late")
    assert isinstance(timeout, OmniPrefixCacheUnmatchError)
    assert str(timeout) == "late"


def test_construction_errors_are_not_runtime_errors() -> None:
    """Config and request-record errors are ValueErrors outside the runtime root."""
    for cls in (ConfigError, RequestEventError):
        assert issubclass(cls, ValueError)
        assert not issubclass(cls, OmniPrefixCacheUnmatchError)


def test_invariant_error_is_an_assertion() -> None:
    """A broken invariant is an AssertionError, not a contract violation."""
    assert issubclass(InvariantError, AssertionError)
    assert not issubclass(InvariantError, OmniPrefixCacheUnmatchError)
    assert str(InvariantError("page 2 held twice")) == "page 2 held twice"


def test_request_event_error_without_req_id() -> None:
    """A request-record error that cannot tell the request says so instead of naming one."""
    err = RequestEventError(req_id=None, field="events", value=3, expected="events")
    assert err.req_id is None
    assert str(err).startswith("request record: bad field 'events'")


def _public_error_classes() -> list[type[BaseException]]:
    return [
        obj
        for name, obj in vars(_errors).items()
        if inspect.isclass(obj) and issubclass(obj, BaseException) and not name.startswith("_")
    ]


def test_every_error_class_is_exported() -> None:
    """Every public error class is re-exported by the package and listed in __all__."""
    classes = _public_error_classes()
    assert len(classes) == 19
    for cls in classes:
        assert cls.__name__ in omni_cache_core.__all__
        assert getattr(omni_cache_core, cls.__name__) is cls


def test_every_error_docstring_says_what_survives() -> None:
    """Every error class's docstring says what state survives it."""
    survival_words = ("unchanged", "discarded", "no state", "no change", "no trace")
    for cls in _public_error_classes():
        doc = (cls.__doc__ or "").lower()
        assert any(word in doc for word in survival_words), cls.__name__
