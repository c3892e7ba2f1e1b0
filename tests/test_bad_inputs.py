"""One test per row of the bad-input catalogue (spec/BAD_INPUTS.md), FAIL-5.

Each case sets up what it needs on a cache that has served a step (request ``a`` on blocks 0-2,
four rows computed), makes the bad call, checks the typed error and what the row says survives,
then checks that the cache still serves exact rows and keeps its invariants (`usable`). The
catalogue and the cases must name the same ids and error classes.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import omni_cache_cuda
from omni_cache_core._delivery import RequestState
from omni_cache_cuda import (
    HIDDEN_KEY,
    BadInputError,
    ConfigError,
    DeliveryOrderError,
    LifecycleError,
    ModelCachePolicy,
    OmniPrefixCacheManager,
    OversizeStepError,
    PrefixCacheConfig,
    PrefixCacheEventKind,
    PrefixCacheRequestEvent,
    PrefixCacheStep,
    PrefixCacheWrite,
    PrefixCacheWriteLayout,
    RequestEventError,
    StepAlreadyConsumedError,
    UnknownStepError,
)
from tests.adapter_helpers import MM, Engine, config, encode, make_manager, policy, settle
from tests.reliability_helpers import usable

CATALOGUE = Path(__file__).resolve().parents[1] / "spec" / "BAD_INPUTS.md"
#: A catalogue row: ``| id | call | input | `Error` | what survives |``.
ROW = re.compile(r"^\| ([a-z][a-z0-9-]+) \|[^|]*\|[^|]*\| `(\w+)` \|[^|]*\|$", re.MULTILINE)

STARTED = PrefixCacheEventKind.STARTED


class Ctx:
    """The cache under test, its engine and checks to run after the bad call."""

    def __init__(self, manager: OmniPrefixCacheManager, threaded: bool) -> None:
        self.manager = manager
        self.threaded = threaded
        self.engine = Engine(manager)
        self.engine.start("a", [0, 1, 2])
        self.first = self.engine.step({"a": 4})
        self.engine.materialize(self.first)
        self.after: list[Callable[[], None]] = []
        self.extra: list[OmniPrefixCacheManager] = []

    def begin(self, schedule: dict[str, int], *events: PrefixCacheRequestEvent) -> None:
        """Send a step's records and counts straight to the cache."""
        self.manager.new_step_starts(PrefixCacheStep(events=events, scheduled_tokens=schedule))

    def save(
        self,
        *,
        n: Any = 2,
        padded: Any = None,
        writes: list[tuple[str, int, int]] | None = None,
        slots: list[int] | None = None,
        hidden: Any = "rows",
        mm: Any = "rows",
        layout: Any = None,
    ) -> Callable[[], Any]:
        """A save of request a's next rows (slots 4, 5), with any argument replaced."""
        slot_ids = torch.tensor([4, 5] if slots is None else slots, dtype=torch.int64)
        if layout is None:
            spans = writes if writes is not None else [("a", 0, len(slot_ids))]
            layout = PrefixCacheWriteLayout([PrefixCacheWrite(*w) for w in spans], slot_ids)
        if isinstance(hidden, str):
            hidden = encode(HIDDEN_KEY, slot_ids, 99)
        if isinstance(mm, str):
            mm = {MM: encode(MM, slot_ids, 99)}
        self.begin({w.req_id: w.row_end - w.row_start for w in getattr(layout, "writes", ())})
        before = settle(self.manager)

        def unchanged() -> None:
            after = settle(self.manager)
            assert after.steps_saved == before.steps_saved
            assert after.pages_in_use == before.pages_in_use

        self.after.append(unchanged)
        return lambda: self.manager.save_outputs(
            hidden, mm, num_tokens_unpadded=n, num_tokens_padded=padded, write_layout=layout
        )


Case = Callable[[Ctx], Callable[[], Any]]
CASES: dict[str, tuple[type[BaseException], Case]] = {}


def case(ident: str, error: type[BaseException]) -> Callable[[Case], Case]:
    def register(setup: Case) -> Case:
        CASES[ident] = (error, setup)
        return setup

    return register


