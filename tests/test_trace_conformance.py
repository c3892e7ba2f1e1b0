"""The SPIN model and the pure core agree on every trace the model prints.

`spec/omni_cache.pml` prints each action of a random simulation as one line
``ACT <name> k=v ... [-> outcome]``. The replay here feeds every action to `CacheCore` through the
checked-in map (`spec/trace_map.toml`), executes the core's effects on integer rows the way an
adapter does (a pool per key, the staging pages, write tasks with their tombstones, preserved and
prefetched reads), and checks that the core accepts what the model did, raises the same kind of
error where the model raised one, and agrees on every observable result: which page a save
claimed, which write ids it registered, how much budget it charged, which read raised, and which
step's rows each hit row returned (a row is named by the engine step that computed it, as in the
model; 0 is zeros).

Fresh seeds on every run (printed, and named in every failure, so ``spin -n<seed>`` reproduces
the trace; set ``TRACE_SEED`` to rerun one batch) plus the regression traces committed in
`spec/traces/`. `spec/README.md` says how to run and extend it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import time
import tomllib
import typing
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest

import omni_cache_core
from omni_cache_core import (
    HIDDEN_KEY,
    ModelCachePolicy,
    PrefixCacheConfig,
    PrefixCacheEventKind,
    PrefixCacheRequestEvent,
    PrefixCacheStep,
    ReqId,
    StepId,
    TensorName,
    Tid,
)
from omni_cache_core import _values as values
from omni_cache_core._core import CacheCore, dispatch
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
    PrefetchRead,
    Preserve,
    ReadPlan,
    SaveAbort,
    SaveBegin,
    SaveCommit,
    SaveProceed,
    SavePublished,
    ShutDown,
    SlotSource,
    StartStep,
    StepWrite,
    TaskState,
    Tombstone,
    WriteFailed,
    WriteLanded,
)

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "spec" / "omni_cache.pml"
MAP_FILE = ROOT / "spec" / "trace_map.toml"
TRACES = ROOT / "spec" / "traces"

#: Traces with at least one save that every run replays from fresh seeds.
FRESH_TRACES = int(os.environ.get("TRACE_COUNT", "200"))
#: Seeds tried at most to find them (most seeds that save nothing stop at once).
MAX_SEEDS = 4 * FRESH_TRACES
#: Simulation steps per trace; a whole run of the model takes a few hundred.
MAX_STEPS = 20_000
#: Speculative decoding (SPEC-1..SPEC-5): the bounds of the model checks `safety_spec` (four steps,
#: no preemption) and `safety_spec_resume` (drafts with preemption), in the seeds' rotation too.
SPEC_DEFINES: tuple[tuple[str, ...], ...] = (
    ("-DSPEC_DRAFTS", "-DPREEMPTS=0", "-DSTARTS=2", "-DMAXSTEP=4"),
    ("-DSPEC_DRAFTS", "-DSTARTS=2"),
)
#: Model variants the seeds rotate through: the defaults (one preemption); a budget of one clone
#: (saves flush); no committer failures and a fourth step (blocks are reused, hits read rows); no
#: failures or timeouts and a roomy budget (long runs); no committer failures (waits run out
#: instead); no preemption; two preemptions over four steps with no faults (resumes whose hit
#: reads rows, delivery cut below the cursor); the two speculative-decoding variants.
DEFINES: tuple[tuple[str, ...], ...] = (
    (),
    ("-DBUDGET=1",),
    ("-DFAILURES=0", "-DMAXSTEP=4"),
    ("-DFAILURES=0", "-DTIMEOUTS=0", "-DBUDGET=4"),
    ("-DFAILURES=0",),
    ("-DPREEMPTS=0",),
    ("-DFAULTS=0", "-DMAXSTEP=4", "-DPREEMPTS=2", "-DBUDGET=4"),
    *SPEC_DEFINES,
)

ACT = re.compile(r"^ACT (?P<name>\w+)(?P<args>(?: \w+=[-\w]+)*)(?: -> (?P<result>.*))?$")
PRINTF_ACT = re.compile(r'printf\("ACT (\w+)')


def load_map() -> dict[str, Any]:
    """The checked-in action map."""
    with MAP_FILE.open("rb") as f:
        return tomllib.load(f)


MAP = load_map()


# ---------------------------------------------------------------------------------------------
# Traces.


@attrs.frozen(kw_only=True, eq=False)
class Act:
    """One trace line: an action name, its arguments and its outcome (after ``->``)."""

    index: int
    text: str
    name: str
    args: dict[str, str]
    result: dict[str, str]

    def num(self, field: str) -> int:
        """An integer argument."""
        return int(self.args[field])

    @property
    def error(self) -> str | None:
        """The error kind after ``-> error=``; empty for a bare ``-> error``; None on success."""
        return self.result.get("error")


def parse_act(index: int, text: str) -> Act:
    """Parse one ``ACT ...`` line."""
    match = ACT.match(text)
    if match is None:
        raise ValueError(f"trace line {index}: not an action line: {text!r}")
    args = dict(item.split("=", 1) for item in match["args"].split())
    result: dict[str, str] = {}
    for item in (match["result"] or "").split():
        key, _, value = item.partition("=")
        result[key] = value
    return Act(index=index, text=text, name=match["name"], args=args, result=result)


@attrs.frozen(kw_only=True)
class Trace:
    """The action lines of one simulation, the model bounds it ran with, and its origin."""

    source: str
    defines: tuple[str, ...]
    bounds: tuple[tuple[str, int], ...]
    lines: tuple[str, ...]
    problems: tuple[str, ...] = ()

    def acts(self) -> list[Act]:
        """The parsed actions, in order."""
        return [parse_act(i, line) for i, line in enumerate(self.lines)]

    @property
    def saves(self) -> int:
        """How many saves succeeded in it."""
        return sum(1 for line in self.lines if line.startswith("ACT save ") and "-> ok" in line)


def act_lines(output: str) -> tuple[str, ...]:
    """The action lines of a spin output: lines that start with ACT once spaces are stripped."""
    stripped = (line.strip() for line in output.splitlines())
    return tuple(line for line in stripped if line.startswith("ACT"))


def model_bounds(defines: Sequence[str]) -> tuple[tuple[str, int], ...]:
    """The model constants the map's [config] names: ``-D`` flags first, else their #define."""
    text = MODEL.read_text()
    values = {
        m[1]: int(m[2]) for m in re.finditer(r"^#define\s+(\w+)\s+(\d+)\b", text, re.MULTILINE)
    }
    for flag in defines:
        name, _, value = flag.removeprefix("-D").partition("=")
        if value.isdigit():
            values[name] = int(value)
    names = sorted(v for v in MAP["config"].values() if isinstance(v, str))
    missing = [name for name in names if name not in values]
    if missing:
        raise AssertionError(f"spec/omni_cache.pml defines no {missing} (spec/trace_map.toml)")
    return tuple((name, values[name]) for name in names)


