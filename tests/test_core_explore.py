"""Breadth-first exploration of every core state reachable within small bounds.

Bounds: 2 pages, 2 requests ("a" computes block 0; "b" block 1 and may start with a hit on
block 0), 2 blocks of 2 slots, at most 2 request starts, 1 preemption, 3 saves and 8 inputs on
any path, a clock of three values (0, 1, 2) against a 1 ns timeout, hidden states (immediate)
and one deferred key, and a budget of 4 bytes (1 byte per row and key: a save of both requests,
or one after a deferred write, needs a flush; a smaller budget flushes every older write to the
pool before each save, and no save could then take a slot from a write still in flight).

From every state the explorer applies every enabled input to a copy of the core: request
starts, finishes (a preempted request's too) and preemptions, resumes (with no hit, or a hit on
the other request's block), saves (begun, then driven until they wait or commit), materialize
and discard of any open step, one committer stage of any queued write (a deferred write's copy,
then its pool write; a step write's whole pipeline, which nothing can observe half done once the
next barrier waits for it), a step write failing while a save waits, and the clock ticking while
something waits. Every state reached keeps `check_invariants()`; in every state an unknown step
id, an unaligned hit and every lifecycle record LIFE-2 forbids (RESUMED of a running request,
PREEMPTED or STARTED of a preempted one, a save naming a preempted one) raise and change
nothing; a wait that runs out changes nothing. A materialize hands each admission every position
at most once and never below one it handed out (DLV-2), is refused exactly when DLV-5 says, and a
refusal changes nothing. States are told apart by `CacheCore.snapshot()`, the clock, the number
of saves and who started or was preempted; with nothing waiting the clock is reset to 0, since
the core only compares it with deadlines.
"""

from __future__ import annotations

import copy
import time
from collections import Counter, deque
from collections.abc import Iterator
from typing import Any

import attrs
import numpy as np
import pytest

from omni_cache_core import (
    HIDDEN_KEY,
    BadInputError,
    DeliveryOrderError,
    HitUnreadableError,
    LifecycleError,
    ModelCachePolicy,
    OmniPrefixCacheUnmatchError,
    PageTimeoutError,
    PrefixCacheConfig,
    PrefixCacheEventKind,
    PrefixCacheRequestEvent,
    PrefixCacheStep,
    ReqId,
    StepId,
    TensorName,
    Tid,
    UnknownStepError,
    WaitTimeoutError,
)
from omni_cache_core._core import CacheCore
from omni_cache_core._delivery import RequestState
from omni_cache_core._values import (
    AwaitPage,
    AwaitTasks,
    ConsumeBegin,
    ConsumeEnd,
    ConsumePlan,
    CopyLanded,
    CopyStarted,
    DeferredChunk,
    EscalateTasks,
    PageClaimed,
    Preserve,
    SaveAbort,
    SaveBegin,
    SaveCommit,
    SaveProceed,
    StartStep,
    StepWrite,
    TaskState,
    Tombstone,
    WriteFailed,
    WriteLanded,
)

DEFERRED = TensorName("codes.audio")
CONFIG = PrefixCacheConfig(
    num_blocks=2,
    block_size=2,
    staging_depth=2,
    staging_capacity_tokens=4,
    gpu_staging_bytes=4,
    staging_claim_timeout_s=1e-9,  # 1 ns: the clock's three values cover every deadline
)
POLICY = ModelCachePolicy(deferred_keys={DEFERRED})
#: Each request computes its own block.
HOME = {ReqId("a"): 0, ReqId("b"): 1}
#: The starts explored: "b" may start with a hit on block 0, which "a" writes.
STARTS: tuple[tuple[ReqId, int | None], ...] = (
    (ReqId("a"), None),
    (ReqId("b"), None),
    (ReqId("b"), 0),
)
#: The request that may be preempted, and its resumes: no hit, or a hit on block 0 (DLV-3).
PREEMPTABLE = ReqId("b")
RESUMES: tuple[tuple[ReqId, int | None], ...] = ((PREEMPTABLE, None), (PREEMPTABLE, 0))
#: The layouts explored, and whether the save emits the deferred key (else it is absent).
LAYOUTS: tuple[tuple[tuple[ReqId, ...], bool], ...] = (
    ((ReqId("a"),), True),
    ((ReqId("a"),), False),
    ((ReqId("b"),), False),
    ((ReqId("a"), ReqId("b")), True),
    ((), False),
)
MAX_SAVES = 3
MAX_STARTS = 2
MAX_PREEMPTS = 1
MAX_RESUMES = 1
MAX_CLOCK = 2
#: The longest input path explored ("bounded steps"); the copy-on-write rescue needs all 8.
MAX_INPUTS = 8

