"""The stateful machine: `CacheMachine` drives a driver and the reference model side by side.

It is a hypothesis `RuleBasedStateMachine` that compares every materialize row by row and
position by position, every error by its exact class, and the state a refused call leaves
(unchanged); its invariant checks the core's invariants, the driver's page ownership and the open
step ids. What its engine knows and draws is its base, `_EngineDraws`
(`omni_cache_core.testing._draws`); here are the rules that run those draws against the driver
and the model and check the outcomes. `reach_every_case` runs a machine until its runs have
reached every case the test names.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any, ClassVar

from hypothesis import seed, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    consumes,
    get_state_machine_test,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
)

from omni_cache_core._contract import (
    ModelCachePolicy,
    PrefixCacheConfig,
    PrefixCacheEventKind,
    PrefixCacheRequestEvent,
    ReqId,
    StepId,
)
from omni_cache_core._errors import (
    BadInputError,
    DeliveryOrderError,
    PageTimeoutError,
    WaitTimeoutError,
)
from omni_cache_core.testing._draws import OUTSIDER, REQS, _EngineDraws
from omni_cache_core.testing._driver import IntPoolDriver
from omni_cache_core.testing._interface import DEFERRED_KEY, CacheDriver, Rows, SaveSpec
from omni_cache_core.testing._model import ModelMismatch, Outcome, ReferenceModel

__all__ = ["CacheMachine", "reach_every_case"]


#: Lifecycle records LIFE-2 refuses, tried on purpose by the `misuse` rule.
_LIFECYCLE_MISUSE = (
    "resume a running request",
    "preempt twice",
    "preempt after the end",
    "start a preempted request",
    "start and resume in one step",
)


def _describe(outcomes: Iterable[Outcome]) -> str:
    return " or ".join(sorted("success" if o is None else o.__name__ for o in outcomes))


def _diff(got: Rows, want: Rows) -> str:
    lines = []
    for key in sorted(set(got) | set(want)):
        g, w = got.get(key), want.get(key)
        if g != w:
            lines.append(f"  {key}: got {g}, model {w}")
    return "\n".join(lines)


class CacheMachine(_EngineDraws):
    """Drive a cache through a driver and the reference model side by side.

    Each run draws a policy (hidden cached or not), 2 or 3 pages, a budget (roomy, or small
    enough that saves flush deferred writes), prefetch on or off, a wait bound of 1 s or 0,
    whether committer failures may happen, whether reads are late, and whether the engine
    preempts. The KV cache has 4 blocks of 2 slots; up to 4 request ids start, finish, abort and
    start again; with preemption, running requests are preempted (their blocks go back to the
    pool), and preempted ones finish, abort or resume with a new block list and a hit that ends
    nowhere, below, at or above the delivery cursor, over the blocks that still hold their rows,
    or beyond what they computed (LIFE-1..4, DLV-3).

    Rules: `engine` (a step start or the save after it, with background committer work and
    sometimes a catch-up consume), `save_while_a_step_is_consumed`, `consume`, `misuse` (every
    error path, illegal lifecycle records included), `committer` (one stage, all of it, a
    failure, or time passing) and a late `shut_down`. Every outcome is checked against
    `ReferenceModel`: each materialize's positions and rows (each position once per admission,
    DLV-2, DLV-7), and its DLV-5 refusals, which must change nothing, after which the output
    builder consumes something else. The invariant checks the core's invariants, the driver's
    page ownership and the open step ids. `coverage` counts the lifecycle and delivery cases
    runs reach.

    Subclasses set `driver_factory` to run the same rules against another driver. The engine's
    side (request ids, block lists, the KV cache's shape, the draws of layouts, resumes and bad
    inputs) is the base class, `_EngineDraws`.
    """

    #: Builds the system under test: ``(config, policy, prefetch) -> driver``.
    driver_factory: ClassVar[Callable[[PrefixCacheConfig, ModelCachePolicy, bool], CacheDriver]]
    driver_factory = staticmethod(
        lambda config, policy, prefetch: IntPoolDriver(config, policy, prefetch=prefetch)
    )
    #: Rules run before a shutdown may happen (it ends the useful part of a run).
    shutdown_after: ClassVar[int] = 55
    #: Rules run before a committer failure may happen (it is sticky, FAIL-1).
    fail_after: ClassVar[int] = 40
    #: Runs spend every rule on slots and writes: no preemption, and reads always late (what
    #: HIT-6 needs); the controls of those rules use it. Otherwise each run draws both.
    slots_only: ClassVar[bool] = False
    #: What runs reached, counted across runs (lifecycle and delivery cases); a subclass that
    #: wants its own counts sets its own Counter.
    coverage: ClassVar[Counter[str]] = Counter()

    steps = Bundle("steps")

    def __init__(self) -> None:
        super().__init__()
        self.driver: CacheDriver | None = None
        self.phase = "start"
        self.rules_run = 0
        self.allow_failures = False
        self.late_reads = False
        self.preemption = False

    # -----------------------------------------------------------------------------------------
    # Helpers.

    @property
    def sut(self) -> CacheDriver:
        assert self.driver is not None
        return self.driver

    def _usable(self) -> bool:
        return self.driver is not None and not (self.model.closed or self.model.failed)

    def _expect(self, outcomes: Iterable[Outcome], what: str, call: Callable[[], Any]) -> Any:
        """Run `call`; its outcome must be one of `outcomes` (exact error classes)."""
        allowed = frozenset(outcomes)
        try:
            result = call()
        except Exception as exc:
            if type(exc) not in allowed:
                raise ModelMismatch(
                    f"{what}: raised {type(exc).__name__} ({exc}); model: {_describe(allowed)}"
                ) from exc
            return exc
        if None not in allowed:
            raise ModelMismatch(f"{what}: succeeded; model: {_describe(allowed)}")
        return result

    def _quiet_snapshot(self) -> Any:
        """The state after pending committer reports are in (so they are not a trace)."""
        self.sut.sync()
        return self.sut.snapshot()

    def _unchanged(self, before: Any, what: str) -> None:
        if self.sut.snapshot() != before:
            raise ModelMismatch(f"{what} raised but changed the cache's state")

    def _may_consume(self) -> bool:
        """Whether a step may be consumed now: reads are often late (HIT-6).

        A lone open step is consumed on every other rule only; with late reads, a step is
        consumed only once every page is taken (an output builder that lags behind).
        """
        open_count = len(self.model.open_step_ids())
        if open_count >= self.model.config.staging_depth:
            return True
        return not self.late_reads and (self.rules_run % 2 == 0 or open_count >= 2)

    def _show(self, *labels: str) -> None:
        """Count what a run reached (the tests check every case occurs)."""
        type(self).coverage.update(labels)

    def _save(
        self, spec: SaveSpec, *, stall: bool, relief: Callable[[], None] | None = None
    ) -> Any:
        before = self._quiet_snapshot()
        outcomes = self.model.save_outcomes(spec, stall=stall, relief=relief is not None)
        result = self._expect(
            outcomes,
            f"save {spec}",
            lambda: self.sut.save(spec, stall=stall, on_page_wait=relief),
        )
        if isinstance(result, Exception):
            if isinstance(result, WaitTimeoutError) and result.tid not in self.sut.in_flight():
                raise ModelMismatch(f"save timed out on task {result.tid}, which is not in flight")
            if not self.sut.save_touched:
                self._unchanged(before, f"save ({type(result).__name__})")  # STEP-5
            if isinstance(result, PageTimeoutError | WaitTimeoutError):
                self.phase = "start"
            return multiple()
        want = self.model.save(spec)
        self.written_slots.update(spec.flat_slots)
        for req_id, run in zip(spec.req_ids, spec.slots, strict=True):
            own = self.model.saved(want).carried[req_id].own
            self._note_kv(req_id, ((own + i, slot) for i, slot in enumerate(run)))
        if result != want:
            raise ModelMismatch(f"save returned step {result}, model {want}")
        self.phase = "start"
        return result

    def _catch_up(self) -> None:
        """The committer lands every write in flight."""
        while self.sut.in_flight():
            self.sut.land(self.sut.in_flight()[0])

    def _consume(
        self, step_id: StepId, how: str, data: st.DataObject, *, must_end: bool = False
    ) -> None:
        """Materialize or discard a step; ``must_end``: a refusal (DLV-5) turns into a discard."""
        if data.draw(st.sampled_from([False, False, True])):
            # The output builder lags behind the committer: a later save's write has reached
            # the pool rows this step's hit planned on (HIT-6 shows only then).
            self._catch_up()
        req_ids: list[ReqId] | None = None
        if how == "materialize":
            layout = list(self.model.saved(step_id).spec.req_ids)
            # Usually every request of the step, in any order; sometimes a subset.
            req_ids = [
                r
                for r in (data.draw(st.permutations(layout)) if layout else [])
                if data.draw(st.sampled_from([True, True, True, False]))
            ]
            if data.draw(st.sampled_from([False] * 7 + [True])):
                req_ids.append(OUTSIDER)  # STEP-4
            elif (
                must_end
                and step_id in self.model.open_step_ids()
                and self.model.owed_by_earlier(step_id, req_ids)
            ):
                req_ids = None  # the consume beside a page wait must free the page
        outcome, want = self.model.consume(step_id, req_ids)
        if req_ids is None:
            self._expect({outcome}, f"discard({step_id})", lambda: self.sut.discard(step_id))
            return
        asked = tuple(req_ids)
        what = f"materialize({step_id}, {list(asked)})"
        if outcome is DeliveryOrderError:
            self._refused(step_id, asked, data)
            return
        got = self._expect({outcome}, what, lambda: self.sut.materialize(step_id, asked))
        if outcome is None:
            assert want is not None
            self.model.check_delivery(step_id, got)
            if got.positions != want.positions:
                raise ModelMismatch(
                    f"{what} handed out positions {got.positions}, model {want.positions} (DLV-7)"
                )
            if got.rows != want.rows:
                raise ModelMismatch(
                    f"{what} rows differ from the model:\n" + _diff(got.rows, want.rows)
                )
            self._show(*self.model.shown)

    def _refused(self, step_id: StepId, asked: tuple[ReqId, ...], data: st.DataObject) -> None:
        """A materialize while an earlier open step still owes the request rows is refused (DLV-5).

        The error names the request, the earlier step and the positions it owes; the state is
        unchanged and the step stays open. The output builder then consumes something else:
        mostly the step that owes the rows (and then, often, the refused step again), sometimes
        the oldest open step (never refused).
        """
        allowed = self.model.refusals
        what = f"materialize({step_id}, {list(asked)})"
        before = self._quiet_snapshot()
        error = self._expect(
            {DeliveryOrderError}, what, lambda: self.sut.materialize(step_id, asked)
        )
        named = (ReqId(error.req_id), StepId(error.earlier_step_id), tuple(error.gap))
        if error.step_id != step_id or named not in allowed:
            raise ModelMismatch(f"{what} refused naming {named}; the model allows {allowed}")
        self._unchanged(before, what)
        self._show("delivery order refused", *self.model.shown)
        then = data.draw(st.sampled_from(["earlier", "earlier", "oldest", "nothing"]))
        how = data.draw(st.sampled_from(["materialize", "materialize", "discard"]))
        if then == "earlier":
            self._consume(named[1], how, data)
            if step_id in self.model.open_step_ids() and data.draw(st.booleans()):
                # Then the refused step again (refused again while another step owes rows).
                self._consume(step_id, "materialize", data)
        elif then == "oldest":
            self._consume(self.model.open_step_ids()[0], how, data)

    # -----------------------------------------------------------------------------------------
    # Setup and invariants.

    @initialize(
        hidden=st.sampled_from([True, False]),
        depth=st.sampled_from([2, 3]),
        budget=st.sampled_from([64, 6, 3]),
        prefetch=st.booleans(),
        failures=st.sampled_from([False, False, False, True]),
        timeout_s=st.sampled_from([1.0, 1.0, 1.0, 0.0]),
        late_reads=st.booleans(),
        preemption=st.sampled_from([False, True, True]),
    )
    def setup(
        self,
        hidden: bool,
        depth: int,
        budget: int,
        prefetch: bool,
        failures: bool,
        timeout_s: float,
        late_reads: bool,
        preemption: bool,
    ) -> None:
        """Build the cache: policy, depth, budget, prefetch and the wait bound vary per run.

        So does whether the engine preempts requests at all: runs without preemption spend
        every step on the slot and write rules (HIT-6 needs long runs of saves and late reads).
        """
        config = PrefixCacheConfig(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            staging_depth=depth,
            staging_capacity_tokens=5,
            gpu_staging_bytes=budget,
            staging_claim_timeout_s=timeout_s,
        )
        policy = ModelCachePolicy(needs_full_hidden_states=hidden, deferred_keys={DEFERRED_KEY})
        self.driver = type(self).driver_factory(config, policy, prefetch)
        self.model = ReferenceModel(config, policy)
        self.allow_failures = failures
        self.late_reads = late_reads or self.slots_only
        self.preemption = preemption and not self.slots_only

    @invariant()
    def agrees_with_model(self) -> None:
        """The core's invariants hold and its open step ids are the model's."""
        if self.driver is None:
            return
        self.rules_run += 1
        self.driver.check_invariants()
        got, want = self.driver.open_step_ids, self.model.open_step_ids()
        if got != want:
            raise ModelMismatch(f"open step ids {got}, model {want}")

    # -----------------------------------------------------------------------------------------
    # Engine rules.

    def _background(self, data: st.DataObject) -> None:
        """The committer runs while the engine works: land a few stages of in-flight tasks."""
        for _ in range(data.draw(st.integers(0, 3))):
            tids = self.sut.in_flight()
            if not tids:
                return
            self.sut.land(data.draw(st.sampled_from(tids)))

    @precondition(lambda self: self.driver is not None)
    @rule(target=steps, data=st.data(), stall=st.sampled_from([False, False, False, True]))
    def engine(self, data: st.DataObject, stall: bool) -> Any:
        """The engine's next call: a step start, or the save that follows it.

        One rule for both, so that swarm testing (which turns rules off per run) never leaves
        the engine half on. The committer does some work in the background first, and the
        output builder may catch up with an open step (a consume outside the `steps` bundle:
        the bundle may then offer that id again, which must raise StepAlreadyConsumedError).
        """
        self._background(data)
        open_ids = self.model.open_step_ids()
        if open_ids and self._may_consume() and data.draw(st.sampled_from([False, False, True])):
            step_id = data.draw(st.sampled_from(open_ids))
            how = data.draw(st.sampled_from(["materialize", "materialize", "discard"]))
            self._consume(step_id, how, data)
        if self.phase == "start":
            self._start_step(data)
            return multiple()
        # A save (n == 0 too, sparse keys); a stalled committer lets waits run out.
        return self._save(self._draw_spec(data), stall=stall)

    def _start_step(self, data: st.DataObject) -> None:
        """One step's lifecycle records, legal in every order they come in (HIT-1, HIT-2, LIFE-2).

        Some live requests finish or abort (preempted ones too), some running ones are
        preempted (their blocks go back to the pool, LIFE-3), some preempted ones resume with
        a new block list and a hit drawn around what was delivered (LIFE-4, DLV-3), and some
        ids start: new, reused after an end, or a continuation of a running request.
        """
        if data.draw(st.sampled_from([False, False, False, True])):
            # The committer caught up before this step: hits then read committed pool rows,
            # which a later save must preserve for a late read (HIT-6).
            self._catch_up()
        model = self.model
        live = sorted(model.live)
        events: list[PrefixCacheRequestEvent] = []
        ended: set[ReqId] = set()
        if live:
            for req_id in data.draw(st.lists(st.sampled_from(live), unique=True, max_size=2)):
                kind = data.draw(
                    st.sampled_from([PrefixCacheEventKind.FINISHED, PrefixCacheEventKind.ABORTED])
                )
                events.append(PrefixCacheRequestEvent(req_id=req_id, kind=kind))
                ended.add(req_id)
        running = sorted(model.running - ended)
        # One draw each for a preemption and a resume (draws are what a step costs).
        preempting: list[ReqId] = []
        if running and self.preemption:
            # Mostly a request that has rows delivered already (preempted mid-decode).
            delivered = [(r,) for r in running if model.admission_of[r].cursor]
            options = [(), (), *((r,) for r in running), *delivered, *delivered]
            preempting = list(data.draw(st.sampled_from(options)))
            events.extend(
                PrefixCacheRequestEvent(req_id=r, kind=PrefixCacheEventKind.PREEMPTED)
                for r in preempting
            )
        # The blocks an ending request hit come free now, while the read of its hit may still be
        # pending (late reads): a new tenant recomputing them is the HIT-6 case, made likely. A
        # preempted request gives all its blocks back.
        freed = sorted(
            {b for r in ended for b in self._hit_blocks(r)}
            | {b for r in preempting for b in self.blocks.get(r, ((), 0))[0]}
        )
        blocks_of: dict[ReqId, tuple[tuple[int, ...], int]] = {}
        # RESUMED: a request preempted earlier, or in this very step (LIFE-2 applies the
        # preemption first).
        resumable = sorted(model.preempted - ended) + preempting
        resuming: list[ReqId] = []
        if resumable:
            options = [(r,) for r in resumable]
            resuming = list(data.draw(st.sampled_from([(), *options, *options])))
        if resuming and data.draw(st.sampled_from([False, True, True])):
            # The output builder caught up with the request's steps before it resumes, and
            # needed some of them (a resume hit serves what it discarded: DLV-4).
            for step_id in self.model.open_step_ids():
                if resuming[0] in self.model.saved(step_id).carried:
                    how = data.draw(st.sampled_from(["materialize", "materialize", "discard"]))
                    self._consume(step_id, how, data)
        cases: list[str] = []
        for req_id in resuming:
            blocks, hit_blocks, where = self._draw_resume(req_id, data, freed)
            cases.extend(where)
            blocks_of[req_id] = (blocks, hit_blocks)
            events.append(
                PrefixCacheRequestEvent(
                    req_id=req_id,
                    kind=PrefixCacheEventKind.RESUMED,
                    hit_end=hit_blocks * self.block_size,
                    block_ids=blocks,
                    scheduled_tokens=1,
                )
            )
        # STARTED: any id that is neither preempted (LIFE-2) nor resuming in this step.
        startable = [
            r
            for r in REQS
            if r not in resuming
            and r not in preempting
            and (r not in model.preempted or r in ended)
        ]
        chosen = (
            data.draw(st.lists(st.sampled_from(startable), unique=True, max_size=2))
            if startable
            else []
        )
        for req_id in chosen:
            # Hit blocks come mostly from blocks some save wrote (so hits read the pool and
            # later saves may reuse them under a delayed read: HIT-6), else from any block.
            written = sorted({s // self.block_size for s in self.written_slots})
            first = data.draw(
                st.sampled_from(freed * 6 + written * 3 + list(range(self.num_blocks)))
            )
            rest = data.draw(st.lists(st.integers(0, self.num_blocks - 1), min_size=1, max_size=2))
            blocks = tuple(dict.fromkeys([first, *rest]))
            if len(blocks) == 1:
                blocks = (first, (first + 1) % self.num_blocks)
            # Mostly a one-block hit followed by blocks to compute; sometimes no hit, or a hit
            # over every block (the request then recomputes in its last block).
            recompute = [0, 0, 0, 1] if first in freed else [1, 1, 1, 0, len(blocks)]
            hit_blocks = data.draw(st.sampled_from(recompute))
            blocks_of[req_id] = (blocks, hit_blocks)
            events.append(
                PrefixCacheRequestEvent(
                    req_id=req_id,
                    kind=PrefixCacheEventKind.STARTED,
                    hit_end=hit_blocks * self.block_size,
                    block_ids=blocks,
                    scheduled_tokens=1,
                )
            )
        if len(events) > 1 and data.draw(st.booleans()):
            # LIFE-2: ends and preemptions apply before starts and resumes, whatever the order.
            events = list(data.draw(st.permutations(events)))
        # A continuation keeps its blocks; a new or restarted id (HIT-2) and a resume take the
        # drawn ones.
        fresh = {r for r in blocks_of if r not in model.live or r in ended or r in resuming}
        shown = ["preempted"] * len(preempting) + cases
        shown += ["ended while preempted" for r in ended if r in model.preempted]
        shown += [
            "id reused"
            for r in chosen
            if (r not in model.live or r in ended) and any(a.req_id == r for a in model.admissions)
        ]
        outcome = model.start(events)
        self._expect({outcome}, f"start {events}", lambda: self.sut.start(events))
        if outcome is None:
            bs = self.block_size
            for req_id in fresh:
                self.blocks[req_id] = blocks_of[req_id]
                # The engine's KV of the request is its hit blocks now (LIFE-3: the rest is gone).
                table, hit_blocks = blocks_of[req_id]
                self.kv[req_id] = {}
                self._note_kv(
                    req_id, ((p, table[p // bs] * bs + p % bs) for p in range(hit_blocks * bs))
                )
            self._show(*shown)
            self.phase = "save"

    @precondition(
        lambda self: (
            self._usable()
            and self.phase == "save"
            and len(self.model.open_step_ids()) >= self.model.config.staging_depth
            # A zero bound fails at once instead of waiting for the page (PAGE-4).
            and self.model.config.staging_claim_timeout_s > 0
        )
    )
    @rule(
        target=steps,
        relief=consumes(steps),
        how=st.sampled_from(["materialize", "discard"]),
        data=st.data(),
    )
    def save_while_a_step_is_consumed(self, relief: StepId, how: str, data: st.DataObject) -> Any:
        """A save waiting for a page gets the one a concurrent consume frees (PAGE-4, CONC-3)."""
        open_ids = self.model.open_step_ids()
        if relief not in open_ids:
            # The engine rule's catch-up consumed it already; relieve with an open step.
            relief = data.draw(st.sampled_from(open_ids))
        spec = self._draw_spec(data, max_rows=1)
        called: list[bool] = []

        def consume_meanwhile() -> None:
            called.append(True)
            self._consume(relief, how, data, must_end=True)

        result = self._save(spec, stall=False, relief=consume_meanwhile)
        if not called:
            self._consume(relief, how, data)
        return result

    @precondition(lambda self: self._may_consume())
    @rule(
        step=consumes(steps),
        how=st.sampled_from(["materialize", "materialize", "materialize", "discard"]),
        data=st.data(),
    )
    def consume(self, step: StepId, how: str, data: st.DataObject) -> None:
        """Materialize or discard a step, late and out of order (STEP-1, STEP-4, HIT-3..6)."""
        self._consume(step, how, data)

    # -----------------------------------------------------------------------------------------
    # Error paths, on purpose.

    # Misuse is one rule in three steps at most, so the engine keeps most of each run.
    @precondition(lambda self: self.driver is not None and self.rules_run % 3 == 0)
    @rule(
        kind=st.sampled_from(
            [
                "unaligned hit",
                "hit without blocks",
                "hit with too few blocks",
                "hit block out of range",
                "started twice",
                "request not live",
                "slot out of range",
                "hidden rows wrong",
                "hit request left out",
                "consume twice",
                "consume unknown",
                "register policy late",
                *_LIFECYCLE_MISUSE,
                "save a preempted request",
            ]
        ),
        data=st.data(),
    )
    def misuse(self, kind: str, data: st.DataObject) -> None:
        """Each misuse raises its typed error and leaves the state as SPEC says.

        STEP-2 and FAIL-5 for steps and layouts; LIFE-2 for lifecycle records in a state that
        does not allow them (LifecycleError); LIFE-3 for a save naming a preempted request.
        """
        before = self._quiet_snapshot()
        if kind in _LIFECYCLE_MISUSE:
            bad = self._bad_lifecycle(kind, data)
            if bad is None:
                return
            outcome = self.model.start(bad)
            if outcome is None:
                raise ModelMismatch(f"the model accepts a bad lifecycle: {kind}")
            self._expect({outcome}, kind, lambda: self.sut.start(bad))
            self._show(f"refused: {kind}")
        elif kind in ("consume twice", "consume unknown"):
            if kind == "consume twice" and self.model.consumed:
                step_id = data.draw(st.sampled_from(sorted(self.model.consumed)))
            else:
                offset = data.draw(st.sampled_from([0, 1, 7, -(10**6)]))
                step_id = StepId(self.model.next_step_id + offset)
            if data.draw(st.booleans()):
                outcome, _ = self.model.consume(step_id, None)
                self._expect({outcome}, f"discard({step_id})", lambda: self.sut.discard(step_id))
            else:
                outcome, _ = self.model.consume(step_id, [])
                self._expect(
                    {outcome},
                    f"materialize({step_id})",
                    lambda: self.sut.materialize(step_id, ()),
                )
        elif kind == "register policy late":
            if not self.model.started:
                return
            outcome = self.model._refusal() or BadInputError
            self._expect({outcome}, kind, lambda: self.sut.register_policy(self.model.policy))
        elif kind in (
            "request not live",
            "slot out of range",
            "hidden rows wrong",
            "hit request left out",
            "save a preempted request",
        ):
            if kind == "hit request left out" and not self.model.hits:
                return
            if kind == "save a preempted request" and not self.model.preempted:
                return
            spec = self._bad_spec(kind)
            outcomes = self.model.save_outcomes(spec)
            if None in outcomes:
                raise ModelMismatch(f"the model accepts a bad layout: {kind}")
            self._expect(outcomes, kind, lambda: self.sut.save(spec))
        else:
            events = self._bad_events(kind, data.draw(st.sampled_from(REQS)))
            outcome = self.model.start(events)
            if outcome is None:
                raise ModelMismatch(f"the model accepts a bad start: {kind}")
            self._expect({outcome}, kind, lambda: self.sut.start(events))
        self._unchanged(before, kind)

    # -----------------------------------------------------------------------------------------
    # Committer and clock rules.

    @precondition(lambda self: self.driver is not None)
    @rule(
        data=st.data(),
        how=st.sampled_from(["one stage", "one stage", "everything", "fail", "time passes"]),
    )
    def committer(self, data: st.DataObject, how: str) -> None:
        """The committer lands a stage, catches up or fails a write (FAIL-1); or time passes."""
        tids = self.sut.in_flight()
        if how == "time passes" or not tids:
            self.sut.advance_clock(data.draw(st.sampled_from([1, 400, 1500])) * 1_000_000)
        elif how == "fail" and self.allow_failures and self.rules_run >= self.fail_after:
            self.sut.fail(data.draw(st.sampled_from(tids)))
            self.model.failed = True
        elif how == "everything":
            self._catch_up()
        else:
            self.sut.land(data.draw(st.sampled_from(tids)))

    @precondition(
        lambda self: (
            self.driver is not None
            and not self.model.closed
            and self.rules_run >= self.shutdown_after
        )
    )
    @rule()
    def shut_down(self) -> None:
        """Shut the cache down: every later call raises ShutDownError (FAIL-4)."""
        self.sut.shutdown()
        self.model.closed = True


def reach_every_case(
    machine: type[CacheMachine], cases: Sequence[str], each: settings, *, rounds: int = 4
) -> Counter[str]:
    """Run `machine` (its own `coverage` Counter) until it reaches every one of `cases`.

    Each round is one hypothesis run with the settings `each` and a fixed seed (0, 1, ...), so
    a result reproduces; every round also checks the machine against the model. Why rounds and not
    one derandomized run: hypothesis draws some values from constants in the project's loaded
    modules, so one fixed run's sequence changes with what else the test session imported; a
    rare case reached when a test file runs alone can be missed inside the whole suite. Rounds
    make the requirement "within `rounds` runs" instead of "in this one sequence".

    Returns:
        What the rounds reached, every case included.

    Raises:
        AssertionError: Some case was never reached in `rounds` runs.
    """
    machine.coverage = Counter()
    for number in range(rounds):
        run = get_state_machine_test(machine, settings=each)
        seed(number)(run)()
        if all(machine.coverage[case] for case in cases):
            return machine.coverage
    missing = [case for case in cases if not machine.coverage[case]]
    raise AssertionError(f"never reached in {rounds} runs: {missing}")
