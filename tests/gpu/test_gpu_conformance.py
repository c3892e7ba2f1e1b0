"""Conformance of the CUDA adapter: byte-exact rows through pinned pages, streams and events.

Every row a test writes encodes where it belongs: its KV slot, the write (step) that produced it
and the key, so a row served from the wrong slot, an older tenant or a torn copy differs from
the expected one. Comparisons are bitwise (`torch.equal` on an integer view of CPU tensors).

The scripted workload drives the manager the way an engine does (step starts, a save per step,
materialize one step late on an output-builder thread) and keeps its own reference of what every
slot last held, written independently of the cache's occupancy tables.
"""

from __future__ import annotations

import concurrent.futures
import gc
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import attrs
import pytest
import torch

from omni_cache_cuda import (
    HIDDEN_KEY,
    ModelCachePolicy,
    OmniPrefixCacheManager,
    PrefixCacheConfig,
    PrefixCacheEventKind,
    PrefixCacheRequestEvent,
    PrefixCacheStep,
    PrefixCacheWriteLayout,
    StageCacheOutputs,
    StepId,
)
from omni_cache_cuda import _committer as committer_module
from omni_cache_cuda._storage import registered_pinned_bytes

BLOCK_SIZE = 16
TALKER = "talker.h"
CODES = "codes.audio"
#: Row shape and dtype per cached key: hidden in float32, an immediate mm key in bf16 with a
#: multi-dimensional row, a deferred (JOIN_ON_FINISH) key in int64.
SHAPES: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
    HIDDEN_KEY: ((64,), torch.float32),
    TALKER: ((4, 4), torch.bfloat16),
    CODES: ((2,), torch.int64),
}
KEY_IDS = {HIDDEN_KEY: 1, TALKER: 2, CODES: 3}
POLICY = ModelCachePolicy(deferred_keys={CODES})
#: GPU clock cycles a `torch.cuda._sleep` keeps a stream busy: tens of milliseconds, far longer
#: than any host-side call under test.
SLEEP_CYCLES = 200_000_000
_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

Started = tuple[str, Sequence[int], int]


# ---------------------------------------------------------------------------------------------
# Rows that say where they belong, and bitwise comparison.


def encode(slots: torch.Tensor, write_id: int, key: str) -> torch.Tensor:
    """Rows for ``slots`` written by ``write_id`` under ``key``, on the CPU.

    Column 0 is the slot, column 1 the write id, column 2 the key id, the rest a mix of all
    three. bf16 rows are built from int16 bit patterns of positive normal numbers, so every
    value is exact and distinct where the codes are.
    """
    features, dtype = SHAPES[key]
    width = math.prod(features)
    slot = slots.to(torch.int64)[:, None]
    col = torch.arange(width, dtype=torch.int64)[None, :]
    mixed = (slot * 31 + write_id * 131 + KEY_IDS[key] * 17 + col * 7) % 8191
    code = torch.where(col == 0, slot.expand_as(mixed), mixed)
    code = torch.where(col == 1, torch.full_like(mixed, write_id), code)
    code = torch.where(col == 2, torch.full_like(mixed, KEY_IDS[key]), code)
    if dtype == torch.bfloat16:
        rows = (code % 16000 + 0x0100).to(torch.int16).view(torch.bfloat16)
    else:
        rows = code.to(dtype)
    return rows.reshape(len(slots), *features)


def zero_rows(count: int, key: str) -> torch.Tensor:
    """``count`` zero rows of ``key`` (what a hit serves for UNKNOWN or ABSENT mm slots)."""
    features, dtype = SHAPES[key]
    return torch.zeros((count, *features), dtype=dtype)


def assert_same(got: object, want: torch.Tensor, what: str) -> None:
    """Assert ``got`` is an unpinned CPU tensor bitwise equal to ``want`` (OUT-4)."""
    assert isinstance(got, torch.Tensor), f"{what}: got {type(got).__name__}, not a tensor"
    assert got.device.type == "cpu", f"{what}: returned on {got.device}, not on the CPU"
    assert not got.is_pinned(), f"{what}: the returned tensor holds pinned pages (OUT-4)"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype}, expected {want.dtype}"
    assert tuple(got.shape) == tuple(want.shape), (
        f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    )
    view = _INT_VIEW[want.element_size()] if want.dtype.is_floating_point else want.dtype
    same = torch.equal(got.contiguous().view(view), want.contiguous().view(view))
    if not same:
        bad = (got.reshape(len(got), -1) != want.reshape(len(want), -1)).any(dim=1)
        first = int(bad.nonzero()[0]) if bad.any() else -1
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {len(want)} rows differ; first row {first}: "
            f"got {got[first].flatten()[:4].tolist()}, "
            f"expected {want[first].flatten()[:4].tolist()}"
        )