#: What the explorer must see at least once (counted where the input shows it).
INTERESTING = (
    "page timeout",
    "slot stolen in flight",
    "budget flush",
    "sparse absence",
    "copy-on-write rescue",
    "preempted request",
    "resume with a hit",
    "resume without a hit",
    "rows cut below the cursor",
    "delivery order refused",
)

#: A floor under the number of distinct states, measured when the bounds were set (keeps a
#: change that silently prunes the space from passing unnoticed): 37.3k states, 22.8k of them
#: without the preemption (87 s and 53 s of CPU time on one core of the development machine).
MIN_STATES = 35_000

Input = tuple[Any, ...]


@attrs.define
class Node:
    """One explored state: the core and what the snapshot does not hold.

    `delivered` is the history of the path that first reached the state (not part of its key):
    per admission (request and its number of starts), the positions handed out so far.
    """

    core: CacheCore
    clock: int = 0
    saves: int = 0
    tids: frozenset[Tid] = frozenset()
    step_writes: frozenset[Tid] = frozenset()
    started: frozenset[ReqId] = frozenset()
    preempts: int = 0
    resumes: int = 0
    admissions: dict[ReqId, int] = attrs.Factory(dict)
    carried: dict[StepId, dict[ReqId, int]] = attrs.Factory(dict)
    delivered: dict[tuple[ReqId, int], set[int]] = attrs.Factory(dict)

    def key(self) -> tuple[Any, ...]:
        return (
            self.core.snapshot(),
            self.clock,
            self.saves,
            self.started,
            self.preempts,
            self.resumes,
        )


def _live(core: CacheCore) -> list[ReqId]:
    return sorted(core.request_states())


def _running(core: CacheCore) -> list[ReqId]:
    return sorted(r for r, s in core.request_states().items() if s is RequestState.RUNNING)


def _preempted(core: CacheCore) -> list[ReqId]:
    return sorted(r for r, s in core.request_states().items() if s is RequestState.PREEMPTED)


def _records(
    *records: tuple[str, PrefixCacheEventKind, int, tuple[int, ...]], now_ns: int = 0
) -> StartStep:
    """One step's lifecycle records: ``(request, kind, hit_end, block_ids)`` each."""
    events = [
        PrefixCacheRequestEvent(req_id=r, kind=kind, hit_end=hit_end, block_ids=blocks)
        for r, kind, hit_end, blocks in records
    ]
    return StartStep(step=PrefixCacheStep(events=events), now_ns=now_ns)


def _slots(req_ids: tuple[ReqId, ...]) -> np.ndarray:
    bs = CONFIG.block_size
    return np.asarray([HOME[r] * bs + o for r in req_ids for o in range(bs)], dtype=np.int64)


