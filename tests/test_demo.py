"""Tests of the end-to-end demo: its engine, its reference comparison and the CLI."""

from __future__ import annotations

import enum
import io
import json
import logging
import struct
import sys
from types import SimpleNamespace

import attrs
import pytest
import torch

from omni_cache_cuda.demo import main
from omni_cache_cuda.demo._engine import Engine, EngineConfig
from omni_cache_cuda.demo._model import ModelConfig, TinyCausalLM
from omni_cache_cuda.demo._run import _Progress, compare_runs, make_progress
from omni_cache_cuda.demo._stages import TALKER_KEY, DirectSink, OmniSink, Talker
from omni_cache_cuda.demo._workload import WorkloadConfig, make_workload
from omni_cache_cuda.sim import BlockPool, prefix_hashes

# Small enough to run in a few seconds on 2 cores, large enough that cached blocks are evicted
# and recycled while shared prefixes still hit.
_WORKLOAD = WorkloadConfig(num_requests=40, seed=3)
_ENGINE = EngineConfig(num_blocks=96, max_batched_tokens=128, max_num_seqs=12)


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """Run the tiny model on one intra-op thread, as the demo does: threads only spin here."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _run(config: EngineConfig, specs, model):
    talker = Talker({s.req_id: len(s.prompt) for s in specs}, d_model=model.config.d_model)
    report = Engine(model, config).run(specs, DirectSink(talker))
    return report, talker


@pytest.fixture(scope="module")
def kv_runs():
    """Run the small workload without and with KV prefix caching, without the omni cache."""
    specs = make_workload(_WORKLOAD)
    model = TinyCausalLM(ModelConfig(seed=3))
    ref = _run(attrs.evolve(_ENGINE, enable_prefix_caching=False), specs, model)
    cached = _run(_ENGINE, specs, model)
    return specs, ref, cached


def test_kv_prefix_caching_reuses_and_recycles_blocks(kv_runs):
    """The workload hits shared prefixes and the engine evicts and recycles cached blocks."""
    _, (ref, _), (cached, _) = kv_runs
    assert ref.hit_tokens == 0
    assert cached.hit_rate > 0.3
    assert cached.evictions > 0
    assert cached.block_reuses > 0
    assert cached.computed_tokens < ref.computed_tokens
    assert len(cached.aborted) == len(ref.aborted) > 0


def test_kv_prefix_caching_matches_full_recompute(kv_runs):
    """Rows computed on top of cached KV equal the full recompute's rows, and so do the tokens."""
    specs, (ref, ref_talker), (cached, talker) = kv_runs
    assert cached.outputs == ref.outputs
    worst = 0.0
    hit_chunks = 0
    for spec in specs:
        ref_hidden, ref_talker_h = ref_talker.rows(spec.req_id)
        for start, hidden, talker_h in talker.chunks(spec.req_id):
            rows = slice(start, start + hidden.shape[0])
            worst = max(worst, float((hidden - ref_hidden[rows]).abs().max()))
            torch.testing.assert_close(talker_h, ref_talker_h[rows], rtol=1e-4, atol=1e-5)
        hit_chunks += talker.chunks(spec.req_id)[0][0] > 0
    assert hit_chunks > 0
    assert worst < 1e-4


def test_kv_only_run_leaves_hit_prefix_rows_missing(kv_runs):
    """Without the omni cache the talker misses the hit prefix rows, and the comparison says so."""
    specs, ref, cached = kv_runs
    cmp = compare_runs(specs, ref, cached)
    assert cmp.incomplete
    assert not cmp.ok(1e-4)


def test_comparison_catches_a_perturbed_row(kv_runs):
    """A single wrong element in one request's rows fails the comparison."""
    specs, ref, _ = kv_runs
    ref_report, ref_talker = ref
    bad = Talker({s.req_id: len(s.prompt) for s in specs}, d_model=128)
    victim = specs[5].req_id
    for spec in specs:
        for start, hidden, talker_h in ref_talker.chunks(spec.req_id):
            if spec.req_id == victim and start == 0:
                hidden = hidden.clone()
                hidden[-1, 7] += 0.01
            bad.consume(spec.req_id, start, hidden, talker_h)
    cmp = compare_runs(specs, ref, (ref_report, bad))
    assert not cmp.incomplete
    assert cmp.max_abs_hidden == pytest.approx(0.01, rel=1e-3)
    assert not cmp.ok(1e-4)
    assert compare_runs(specs, ref, ref).ok(0.0)