def spin_command(seed: int, defines: Sequence[str]) -> list[str]:
    """The command that prints the trace of one seed."""
    return ["spin", f"-n{seed}", f"-u{MAX_STEPS}", *defines, str(MODEL)]


def simulate(seed: int, defines: Sequence[str]) -> Trace:
    """Run one random simulation of the model in a scratch directory and keep its actions."""
    command = spin_command(seed, defines)
    with tempfile.TemporaryDirectory() as scratch:
        proc = subprocess.run(
            command, cwd=scratch, capture_output=True, text=True, timeout=120, check=False
        )
    output = proc.stdout + proc.stderr
    problems = [
        line.strip()
        for line in output.splitlines()
        if "assertion violated" in line or "error:" in line.lower()
    ]
    if proc.returncode != 0:
        problems.append(f"spin exited with {proc.returncode}")
    return Trace(
        source=" ".join([*command[:-1], "spec/omni_cache.pml"]),
        defines=tuple(defines),
        bounds=model_bounds(defines),
        lines=act_lines(proc.stdout),
        problems=tuple(problems),
    )


def counterexample(probe: int, defines: Sequence[str]) -> Trace:
    """A whole model run that goes through reachability probe `probe` (``REACH(k)``).

    Random simulation seldom reaches some situations (a refused materialize, a resume below
    the delivery cursor). The model built with ``-DPROBE=k`` fails at the end of any run that
    went through probe k, so pan's exhaustive search finds one, and ``spin -t`` prints it.
    Needs gcc; used by hand to make regression traces (see spec/MODEL.md).
    """
    flags = (*defines, f"-DPROBE={probe}")
    with tempfile.TemporaryDirectory() as scratch:
        shutil.copy(MODEL, scratch)

        def run(*command: str) -> str:
            proc = subprocess.run(
                command, cwd=scratch, capture_output=True, text=True, timeout=600, check=True
            )
            return proc.stdout + proc.stderr

        run("spin", *flags, "-a", MODEL.name)
        run("gcc", "-O0", "-DSAFETY", "-DNOCLAIM", "-DCOLLAPSE", "-o", "pan", "pan.c")
        found = run("./pan", "-m100000")
        if "assertion violated  !(g_probe)" not in found:
            raise AssertionError(f"no run reaches probe {probe} with {defines}:\n{found}")
        output = run("spin", "-t", *flags, MODEL.name)
    return Trace(
        source=" ".join([f"pan -DPROBE={probe} counterexample:", *defines, "spec/omni_cache.pml"]),
        defines=flags,
        bounds=model_bounds(defines),
        lines=act_lines(output),
    )


def read_trace_file(path: Path) -> Trace:
    """A committed trace: comment lines (``# defines:``, ``# bounds:``), then action lines."""
    defines: tuple[str, ...] = ()
    bounds: dict[str, int] = {}
    lines = []
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if line.startswith("# defines:"):
            defines = tuple(line.removeprefix("# defines:").split())
        elif line.startswith("# bounds:"):
            pairs = (item.split("=") for item in line.removeprefix("# bounds:").split())
            bounds = {name: int(value) for name, value in pairs}
        elif line.startswith("ACT"):
            lines.append(line)
    if not bounds:
        raise AssertionError(f"{path.name}: no '# bounds:' line")
    return Trace(
        source=str(path.relative_to(ROOT)),
        defines=defines,
        bounds=tuple(sorted(bounds.items())),
        lines=tuple(lines),
    )


def write_trace_file(path: Path, trace: Trace, why: str) -> None:
    """Commit a trace for regression replay (used by hand; see spec/README.md)."""
    header = [
        f"# {why}",
        f"# from: {trace.source}",
        f"# defines: {' '.join(trace.defines)}",
        f"# bounds: {' '.join(f'{name}={value}' for name, value in trace.bounds)}",
    ]
    path.write_text("\n".join([*header, *trace.lines]) + "\n")


# ---------------------------------------------------------------------------------------------
# The replay.


class Disagreement(AssertionError):
    """The core and the model disagree on an action."""


@attrs.frozen(kw_only=True)
class Outcome:
    """How many actions a replay went through, and what it compared."""

    replayed: int
    checked: Counter[str] = attrs.Factory(Counter)


@attrs.define
class _Write:
    """The adapter's side of one write task."""

    tid: Tid
    deferred: bool
    keys: tuple[TensorName, ...]
    page: int | None = None
    slots: tuple[int, ...] = ()
    #: Deferred chunks: (slots, value) in append order.
    chunks: list[tuple[tuple[int, ...], int]] = attrs.Factory(list)
    tombstones: dict[TensorName, set[int]] = attrs.Factory(dict)


@attrs.define
class _Consume:
    """One consume of a step in progress."""

    discard: bool
    #: Counts the consume reports for drafted requests (ConsumeBegin.computed, SPEC-2).
    computed: dict[ReqId, int] | None = None
    result: ConsumePlan | AwaitTasks | None = None
    #: Per request of the step: the positions the model says it delivered (DLV-2, DLV-7).
    delivered: dict[ReqId, tuple[int, int]] = attrs.Factory(dict)
    error: BaseException | None = None
    error_seen: bool = False
    reads_before_error: int = 0
    reads_seen: set[tuple[TensorName, int]] = attrs.Factory(set)


@attrs.define
class _Step:
    """A saved step as the adapter remembers it."""

    step: int
    page: int
    req_ids: tuple[ReqId, ...]
    consume: _Consume | None = None


def _error_classes(names: Iterable[str]) -> tuple[type[BaseException], ...]:
    return tuple(getattr(omni_cache_core, name) for name in names)