def enabled(node: Node) -> Iterator[Input]:
    """Every input that may be applied in this state (illegal ones are tried separately)."""
    core = node.core
    if core.fatal is not None:
        return  # FAIL-1: a poisoned cache refuses every engine input; nothing left to explore
    live = _live(core)
    running = _running(core)
    save = core.save_in_progress
    if not save:
        if len(node.started) < MAX_STARTS:
            for req_id, block in STARTS:
                if req_id not in live and req_id not in node.started:
                    yield ("start", req_id, block)
        for req_id in live:
            yield ("finish", req_id)  # LIFE-2: a preempted request may end too
        if node.preempts < MAX_PREEMPTS and PREEMPTABLE in running:
            yield ("preempt", PREEMPTABLE)
        if node.resumes < MAX_RESUMES:
            for req_id, block in RESUMES:
                if core.request_states().get(req_id) is RequestState.PREEMPTED:
                    yield ("resume", req_id, block)
        if node.saves < MAX_SAVES:
            hits = set(core._hits.start_hit_requests())
            for layout, with_deferred in LAYOUTS:
                # D9, D10, LIFE-3: a save names running requests only, every pending hit, no
                # lost hit.
                if (
                    set(layout) <= set(running)
                    and hits <= set(layout)
                    and not core._hits.lost_hit_requests() & set(layout)
                ):
                    yield ("save", layout, with_deferred)
    else:
        yield ("proceed",)
    if node.clock < MAX_CLOCK and core.next_deadline_ns() is not None:
        yield ("tick",)  # time matters only while something waits (D7)
    for tid in sorted(node.tids):
        state = core.task_state(tid)
        if state in (TaskState.QUEUED, TaskState.HOST_READY):
            yield ("report", tid)
        if state is TaskState.QUEUED and save and tid in node.step_writes:
            # One failure point per write, while a save waits on the committer: FAILED is
            # terminal and sticky (FAIL-1), so a poisoned state has nothing left to explore.
            yield ("fail", tid)
    for step_id in core.open_step_ids:
        yield ("materialize", step_id)
        yield ("discard", step_id)


def apply(node: Node, inp: Input, seen: Counter[str]) -> None:
    """Apply one input to `node` in place, noting the interesting things it shows."""
    core = node.core
    kind = inp[0]
    try:
        if kind == "start":
            _, req_id, block = inp
            node.started |= {req_id}
            node.admissions[req_id] = node.admissions.get(req_id, 0) + 1
            hit_end = 0 if block is None else CONFIG.block_size
            blocks = (HOME[req_id],) if block is None else (block, HOME[req_id])
            event = PrefixCacheRequestEvent(
                req_id=req_id,
                kind=PrefixCacheEventKind.STARTED,
                hit_end=hit_end,
                block_ids=blocks,
            )
            core.start_step(StartStep(step=PrefixCacheStep(events=[event]), now_ns=node.clock))
        elif kind == "finish":
            core.start_step(
                _records((inp[1], PrefixCacheEventKind.FINISHED, 0, ()), now_ns=node.clock)
            )
        elif kind == "preempt":
            node.preempts += 1
            core.start_step(
                _records((inp[1], PrefixCacheEventKind.PREEMPTED, 0, ()), now_ns=node.clock)
            )
            seen["preempted request"] += 1
        elif kind == "resume":
            # LIFE-4: the request's own block to compute in, after the hit block if any.
            _, req_id, block = inp
            node.resumes += 1
            hit_end = 0 if block is None else CONFIG.block_size
            blocks = (HOME[req_id],) if block is None else (block, HOME[req_id])
            core.start_step(
                _records((req_id, PrefixCacheEventKind.RESUMED, hit_end, blocks), now_ns=node.clock)
            )
            seen[
                "resume with a hit"
                if req_id in core._hits.start_hit_requests()
                else "resume without a hit"
            ] += 1
        elif kind == "save":
            _, layout, with_deferred = inp
            node.saves += 1
            slots = _slots(layout)
            n = len(slots)
            bounds = np.arange(0, n + 1, CONFIG.block_size, dtype=np.int64)
            if n == 0:
                bounds = np.zeros(len(layout) + 1, dtype=np.int64)
            core.save_begin(
                SaveBegin(
                    now_ns=node.clock,
                    req_ids=layout,
                    row_bounds=bounds,
                    slots=slots,
                    num_tokens=n,
                    immediate_keys=(HIDDEN_KEY,) if n else (),
                    deferred_keys=(DEFERRED,) if with_deferred else (),
                    immediate_bytes=n,
                    deferred_bytes=n if with_deferred else 0,
                )
            )
            _proceed(node, seen)
        elif kind == "proceed":
            _proceed(node, seen)
        elif kind == "tick":
            node.clock += 1
        elif kind == "report":
            # A deferred write's copy (started, landed) is one input and its pool write the
            # next: between them its clone budget is free (BUDGET-1) and a hit reads its own
            # rows (HIT-3). A step write does all three at once: the next save's barrier waits
            # for WRITTEN anyway (TASK-3), so its HOST_READY is never seen by a decision.
            tid = inp[1]
            if core.task_state(tid) is TaskState.QUEUED:
                core.report(CopyStarted(tid=tid))
                core.report(CopyLanded(tid=tid))
                if tid in node.step_writes:
                    core.report(WriteLanded(tid=tid))
            else:
                core.report(WriteLanded(tid=tid))
        elif kind == "fail":
            core.report(WriteFailed(tid=inp[1], reason="explored failure"))
        elif kind == "materialize":
            _materialize(node, inp[1], seen)
        elif kind == "discard":
            core.consume_begin(ConsumeBegin(step_id=inp[1], req_ids=None, now_ns=node.clock))
        else:  # pragma: no cover - every kind is listed above
            raise AssertionError(kind)
    except OmniPrefixCacheUnmatchError as exc:
        # A refusal is legal only for a poisoned cache (FAIL-1); it must change nothing.
        assert core.fatal is not None, f"{inp} raised {exc!r}"
        seen["refused after a failed write"] += 1