def test_block_allocator_reuses_least_recently_freed_and_evicts():
    """Freed blocks come back oldest first, tail before head, and reuse drops their hash."""
    alloc = BlockPool(4)
    first = alloc.allocate(2)
    h0, h1 = prefix_hashes([1, 2, 3, 4])[1::2]
    assert alloc.register(first[0], h0) and alloc.register(first[1], h1)
    assert not alloc.register(first[1], h0)
    for block in first:
        alloc.mark_written(block)
    alloc.release(reversed(first))  # the engine frees a request's blocks tail first
    assert alloc.lookup([h0, h1]) == first
    alloc.allocate(2)  # the two never-used blocks
    assert alloc.allocate(1) == [first[1]]  # the tail block of the freed request goes first
    assert alloc.lookup([h0, h1]) == [first[0]]
    assert alloc.evictions == 1 and alloc.recycled == 1
    alloc.check_invariants()


def test_block_hash_chains_on_the_parent():
    """Equal blocks after different prefixes hash differently."""
    assert prefix_hashes([5, 6])[1] != prefix_hashes([1, 2, 5, 6])[3]
    assert prefix_hashes([5, 6]) == prefix_hashes((5, 6))


class _Kind(enum.Enum):
    STARTED = "started"
    FINISHED = "finished"
    ABORTED = "aborted"


@attrs.frozen(kw_only=True)
class _Event:
    req_id: str
    kind: _Kind
    hit_end: int = 0
    block_ids: tuple[int, ...] = ()
    scheduled_tokens: int = 0


@attrs.frozen(kw_only=True)
class _Step:
    events: tuple[_Event, ...]
    scheduled_tokens: dict[str, int]