def event(req: str, kind: PrefixCacheEventKind, **fields: Any) -> PrefixCacheRequestEvent:
    return PrefixCacheRequestEvent(req_id=req, kind=kind, **fields)


# Building values ------------------------------------------------------------------------------


@case("manager-config-type", BadInputError)
def _(ctx: Ctx) -> Callable[[], Any]:
    return lambda: OmniPrefixCacheManager({"num_blocks": 4}, device="cpu")  # type: ignore[arg-type]


@case("manager-policy-type", BadInputError)
def _(ctx: Ctx) -> Callable[[], Any]:
    return lambda: OmniPrefixCacheManager(config(), policy="x", device="cpu")  # type: ignore[arg-type]


@case("config-size", ConfigError)
def _(ctx: Ctx) -> Callable[[], Any]:
    return lambda: PrefixCacheConfig(num_blocks=0, block_size=4)


@case("config-timeout", ConfigError)
def _(ctx: Ctx) -> Callable[[], Any]:
    return lambda: PrefixCacheConfig(num_blocks=4, block_size=4, staging_claim_timeout_s=math.inf)


@case("policy-deferred-hidden", ConfigError)
def _(ctx: Ctx) -> Callable[[], Any]:
    return lambda: ModelCachePolicy(deferred_keys={HIDDEN_KEY})


@case("event-field", RequestEventError)
def _(ctx: Ctx) -> Callable[[], Any]:
    return lambda: event("b", STARTED, hit_end=-4)


@case("step-events", RequestEventError)
def _(ctx: Ctx) -> Callable[[], Any]:
    return lambda: PrefixCacheStep(events=[3])  # type: ignore[list-item]


@case("layout-rows", BadInputError)
def _(ctx: Ctx) -> Callable[[], Any]:
    slots = torch.zeros(1, dtype=torch.int64)
    return lambda: PrefixCacheWriteLayout([PrefixCacheWrite("a", 1, 2)], slots)


@case("layout-slots-type", BadInputError)
def _(ctx: Ctx) -> Callable[[], Any]:
    return lambda: PrefixCacheWriteLayout([PrefixCacheWrite("a", 0, 1)], torch.zeros(1))


@case("layout-helper-blocks", BadInputError)
def _(ctx: Ctx) -> Callable[[], Any]:
    return lambda: PrefixCacheWriteLayout.from_block_tables(
        ["a"], {"a": 5}, {"a": 0}, {"a": [0]}, 4
    )


# register_policy ------------------------------------------------------------------------------


@case("policy-type", BadInputError)
def _(ctx: Ctx) -> Callable[[], Any]:
    return lambda: ctx.manager.register_policy("x")  # type: ignore[arg-type]


@case("policy-late", BadInputError)
def _(ctx: Ctx) -> Callable[[], Any]:
    first = ctx.manager.policy
    ctx.after.append(lambda: _same(ctx.manager.policy is first, True))
    return lambda: ctx.manager.register_policy(policy(hidden=False))


def _same(got: Any, want: Any) -> None:
    assert got == want, (got, want)


# new_step_starts ------------------------------------------------------------------------------


@case("start-type", BadInputError)
def _(ctx: Ctx) -> Callable[[], Any]:
    return lambda: ctx.manager.new_step_starts({"a": 1})  # type: ignore[arg-type]


@case("start-hit-unaligned", BadInputError)
def _(ctx: Ctx) -> Callable[[], Any]:
    return lambda: ctx.begin({"b": 1}, event("b", STARTED, hit_end=3, block_ids=(0, 3)))


@case("start-hit-no-blocks", BadInputError)
def _(ctx: Ctx) -> Callable[[], Any]:
    return lambda: ctx.begin({"b": 1}, event("b", STARTED, hit_end=4))


@case("start-hit-short-blocks", BadInputError)
def _(ctx: Ctx) -> Callable[[], Any]:
    return lambda: ctx.begin({"b": 1}, event("b", STARTED, hit_end=8, block_ids=(0,)))


