"""A stateful test of speculative decoding in the pure core (SPEC-1..SPEC-5, DLV-2, LIFE-1..4).

A hypothesis state machine plays a tiny engine over a `CacheCore` (block size 4): a few request
ids (reused after they end), block tables allocated from a free list and recycled at every end and
preemption, prefill chunks, decode steps with ``k`` drafts (``k`` in 0..3) of which the sampler
accepts ``a`` in 0..k, so the next computed count is ``c' = c + 1 + a`` (vLLM's rule). The count
reaches the core at the next step's start (`PrefixCacheStep.computed_tokens`) or is reported by
the drafted step's materialize (`ConsumeBegin.computed`). Steps are materialized right after
their save, one step late (after the next start), with or without a report, with a request left
out, or discarded. Requests are preempted (with and without unconfirmed drafts, with and without
the count) and resumed with ``hit_end`` 0 or block aligned over blocks vLLM would still hold and
hash (only blocks made of accepted positions, confirmed or left unconfirmed by a preemption:
SPEC-3, SPEC-5), and they finish or abort (with and
without unconfirmed drafts, SPEC-5).

The oracle is written from the spec, not from the core. Per admission it keeps the *accepted*
positions (prefill rows, the first row of each decode step, drafts accepted by a count) and per
step and request the positions it carries and which of its drafts are not accepted. Every
consume's delivered range must hold accepted positions only, none its step's drafts did not get
accepted, each at most once per admission and in increasing order (SPEC-1, SPEC-2, SPEC-3,
DLV-2). When an admission has ended and every step that carried it was materialized with it,
every accepted position below its final count was delivered exactly once (SPEC-4, SPEC-5, DLV-2):
accepted rows a consumed step held back are read back by the next save, or served by a resume
hit, or recomputed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any, ClassVar

import pytest
from hypothesis import HealthCheck, Phase, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from omni_cache_core import PrefixCacheRequestEvent, StepId
from omni_cache_core._core import CacheCore
from omni_cache_core._drafts import Drafts
from omni_cache_core._values import EscalateTasks, SlotArray
from tests.core_helpers import (
    BLOCK,
    aborted,
    config,
    consume,
    finished,
    land,
    preempted,
    resumed,
    save,
    start,
    started,
)

#: Request ids; an ended id is admitted again (LIFE-1).
IDS = ("r0", "r1", "r2")
#: Positions per admission at most: 5 blocks, so three live admissions fit in 16 blocks.
MAX_POS = 20
NUM_BLOCKS = 16
#: Longest prefill chunk.
CHUNK = 8
#: How a step is consumed, drawn at its save. "late" ones are materialized after the next start
#: (as the drop-in worker does), "report" ones report the drafted requests' counts (SPEC-2).
MODES = (
    "now",
    "now",
    "now report",
    "late",
    "late",
    "late report",
    "discard now",
    "discard late",
    "partial now",
    "partial late",
)
#: Cases the runs must reach (`test_spec_2_..._coverage` asserts them).
CASES = (
    "rejected none",
    "rejected some",
    "rejected all",
    "count at start",
    "count at materialize",
    "count at start and at materialize",
    "late materialize of a confirmed step",
    "read back",
    "preempted with unconfirmed drafts",
    "preempted with the count",
    "ended with unconfirmed drafts",
    "ended with unconfirmed drafts, count at materialize",
    "resume without a hit",
    "resume with a hit",
    "resume hit above the delivered end",
    "resume hit over unconfirmed accepted drafts",
    "id reused",
    "discarded drafted step",
    "request left out of a drafted step",
    "writes left in flight",
    "admission checked complete",
    "admission with read back checked complete",
)


class Row:
    """What one step carries for one request, as the engine saved it."""

    def __init__(self, adm: Adm, lo: int, hi: int, k: int, a: int) -> None:
        self.adm = adm
        #: Own positions ``[lo, hi)``; the last `k` are drafts, `a` of them accepted.
        self.lo, self.hi, self.k, self.a = lo, hi, k, a
        #: Whether the core learned `a` (a count at a start or at this step's materialize).
        self.settled = k == 0

    @property
    def base(self) -> int:
        return self.hi - self.k

    def allowed_end(self) -> int:
        """One past the last position this step may hand out: no draft not accepted (SPEC-1)."""
        return self.base + self.a if self.settled else self.base


class Rec:
    """One saved step: its id, how it is consumed and its rows per request."""

    def __init__(self, step_id: StepId, mode: str, rows: dict[str, Row]) -> None:
        self.step_id, self.mode, self.rows = step_id, mode, rows
        self.consumed = False


class Adm:
    """One admission of a request id, as the engine and the oracle see it."""

    def __init__(self, rid: str, serial: int, prompt: int) -> None:
        self.rid, self.serial = rid, serial
        self.running = True
        #: The core's view of the next position (DLV-1): a drafted step's end until its count.
        self.c = 0
        #: Positions the engine knows the tokens of: prefilled up to here, decoded from here.
        self.known = prompt
        self.table: list[int] = []
        #: After a preemption: its blocks and their allocation stamps (vLLM keeps them cached
        #: until they are allocated again).
        self.parked: list[tuple[int, int]] = []
        #: Positions whose slot holds a row the core knows is confirmed: what vLLM hashes.
        self.good: set[int] = set()
        #: Oracle: positions accepted so far, and those delivered, with the delivery end.
        self.accepted: set[int] = set()
        self.delivered: set[int] = set()
        self.delivered_end = 0
        #: The last step's drafts while the core waits for their count at a start.
        self.pending: tuple[Rec, Row] | None = None
        self.open_steps: set[StepId] = set()
        #: Every step that carried it was materialized with it (the completeness check applies).
        self.promising = True
        self.read_back = False
        self.ended = False
        #: Accepted drafts a consumed step held back when its count came with a preemption:
        #: only a save reads them back (SPEC-4), so they are owed until the request resumes.
        self.owed: set[int] = set()
        #: Accepted drafts a preemption left unconfirmed: vLLM hashes them all the same.
        self.unsettled: set[int] = set()

    def next_position(self) -> int:
        """The engine's next position (it knows what its sampler accepted)."""
        if self.pending is not None:
            return self.pending[1].base + self.pending[1].a
        return self.c

    def slot(self, p: int) -> int:
        return self.table[p // BLOCK] * BLOCK + p % BLOCK


class SpeculativeMachine(RuleBasedStateMachine):
    """The engine model and the oracle around one core."""

    coverage: ClassVar[Counter[str]] = Counter()

    def __init__(self) -> None:
        super().__init__()
        self.core = CacheCore(config(num_blocks=NUM_BLOCKS))
        self.free: list[int] = list(range(NUM_BLOCKS))
        self.stamp = [0] * NUM_BLOCKS
        self.live: dict[str, Adm] = {}
        self.serial = 0
        self.ever: set[str] = set()
        #: Steps to consume after the next start.
        self.late: list[Rec] = []

    # -----------------------------------------------------------------------------------------
    # Coverage.

    def _saw(self, case: str) -> None:
        self.coverage[case] += 1
        event(case)

    # -----------------------------------------------------------------------------------------
    # Blocks.

    def _alloc(self, adm: Adm, upto: int, data: st.DataObject) -> None:
        while len(adm.table) * BLOCK < upto:
            i = data.draw(st.integers(0, len(self.free) - 1), label="free block")
            block = self.free.pop(i)
            self.stamp[block] += 1
            adm.table.append(block)

    def _release(self, adm: Adm) -> None:
        self.free.extend(adm.table)
        adm.table = []

    # -----------------------------------------------------------------------------------------
    # Oracle: acceptance.

    def _settle(self, row: Row) -> None:
        """The core learned the row's acceptance: its accepted drafts count from now (SPEC-2)."""
        if row.settled:
            return
        row.settled = True
        row.adm.accepted.update(range(row.base, row.base + row.a))
        self._saw(
            "rejected all" if row.a == 0 else "rejected some" if row.a < row.k else "rejected none"
        )

    def _confirm_at_start(self, adm: Adm) -> None:
        """A count at a start: accepted slots hold confirmed rows, rejected ones not (SPEC-3)."""
        assert adm.pending is not None
        row = adm.pending[1]
        adm.pending = None
        if row.settled:
            self._saw("count at start and at materialize")
        self._saw("count at start")
        self._settle(row)
        adm.good.update(range(row.base, row.base + row.a))
        adm.c = row.base + row.a

    def _drop_pending(self, adm: Adm, *, preempted: bool) -> None:
        """An end or a preemption without the count: the core leaves the draft rows as written
        (SPEC-5). The engine accepted some of them: they are tokens, so vLLM hashes the blocks
        they fill and a resume may hit them. Until it resumes the request is owed them."""
        assert adm.pending is not None
        row = adm.pending[1]
        adm.pending = None
        if not preempted or row.settled:
            return
        accepted = set(range(row.base, row.base + row.a))
        adm.accepted |= accepted
        adm.good |= accepted
        adm.unsettled |= accepted
        adm.owed |= accepted - adm.delivered

    # -----------------------------------------------------------------------------------------
    # Oracle: delivery.

    def _consume(self, rec: Rec, data: st.DataObject) -> None:
        mode = rec.mode
        rids = list(rec.rows)
        rec.consumed = True
        if mode.startswith("discard"):
            consume(self.core, rec.step_id)
            asked: list[str] = []
            if any(row.k for row in rec.rows.values()):
                self._saw("discarded drafted step")
        elif mode.startswith("partial"):
            keep = data.draw(st.lists(st.booleans(), min_size=len(rids), max_size=len(rids)))
            asked = [r for r, kept in zip(rids, keep, strict=True) if kept]
            if any(rec.rows[r].k for r in rids if r not in asked):
                self._saw("request left out of a drafted step")
        else:
            asked = rids
        if not mode.startswith("discard"):
            report = None
            if mode.endswith("report"):
                report = {r: rec.rows[r].base + rec.rows[r].a for r in asked if rec.rows[r].k}
                for r in report:
                    if not rec.rows[r].settled:
                        self._saw("count at materialize")
                        if rec.rows[r].adm.ended:
                            self._saw("ended with unconfirmed drafts, count at materialize")
                    self._settle(rec.rows[r])
            plan = consume(self.core, rec.step_id, asked, computed=report or None)
            assert len(plan.starts) == len(asked)
            for i, r in enumerate(asked):
                self._check_delivery(rec, r, int(plan.starts[i]), int(plan.ends[i]))
        for r, row in rec.rows.items():
            row.adm.open_steps.discard(rec.step_id)
            if r not in asked:
                row.adm.promising = False
            self._check_complete(row.adm)

    def _check_delivery(self, rec: Rec, r: str, s: int, e: int) -> None:
        """SPEC-1..SPEC-3, DLV-2: accepted positions only, never a draft not accepted, once each,
        in increasing order."""
        row = rec.rows[r]
        adm = row.adm
        where = f"step {rec.step_id} ({rec.mode}), request {r!r} #{adm.serial}"
        assert s <= e, f"{where}: range [{s}, {e})"
        if s == e:
            return
        assert s >= adm.delivered_end, (
            f"{where}: delivered [{s}, {e}) after positions up to {adm.delivered_end} (DLV-2)"
        )
        assert e <= row.allowed_end(), (
            f"{where}: delivered [{s}, {e}) beyond {row.allowed_end()}: rows [{row.lo}, "
            f"{row.hi}), drafts from {row.base}, {row.a} accepted, settled={row.settled} "
            "(SPEC-1..SPEC-3)"
        )
        not_accepted = sorted(set(range(s, e)) - adm.accepted)
        assert not not_accepted, f"{where}: delivered positions not accepted {not_accepted}"
        adm.delivered.update(range(s, e))
        adm.delivered_end = e

    def _check_complete(self, adm: Adm) -> None:
        """SPEC-4, SPEC-5, DLV-2: an ended admission whose steps were all materialized with it
        got every accepted position below its final count, exactly once."""
        if not adm.ended or adm.open_steps or not adm.promising:
            return
        adm.promising = False  # checked once
        # An admission that ended while preempted never had the save that reads back what
        # it was owed (SPEC-4): those positions stay undelivered.
        if adm.owed:
            self._saw("ended while owed a read back")
        expected = {p for p in adm.accepted if p < adm.c} - adm.owed
        got = {p for p in adm.delivered if p < adm.c}
        assert got == expected, (
            f"request {adm.rid!r} #{adm.serial} (final count {adm.c}): accepted positions never "
            f"delivered {sorted(expected - got)}, delivered but not expected {sorted(got - expected)}"
        )
        self._saw("admission checked complete")
        if adm.read_back:
            self._saw("admission with read back checked complete")

    # -----------------------------------------------------------------------------------------
    # The engine step.

    @rule(data=st.data())
    def engine_step(self, data: st.DataObject) -> None:
        ends: list[PrefixCacheRequestEvent] = []
        computed: dict[str, int] = {}
        resuming: list[Adm] = []
        admitting: list[str] = []
        for rid in IDS:
            adm = self.live.get(rid)
            if adm is None:
                if data.draw(st.booleans(), label=f"admit {rid}"):
                    admitting.append(rid)
                continue
            if adm.running:
                must_end = adm.next_position() >= MAX_POS
                choices = ["end"] if must_end else ["run", "run", "run", "run", "preempt", "end"]
            else:
                choices = ["stay", "resume", "resume", "end"]
            action = data.draw(st.sampled_from(choices), label=f"{rid} action")
            if action == "run":
                if adm.pending is not None:
                    computed[rid] = adm.next_position()  # vLLM's num_computed_tokens
                    self._confirm_at_start(adm)
            elif action == "preempt":
                if adm.pending is not None:
                    if data.draw(st.booleans(), label=f"{rid} count with the preemption"):
                        computed[rid] = adm.next_position()
                        drafted, row = adm.pending
                        self._confirm_at_start(adm)
                        self._saw("preempted with the count")
                        if drafted.consumed:
                            adm.owed = set(range(row.base, row.base + row.a)) - adm.delivered
                    else:
                        self._drop_pending(adm, preempted=True)
                        self._saw("preempted with unconfirmed drafts")
                ends.append(preempted(rid))
                adm.running = False
                adm.parked = [(b, self.stamp[b]) for b in adm.table]
                self._release(adm)
            elif action == "resume":
                resuming.append(adm)
            elif action == "end":
                if adm.pending is not None:
                    self._drop_pending(adm, preempted=False)
                    self._saw("ended with unconfirmed drafts")
                ends.append(data.draw(st.sampled_from([finished, aborted]))(rid))
                if adm.running:
                    self._release(adm)
                adm.ended = True
                del self.live[rid]
                self._check_complete(adm)
                if data.draw(st.booleans(), label=f"admit {rid} again"):
                    admitting.append(rid)
        starts: list[PrefixCacheRequestEvent] = []
        plans: dict[str, tuple[int, int]] = {}
        for adm in resuming:
            hit = self._draw_hit(adm, data)
            self._plan_rows(adm, data, plans)
            n = plans[adm.rid][0]
            starts.append(resumed(adm.rid, hit_end=hit, block_ids=adm.table, scheduled=n))
        for rid in admitting:
            self.serial += 1
            prompt = data.draw(st.integers(1, 10), label=f"{rid} prompt")
            adm = Adm(rid, self.serial, prompt)
            if rid in self.ever:
                self._saw("id reused")
            self.ever.add(rid)
            self.live[rid] = adm
            self._plan_rows(adm, data, plans)
            starts.append(started(rid, block_ids=adm.table, scheduled=plans[rid][0]))
        for rid, adm in self.live.items():
            if adm.running and rid not in plans:
                self._plan_rows(adm, data, plans)
        read_back_before = self.core.counters.draft_rows_read_back
        effects = start(self.core, *ends, *starts, computed=computed)
        for effect in effects:
            if isinstance(effect, EscalateTasks):
                for tid in effect.tids:
                    land(self.core, tid)
        if self.core.counters.draft_rows_read_back > read_back_before:
            self._saw("read back")
            for rid in computed:
                if rid in self.live:
                    self.live[rid].read_back = True
        late, self.late = self.late, []
        for rec in late:
            if any(row.k and row.settled for row in rec.rows.values()):
                self._saw("late materialize of a confirmed step")
            self._consume(rec, data)
        self._save(plans, data)

    def _draw_hit(self, adm: Adm, data: st.DataObject) -> int:
        """A resume's hit: blocks still cached (not allocated since) and made of accepted
        positions only, as vLLM hashes them (SPEC-3, SPEC-5); positions restart there."""
        top = 0
        for j, (block, stamp) in enumerate(adm.parked):
            if self.stamp[block] != stamp or block not in self.free:
                break
            if not set(range(j * BLOCK, (j + 1) * BLOCK)) <= adm.good:
                break
            top = (j + 1) * BLOCK
        # At least one position is left to compute, within the admission's bound.
        top = min(top, (MAX_POS - 1) // BLOCK * BLOCK)
        hit = data.draw(st.sampled_from(range(0, top + 1, BLOCK)), label=f"{adm.rid} hit")
        self._saw("resume with a hit" if hit else "resume without a hit")
        if any(p < hit for p in adm.unsettled):
            self._saw("resume hit over unconfirmed accepted drafts")
        adm.unsettled = set()
        if hit > adm.delivered_end:
            self._saw("resume hit above the delivered end")
        for block, _ in adm.parked[: hit // BLOCK]:
            self.free.remove(block)
            adm.table.append(block)
        adm.parked = []
        adm.owed = set()  # served by the resume's hit or recomputed
        adm.good = {p for p in adm.good if p < hit}
        adm.c = hit
        adm.running = True
        return hit

    def _plan_rows(self, adm: Adm, data: st.DataObject, plans: dict[str, tuple[int, int]]) -> None:
        """This step's rows and drafts for a running request: a prefill chunk up to the known
        tokens, else a decode row with up to three drafts."""
        c = adm.c
        if c < adm.known:
            n = data.draw(st.integers(1, min(CHUNK, adm.known - c)), label=f"{adm.rid} chunk")
            k = 0
        else:
            k = data.draw(st.integers(0, min(3, MAX_POS - c - 1)), label=f"{adm.rid} drafts")
            n = 1 + k
        self._alloc(adm, c + n, data)
        plans[adm.rid] = (n, k)

    def _save(self, plans: dict[str, tuple[int, int]], data: st.DataObject) -> None:
        running = [r for r in IDS if r in plans]
        if not running:
            return
        layout: list[tuple[str, list[int]]] = []
        rows: dict[str, Row] = {}
        for rid in running:
            adm = self.live[rid]
            n, k = plans[rid]
            c = adm.c
            a = data.draw(st.integers(0, k), label=f"{rid} accepted") if k else 0
            layout.append((rid, [adm.slot(p) for p in range(c, c + n)]))
            rows[rid] = Row(adm, c, c + n, k, a)
        land_writes = data.draw(st.sampled_from([True, True, False]), label="land writes")
        if not land_writes:
            self._saw("writes left in flight")
        drafts = [plans[r][1] for r in running]
        published = save(
            self.core, layout, drafts=drafts if any(drafts) else None, land_writes=land_writes
        )
        mode = data.draw(st.sampled_from(MODES), label="mode")
        rec = Rec(published.step_id, mode, rows)
        for row in rows.values():
            adm = row.adm
            adm.open_steps.add(rec.step_id)
            # Confirmed rows are accepted at once; draft rows overwrite their slots (SPEC-1).
            adm.accepted.update(range(row.lo, row.base))
            adm.good.update(range(row.lo, row.base))
            adm.good.difference_update(range(row.base, row.hi))
            adm.c = row.hi
            if row.k:
                adm.pending = (rec, row)
                adm.known = row.base + row.a
            else:
                adm.known = max(adm.known, row.hi)
        if mode.endswith("late") or mode == "late report":
            self.late.append(rec)
        else:
            self._consume(rec, data)

    @invariant()
    def core_invariants(self) -> None:
        self.core.check_invariants()


#: Sized so the run takes about 15 s; `ci` (tests/conftest.py) derandomizes it.
SETTINGS = settings(
    max_examples=200,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


def test_spec_2_spec_4_the_engine_model_and_the_oracle_agree() -> None:
    """Drafts, their acceptance at a start or a materialize, read backs, preemptions and ends:
    every delivered range holds accepted positions only, never a draft not accepted, each once
    per admission and in order; an ended admission materialized throughout got every accepted
    position below its final count (SPEC-1..SPEC-5, DLV-2). The runs reach every case in
    `CASES`, the core's read back among them (`draft_rows_read_back`).
    """
    SpeculativeMachine.coverage = Counter()
    run_state_machine_as_test(SpeculativeMachine, settings=SETTINGS)
    seen = SpeculativeMachine.coverage
    print(f"\nreached: {dict(sorted(seen.items()))}")
    missing = [case for case in CASES if not seen[case]]
    assert not missing, f"the runs never reached {missing}"


# ---------------------------------------------------------------------------------------------
# Controls: the core with one SPEC rule broken on purpose; the machine must notice.

_REAL_CONFIRM = CacheCore._confirm
_REAL_ON_SAVE = Drafts.on_save


def _drafts_never_cut(self: Drafts, step_id: Any, entries: Any, hi: Any, *args: Any) -> Any:
    """A core that forgets SPEC-1: unconfirmed drafts are handed out like confirmed rows."""
    _REAL_ON_SAVE(self, step_id, entries, hi, *args)
    return hi.copy()


def _no_read_back(self: CacheCore, confirmed: Any, catch_up: list[Any]) -> SlotArray:
    """A core that forgets SPEC-4: accepted rows a consumed step held back are never read."""
    return _REAL_CONFIRM(self, confirmed, [])


def _rejected_handed_out(self: CacheCore, confirmed: Any, catch_up: list[Any]) -> SlotArray:
    """A core that forgets SPEC-3: a step consumed after its count hands out rejected rows."""
    drafts = self._drafts
    steps, index, _ = drafts.where(confirmed.entries)
    ends = drafts._end[confirmed.entries].copy()
    rejected = _REAL_CONFIRM(self, confirmed, catch_up)
    for s, i, end in zip(steps.tolist(), index.tolist(), ends.tolist(), strict=True):
        step = self._saved.get(s)
        if step is not None and not step.consuming:
            step.valid[i] = end
    return rejected


#: Per control: what it patches, and what the oracle's failure says.
_BROKEN: dict[str, tuple[object, str, Callable[..., Any], str]] = {
    "drafts handed out unconfirmed (SPEC-1)": (Drafts, "on_save", _drafts_never_cut, "beyond"),
    "no read back (SPEC-4)": (CacheCore, "_confirm", _no_read_back, r"never delivered \[\d"),
    "rejected rows handed out (SPEC-3)": (CacheCore, "_confirm", _rejected_handed_out, "beyond"),
}


@pytest.mark.parametrize("broken", sorted(_BROKEN))
def test_spec_1_spec_3_spec_4_the_machine_finds_a_broken_rule(
    broken: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With one of SPEC-1, SPEC-3 or SPEC-4 broken in the core, the oracle fails a run: the
    checks above can fail."""
    owner, name, replacement, says = _BROKEN[broken]
    monkeypatch.setattr(owner, name, replacement)
    quick = settings(
        max_examples=500,
        stateful_step_count=40,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.generate],  # the first failure is enough; shrinking it costs minutes
        suppress_health_check=list(HealthCheck),
    )
    with pytest.raises(AssertionError, match=says):
        run_state_machine_as_test(SpeculativeMachine, settings=quick)


def test_controls_leave_the_core_intact() -> None:
    """The controls patch the core only inside their own test."""
    assert CacheCore._confirm is _REAL_CONFIRM
    assert Drafts.on_save is _REAL_ON_SAVE