@attrs.frozen(kw_only=True)
class _Layout:
    ranges: dict[str, tuple[int, int]]
    slots: list[int]

    @classmethod
    def from_block_tables(cls, *, order, num_scheduled, num_computed, block_ids, block_size):
        ranges, slots, row = {}, [], 0
        for r in order:
            for pos in range(num_computed[r], num_computed[r] + num_scheduled[r]):
                slots.append(block_ids[r][pos // block_size] * block_size + pos % block_size)
            ranges[r] = (row, row + num_scheduled[r])
            row += num_scheduled[r]
        return cls(ranges=ranges, slots=slots)


#: The names OmniSink takes from the library, for the stand-in manager below.
_API = SimpleNamespace(
    PrefixCacheEventKind=_Kind,
    PrefixCacheRequestEvent=_Event,
    PrefixCacheStep=_Step,
    PrefixCacheWriteLayout=_Layout,
)


class _NaiveManager:
    """A deliberately naive stand-in for the cache: a dict mirror read back at save time.

    It checks the engine-facing protocol as it goes (events before saves, hits block aligned,
    every saved request started and not ended, each step id consumed once). ``forget_hits``
    makes it a known-bad cache that serves zeros for hit prefixes.
    """

    def __init__(self, block_size: int, *, forget_hits: bool = False) -> None:
        self.block_size = block_size
        self.forget_hits = forget_hits
        self.mirror: dict[tuple[str, int], torch.Tensor] = {}
        self.live: set[str] = set()
        self.hits: dict[str, tuple[int, tuple[int, ...]]] = {}
        self.steps: dict[int, dict] = {}
        self.next_step = 1
        self.consumed = 0

    def new_step_starts(self, step: _Step) -> None:
        self.hits = {}
        for e in sorted(step.events, key=lambda e: e.kind is _Kind.STARTED):
            if e.kind is _Kind.STARTED:
                assert e.req_id not in self.live
                assert e.hit_end % self.block_size == 0
                self.live.add(e.req_id)
                if e.hit_end:
                    self.hits[e.req_id] = (e.hit_end, e.block_ids)
            else:
                self.live.remove(e.req_id)

    def save_outputs(self, hidden, mm, *, num_tokens_unpadded, num_tokens_padded, write_layout):
        assert num_tokens_padded is None and len(write_layout.slots) == num_tokens_unpadded
        tensors = {"hidden": hidden, **mm}
        for name, t in tensors.items():
            for row, slot in enumerate(write_layout.slots):
                self.mirror[(name, slot)] = t[row].clone()
        saved = {}
        for r, (lo, hi) in write_layout.ranges.items():
            assert r in self.live, r
            saved[r] = {}
            for name, t in tensors.items():
                rows = t[lo:hi].clone()
                if r in self.hits:
                    hit_end, blocks = self.hits[r]
                    bs = self.block_size
                    slots = [blocks[p // bs] * bs + p % bs for p in range(hit_end)]
                    prefix = torch.stack([self.mirror[(name, s)] for s in slots])
                    rows = torch.cat(
                        [torch.zeros_like(prefix) if self.forget_hits else prefix, rows]
                    )
                saved[r][name] = rows
        step_id = self.next_step
        self.next_step += 1
        self.steps[step_id] = saved
        return step_id

    def materialize(self, step_id, req_ids):
        saved = self.steps.pop(step_id)
        self.consumed += 1
        hidden = {r: saved[r]["hidden"] for r in req_ids}
        return SimpleNamespace(
            hidden_states=hidden,
            mm_outputs={TALKER_KEY: {r: saved[r][TALKER_KEY] for r in req_ids}},
        )

    def discard_step(self, step_id):
        del self.steps[step_id]
        self.consumed += 1


@pytest.mark.parametrize("forget_hits", [False, True])
def test_omni_sink_feeds_the_talker_full_prompt_rows(kv_runs, forget_hits):
    """Through a correct stand-in cache the talker matches the recompute; a forgetful one fails."""
    specs, ref, _ = kv_runs
    model = TinyCausalLM(ModelConfig(seed=3))
    talker = Talker({s.req_id: len(s.prompt) for s in specs}, d_model=model.config.d_model)
    mgr = _NaiveManager(_ENGINE.block_size, forget_hits=forget_hits)
    sink = OmniSink(mgr, talker, block_size=_ENGINE.block_size, api=_API)
    try:
        report = Engine(model, _ENGINE).run(specs, sink)
    finally:
        sink.close()
    assert mgr.consumed == report.steps and not mgr.steps
    assert not mgr.live  # the trailing finish events were delivered
    cmp = compare_runs(specs, ref, (report, talker))
    assert not cmp.incomplete
    assert cmp.ok(1e-4) is not forget_hits


def test_demo_quick_run_matches_full_recompute(capsys):
    """The quick demo serves prefix hits through the omni cache and matches the full recompute."""
    assert main(["demo", "--quick", "--device", "cpu", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "OK: differences within" in out
    assert _figure(out, "prefix hit rate") > 30.0
    assert "pool " in out.split("rows served from cache")[1].split("\n")[0]


def test_demo_with_deferred_mm_and_a_tiny_budget_flushes_and_still_matches(capsys):
    """A deferred talker.h under a tiny GPU budget is flushed early and still matches."""
    argv = ["--requests", "24", "--defer-mm", "--gpu-staging-bytes", "4096", "--threaded"]
    assert main([*argv, "--device", "cpu", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "OK: differences within" in out
    assert _figure(out, "budget flushes") > 0


def test_demo_exits_non_zero_when_the_difference_exceeds_the_tolerance(capsys):
    """With a zero tolerance the rounding-level differences fail the run with exit status 1."""
    assert main(["--requests", "12", "--tolerance", "0", "--device", "cpu", "--no-progress"]) == 1
    assert "FAILED: difference above 0 relative" in capsys.readouterr().out


def _figure(out: str, label: str) -> float:
    return float(out.split(label)[1].split()[0].rstrip("%"))


def test_demo_rejects_unknown_flags():
    """An unknown flag is a usage error (exit status 2)."""
    with pytest.raises(SystemExit) as exc:
        main(["--no-such-flag"])
    assert exc.value.code == 2


@pytest.mark.parametrize("argv", [["--num-blocks", "4"], ["--staging-depth", "1"]])
def test_demo_rejects_sizes_that_cannot_work(argv):
    """A cache smaller than one request, or one staging page, is a usage error, not a hang."""
    with pytest.raises(SystemExit) as exc:
        main(["--quick", "--no-progress", *argv])
    assert exc.value.code == 2


def test_progress_bar_draws_after_its_delay_and_ends_its_line():
    """The progress bar stays silent before its delay, then draws the count and ends the line."""
    stream = io.StringIO()
    quiet = _Progress("run", stream, enabled=True, delay_s=60.0)
    quiet(1, 10)
    quiet.close()
    assert stream.getvalue() == ""
    bar = _Progress("run", stream, enabled=True, delay_s=0.0)
    bar(5, 10)
    bar.close()
    assert "[###############...............] 5/10 requests" in stream.getvalue()
    assert stream.getvalue().endswith("\n")


def test_tqdm_progress_bar_draws_after_its_delay(monkeypatch):
    """With tqdm installed the bar is tqdm's: silent before its delay, then the count."""
    pytest.importorskip("tqdm")
    stream = io.StringIO()
    quiet = make_progress("run", stream, enabled=True, delay_s=60.0)
    quiet(1, 10)
    quiet.close()
    assert stream.getvalue() == ""
    bar = make_progress("run", stream, enabled=True, delay_s=0.0)
    assert not isinstance(bar, _Progress)
    bar(5, 10)
    bar.close()
    assert "5/10" in stream.getvalue()


def test_without_tqdm_the_plain_bar_is_used(monkeypatch):
    """tqdm is optional: without it the demo falls back to its own bar."""
    monkeypatch.setitem(sys.modules, "tqdm", None)
    stream = io.StringIO()
    bar = make_progress("run", stream, enabled=True, delay_s=0.0)
    assert isinstance(bar, _Progress)
    bar(5, 10)
    bar.close()
    assert "5/10 requests" in stream.getvalue()


def test_demo_writes_its_figures_as_json(tmp_path, capsys):
    """--json writes what the text says, per-step series included, as plain JSON."""
    path = tmp_path / "figures.json"
    argv = ["--requests", "16", "--device", "cpu", "--no-progress", "--json", str(path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    figures = json.loads(path.read_text())
    assert figures["ok"] is True
    assert figures["workload"]["requests"] == 16
    ref, got = figures["full_recompute"], figures["prefix_cache"]
    assert ref["hit_tokens"] == 0 and got["hit_tokens"] > 0
    assert f"{100 * got['hit_rate']:.1f}%" in out
    for run in (ref, got):
        steps = run["per_step"]
        assert len(steps["seconds"]) == run["steps"]
        assert sum(steps["seconds"]) == pytest.approx(run["wall_s"], rel=1e-6)
        assert sum(steps["admitted_prompt_tokens"]) == run["prompt_tokens"]
        assert sum(steps["hit_tokens"]) == run["hit_tokens"]
        assert sum(steps["tokens"]) == run["computed_tokens"]
        assert steps["requests_done"][-1] == 16
    assert figures["throughput_ratio"] == pytest.approx(got["tokens_per_s"] / ref["tokens_per_s"])
    stats = figures["cache_stats"]
    assert stats["steps_saved"] == got["steps"]
    assert stats["hit_rows"]["POOL"] > 0
    assert figures["comparison"]["max_rel_hidden"] <= figures["tolerance"]


def test_demo_draws_its_plot(tmp_path, capsys):
    """--plot writes a PNG chart of both runs."""
    pytest.importorskip("matplotlib")
    path = tmp_path / "demo.png"
    argv = ["--requests", "12", "--device", "cpu", "--no-progress", "--plot", str(path)]
    assert main(argv) == 0
    assert f"plot written to {path}" in capsys.readouterr().out
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (1210, 1100)


def test_demo_refuses_plot_without_matplotlib(monkeypatch, tmp_path, capsys):
    """Without matplotlib --plot is a usage error that says what to install, before any run."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(SystemExit) as exc:
        main(["--quick", "--no-progress", "--plot", str(tmp_path / "x.png")])
    assert exc.value.code == 2
    assert "pip install 'omni-cache[demo]'" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_demo_refuses_an_output_path_in_a_missing_folder(tmp_path, capsys):
    """A --json path whose folder does not exist fails up front, not after the runs."""
    with pytest.raises(SystemExit) as exc:
        main(["--quick", "--no-progress", "--json", str(tmp_path / "nope" / "f.json")])
    assert exc.value.code == 2
    assert "does not exist" in capsys.readouterr().err


def test_demo_verbose_prints_the_cache_log_lines(capsys):
    """--verbose shows the omni_cache logger's lines on stderr, and leaves the logger as it was."""
    logger = logging.getLogger("omni_cache")
    level, handlers = logger.level, list(logger.handlers)
    assert main(["--requests", "4", "--device", "cpu", "--no-progress", "--verbose"]) == 0
    err = capsys.readouterr().err
    assert "[omni_cache INFO] cache " in err
    assert "allocated immediate key '__hidden_states__'" in err
    assert "shut down; step ids still open: none; writes not landed (tids): none" in err
    assert (logger.level, logger.handlers) == (level, handlers)