@case("start-hit-block-range", BadInputError)
def _(ctx: Ctx) -> Callable[[], Any]:
    return lambda: ctx.begin({"b": 1}, event("b", STARTED, hit_end=4, block_ids=(99, 3)))


@case("start-twice", BadInputError)
def _(ctx: Ctx) -> Callable[[], Any]:
    twice = [event("b", STARTED, block_ids=(3,)), event("b", STARTED, block_ids=(4,))]
    return lambda: ctx.begin({"b": 1}, *twice)


@case("resume-running", LifecycleError)
def _(ctx: Ctx) -> Callable[[], Any]:
    resumed = event("a", PrefixCacheEventKind.RESUMED, block_ids=(0, 1, 2))
    return lambda: ctx.begin({"a": 1}, resumed)


@case("preempt-not-live", LifecycleError)
def _(ctx: Ctx) -> Callable[[], Any]:
    return lambda: ctx.begin({}, event("zz", PrefixCacheEventKind.PREEMPTED))


def _preempt_a(ctx: Ctx) -> None:
    """Preempt request a (LIFE-3) in a step of its own, consumed at once."""
    ctx.begin({}, event("a", PrefixCacheEventKind.PREEMPTED))
    empty = PrefixCacheWriteLayout([], torch.zeros(0, dtype=torch.int64))
    ctx.manager.discard_step(
        ctx.manager.save_outputs(None, {}, num_tokens_unpadded=0, write_layout=empty)
    )


@case("start-preempted", LifecycleError)
def _(ctx: Ctx) -> Callable[[], Any]:
    _preempt_a(ctx)
    ctx.after.append(
        lambda: _same(
            ctx.manager._state.core.request_states().get("a") is RequestState.PREEMPTED, True
        )
    )
    return lambda: ctx.begin({"a": 1}, event("a", STARTED, block_ids=(0, 1, 2)))


# save_outputs ---------------------------------------------------------------------------------


@case("save-unpadded", BadInputError)
def _(ctx: Ctx) -> Callable[[], Any]:
    return ctx.save(n=-1)


@case("save-padded", BadInputError)
def _(ctx: Ctx) -> Callable[[], Any]:
    return ctx.save(padded=1)


@case("save-layout-type", BadInputError)
def _(ctx: Ctx) -> Callable[[], Any]:
    return ctx.save(layout="slots 4 and 5")


@case("save-mm-type", BadInputError)
def _(ctx: Ctx) -> Callable[[], Any]:
    return ctx.save(mm=[1])


@case("save-hidden-type", BadInputError)
def _(ctx: Ctx) -> Callable[[], Any]:
    return ctx.save(hidden=[[0.0] * 4] * 2)


@case("save-hidden-rows", BadInputError)
def _(ctx: Ctx) -> Callable[[], Any]:
    return ctx.save(hidden=torch.zeros(1, 4))


@case("save-hidden-ndim", BadInputError)
def _(ctx: Ctx) -> Callable[[], Any]:
    return ctx.save(hidden=torch.zeros(2))


@case("save-slot-count", BadInputError)
def _(ctx: Ctx) -> Callable[[], Any]:
    return ctx.save(slots=[4, 5, 6])


@case("save-slot-range", BadInputError)
def _(ctx: Ctx) -> Callable[[], Any]:
    return ctx.save(slots=[4, ctx.manager.config.num_slots])


@case("save-slot-negative", BadInputError)
def _(ctx: Ctx) -> Callable[[], Any]:
    return ctx.save(slots=[-1, 5])


@case("save-width-change", BadInputError)
def _(ctx: Ctx) -> Callable[[], Any]:
    return ctx.save(mm={MM: torch.zeros(2, 5)})


@case("save-dtype-change", BadInputError)
def _(ctx: Ctx) -> Callable[[], Any]:
    return ctx.save(mm={MM: torch.zeros(2, 3, dtype=torch.float64)})


@case("save-not-started", BadInputError)
def _(ctx: Ctx) -> Callable[[], Any]:
    return ctx.save(writes=[("zz", 0, 2)])