def _owed(core: CacheCore, step_id: StepId) -> bool:
    """DLV-5: whether an earlier open step owes rows to a request this step would move.

    A request's cursor moves when the step carries positions above it; an earlier step owes
    rows when it carries positions of the same admission at or above the cursor.
    """
    # The explorer's own DLV-5 oracle reads the steps' admission entries and the cursors,
    # which only the machines hold.
    steps = core._saved.by_id
    step = steps[step_id]
    cursor = core._requests.cursor
    for i, entry in enumerate(step.entries.tolist()):
        if step.hi[i] <= cursor[entry]:
            continue
        for other in steps.values():
            if other.step_id < step_id and not other.consuming:
                for j, earlier in enumerate(other.entries.tolist()):
                    if earlier == entry and other.hi[j] > max(other.lo[j], cursor[entry]):
                        return True
    return False


def _materialize(node: Node, step_id: StepId, seen: Counter[str]) -> None:
    """Materialize a whole step: refused exactly when DLV-5 says, else each position once."""
    core = node.core
    req_ids, _ = core.step_slots_of(step_id)
    owed = _owed(core, step_id)
    before = core.snapshot() if owed else None
    try:
        result = core.consume_begin(
            ConsumeBegin(step_id=step_id, req_ids=req_ids, now_ns=node.clock)
        )
    except DeliveryOrderError:
        assert owed, f"materialize({step_id}) refused, but no earlier step owes rows (DLV-5)"
        assert core.snapshot() == before, "a DeliveryOrderError changed the state (DLV-5)"
        seen["delivery order refused"] += 1
        return
    except (HitUnreadableError, WaitTimeoutError):
        assert not owed, f"materialize({step_id}) not refused, but an earlier step owes rows"
        seen["unreadable hit"] += 1
        return
    assert not owed, f"materialize({step_id}) not refused, but an earlier step owes rows"
    # Reads are done at once (the machine explores saves during a consume).
    assert isinstance(result, ConsumePlan), result
    # DLV-2, DLV-7: per admission, each position once and never below one handed out.
    admissions = node.carried.get(step_id, {})
    skip = result.skip.tolist() if result.skip is not None else [0] * len(req_ids)
    for req_id, start, end, cut in zip(
        req_ids, result.starts.tolist(), result.ends.tolist(), skip, strict=True
    ):
        if cut:
            seen["rows cut below the cursor"] += 1
        got = node.delivered.setdefault((req_id, admissions.get(req_id, 0)), set())
        assert start <= end and not got.intersection(range(start, end)), (
            f"materialize({step_id}) hands {req_id} positions [{start}, {end}) again (DLV-2)"
        )
        assert start >= max(got, default=-1), f"{req_id}: positions below {max(got)} (DLV-2)"
        got.update(range(start, end))
    core.consume_end(ConsumeEnd(step_id=step_id))