def walk_tensors(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside a payload of dicts, lists and tuples."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from walk_tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from walk_tensors(item)


def wait_written(manager: OmniPrefixCacheManager, rows: int, timeout_s: float = 30.0) -> None:
    """Wait until the committer has written ``rows`` hidden rows to the pool in all."""
    deadline = time.monotonic() + timeout_s
    while manager.stats().rows_written.get(HIDDEN_KEY, 0) < rows:
        assert time.monotonic() < deadline, "the pool write did not land"
        time.sleep(0.001)


def prefix_slots(blocks: Sequence[int], hit_end: int) -> torch.Tensor:
    """KV slots of a request's first ``hit_end`` positions."""
    pos = torch.arange(hit_end, dtype=torch.int64)
    return torch.tensor(list(blocks), dtype=torch.int64)[pos // BLOCK_SIZE] * BLOCK_SIZE + (
        pos % BLOCK_SIZE
    )


# ---------------------------------------------------------------------------------------------
# A scripted engine with an independent reference of every slot's last write.


@attrs.frozen(kw_only=True)
class Expected:
    """What `materialize` must return for one saved step."""

    step_id: StepId
    write_id: int
    req_ids: tuple[str, ...]
    #: key -> request -> merged rows; a key missing here must be missing from the output.
    cached: dict[str, dict[str, torch.Tensor]]
    #: leftover name -> request -> value.
    leftover: dict[str, dict[str, Any]]


class ScriptedEngine:
    """Drives one manager through scripted steps and predicts every returned row.

    The reference is an append-only view of the writes: for each key, slot -> the write id of
    the last step that emitted the key there (None when a step wrote the slot without the key,
    or nobody wrote it). A hit's prefix is read from it when the request starts, which is what
    a run without prefix caching would have computed for those positions.
    """

    def __init__(
        self,
        manager: OmniPrefixCacheManager,
        device: torch.device,
        *,
        stream: Any = None,
    ) -> None:
        self.manager = manager
        self.device = device
        self.stream = stream
        self.blocks: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.last_write: dict[str, dict[int, int | None]] = {key: {} for key in SHAPES}
        self.write_id = 0
        self.hits = 0

    def _prefix(self, key: str, slots: torch.Tensor) -> torch.Tensor:
        rows = []
        for slot in slots.tolist():
            write_id = self.last_write[key].get(slot)
            if write_id is None:
                # HIT-4: a hidden hit on a slot nobody wrote is a broken script, not a miss.
                assert key != HIDDEN_KEY, f"script error: hidden hit on unwritten slot {slot}"
                rows.append(zero_rows(1, key))
            else:
                rows.append(encode(torch.tensor([slot]), write_id, key))
        return torch.cat(rows)

    def step(
        self,
        *,
        scheduled: Mapping[str, int],
        start: Sequence[Started] = (),
        finish: Sequence[str] = (),
        talker: bool = True,
        pad: int = 0,
    ) -> Expected:
        """Run one engine step: its starts and finishes, a forward's outputs, the save."""
        assert 0 <= pad <= 4, "the leftover 'ref' tensor must not look like a step tensor"
        self.write_id += 1
        write_id = self.write_id
        kind = PrefixCacheEventKind
        events = [PrefixCacheRequestEvent(req_id=r, kind=kind.FINISHED) for r in finish]
        events += [
            PrefixCacheRequestEvent(
                req_id=r,
                kind=kind.STARTED,
                hit_end=hit_end,
                block_ids=blocks,
                scheduled_tokens=scheduled.get(r, 0),
            )
            for r, blocks, hit_end in start
        ]
        self.manager.new_step_starts(PrefixCacheStep(events=events, scheduled_tokens=scheduled))
        for r in finish:
            del self.blocks[r], self.computed[r]
        prefixes: dict[str, dict[str, torch.Tensor]] = {}
        hit_slots: set[int] = set()
        for r, blocks, hit_end in start:
            self.blocks[r] = list(blocks)
            self.computed[r] = hit_end
            if hit_end:
                self.hits += 1
                slots = prefix_slots(blocks, hit_end)
                hit_slots.update(slots.tolist())
                prefixes[r] = {key: self._prefix(key, slots) for key in SHAPES}

        order = list(scheduled)
        layout = PrefixCacheWriteLayout.from_block_tables(
            order,
            dict(scheduled),
            {r: self.computed[r] for r in order},
            {r: self.blocks[r] for r in order},
            BLOCK_SIZE,
        )
        slots = layout.slots_cpu
        n = len(slots)
        assert not hit_slots & set(slots.tolist()), "script error: a same-step producer (HIT-5)"
        own = {key: encode(slots, write_id, key) for key in SHAPES}
        padded = n + pad

        hidden = torch.cat([own[HIDDEN_KEY], torch.full((pad, 64), -5.0)])
        codes = torch.cat([own[CODES], torch.full((pad, 2), -5, dtype=torch.int64)])
        ref = torch.arange((n + 5) * 3, dtype=torch.float32).reshape(n + 5, 3) + write_id * 1000
        tokens = torch.arange(n, dtype=torch.float32) + write_id * 100
        score = torch.arange(n, dtype=torch.float32)[:, None] * 0.5 + write_id
        cpu_mm: dict[str, Any] = {CODES: codes, "ref": ref, "tokens": tokens}
        if talker:
            cpu_mm[TALKER] = own[TALKER]  # unpadded on a padded step: still cached (OUT-2)

        rows_of = {w.req_id: (w.row_start, w.row_end) for w in layout.writes}
        keys = [HIDDEN_KEY, CODES] + ([TALKER] if talker else [])
        cached: dict[str, dict[str, torch.Tensor]] = {key: {} for key in keys}
        for r, (lo, hi) in rows_of.items():
            for key in keys:
                mine = own[key][lo:hi]
                cached[key][r] = torch.cat([prefixes[r][key], mine]) if r in prefixes else mine
        leftover: dict[str, dict[str, Any]] = {
            # OUT-5: tensors covering the step's rows are sliced per request, lists go whole.
            "ref": {r: ref[lo:hi] for r, (lo, hi) in rows_of.items()},
            "tokens": {r: tokens[lo:hi] for r, (lo, hi) in rows_of.items()},
            "meta": {
                r: {"score": score[lo:hi], "tags": [write_id, "x"]}
                for r, (lo, hi) in rows_of.items()
            },
            "step": dict.fromkeys(rows_of, write_id),
        }

        with _maybe_stream(self.stream):
            mm = {k: v.to(self.device) for k, v in cpu_mm.items()}
            mm["meta"] = {"score": score.to(self.device), "tags": [write_id, "x"]}
            mm["step"] = write_id
            step_id = self.manager.save_outputs(
                hidden.to(self.device),
                mm,
                num_tokens_unpadded=n,
                num_tokens_padded=padded,
                write_layout=layout,
            )

        for slot in slots.tolist():
            for key in SHAPES:
                self.last_write[key][slot] = write_id if key in keys else None  # SLOT-4
        for r in order:
            self.computed[r] += scheduled[r]
        return Expected(
            step_id=step_id,
            write_id=write_id,
            req_ids=tuple(order),
            cached=cached,
            leftover=leftover,
        )

    def consume(self, expected: Expected, req_ids: Sequence[str] | None = None) -> None:
        """Materialize a saved step and check every returned row and value."""
        wanted = tuple(expected.req_ids if req_ids is None else req_ids)
        out = self.manager.materialize(expected.step_id, wanted)
        check_outputs(out, expected, wanted)


def check_outputs(out: StageCacheOutputs, expected: Expected, wanted: Sequence[str]) -> None:
    """Compare a materialized step with what the reference predicts, bitwise."""
    step = f"step {expected.step_id}"
    assert out.hidden_states is not None, f"{step}: hidden states missing"
    assert set(out.hidden_states) == set(wanted), f"{step}: requests {sorted(out.hidden_states)}"
    names = {*expected.cached, *expected.leftover} - {HIDDEN_KEY}
    assert set(out.mm_outputs) == names, f"{step}: mm names {sorted(out.mm_outputs)} (OUT-6)"
    for key, per_req in expected.cached.items():
        got = out.hidden_states if key == HIDDEN_KEY else out.mm_outputs[key]
        for r in wanted:
            assert_same(got[r], per_req[r], f"{step} {key}[{r}]")
    for name in ("ref", "tokens"):
        for r in wanted:
            assert_same(out.mm_outputs[name][r], expected.leftover[name][r], f"{step} {name}[{r}]")
    for r in wanted:
        meta = out.mm_outputs["meta"][r]
        assert_same(meta["score"], expected.leftover["meta"][r]["score"], f"{step} meta[{r}]")
        assert meta["tags"] == expected.leftover["meta"][r]["tags"]
        assert out.mm_outputs["step"][r] == expected.write_id


class _maybe_stream:
    """``torch.cuda.stream(stream)`` when a stream is given, else nothing."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.inner: Any = None

    def __enter__(self) -> None:
        if self.stream is not None:
            self.inner = torch.cuda.stream(self.stream)
            self.inner.__enter__()

    def __exit__(self, *exc: object) -> None:
        if self.inner is not None:
            self.inner.__exit__(*exc)


def run_scripted_workload(engine: ScriptedEngine) -> None:
    """Ten steps: chunked prefill, hits on live and finished requests, block reuse, a discard,
    a sparse mm key, padded steps, and consumes one step late on an output-builder thread."""
    step = engine.step
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="output-builder") as pool:

        def late(expected: Expected) -> concurrent.futures.Future[None]:
            return pool.submit(engine.consume, expected)

        # talker.h is first seen in step 2: hits on step-1 rows read zeros for it (HIT-3).
        s1 = step(
            start=[("A", [0, 1, 2, 3], 0), ("B", [4, 5, 6], 0)],
            scheduled={"A": 40, "B": 32},
            talker=False,
            pad=3,
        )
        # C hits A's first two blocks while A is live: its deferred rows come from A's write.
        s2 = step(start=[("C", [0, 1, 7, 8], 32)], scheduled={"A": 24, "B": 1, "C": 16}, pad=4)
        f1 = late(s1)  # CONC-3: runs while step 3 starts and saves
        engine.consume(s2)
        # A finishes (its deferred write is escalated); D hits all of A's rows. No talker.h
        # this step: its slots become ABSENT and the step returns no talker.h (SLOT-4, OUT-6).
        s3 = step(
            start=[("D", [0, 1, 2, 3, 9], 64)],
            finish=["A"],
            scheduled={"B": 1, "C": 1, "D": 5},
            talker=False,
        )
        f1.result()
        engine.consume(s3)
        # B finishes and E reuses B's blocks 4 and 5; the step is discarded, its writes go on.
        s4 = step(
            start=[("E", [4, 5], 0)], finish=["B"], scheduled={"C": 1, "D": 1, "E": 20}, pad=2
        )
        engine.manager.discard_step(s4.step_id)
        # F hits E's block 4 (the newest tenant, not B); G hits A's and C's rows, C still live.
        s5 = step(
            start=[("F", [4, 10], 16), ("G", [0, 1, 7, 11], 48)],
            scheduled={"E": 1, "F": 3, "G": 2},
        )
        f5 = late(s5)
        s6 = step(
            start=[("H", [4, 12], 16)],
            finish=["C", "D", "E"],
            scheduled={"F": 1, "G": 1, "H": 4},
        )
        f5.result()
        late(s6).result()
        # I hits E's block 4; its step is consumed only after J has taken block 4 (HIT-6).
        s7 = step(start=[("I", [4, 13], 16)], scheduled={"F": 1, "G": 1, "H": 1, "I": 2})
        s8 = step(
            start=[("J", [4, 15], 0)], finish=["F", "H", "I"], scheduled={"G": 1, "J": 16}, pad=1
        )
        late(s7).result()
        engine.consume(s8)
        s9 = step(start=[("K", [4, 14], 16)], scheduled={"G": 1, "J": 1, "K": 1})
        late(s9).result()
        s10 = step(start=[("L", [0, 1, 2, 3, 16], 64)], finish=["G", "J", "K"], scheduled={"L": 1})
        engine.consume(s10, ["L"])


def scripted_config() -> PrefixCacheConfig:
    """A small cache: 32 blocks of 16 slots, three pages of 256 rows."""
    return PrefixCacheConfig(
        num_blocks=32,
        block_size=BLOCK_SIZE,
        staging_depth=3,
        staging_capacity_tokens=256,
        staging_claim_timeout_s=20.0,
    )


# ---------------------------------------------------------------------------------------------
# Tests.


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("threaded", "engine_stream", "prefetch"),
    [(True, False, True), (True, True, True), (True, False, False), (False, False, True)],
    ids=["threaded", "threaded-engine-stream", "threaded-no-prefetch", "inline"],
)
def test_scripted_workload_returns_every_row_byte_exact(
    make_manager: Callable[..., OmniPrefixCacheManager],
    cuda: torch.device,
    threaded: bool,
    engine_stream: bool,
    prefetch: bool,
) -> None:
    """Every row of a multi-step CUDA workload comes back bitwise equal to the row written."""
    # Without prefetch, the late consume of step 7 can only be right through the rows
    # preserved before J's write took block 4 (HIT-6); with it, through the early gather (HIT-7).
    manager = make_manager(scripted_config(), policy=POLICY, threaded=threaded, prefetch=prefetch)
    stream = torch.cuda.Stream(cuda) if engine_stream else None
    engine = ScriptedEngine(manager, cuda, stream=stream)
    run_scripted_workload(engine)
    stats = manager.stats()
    assert stats.steps_saved == 10
    assert stats.steps_discarded == 1
    assert stats.hit_requests == engine.hits == 8
    assert stats.hit_rows["TASK"] > 0, "no hit read a live request's deferred write"
    assert stats.hit_rows["ZEROS"] > 0, "no hit read an unknown or absent mm slot"
    assert stats.writes_failed == 0
    assert stats.timeouts == 0
    # The step copies went device-to-host through the pages (PAGE-6).
    assert stats.bytes_device_to_host > 0 or cuda.type != "cuda"


@pytest.mark.gpu
def test_deferred_rows_copied_in_small_pieces_come_back_byte_exact(
    make_manager: Callable[..., OmniPrefixCacheManager],
    cuda: torch.device,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """BUDGET-3: with `copy_chunk_bytes` of three codes rows, every deferred copy goes in pieces
    of at most that size, and every row of the scripted workload still comes back exact."""
    codes_row = 2 * 8  # codes.audio: 2 x int64
    limit = 3 * codes_row
    copies: list[list[tuple[int, int]]] = []  # the pieces of each deferred copy
    copy_in_pieces = committer_module.copy_in_pieces

    def recorded(
        dst: torch.Tensor, src: torch.Tensor, max_bytes: int, *, non_blocking: bool = False
    ) -> list[tuple[int, int]]:
        got = copy_in_pieces(dst, src, max_bytes, non_blocking=non_blocking)
        copies.append(got)
        return got

    monkeypatch.setattr(committer_module, "copy_in_pieces", recorded)
    config = attrs.evolve(scripted_config(), copy_chunk_bytes=limit)
    manager = make_manager(config, policy=POLICY, threaded=True, prefetch=False)
    run_scripted_workload(ScriptedEngine(manager, cuda))
    assert manager.stats().writes_failed == 0
    assert any(len(pieces) > 1 for pieces in copies), f"no deferred copy was split: {copies}"
    sizes = [stop - start for pieces in copies for start, stop in pieces]
    assert all(size * codes_row <= limit for size in sizes), copies


@pytest.mark.gpu
@pytest.mark.parametrize("overwrite", ["fill", "copy", "graph"])
def test_overwriting_live_buffers_after_save_keeps_the_saved_rows(
    make_manager: Callable[..., OmniPrefixCacheManager], cuda: torch.device, overwrite: str
) -> None:
    """Rows overwritten on the compute stream right after the save are still served as saved."""
    n, width, pad = 8192, 2048, 8
    blocks = list(range(n // BLOCK_SIZE))
    gen = torch.Generator(device=cuda).manual_seed(7)
    # The live buffers of a CUDA-graph engine: the next forward writes them in place.
    hidden = torch.empty((n + pad, width), dtype=torch.bfloat16, device=cuda)
    talker = torch.empty((n, 4, 4), dtype=torch.bfloat16, device=cuda)
    codes = torch.empty((n, 2), dtype=torch.int64, device=cuda)
    tokens = torch.empty((n,), dtype=torch.float32, device=cuda)
    live = (hidden, talker, codes, tokens)
    garbage = [torch.full_like(t, -3) for t in live]

    def clobber() -> None:
        for dst, src in zip(live, garbage, strict=True):
            dst.copy_(src)

    graph = None
    if overwrite == "graph":
        # Captured before the manager exists, so no other thread touches CUDA during capture.
        side = torch.cuda.Stream(cuda)
        side.wait_stream(torch.cuda.current_stream(cuda))
        with torch.cuda.stream(side):
            clobber()  # warm-up outside the capture
        torch.cuda.current_stream(cuda).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            clobber()
        torch.cuda.synchronize(cuda)

    def refill(seed: int) -> dict[str, torch.Tensor]:
        gen.manual_seed(seed)
        hidden.normal_(generator=gen)
        talker.normal_(generator=gen)
        codes.random_(0, 1 << 40, generator=gen)
        tokens.normal_(generator=gen)
        # Copies that own their memory (`.cpu()` of a CPU tensor would alias the buffer).
        return {
            HIDDEN_KEY: hidden[:n].to("cpu", copy=True),
            TALKER: talker.to("cpu", copy=True),
            CODES: codes.to("cpu", copy=True),
            "tokens": tokens.to("cpu", copy=True),
        }

    def save(layout: PrefixCacheWriteLayout, rows: int) -> StepId:
        mm = {TALKER: talker[:rows], CODES: codes[:rows], "tokens": tokens[:rows]}
        return manager.save_outputs(
            hidden[: rows + pad],
            mm,
            num_tokens_unpadded=rows,
            num_tokens_padded=rows + pad,
            write_layout=layout,
        )

    def start(req: str, req_blocks: list[int], hit_end: int, sched: int, done=()) -> None:
        events = [
            PrefixCacheRequestEvent(req_id=r, kind=PrefixCacheEventKind.FINISHED) for r in done
        ]
        events.append(
            PrefixCacheRequestEvent(
                req_id=req,
                kind=PrefixCacheEventKind.STARTED,
                hit_end=hit_end,
                block_ids=req_blocks,
                scheduled_tokens=sched,
            )
        )
        manager.new_step_starts(PrefixCacheStep(events=events, scheduled_tokens={req: sched}))

    def layout_of(req: str, req_blocks: list[int], computed: int, sched: int):
        return PrefixCacheWriteLayout.from_block_tables(
            [req], {req: sched}, {req: computed}, {req: req_blocks}, BLOCK_SIZE
        )

    config = PrefixCacheConfig(
        num_blocks=2 * len(blocks) + 8,
        block_size=BLOCK_SIZE,
        staging_depth=2,
        staging_capacity_tokens=n,
        staging_claim_timeout_s=30.0,
    )
    manager = make_manager(config, policy=POLICY, threaded=True)

    # A warm-up step of the same size installs the pinned pool and pages and fills the
    # allocators' caches, so the timed save below allocates nothing new.
    warm_blocks = [b + len(blocks) for b in blocks]
    start("warm", warm_blocks, 0, n)
    refill(1)
    manager.materialize(save(layout_of("warm", warm_blocks, 0, n), n), ["warm"])
    wait_written(manager, n)  # the timed save below must not wait the save barrier either

    start("a", blocks, 0, n, done=["warm"])
    want = refill(2)
    torch.cuda.synchronize(cuda)
    # Keep the compute stream busy past the save: the save must only enqueue work (DEV-3) and
    # the copy stream must wait for the clones (DEV-1) before the overwrite below lands.
    torch.cuda._sleep(SLEEP_CYCLES)
    t0 = time.perf_counter()
    step_id = save(layout_of("a", blocks, 0, n), n)
    save_s = time.perf_counter() - t0
    if graph is not None:
        graph.replay()
    elif overwrite == "fill":
        for t in live:
            t.fill_(-1)
    else:
        clobber()
    torch.cuda.synchronize(cuda)
    busy_s = time.perf_counter() - t0
    assert cuda.type != "cuda" or save_s < 0.5 * busy_s, (
        f"save_outputs took {save_s * 1e3:.1f} ms of the {busy_s * 1e3:.1f} ms the device was "
        "busy: the engine thread waited for the device (DEV-3)"
    )

    out = manager.materialize(step_id, ["a"])
    assert out.hidden_states is not None
    assert_same(out.hidden_states["a"], want[HIDDEN_KEY], "own step hidden")
    assert_same(out.mm_outputs[TALKER]["a"], want[TALKER], "own step talker.h")
    assert_same(out.mm_outputs[CODES]["a"], want[CODES], "own step codes.audio")
    assert_same(out.mm_outputs["tokens"]["a"], want["tokens"], "own step leftover")

    # A hit while "a" is live: hidden and talker.h from the pool, codes.audio from a's
    # deferred write (its device clone, taken before the overwrite).
    extra = [len(blocks) * 2]
    start("b", blocks + extra, n, 1)
    b_rows = refill(4)
    out = manager.materialize(save(layout_of("b", blocks + extra, n, 1), 1), ["b"])
    assert out.hidden_states is not None
    for key, got in (
        (HIDDEN_KEY, out.hidden_states["b"]),
        (TALKER, out.mm_outputs[TALKER]["b"]),
        (CODES, out.mm_outputs[CODES]["b"]),
    ):
        assert_same(got, torch.cat([want[key], b_rows[key][:1]]), f"hit on a live request {key}")

    # After "a" finishes its deferred rows are in the pool; a new hit reads them there.
    extra = [len(blocks) * 2 + 1]
    start("c", blocks + extra, n, 1, done=["a", "b"])
    c_rows = refill(5)
    out = manager.materialize(save(layout_of("c", blocks + extra, n, 1), 1), ["c"])
    assert out.hidden_states is not None
    assert_same(
        out.hidden_states["c"], torch.cat([want[HIDDEN_KEY], c_rows[HIDDEN_KEY][:1]]), "hit hidden"
    )
    assert_same(
        out.mm_outputs[CODES]["c"], torch.cat([want[CODES], c_rows[CODES][:1]]), "hit codes"
    )
    assert manager.stats().writes_failed == 0


@pytest.mark.gpu
def test_pool_and_pages_are_pinned_at_their_configured_size(
    make_manager: Callable[..., OmniPrefixCacheManager], cuda: torch.device
) -> None:
    """The host pool and staging pages are pinned and pin exactly their configured bytes."""
    config = PrefixCacheConfig(
        num_blocks=256, block_size=BLOCK_SIZE, staging_depth=2, staging_capacity_tokens=512
    )
    width = 2048
    n = 100
    # Pinned bytes are counted per process; collect garbage first and keep the collector off
    # so no earlier manager's storage is unpinned while this one is measured.
    gc.collect()
    gc.disable()
    try:
        before = registered_pinned_bytes()
        manager = make_manager(config, policy=POLICY, threaded=True)
        kind = PrefixCacheEventKind
        manager.new_step_starts(
            PrefixCacheStep(
                events=[PrefixCacheRequestEvent(req_id="a", kind=kind.STARTED)],
                scheduled_tokens={"a": n},
            )
        )
        layout = PrefixCacheWriteLayout.from_block_tables(
            ["a"], {"a": n}, {"a": 0}, {"a": list(range(16))}, BLOCK_SIZE
        )
        step_id = manager.save_outputs(
            torch.ones((n, width), dtype=torch.bfloat16, device=cuda),
            {
                TALKER: torch.ones((n, 4, 4), dtype=torch.bfloat16, device=cuda),
                CODES: torch.ones((n, 2), dtype=torch.int64, device=cuda),
            },
            num_tokens_unpadded=n,
            write_layout=layout,
        )
        manager.materialize(step_id, ["a"])
        pinned = registered_pinned_bytes() - before
    finally:
        gc.enable()

    hidden_row, talker_row, codes_row = width * 2, 16 * 2, 2 * 8
    pool_bytes = config.num_slots * (hidden_row + talker_row + codes_row)
    page_bytes = config.staging_depth * config.staging_capacity_tokens * (hidden_row + talker_row)
    configured = pool_bytes + page_bytes
    ratio = pinned / configured
    print(f"pinned {pinned} B for pool {pool_bytes} B + pages {page_bytes} B: ratio {ratio:.4f}")

    pools = manager._state.pool.tensors
    pages = manager._state.pages.buffers
    assert set(pools) == {HIDDEN_KEY, TALKER, CODES}
    assert set(pages) == {HIDDEN_KEY, TALKER}, "a deferred key has no staging pages"
    for key, tensor in {**pools, **{f"page {k}": v for k, v in pages.items()}}.items():
        assert tensor.is_pinned(), f"{key} storage is not pinned"
    stats = manager.stats()
    assert (stats.pool_bytes, stats.staging_bytes) == (pool_bytes, page_bytes)
    # Below 1: some storage was pinned by the rounding caching allocator instead (a refused
    # registration); above 1.01: pinned memory costs more than the configuration says.
    assert 0.99 <= ratio <= 1.01, f"pinned/configured = {ratio:.4f}"


@pytest.mark.gpu
def test_leftover_cuda_tensors_come_back_on_the_cpu_unpinned(
    make_manager: Callable[..., OmniPrefixCacheManager], cuda: torch.device
) -> None:
    """Leftover CUDA values come back as unpinned CPU tensors, sliced as OUT-4 and OUT-5 say."""
    manager = make_manager(scripted_config(), policy=POLICY, threaded=True)
    n, padded = 8, 10
    rows = {"a": (0, 5), "b": (5, 8)}
    kind = PrefixCacheEventKind
    manager.new_step_starts(
        PrefixCacheStep(
            events=[
                PrefixCacheRequestEvent(req_id="a", kind=kind.STARTED, scheduled_tokens=5),
                PrefixCacheRequestEvent(req_id="b", kind=kind.STARTED, scheduled_tokens=3),
            ],
            scheduled_tokens={"a": 5, "b": 3},
        )
    )
    layout = PrefixCacheWriteLayout.from_block_tables(
        ["a", "b"], {"a": 5, "b": 3}, {"a": 0, "b": 0}, {"a": [0], "b": [1]}, BLOCK_SIZE
    )
    cpu = {
        "ref": torch.arange(6, dtype=torch.float32).reshape(3, 2),  # another first dimension
        "tokens": torch.arange(n, dtype=torch.int32),  # 1-D: never cached
        "padded_vec": torch.arange(padded, dtype=torch.float32) * 3,  # padded count, 1-D
        "score": torch.arange(n * 2, dtype=torch.float16).reshape(n, 2),
        "pair": torch.tensor([7, 9]),
        CODES: encode(layout.slots_cpu, 1, CODES),
    }
    mm: dict[str, Any] = {
        "ref": cpu["ref"].to(cuda),
        "tokens": cpu["tokens"].to(cuda),
        "padded_vec": cpu["padded_vec"].to(cuda),
        "meta": {"score": cpu["score"].to(cuda), "pair": [cpu["pair"].to(cuda)], "tag": "t"},
        CODES: cpu[CODES].to(cuda),
        "scalar": 3,
    }
    hidden = encode(layout.slots_cpu, 1, HIDDEN_KEY)
    step_id = manager.save_outputs(
        torch.cat([hidden, torch.zeros(padded - n, 64)]).to(cuda),
        mm,
        num_tokens_unpadded=n,
        num_tokens_padded=padded,
        write_layout=layout,
    )
    out = manager.materialize(step_id, ["a", "b"])
    tensors = list(walk_tensors(out.mm_outputs)) + list(walk_tensors(out.hidden_states))
    assert tensors
    for t in tensors:
        assert t.device.type == "cpu" and not t.is_pinned(), (t.device, t.is_pinned())
    for r, (lo, hi) in rows.items():
        assert_same(out.mm_outputs["ref"][r], cpu["ref"], f"ref[{r}] kept whole")
        assert_same(out.mm_outputs["tokens"][r], cpu["tokens"][lo:hi], f"tokens[{r}]")
        assert_same(out.mm_outputs["padded_vec"][r], cpu["padded_vec"][lo:hi], f"padded[{r}]")
        meta = out.mm_outputs["meta"][r]
        assert_same(meta["score"], cpu["score"][lo:hi], f"meta.score[{r}]")
        assert len(meta["pair"]) == 1
        assert_same(meta["pair"][0], cpu["pair"], f"meta.pair[{r}] passed whole")
        assert meta["tag"] == "t"
        assert out.mm_outputs["scalar"][r] == 3
        assert_same(out.mm_outputs[CODES][r], cpu[CODES][lo:hi], f"deferred {CODES}[{r}]")
        assert out.hidden_states is not None
        assert_same(out.hidden_states[r], hidden[lo:hi], f"hidden[{r}]")


@pytest.mark.gpu
def test_materialize_on_a_busy_consumer_stream_returns_the_saved_rows(
    make_manager: Callable[..., OmniPrefixCacheManager], cuda: torch.device
) -> None:
    """A materialize whose thread's current stream is busy still serves in-flight rows intact."""
    manager = make_manager(scripted_config(), policy=POLICY, threaded=True)
    engine = ScriptedEngine(manager, cuda)
    engine.consume(engine.step(start=[("a", [0, 1, 2], 0)], scheduled={"a": 32}))
    # "b" hits "a" while "a" is live: b's codes.audio prefix is read from a's device clones.
    s2 = engine.step(start=[("b", [0, 1, 3], 32)], scheduled={"a": 1, "b": 1})
    busy = torch.cuda.Stream(cuda)
    # An output builder whose stream still has work queued (CONC-3): nothing the cache reads
    # may be ordered after that work, or after nothing at all.
    with torch.cuda.stream(busy):
        torch.cuda._sleep(SLEEP_CYCLES)
        out = manager.materialize(s2.step_id, list(s2.req_ids))
    check_outputs(out, s2, s2.req_ids)
    assert manager.stats().hit_rows["TASK"] > 0