@case("save-preempted", BadInputError)
def _(ctx: Ctx) -> Callable[[], Any]:
    _preempt_a(ctx)
    return ctx.save()


@case("save-repeated-request", BadInputError)
def _(ctx: Ctx) -> Callable[[], Any]:
    return ctx.save(writes=[("a", 0, 1), ("a", 1, 2)])


@case("save-hit-missing", BadInputError)
def _(ctx: Ctx) -> Callable[[], Any]:
    call = ctx.save()
    # The save's step also starts b with a hit on block 0, but its layout has only a.
    ctx.begin({"a": 2, "b": 1}, event("b", STARTED, hit_end=4, block_ids=(0, 3)))
    return call


@case("save-lost-hit", BadInputError)
def _(ctx: Ctx) -> Callable[[], Any]:
    ctx.begin({"b": 1}, event("b", STARTED, hit_end=4, block_ids=(0, 3)))
    return ctx.save(writes=[("b", 0, 2)], slots=[12, 13])


@case("save-oversize", OversizeStepError)
def _(ctx: Ctx) -> Callable[[], Any]:
    rows = ctx.manager.config.staging_capacity_tokens + 1
    slots = [s % ctx.manager.config.num_slots for s in range(rows)]
    return ctx.save(n=rows, slots=slots)


# materialize and discard_step -----------------------------------------------------------------


def _open_step(ctx: Ctx) -> Any:
    saved = ctx.engine.step({"a": 1})
    ctx.after.append(lambda: _consume_ok(ctx, saved))
    return saved


def _consume_ok(ctx: Ctx, *steps: Any) -> None:
    for saved in steps:
        ctx.engine.materialize(saved)


def _consumed(ctx: Ctx, step_id: int) -> None:
    with pytest.raises(StepAlreadyConsumedError):
        ctx.manager.discard_step(step_id)


@case("materialize-unknown", UnknownStepError)
def _(ctx: Ctx) -> Callable[[], Any]:
    _open_step(ctx)
    return lambda: ctx.manager.materialize(999, ["a"])


@case("materialize-consumed", StepAlreadyConsumedError)
def _(ctx: Ctx) -> Callable[[], Any]:
    return lambda: ctx.manager.materialize(ctx.first.step_id, ["a"])


@case("materialize-step-type", BadInputError)
def _(ctx: Ctx) -> Callable[[], Any]:
    saved = _open_step(ctx)
    return lambda: ctx.manager.materialize(str(saved.step_id), ["a"])  # type: ignore[arg-type]


@case("materialize-req-str", BadInputError)
def _(ctx: Ctx) -> Callable[[], Any]:
    saved = _open_step(ctx)
    return lambda: ctx.manager.materialize(saved.step_id, "a")


@case("materialize-req-type", BadInputError)
def _(ctx: Ctx) -> Callable[[], Any]:
    saved = _open_step(ctx)
    return lambda: ctx.manager.materialize(saved.step_id, None)  # type: ignore[arg-type]


@case("materialize-outside", BadInputError)
def _(ctx: Ctx) -> Callable[[], Any]:
    saved = ctx.engine.step({"a": 1})
    ctx.after.append(lambda: _consumed(ctx, saved.step_id))
    return lambda: ctx.manager.materialize(saved.step_id, ["a", "zz"])


@case("materialize-order", DeliveryOrderError)
def _(ctx: Ctx) -> Callable[[], Any]:
    first = ctx.engine.step({"a": 1})
    second = ctx.engine.step({"a": 1})
    ctx.after.append(lambda: _consume_ok(ctx, first, second))
    return lambda: ctx.manager.materialize(second.step_id, ["a"])


@case("discard-unknown", UnknownStepError)
def _(ctx: Ctx) -> Callable[[], Any]:
    _open_step(ctx)
    return lambda: ctx.manager.discard_step(999)


@case("discard-consumed", StepAlreadyConsumedError)
def _(ctx: Ctx) -> Callable[[], Any]:
    return lambda: ctx.manager.discard_step(ctx.first.step_id)