def _proceed(node: Node, seen: Counter[str]) -> None:
    """Advance the pending save as far as it goes without the committer or the clock.

    A claimed page is filled and committed at once (that copy has no interleaving worth
    exploring); a wait leaves the save pending for a later ``proceed``.
    """
    core = node.core
    before = core.snapshot()
    try:
        effect = core.save_proceed(SaveProceed(now_ns=node.clock))
    except (PageTimeoutError, WaitTimeoutError) as exc:
        seen["page timeout" if isinstance(exc, PageTimeoutError) else "wait timeout"] += 1
        # FAIL-3, STEP-5: a wait that ran out changes nothing, not even the pending save.
        assert core.snapshot() == before, f"{exc!r} changed the state"
        core.save_abort(SaveAbort())  # the adapter aborts a save that raised (STEP-5)
        return
    if isinstance(effect, EscalateTasks):
        seen["budget flush"] += 1
        for tid in effect.tids:
            node.tids |= {tid}
        return
    if not isinstance(effect, PageClaimed):
        assert isinstance(effect, AwaitTasks | AwaitPage)
        return
    published = core.save_commit(SaveCommit(now_ns=node.clock))
    saved_ids, _ = core.step_slots_of(published.step_id)
    node.carried[published.step_id] = {r: node.admissions.get(r, 0) for r in saved_ids}
    for eff in published.effects:
        if isinstance(eff, Tombstone):
            seen["slot stolen in flight"] += 1
        elif isinstance(eff, Preserve):
            seen["copy-on-write rescue"] += 1
        elif isinstance(eff, StepWrite):
            node.tids |= {eff.tid}
            node.step_writes |= {eff.tid}
        elif isinstance(eff, DeferredChunk):
            node.tids |= {eff.tid}
    if any(core.presence(DEFERRED, s)[0] == -1 for s in range(CONFIG.num_slots)):
        seen["sparse absence"] += 1


def _illegal_inputs_change_nothing(core: CacheCore) -> None:
    """An unknown step id, an unaligned hit and illegal lifecycle records change nothing.

    LIFE-2: RESUMED of a running request, PREEMPTED or STARTED of a preempted one raise
    LifecycleError; LIFE-3: a save naming a preempted request raises BadInputError. Each must
    raise its error; the state is compared once, after all of them (one snapshot per state).
    """
    before = core.snapshot()
    with pytest.raises(OmniPrefixCacheUnmatchError) as info:
        core.consume_begin(ConsumeBegin(step_id=StepId(99), req_ids=(), now_ns=0))
    usable = core.fatal is None and not core.closed
    if usable:
        assert type(info.value) is UnknownStepError
    if not core.save_in_progress:
        bad = PrefixCacheRequestEvent(
            req_id="z", kind=PrefixCacheEventKind.STARTED, hit_end=1, block_ids=(0,)
        )
        with pytest.raises(OmniPrefixCacheUnmatchError) as info:
            core.start_step(StartStep(step=PrefixCacheStep(events=[bad]), now_ns=0))
        if core.fatal is None:
            assert type(info.value) is BadInputError
    if usable and not core.save_in_progress:
        kinds = PrefixCacheEventKind
        illegal = [_records((r, kinds.RESUMED, 0, ())) for r in _running(core)[:1]]
        for req_id in sorted(_preempted(core))[:1]:
            illegal.append(_records((req_id, kinds.PREEMPTED, 0, ())))
            illegal.append(_records((req_id, kinds.STARTED, 0, ())))
            with pytest.raises(BadInputError):
                core.save_begin(
                    SaveBegin(
                        now_ns=0,
                        req_ids=(req_id,),
                        row_bounds=np.asarray([0, 1], dtype=np.int64),
                        slots=np.asarray([0], dtype=np.int64),
                        num_tokens=1,
                        immediate_keys=(HIDDEN_KEY,),
                        deferred_keys=(),
                        immediate_bytes=1,
                        deferred_bytes=0,
                    )
                )
        for records in illegal:
            with pytest.raises(LifecycleError):
                core.start_step(records)
    assert core.snapshot() == before, "an illegal input changed the state"