class Replay:
    """Feed a model trace to the core action by action, as the map says, and compare.

    Args:
        bounds: The model constants the trace ran with (NBLK, BS, NPAGE, NSLOT, BUDGET).
        prefetch: Gather committed rows at `PrefetchRead` (HIT-7); results must not differ.
    """

    def __init__(self, bounds: Iterable[tuple[str, int]], *, prefetch: bool = True) -> None:
        model = dict(bounds)
        cfg = {
            field: model[value] if isinstance(value, str) else value
            for field, value in MAP["config"].items()
        }
        self.keys = {
            int(k): HIDDEN_KEY if name == "hidden" else TensorName(name)
            for k, name in MAP["keys"].items()
        }
        self.deferred_key = self.keys[1]
        self.core = CacheCore(
            PrefixCacheConfig(**cfg),
            ModelCachePolicy(needs_full_hidden_states=True, deferred_keys={self.deferred_key}),
        )
        self.block_size = cfg["block_size"]
        self.handlers = dispatch(self.core)
        self.prefetch = prefetch
        self.now_ns = 0
        # The step being composed (engine lines before new_step_starts): finish, abort and
        # preempt records in order, then start and resume records (LIFE-2).
        self.finishes: list[tuple[ReqId, PrefixCacheEventKind]] = []
        self.starts: list[PrefixCacheRequestEvent] = []
        self.sched: dict[int, tuple[tuple[int, ...], bool]] = {}
        # Speculative decoding (SPEC-2): draft rows per request of the composed step
        # (SaveBegin.drafts) and the counts its computed_tokens confirms.
        self.drafts: dict[int, int] = {}
        self.computed: dict[str, int] = {}
        # The save in progress.
        self.save_step: int | None = None
        self.save_effect: Any = None
        self.save_slots: tuple[int, ...] = ()
        self.save_layout: tuple[ReqId, ...] = ()
        # What an adapter keeps: pool rows per key, page contents, writes, read overlays.
        self.pool: dict[TensorName, dict[int, int]] = {k: {} for k in self.keys.values()}
        self.pages = [0] * cfg["staging_depth"]
        self.writes: dict[Tid, _Write] = {}
        self.steps: dict[int, _Step] = {}
        self.preserved: dict[int, dict[int, int]] = {}
        self.prefetched: dict[int, dict[int, int]] = {}
        #: Input types fed for the action being replayed (checked against the map).
        self.fed: list[str] = []
        #: What the replay compared: hit rows by source, errors by kind, other checks.
        self.checked: Counter[str] = Counter()
        #: The trace prints the delivered positions (traces committed before DLV do not).
        self.delivers = False

    # -----------------------------------------------------------------------------------------
    # Driving the core.

    def run(self, acts: Sequence[Act]) -> Outcome:
        """Replay every action; the first disagreement raises."""
        self.delivers = any(act.name == "deliver" for act in acts)
        for act in acts:
            entry = MAP["actions"].get(act.name)
            if entry is None:
                raise Disagreement(f"action {act.name!r} is not in spec/trace_map.toml")
            self.fed = []
            try:
                getattr(self, f"on_{act.name}")(act)
                extra = [name for name in self.fed if name not in entry["inputs"]]
                if extra:
                    raise Disagreement(f"{act.name} fed {extra}, which the map does not list")
                self.core.check_invariants()
            except Disagreement as err:
                raise Disagreement(f"line {act.index + 1} `{act.text}`: {err}") from err
            except Exception as err:
                raise Disagreement(
                    f"line {act.index + 1} `{act.text}`: {type(err).__name__}: {err}"
                ) from err
        return Outcome(replayed=len(acts), checked=self.checked)

    def feed(self, inp: Any) -> Any:
        """Feed one input to the core, as the adapter would."""
        self.fed.append(type(inp).__name__)
        return self.handlers[type(inp)](inp)

    def expect_error(
        self, kind: str, call: Callable[[], Any], *, unchanged: bool = False
    ) -> BaseException:
        """Run `call` and require the error kind the model reported (see [outcomes])."""
        accepted = _error_classes(MAP["outcomes"][kind])
        if self.core.fatal is not None:
            accepted += _error_classes(MAP["outcomes"]["sticky"])
        before = self.core.snapshot() if unchanged else None
        try:
            result = call()
        except accepted as err:
            if unchanged and self.core.snapshot() != before:
                raise Disagreement(f"the refused call changed the core ({err})") from err
            self.checked[f"error:{type(err).__name__}"] += 1
            return err
        except Exception as err:
            raise Disagreement(
                f"model: error={kind}; core raised {type(err).__name__}: {err}"
            ) from err
        raise Disagreement(f"model: error={kind}; core returned {result!r}")

    def expect_ok(self, call: Callable[[], Any]) -> Any:
        """Run `call` and require that it does not raise."""
        try:
            return call()
        except Exception as err:
            raise Disagreement(f"model: ok; core raised {type(err).__name__}: {err}") from err

    # -----------------------------------------------------------------------------------------
    # Engine: composing a step.

    def on_finish(self, act: Act) -> None:
        """A FINISHED record for the next StartStep."""
        self.finishes.append((ReqId(act.args["req"]), PrefixCacheEventKind.FINISHED))

    def on_preempt(self, act: Act) -> None:
        """A PREEMPTED record for the next StartStep, in order with the finishes (LIFE-2)."""
        self.finishes.append((ReqId(act.args["req"]), PrefixCacheEventKind.PREEMPTED))
        self.checked["preempt"] += 1

    def on_resume(self, act: Act) -> None:
        """A RESUMED record for the next StartStep, with its hit (LIFE-4)."""
        hit = act.num("hit")
        self.starts.append(
            PrefixCacheRequestEvent(
                req_id=act.args["req"],
                kind=PrefixCacheEventKind.RESUMED,
                hit_end=hit,
                block_ids=(act.num("blk"),) if hit else (),
            )
        )
        self.checked["resume"] += 1

    def on_start(self, act: Act) -> None:
        """A STARTED record for the next StartStep, with its hit."""
        hit = act.num("hit")
        self.starts.append(
            PrefixCacheRequestEvent(
                req_id=act.args["req"],
                kind=PrefixCacheEventKind.STARTED,
                hit_end=hit,
                block_ids=(act.num("blk"),) if hit else (),
            )
        )

    def on_sched(self, act: Act) -> None:
        """The request's rows of this step: one slot per computed position."""
        blocks = (act.num("blk0"), act.num("blk1"))
        pos, n = act.num("pos"), act.num("n")
        slots = tuple(
            blocks[p // self.block_size] * self.block_size + p % self.block_size
            for p in range(pos, pos + n)
        )
        self.sched[act.num("req")] = (slots, act.args["key1"] == "1")
        # SPEC: the last `draft` rows are drafts; `computed` confirms earlier drafts (SPEC-2).
        if int(act.args.get("draft", 0)):
            self.drafts[act.num("req")] = act.num("draft")
            self.checked["drafts"] += 1
        if "computed" in act.args:
            self.computed[act.args["req"]] = act.num("computed")
            self.checked["computed_tokens"] += 1

    def on_new_step(self, act: Act) -> None:
        """new_step_starts: finishes first, then starts (HIT-2)."""
        emits = {emit for _, emit in self.sched.values()}
        if len(emits) > 1:
            # D11: a step emits a key for all its rows or none; the model must agree.
            raise Disagreement(f"requests of one step disagree on emitting key 1: {self.sched}")
        events = [PrefixCacheRequestEvent(req_id=r, kind=kind) for r, kind in self.finishes]
        events += self.starts
        scheduled = {str(r): len(slots) for r, (slots, _) in self.sched.items()}
        step = PrefixCacheStep(
            events=events, scheduled_tokens=scheduled, computed_tokens=self.computed
        )
        inp = StartStep(step=step, now_ns=self.now_ns)
        self.finishes, self.starts, self.computed = [], [], {}
        if act.error is not None:
            self.expect_error(act.error, lambda: self.feed(inp), unchanged=True)
            self.sched, self.drafts = {}, {}
            return
        effects = self.expect_ok(lambda: self.feed(inp))
        self.run_effects(effects, step=None)

    # -----------------------------------------------------------------------------------------
    # Engine: save_outputs.

    def begin_save(self, step: int) -> None:
        """Open the step's save (SaveBegin) from the composed rows, in request order."""
        if self.save_step == step:
            return
        reqs = sorted(self.sched)
        slots = tuple(s for r in reqs for s in self.sched[r][0])
        bounds = np.cumsum([0, *(len(self.sched[r][0]) for r in reqs)]).astype(np.int64)
        emits = any(emit for _, emit in self.sched.values())
        drafts = (
            np.asarray([self.drafts.get(r, 0) for r in reqs], dtype=np.int64)
            if self.drafts
            else None
        )
        self.save_step = step
        self.save_slots = slots
        self.save_layout = tuple(ReqId(str(r)) for r in reqs)
        self.save_effect = None
        self.feed(
            SaveBegin(
                now_ns=self.now_ns,
                req_ids=self.save_layout,
                row_bounds=bounds,
                slots=np.asarray(slots, dtype=np.int64),
                num_tokens=len(slots),
                immediate_keys=(HIDDEN_KEY,),
                deferred_keys=(self.deferred_key,) if emits else (),
                immediate_bytes=1,
                deferred_bytes=1 if emits else 0,
                drafts=drafts,
            )
        )

    def proceed(self) -> Any:
        """One SaveProceed; an escalation it asks for is handed to the committer."""
        effect = self.feed(SaveProceed(now_ns=self.now_ns))
        if isinstance(effect, EscalateTasks):
            self.run_effects((effect,), step=None)
        self.save_effect = effect
        return effect

    def end_save(self) -> None:
        """The save failed: abort it (STEP-5) and forget the composed step."""
        self.feed(SaveAbort())
        self.save_step = None
        self.save_effect = None
        self.sched, self.drafts = {}, {}

    def fail_save(self, kind: str, call: Callable[[], Any]) -> None:
        """The model's save failed with `kind` here: the core must raise it, then abort."""
        self.expect_error(kind, call)
        self.end_save()

    def time_out(self, effect: AwaitTasks | AwaitPage, kind: str) -> None:
        """Let the clock pass the wait's deadline; the next SaveProceed must raise `kind`."""
        self.now_ns = max(self.now_ns, effect.deadline_ns)
        self.fail_save(kind, self.proceed)

    def on_barrier(self, act: Act) -> None:
        """The save barrier (TASK-3) passed, ran out, or found the sticky failure."""
        step = act.num("step")
        if act.error == "fatal":
            self.fail_save("fatal", lambda: (self.begin_save(step), self.proceed()))
            return
        self.begin_save(step)
        effect = self.proceed()
        barrier = isinstance(effect, AwaitTasks) and effect.what == "save barrier"
        if act.error == "timeout":
            if not barrier:
                raise Disagreement(f"model: the barrier waits and runs out; core: {effect!r}")
            self.time_out(effect, "timeout")
        elif barrier:
            raise Disagreement(f"model: the barrier passed; core waits: {effect!r}")

    def on_flush(self, act: Act) -> None:
        """The budget flush escalates the oldest unfinished write (BUDGET-2).

        A write that a finish or abort escalated already is not escalated twice by the core
        (the model's escalation of it is a no-op): the core goes straight to waiting for it.
        """
        tid = Tid(act.num("tid"))
        effect = self.save_effect
        if not isinstance(effect, EscalateTasks):
            effect = self.proceed()
        escalated = isinstance(effect, EscalateTasks) and effect.tids == (tid,)
        awaited = isinstance(effect, AwaitTasks) and effect.waits == ((tid, TaskState.WRITTEN),)
        if not (escalated or awaited):
            raise Disagreement(f"model flushes write {tid}; core: {effect!r}")
        self.save_effect = None

    def on_flush_done(self, act: Act) -> None:
        """The flushed write ended (WRITTEN), failed, or its wait ran out."""
        tid = Tid(act.num("tid"))
        if act.error == "failed":
            self.fail_save("failed", self.proceed)
            return
        if act.error == "timeout":
            effect = self.proceed()
            if not (isinstance(effect, AwaitTasks) and effect.waits == ((tid, TaskState.WRITTEN),)):
                raise Disagreement(f"model: the flush of {tid} runs out; core: {effect!r}")
            self.time_out(effect, "timeout")
            return
        state = self.core.task_state(tid)
        if state is not None:
            raise Disagreement(f"model: flushed write {tid} is written; core: {state.name}")
        self.save_effect = None

    def on_budget(self, act: Act) -> None:
        """The save is admitted with its charge; the budget in use agrees (BUDGET-1)."""
        if act.error is not None:
            self.fail_save(act.error, self.proceed)
            return
        effect = self.save_effect
        if effect is None or isinstance(effect, AwaitTasks):
            effect = self.proceed()
        if not isinstance(effect, AwaitPage | PageClaimed):
            raise Disagreement(f"model admits the save; core: {effect!r}")
        charge = 1 + (1 if any(emit for _, emit in self.sched.values()) else 0)
        if charge != act.num("charge"):
            raise Disagreement(f"model charges {act.num('charge')}; the replay charged {charge}")
        if self.core.budget_used != int(act.result["used"]):
            raise Disagreement(
                f"model budget in use {act.result['used']}; core {self.core.budget_used}"
            )

    def on_claim_timeout(self, act: Act) -> None:
        """No page freed up in time (PAGE-4)."""
        effect = self.proceed()
        if not isinstance(effect, AwaitPage):
            raise Disagreement(f"model: no free page; core: {effect!r}")
        self.time_out(effect, "claim_timeout")

    def on_save(self, act: Act) -> None:
        """The page claim and the publish: same page, step id, step write and deferred writes."""
        if act.error is not None:
            self.fail_save(act.error, self.proceed)
            return
        step = act.num("step")
        effect = self.save_effect
        if not isinstance(effect, PageClaimed):
            effect = self.proceed()
        if not isinstance(effect, PageClaimed) or effect.page != act.num("page"):
            raise Disagreement(f"model claims page {act.args['page']}; core: {effect!r}")
        # The adapter copies the step's immediate rows into the page (named by the step).
        self.pages[effect.page] = step
        published: SavePublished = self.expect_ok(lambda: self.feed(SaveCommit(now_ns=self.now_ns)))
        if published.step_id != step:
            raise Disagreement(f"model step {step}; core issued step id {published.step_id}")
        writes = [e.tid for e in published.effects if isinstance(e, StepWrite)]
        if writes != [act.num("tid")]:
            raise Disagreement(f"model step write {act.args['tid']}; core {writes}")
        deferred = {e.req_id: e.tid for e in published.effects if isinstance(e, DeferredChunk)}
        for req in (0, 1):
            want = act.num(f"d{req}")
            got = deferred.get(ReqId(str(req)), 0)
            if want != got:
                raise Disagreement(f"model: request {req} rows go to write {want}; core: {got}")
        self.steps[step] = _Step(step=step, page=effect.page, req_ids=self.save_layout)
        self.run_effects(published.effects, step=step)
        self.save_step = None
        self.save_effect = None
        self.sched, self.drafts = {}, {}

    # -----------------------------------------------------------------------------------------
    # Builder: consume.

    def consume_of(self, act: Act) -> tuple[_Step, _Consume]:
        """The step an action names, and its consume in progress."""
        step = self.steps[act.num("step")]
        if step.consume is None:
            raise Disagreement(f"step {step.step} is not being consumed")
        return step, step.consume

    def begin_consume(self, step: _Step, consume: _Consume) -> None:
        """ConsumeBegin; keep what it returned or raised for the model's next lines."""
        wanted = None if consume.discard else step.req_ids
        inp = ConsumeBegin(
            step_id=StepId(step.step), req_ids=wanted, now_ns=self.now_ns, computed=consume.computed
        )
        try:
            consume.result = self.feed(inp)
        except Exception as err:
            consume.result, consume.error = None, err

    def plan_of(self, act: Act) -> tuple[_Step, _Consume, ConsumePlan]:
        """The plan of the step's consume; a pending hit join is asked again (HIT-3)."""
        step, consume = self.consume_of(act)
        if isinstance(consume.result, AwaitTasks):
            self.begin_consume(step, consume)
        if consume.error is not None:
            err = consume.error
            raise Disagreement(f"model reads step {step.step}; core raised {err!r}") from err
        if not isinstance(consume.result, ConsumePlan):
            raise Disagreement(f"model reads step {step.step}; core: {consume.result!r}")
        return step, consume, consume.result

    def on_materialize(self, act: Act) -> None:
        """materialize of every request of the step's layout."""
        step = self.steps[act.num("step")]
        if act.error == "order":
            # DLV-5: refused, nothing changes and the step stays open for a later consume.
            inp = ConsumeBegin(step_id=StepId(step.step), req_ids=step.req_ids, now_ns=self.now_ns)
            err = self.expect_error("order", lambda: self.feed(inp), unchanged=True)
            if isinstance(err, omni_cache_core.DeliveryOrderError) and (
                err.step_id != step.step or err.req_id not in step.req_ids
            ):
                raise Disagreement(f"model: step {step.step} refused; core: {err}")
            # The request, the earlier step that owes it rows and those positions (traces
            # committed before the model printed them lack the fields).
            if isinstance(err, omni_cache_core.DeliveryOrderError) and "earlier" in act.args:
                want = (act.args["req"], act.num("earlier"), (act.num("start"), act.num("end")))
                got = (err.req_id, err.earlier_step_id, err.gap)
                if got != want:
                    raise Disagreement(
                        f"step {step.step} refused: model (req, earlier step, gap) {want}; "
                        f"core {got}"
                    )
                self.checked["order:gap"] += 1
            if self.core.fatal is None and not self.core.has_step(StepId(step.step)):
                raise Disagreement(f"the refused step {step.step} is no longer open in the core")
            step.consume = None
            return
        step.consume = _Consume(discard=False)
        if "computed" in act.args:
            # SPEC-2: the consume reports the drafted request's count (ConsumeBegin.computed).
            step.consume.computed = {ReqId(act.args["req"]): act.num("computed")}
            self.checked["consume:computed"] += 1
        if act.error is not None:
            inp = ConsumeBegin(step_id=StepId(step.step), req_ids=step.req_ids, now_ns=self.now_ns)
            step.consume.error = self.expect_error(act.error, lambda: self.feed(inp))
            step.consume.error_seen = True
            return
        self.begin_consume(step, step.consume)

    def on_discard(self, act: Act) -> None:
        """discard_step consumes the step at once."""
        step = self.steps[act.num("step")]
        step.consume = _Consume(discard=True)
        self.begin_consume(step, step.consume)
        if step.consume.error is not None:
            raise Disagreement(f"model discards; core raised {step.consume.error!r}")

    def on_join(self, act: Act) -> None:
        """The hit join ran out, or found the sticky failure."""
        step, consume = self.consume_of(act)
        if consume.error is not None:
            raise Disagreement(f"model: join error={act.error}; core raised {consume.error!r}")
        if act.error == "timeout":
            self.begin_consume(step, consume)
            effect = consume.result
            if not isinstance(effect, AwaitTasks):
                raise Disagreement(f"model: the hit join runs out; core: {effect!r}")
            self.now_ns = max(self.now_ns, effect.deadline_ns)
        inp = ConsumeBegin(step_id=StepId(step.step), req_ids=step.req_ids, now_ns=self.now_ns)
        consume.error = self.expect_error(act.error or "", lambda: self.feed(inp))
        consume.error_seen = True

    def on_read(self, act: Act) -> None:
        """The row the adapter assembles from the plan is the model's row."""
        step, consume = self.consume_of(act)
        if consume.error is not None:
            # The core refuses the whole materialize at once; the model reads in order and may
            # return rows before the read that raises. Only that error must follow.
            consume.reads_before_error += 1
            return
        step, consume, plan = self.plan_of(act)
        key, slot = self.keys[act.num("key")], act.num("slot")
        read = self.find_read(plan, ReqId(act.args["req"]), key)
        positions = np.flatnonzero(read.slots == slot).tolist()
        if len(positions) != 1:
            raise Disagreement(f"slot {slot} is not once in the plan's read {read.slots.tolist()}")
        got = self.read_row(step, read, positions[0])
        self.checked[self.source_name(read, positions[0])] += 1
        if act.args.get("catchup") == "1":
            # SPEC-4: accepted draft rows read back from their slot by the next save.
            self.checked["read:catchup"] += 1
        want = int(act.result["val"])
        if got != want:
            source = SlotSource(int(read.source[positions[0]])).name
            raise Disagreement(
                f"read of step {step.step} req {read.req_id} key {key} slot {slot}: model "
                f"returns step {want}'s row, core plan ({source}) gives step {got}'s"
            )
        consume.reads_seen.add((key, slot))

    def on_read_error(self, act: Act) -> None:
        """The consume raised the same kind of error for the same request and key."""
        step, consume = self.consume_of(act)
        if isinstance(consume.result, AwaitTasks):
            self.begin_consume(step, consume)
        reason = act.args["reason"]
        err = consume.error
        accepted = _error_classes(MAP["outcomes"][reason])
        if self.core.fatal is not None:
            accepted += _error_classes(MAP["outcomes"]["sticky"])
        if not isinstance(err, accepted):
            raise Disagreement(f"model: read error {reason}; core: {err or consume.result!r}")
        if isinstance(err, omni_cache_core.HitUnreadableError):
            key = self.keys[act.num("key")]
            if (err.req_id, err.key) != (act.args["req"], key):
                raise Disagreement(f"model: {reason} on {act.args['req']}/{key}; core: {err}")
            if (reason == "hit6") != ("HIT-6" in str(err)):
                raise Disagreement(f"model: {reason}; core: {err}")
        self.checked[f"error:{reason}"] += 1
        consume.error_seen = True

    def on_deliver(self, act: Act) -> None:
        """The positions handed to the request are the model's (DLV-2, DLV-7)."""
        step, consume, plan = self.plan_of(act)
        req = ReqId(act.args["req"])
        want = (act.num("start"), act.num("end"))
        # The model's builder asks for the whole layout, in its order.
        at = step.req_ids.index(req)
        got = tuple(int(x) for x in plan.positions[at])
        if got != want:
            raise Disagreement(
                f"step {step.step} hands request {req} positions {want} in the model; core: {got}"
            )
        consume.delivered[req] = want
        self.checked["positions"] += 1
        if self.skipped(step, plan, req):
            self.checked["positions:cut"] += 1

    @staticmethod
    def skipped(step: _Step, plan: ConsumePlan, req_id: ReqId) -> int:
        """How many of the rows the step carries for the request come before its delivery."""
        if plan.skip is None:
            return 0
        return int(plan.skip[step.req_ids.index(req_id)])

    def on_own(self, act: Act) -> None:
        """The step's page still holds the step's own rows (PAGE-3)."""
        _, _, plan = self.plan_of(act)
        page = act.num("page")
        if plan.page != page or self.pages[page] != int(act.result["val"]):
            raise Disagreement(
                f"model: page {page} holds step {act.result['val']}'s rows; core plan page "
                f"{plan.page}, which holds step {self.pages[plan.page]}'s"
            )

    def on_consumed(self, act: Act) -> None:
        """The consume ends: the step is closed, the plan read what the model read."""
        step, consume = self.consume_of(act)
        if act.error is not None:
            if not consume.error_seen:
                raise Disagreement(f"model: consume of step {step.step} failed; core did not")
        elif consume.error is not None:
            raise Disagreement(f"model: step {step.step} consumed; core raised {consume.error!r}")
        elif not consume.discard:
            _, _, plan = self.plan_of(act)
            # DLV-2: the rows the step carries below a request's delivery are not handed out
            # again, so the model reads only the hit rows from there on.
            planned = {
                (r.key, int(s))
                for r in plan.reads
                for s in r.slots[self.skipped(step, plan, r.req_id) :].tolist()
            }
            if self.delivers and set(consume.delivered) != set(step.req_ids):
                raise Disagreement(
                    f"model delivered to {sorted(consume.delivered)}; the step carries "
                    f"{sorted(step.req_ids)}"
                )
            if planned != consume.reads_seen:
                raise Disagreement(
                    f"model read {sorted(consume.reads_seen)}; core planned {sorted(planned)}"
                )
            self.expect_ok(lambda: self.feed(ConsumeEnd(step_id=StepId(step.step))))
            for read in plan.reads:
                self.preserved.pop(read.read_id, None)
                self.prefetched.pop(read.read_id, None)
        if self.core.fatal is None and self.core.has_step(StepId(step.step)):
            raise Disagreement(f"step {step.step} is still open in the core")

    def on_consume_again(self, act: Act) -> None:
        """A second consume of the same step raises and changes nothing (STEP-2)."""
        inp = ConsumeBegin(step_id=StepId(act.num("step")), req_ids=None, now_ns=self.now_ns)
        self.expect_error(act.error or "", lambda: self.feed(inp), unchanged=True)

    def source_name(self, read: ReadPlan, pos: int) -> str:
        """How a hit row was served, for the coverage figures."""
        if read.preserved[pos]:
            return "row:preserved"
        source = SlotSource(int(read.source[pos]))
        if source is SlotSource.POOL and pos in self.prefetched.get(read.read_id, {}):
            return "row:prefetched"
        return f"row:{source.name.lower()}"

    def find_read(self, plan: ConsumePlan, req_id: ReqId, key: TensorName) -> ReadPlan:
        """The plan's read of one request and key."""
        found = [r for r in plan.reads if r.req_id == req_id and r.key == key]
        if len(found) != 1:
            raise Disagreement(f"the plan has {len(found)} reads of {req_id}/{key}")
        return found[0]

    def read_row(self, step: _Step, read: ReadPlan, pos: int) -> int:
        """Assemble one hit row from its planned source, as the adapter does (HIT-3)."""
        slot = int(read.slots[pos])
        if read.preserved[pos]:
            return self.preserved[read.read_id][pos]
        source = SlotSource(int(read.source[pos]))
        if source is SlotSource.POOL:
            gathered = self.prefetched.get(read.read_id, {})
            if pos in gathered:
                return gathered[pos]
            return self.pool_row(read.key, slot)
        if source is SlotSource.AFTER_WRITE:
            return self.pool_row(read.key, slot)
        if source is SlotSource.ZEROS:
            return 0
        if source is SlotSource.THIS_STEP:
            # The step's own row: hidden from its page, the deferred key from its clone.
            return self.pages[step.page] if read.key == HIDDEN_KEY else step.step
        tid = Tid(int(read.writer[pos]))
        limit = dict(read.chunk_limit).get(tid)
        write = self.writes.get(tid)
        if write is None or limit is None:
            raise Disagreement(f"read from write {tid}, which cannot serve it")
        for slots, value in reversed(write.chunks[:limit]):
            if slot in slots:
                return value
        raise Disagreement(f"write {tid} has no row for slot {slot}")

    def pool_row(self, key: TensorName, slot: int) -> int:
        """A pool row the core says is written."""
        if slot not in self.pool[key]:
            raise Disagreement(f"the plan reads slot {slot} of {key}, which no write landed")
        return self.pool[key][slot]

    # -----------------------------------------------------------------------------------------
    # Committer.

    def on_copy(self, act: Act) -> None:
        """The copy stage: CopyStarted, then CopyLanded or WriteFailed (TASK-2)."""
        tid = Tid(act.num("tid"))
        self.expect_ok(lambda: self.feed(CopyStarted(tid=tid)))
        if act.error is not None:
            self.expect_ok(lambda: self.feed(WriteFailed(tid=tid, reason=act.error or "")))
        else:
            self.expect_ok(lambda: self.feed(CopyLanded(tid=tid)))

    def on_pool_write(self, act: Act) -> None:
        """The pool write: rows the write still owns land, then WriteLanded (SLOT-2, SLOT-3)."""
        tid = Tid(act.num("tid"))
        if act.error is not None:
            self.expect_ok(lambda: self.feed(WriteFailed(tid=tid, reason=act.error or "")))
            return
        write = self.writes[tid]
        if write.deferred:
            for slots, value in write.chunks:
                self.scatter(write, write.keys[0], slots, value)
        else:
            assert write.page is not None
            for key in write.keys:
                self.scatter(write, key, write.slots, self.pages[write.page])
        self.expect_ok(lambda: self.feed(WriteLanded(tid=tid)))

    def scatter(self, write: _Write, key: TensorName, slots: Iterable[int], value: int) -> None:
        """Write rows to the pool, later ones winning, tombstoned slots skipped (TASK-5)."""
        lost = write.tombstones.get(key, set())
        for slot in slots:
            if slot not in lost:
                self.pool[key][slot] = value

    def on_publish(self, act: Act) -> None:
        """Only a known-bad variant prints this."""
        raise Disagreement("a BUG_WAKE_EARLY trace: replay the protocol, not its variants")

    def on_pop(self, act: Act) -> None:
        """Only a known-bad variant prints this."""
        raise Disagreement("a BUG_REQUEUE trace: replay the protocol, not its variants")

    def on_shutdown(self, act: Act) -> None:
        """The writes the committer never took are the ones the core has not queued past."""
        waiting = [
            tid
            for tid in self.writes
            if self.core.task_state(tid) in (TaskState.PENDING, TaskState.QUEUED)
        ]
        if len(waiting) != int(act.result["abandoned"]):
            raise Disagreement(
                f"model abandons {act.result['abandoned']} writes; core has {waiting} not taken"
            )
        self.feed(ShutDown())

    # -----------------------------------------------------------------------------------------
    # Effects.

    def run_effects(self, effects: Iterable[Any], *, step: int | None) -> None:
        """Execute the core's effects in order, as the adapter does."""
        for effect in effects:
            if isinstance(effect, Tombstone):
                tombs = self.writes[effect.tid].tombstones.setdefault(effect.key, set())
                tombs.update(effect.slots.tolist())
            elif isinstance(effect, Preserve):
                kept = self.preserved.setdefault(effect.read_id, {})
                for pos, slot in zip(effect.positions.tolist(), effect.slots.tolist(), strict=True):
                    kept[pos] = self.pool_row(effect.key, slot)
            elif isinstance(effect, PrefetchRead):
                if self.prefetch:
                    got = self.prefetched.setdefault(effect.read_id, {})
                    for pos, slot in zip(
                        effect.positions.tolist(), effect.slots.tolist(), strict=True
                    ):
                        got[pos] = self.pool_row(effect.key, slot)
            elif isinstance(effect, EscalateTasks):
                unknown = [tid for tid in effect.tids if tid not in self.writes]
                if unknown:
                    raise Disagreement(f"escalation of writes never registered: {unknown}")
            elif isinstance(effect, DeferredChunk):
                assert step is not None
                if effect.new_task:
                    self.writes[effect.tid] = _Write(
                        tid=effect.tid, deferred=True, keys=(self.deferred_key,)
                    )
                slots = self.save_slots[effect.row_start : effect.row_end]
                self.writes[effect.tid].chunks.append((slots, step))
            elif isinstance(effect, StepWrite):
                self.writes[effect.tid] = _Write(
                    tid=effect.tid,
                    deferred=False,
                    keys=effect.keys,
                    page=effect.page,
                    slots=self.save_slots,
                )
            else:
                raise Disagreement(f"unexpected effect {effect!r}")


def replay(trace: Trace, *, prefetch: bool = True) -> Outcome:
    """Replay one trace; a disagreement names the trace, the line and how to get it again."""
    try:
        return Replay(trace.bounds, prefetch=prefetch).run(trace.acts())
    except Disagreement as err:
        listing = "\n".join(f"  {i + 1:3d} {line}" for i, line in enumerate(trace.lines))
        raise Disagreement(f"{trace.source}: {err}\n{listing}") from err


# ---------------------------------------------------------------------------------------------
# Tests: the map.


def model_action_names(pml: str) -> set[str]:
    """The action names the model prints (its ``printf("ACT <name>`` lines)."""
    return set(PRINTF_ACT.findall(pml))


def core_input_types() -> set[str]:
    """Every input type the core accepts: `dispatch()` keys and the committer report kinds."""
    inputs = {
        t.__name__ for t in dispatch(CacheCore(PrefixCacheConfig(num_blocks=1, block_size=1)))
    }
    reports = {t.__name__ for t in typing.get_args(values.Report)}
    return inputs | reports


def test_the_map_names_exactly_the_actions_the_model_prints() -> None:
    """Every action name in the model's printf lines has a map entry, and no entry is stale."""
    printed = model_action_names(MODEL.read_text())
    mapped = set(MAP["actions"])
    assert printed, "no ACT printf lines found in spec/omni_cache.pml"
    assert printed - mapped == set(), (
        f"actions missing from spec/trace_map.toml: {printed - mapped}"
    )
    assert mapped - printed == set(), f"map entries the model never prints: {mapped - printed}"


def test_the_map_knows_every_outcome_the_model_prints() -> None:
    """Each ``error=<kind>`` and read error reason the model prints is in the map."""
    pml = MODEL.read_text()
    kinds = set(re.findall(r'printf\("ACT [^"]*-> error=(\w+)', pml))
    reasons = {
        name.strip()
        for names in re.findall(r"^mtype\s*=\s*\{([^}]*)\}", pml, re.MULTILINE)
        for name in names.split(",")
    }
    assert kinds, "no error outcomes found in spec/omni_cache.pml"
    known = set(MAP["outcomes"]) | set(MAP["reported"])
    assert kinds | reasons <= known, f"outcomes missing from the map: {(kinds | reasons) - known}"


def test_every_core_input_and_report_kind_is_fed_by_some_action() -> None:
    """Each input type in `dispatch()` and each report kind is fed by an action or excused."""
    fed = {name for entry in MAP["actions"].values() for name in entry["inputs"]}
    excused = set(MAP["core"]["unmapped"])
    core = core_input_types()
    assert core - fed - excused == set(), f"core inputs no action feeds: {core - fed - excused}"
    assert fed - core == set(), f"map names inputs the core does not have: {fed - core}"


def test_the_core_exports_no_input_that_dispatch_misses() -> None:
    """Every value class `_values` exports is an input `dispatch()` takes, an effect or a part of one."""
    effects = typing.get_args(values.Effect)
    # Values carried inside effects (a ConsumePlan's ReadPlans), named in their field types.
    parts = {
        word
        for effect in effects
        for field in attrs.fields(effect)
        for word in re.findall(r"\w+", str(field.type))
    }
    exported = {name for name in values.__all__ if attrs.has(getattr(values, name))}
    other = exported - {t.__name__ for t in effects} - parts
    assert other, "no input classes found in omni_cache_core._values"
    assert other - core_input_types() == set()


def test_every_action_has_a_replay_handler_and_every_outcome_a_core_error() -> None:
    """The replay handles each mapped action, and each outcome names real error classes."""
    for name in MAP["actions"]:
        assert callable(getattr(Replay, f"on_{name}", None)), name
    for kind, names in MAP["outcomes"].items():
        for cls in _error_classes(names):
            assert issubclass(cls, BaseException), kind


# ---------------------------------------------------------------------------------------------
# Tests: replays.


def committed_traces() -> list[Path]:
    """The regression traces in spec/traces/."""
    return sorted(TRACES.glob("*.trace"))


@pytest.mark.parametrize("path", committed_traces(), ids=lambda p: p.stem)
def test_a_committed_trace_replays_through_the_core(path: Path) -> None:
    """A committed regression trace replays to its end with the core agreeing on every action."""
    trace = read_trace_file(path)
    for prefetch in (True, False):
        outcome = replay(trace, prefetch=prefetch)
        assert outcome.replayed == len(trace.lines)


def test_a_wrong_read_value_in_a_trace_is_caught() -> None:
    """A trace whose read claims another step's row makes the replay fail."""
    for path in committed_traces():
        trace = read_trace_file(path)
        lines = list(trace.lines)
        at = next((i for i, line in enumerate(lines) if line.startswith("ACT read ")), None)
        if at is None:
            continue
        value = int(lines[at].rsplit("=", 1)[1])
        lines[at] = lines[at].rsplit("=", 1)[0] + f"={value + 1}"
        with pytest.raises(Disagreement, match="read of step"):
            replay(attrs.evolve(trace, lines=tuple(lines)))
        return
    pytest.fail("no committed trace has a successful read to tamper with")


def test_a_wrong_page_or_error_in_a_trace_is_caught() -> None:
    """A trace that claims another page, or an error the core does not raise, fails the replay."""
    trace = read_trace_file(committed_traces()[0])
    lines = list(trace.lines)
    at = next(i for i, line in enumerate(lines) if line.startswith("ACT save ") and "ok" in line)
    wrong_page = list(lines)
    wrong_page[at] = re.sub(r"page=(\d)", lambda m: f"page={1 - int(m[1])}", lines[at])
    with pytest.raises(Disagreement, match="claims page"):
        replay(attrs.evolve(trace, lines=tuple(wrong_page)))
    at = next(i for i, line in enumerate(lines) if line.startswith("ACT barrier ") and "ok" in line)
    wrong_error = list(lines)
    wrong_error[at] = lines[at].replace("-> ok", "-> error=timeout")
    with pytest.raises(Disagreement, match="barrier"):
        replay(attrs.evolve(trace, lines=tuple(wrong_error)))


def fresh_seed_base() -> int:
    """A new seed base per run, or TRACE_SEED to repeat a run."""
    fixed = os.environ.get("TRACE_SEED")
    # spin reads the seed as a C int: keep every seed of the run below 2**31.
    return int(fixed) if fixed else int.from_bytes(os.urandom(4), "big") % 2_000_000_000


@pytest.mark.skipif(shutil.which("spin") is None, reason="needs spin (apt-get install spin)")
def test_fresh_model_traces_replay_through_the_core(capsys: pytest.CaptureFixture[str]) -> None:
    """At least 200 fresh random simulations of the model replay with the core agreeing."""
    base = fresh_seed_base()
    with capsys.disabled():
        print(f"\ntrace conformance: seeds from {base} (rerun with TRACE_SEED={base})")
    began = time.monotonic()
    replayed = actions = tried = 0
    checked: Counter[str] = Counter()
    failures: list[str] = []
    with ThreadPoolExecutor(max_workers=4) as pool:
        # A few simulations in flight at a time, replayed in seed order as they finish.
        pending: deque[Future[Trace]] = deque()
        while replayed < FRESH_TRACES and (pending or tried < MAX_SEEDS):
            while len(pending) < 8 and tried < MAX_SEEDS:
                pending.append(pool.submit(simulate, base + tried, DEFINES[tried % len(DEFINES)]))
                tried += 1
            trace = pending.popleft().result()
            if trace.problems:
                failures.append(f"{trace.source}: the model reports {list(trace.problems)}")
                continue
            if trace.saves == 0:
                continue
            try:
                outcome = replay(trace, prefetch=len(trace.lines) % 2 == 0)
            except Disagreement as err:
                failures.append(str(err))
                continue
            replayed += 1
            actions += outcome.replayed
            checked += outcome.checked
        for future in pending:
            future.cancel()
    with capsys.disabled():
        print(
            f"trace conformance: {replayed} traces with a save from {tried} seeds, {actions} "
            f"actions replayed in {time.monotonic() - began:.1f} s; compared: {dict(checked)}"
        )
    assert not failures, f"{len(failures)} traces disagree; first:\n{failures[0]}"
    assert replayed >= FRESH_TRACES, f"only {replayed} traces with a save in {tried} seeds"


def spec_traces() -> list[Trace]:
    """The committed speculative-decoding traces (made with -DSPEC_DRAFTS)."""
    return [
        read_trace_file(path)
        for path in committed_traces()
        if "-DSPEC_DRAFTS" in read_trace_file(path).defines
    ]


def test_the_speculative_traces_show_a_rejection_a_catch_up_and_a_hit_over_a_draft() -> None:
    """The committed -DSPEC_DRAFTS traces feed drafts (SaveBegin.drafts), a rejecting count
    (SPEC-2, SPEC-3), a catch-up read (SPEC-4), a preemption with an unconfirmed draft and a
    hit, after a finish, on the block whose last row is an accepted draft no count confirmed
    (SPEC-5), and replay."""
    checked: Counter[str] = Counter()
    rejected = hit_over_draft = preempted = False
    for trace in spec_traces():
        checked += replay(trace).checked
        acts = trace.acts()
        drafted = {
            (a.num("step"), a.num("req")): a for a in acts if a.name == "sched" and a.num("draft")
        }
        for (step, req), sched in drafted.items():
            draft_pos = sched.num("pos") + sched.num("n") - 1
            blocks = (sched.num("blk0"), sched.num("blk1"))
            slot = blocks[draft_pos // 2] * 2 + draft_pos % 2
            later = [a for a in acts if int(a.args.get("step", 0)) > step]
            counts = [
                a.num("computed") for a in later if a.name == "sched" and "computed" in a.args
            ]
            rejected |= bool(counts) and counts[0] == draft_pos
            ended = [a for a in later if a.name in ("finish", "preempt") and a.num("req") == req]
            preempted |= bool(ended) and not counts and ended[0].name == "preempt"
            hit_over_draft |= (
                bool(ended)
                and not counts
                and ended[0].name == "finish"
                and any(
                    a.name == "read"
                    and a.num("slot") == slot
                    and a.num("key") == 0
                    and a.num("step") >= ended[0].num("step")
                    and a.result == {"val": str(step)}
                    for a in later
                )
            )
    assert checked["drafts"] >= 4 and checked["computed_tokens"] >= 2
    assert checked["read:catchup"] >= 2
    assert rejected and preempted and hit_over_draft


def test_a_wrong_draft_count_in_a_trace_is_caught() -> None:
    """A trace whose computed_tokens accepts the draft the model rejected fails the replay."""
    trace = next(t for t in spec_traces() if any("computed=2" in line for line in t.lines))
    lines = tuple(line.replace("computed=2", "computed=3") for line in trace.lines)
    with pytest.raises(Disagreement):
        replay(attrs.evolve(trace, lines=lines))