@case("discard-step-type", BadInputError)
def _(ctx: Ctx) -> Callable[[], Any]:
    _open_step(ctx)
    return lambda: ctx.manager.discard_step(None)  # type: ignore[arg-type]


# reserve and host_bytes -----------------------------------------------------------------------


def _storage_unchanged(ctx: Ctx) -> None:
    pool = dict(ctx.manager._state.pool.tensors)
    pages = dict(ctx.manager._state.pages.buffers)

    def same() -> None:
        assert ctx.manager._state.pool.tensors == pool
        assert ctx.manager._state.pages.buffers == pages

    ctx.after.append(same)


@case("reserve-type", BadInputError)
def _(ctx: Ctx) -> Callable[[], Any]:
    _storage_unchanged(ctx)
    return lambda: ctx.manager.reserve([("codes.x", (3, torch.float32))])  # type: ignore[arg-type]


@case("reserve-name", BadInputError)
def _(ctx: Ctx) -> Callable[[], Any]:
    _storage_unchanged(ctx)
    return lambda: ctx.manager.reserve({"": (3, torch.float32)})


@case("reserve-width", BadInputError)
def _(ctx: Ctx) -> Callable[[], Any]:
    _storage_unchanged(ctx)
    return lambda: ctx.manager.reserve(
        {"codes.ok": (3, torch.float32), "codes.x": (0, torch.float32)}
    )


@case("reserve-dtype", BadInputError)
def _(ctx: Ctx) -> Callable[[], Any]:
    _storage_unchanged(ctx)
    return lambda: ctx.manager.reserve({"codes.x": (3, "float32")})  # type: ignore[dict-item]


@case("reserve-shape-change", BadInputError)
def _(ctx: Ctx) -> Callable[[], Any]:
    _storage_unchanged(ctx)
    return lambda: ctx.manager.reserve({MM: (5, torch.float32)})


@case("reserve-hidden-not-cached", BadInputError)
def _(ctx: Ctx) -> Callable[[], Any]:
    manager = make_manager(ctx.threaded, cache_policy=policy(hidden=False))
    ctx.extra.append(manager)
    ctx.after.append(lambda: _same(manager._state.pool.tensors, {}))
    ctx.after.append(lambda: usable(manager))
    return lambda: manager.reserve({HIDDEN_KEY: (4, torch.float32)})


@case("host-bytes-width", BadInputError)
def _(ctx: Ctx) -> Callable[[], Any]:
    return lambda: ctx.manager.host_bytes({"codes.x": ((2, -1), torch.float32)})


# ---------------------------------------------------------------------------------------------


@pytest.fixture(params=[False, True], ids=["inline", "threaded"])
def ctx(request: pytest.FixtureRequest) -> Iterator[Ctx]:
    manager = make_manager(bool(request.param))
    context = Ctx(manager, bool(request.param))
    yield context
    for other in (manager, *context.extra):
        other.shutdown()


def catalogue() -> dict[str, str]:
    """Catalogue id -> the error class its row names."""
    return dict(ROW.findall(CATALOGUE.read_text()))


def test_catalogue_and_cases_name_the_same_rows() -> None:
    """Every catalogue row has a case, every case a row, with the same error class."""
    rows = catalogue()
    assert len(rows) == CATALOGUE.read_text().count("\n| ") - 6 * 1  # 6 table headers
    assert sorted(rows) == sorted(CASES)
    for ident, name in rows.items():
        assert CASES[ident][0] is getattr(omni_cache_cuda, name), ident


@pytest.mark.parametrize("ident", sorted(CASES))
def test_bad_input(ctx: Ctx, ident: str) -> None:
    """The bad call raises its typed error, what the row says survives, the cache serves on."""
    error, setup = CASES[ident]
    call = setup(ctx)
    with pytest.raises(error) as caught:
        call()
    assert type(caught.value) is error, repr(caught.value)
    for check in ctx.after:
        check()
    usable(ctx.manager)