def _step(node: Node, inp: Input, seen: Counter[str]) -> None:
    """Apply one input, then forget the clock if nothing waits on it."""
    apply(node, inp, seen)
    if node.core.next_deadline_ns() is None:
        # D7: the core reads time only against a pending deadline, so with none pending,
        # states that differ only by the clock behave alike from here on.
        node.clock = 0


def _replay(path: tuple[Input, ...]) -> Node:
    node = Node(core=CacheCore(CONFIG, POLICY))
    for inp in path:
        _step(node, inp, Counter())
    return node


def explore(clone: str = "deepcopy", max_inputs: int | None = None) -> tuple[int, Counter[str]]:
    """Visit every state within the bounds; return how many and what was seen.

    Args:
        clone: How a child state is made from its parent: ``"deepcopy"`` copies the parent
            (sharing the frozen config and policy); ``"replay"`` replays the input path from a
            fresh core, so only paths wait in the queue. Measured in CPU time for the 15.9k
            states of the bounds before preemption: deepcopy 21 s, replay 31 s (a path of up
            to 8 inputs costs more to re-run than the core's tables, tasks and reads cost to
            copy).
        max_inputs: The longest input path explored (default `MAX_INPUTS`).
    """
    limit = MAX_INPUTS if max_inputs is None else max_inputs
    seen: Counter[str] = Counter()
    root = Node(core=CacheCore(CONFIG, POLICY))
    root.core.check_invariants()
    visited = {root.key()}
    queue: deque[tuple[tuple[Input, ...], Node | None]] = deque([((), root)])
    while queue:
        path, parent = queue.popleft()
        node = parent if parent is not None else _replay(path)
        _illegal_inputs_change_nothing(node.core)
        if len(path) >= limit:
            continue
        inputs = list(enabled(node))
        for i, inp in enumerate(inputs):
            if i == len(inputs) - 1:
                child = node  # the parent is not needed after its last input
            elif clone == "deepcopy":
                # The config and the policy are frozen and shared, never copied.
                child = copy.deepcopy(node, {id(CONFIG): CONFIG, id(POLICY): POLICY})
            else:
                child = _replay(path)
            _step(child, inp, seen)
            key = child.key()
            if key not in visited:
                child.core.check_invariants()
                visited.add(key)
                queue.append(((*path, inp), child if clone == "deepcopy" else None))
    return len(visited), seen


def test_every_reachable_state_keeps_the_invariants() -> None:
    """Every state within the bounds keeps the invariants and the named states are reached.

    Among them (LIFE-1..4, DLV-2, DLV-3, DLV-5): a preempted request, resumes with and without a
    hit, rows cut below the cursor and DLV-5 refusals, each refused exactly when an earlier step
    owes rows and changing nothing; every illegal lifecycle record raises and changes nothing.
    """
    start, cpu = time.perf_counter(), time.process_time()
    count, seen = explore()
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    print(
        f"\nexplored {count} states in {elapsed:.1f}s ({cpu:.1f}s CPU); "
        f"reached: {dict(sorted(seen.items()))}"
    )
    missing = [name for name in INTERESTING if not seen[name]]
    assert not missing, f"never reached: {missing}"
    assert count >= MIN_STATES
