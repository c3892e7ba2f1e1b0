"""The CPU's one copy (DESIGN D27): a step's rows go from the caller's tensors straight into the
pool, and a consume reads them out of the pool once; the staging page is not copied into.

Each test names the rule the page upheld and the one-copy path keeps: the caller may reuse its
tensors as soon as `save_outputs` returns (STEP-3), a delayed reader of a slot's previous tenant
still gets the previous rows (STEP-3, HIT-6), a failed write is sticky (FAIL-1), and threaded
mode keeps the pool write of a small step off the engine thread. Steps of `BIG` rows carry 2.4
MB of hidden states, over `DIRECT_WRITE_MIN_BYTES`, so threaded mode writes them straight too.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import pytest
import torch

from omni_cache_cuda import (
    HIDDEN_KEY,
    HitUnreadableError,
    OmniPrefixCacheManager,
    PrefixCacheConfig,
    PrefixCacheEventKind,
    PrefixCacheRequestEvent,
    PrefixCacheStep,
    PrefixCacheWriteLayout,
    StagingCopyError,
    WriteFailedError,
    _committer,
    _consume_path,
)
from omni_cache_cuda._consume_path import ConsumePath
from omni_cache_cuda._save_path import DIRECT_WRITE_MIN_BYTES
from tests.adapter_helpers import settle

BLOCK = 16
WIDTH = 1024  # float32: 4 KiB a row
MM = "talker.h"
BIG = 640  # rows: 2.5 MiB of hidden states
STARTED = PrefixCacheEventKind.STARTED
FINISHED = PrefixCacheEventKind.FINISHED

pytestmark = pytest.mark.parametrize("threaded", [False, True], ids=["inline", "threaded"])


@pytest.fixture
def manager(threaded: bool) -> Iterator[OmniPrefixCacheManager]:
    config = PrefixCacheConfig(
        num_blocks=256, block_size=BLOCK, staging_depth=4, staging_capacity_tokens=2048
    )
    with OmniPrefixCacheManager(config, device="cpu", threaded=threaded) as m:
        yield m


def _blocks(first: int, tokens: int) -> list[int]:
    return list(range(first, first + -(-tokens // BLOCK)))


def _rows(n: int, seed: float) -> tuple[torch.Tensor, torch.Tensor]:
    base = torch.arange(n, dtype=torch.float32)[:, None] + seed
    return base + torch.arange(WIDTH) * 1e-3, base + torch.arange(8) * 1e-2


def _save(
    m: OmniPrefixCacheManager,
    events: Sequence[PrefixCacheRequestEvent],
    tokens: Mapping[str, int],
    computed: Mapping[str, int],
    blocks: Mapping[str, list[int]],
    rows: tuple[torch.Tensor, torch.Tensor],
) -> int:
    m.new_step_starts(PrefixCacheStep(events=list(events), scheduled_tokens=dict(tokens)))
    reqs = list(tokens)
    layout = PrefixCacheWriteLayout.from_block_tables(reqs, tokens, computed, blocks, BLOCK)
    n = sum(tokens.values())
    # Called on this thread: the tests check which thread writes the pool.
    return m.save_outputs(rows[0], {MM: rows[1]}, num_tokens_unpadded=n, write_layout=layout)


def _start(req: str, blocks: list[int], tokens: int, hit: int = 0) -> PrefixCacheRequestEvent:
    return PrefixCacheRequestEvent(
        req_id=req, kind=STARTED, block_ids=blocks, scheduled_tokens=tokens, hit_end=hit
    )


def _pages_untouched(m: OmniPrefixCacheManager) -> bool:
    return all(not buffer.any() for buffer in m._state.pages.buffers.values())


def test_big_steps_are_large_enough_for_the_direct_write_in_threaded_mode(threaded: bool) -> None:
    """The sizes of this module put a `BIG` step over the threaded threshold (D27)."""
    assert BIG * WIDTH * 4 >= DIRECT_WRITE_MIN_BYTES


def test_caller_may_reuse_its_tensors_right_after_save(manager: OmniPrefixCacheManager) -> None:
    """STEP-3: the caller overwrites its tensors once save_outputs returns; the step and a later
    hit on its blocks return the saved rows. The rows went to the pool in one copy, on the
    engine thread, and no page was copied into (D27)."""
    writers: list[str] = []
    manager._inject_fault("pool_write", lambda job: writers.append(threading.current_thread().name))
    blocks = {"a": _blocks(0, BIG)}
    hidden, mm = _rows(BIG, 0.5)
    kept = (hidden.clone(), mm.clone())
    step = _save(
        manager, [_start("a", blocks["a"], BIG)], {"a": BIG}, {"a": 0}, blocks, (hidden, mm)
    )
    assert writers == [threading.current_thread().name]  # written before save_outputs returned
    hidden.fill_(-1.0)
    mm.fill_(-1.0)
    out = manager.materialize(step, ["a"])
    assert torch.equal(out.hidden_states["a"], kept[0])
    assert torch.equal(out.mm_outputs[MM]["a"], kept[1])
    assert _pages_untouched(manager)
    # b starts on a's first 512 tokens (a finished; its blocks stay in the pool).
    b_blocks = {"b": blocks["a"][:32] + _blocks(100, 16)}
    step = _save(
        manager,
        [PrefixCacheRequestEvent(req_id="a", kind=FINISHED), _start("b", b_blocks["b"], 16, 512)],
        {"b": 16},
        {"b": 512},
        b_blocks,
        _rows(16, 9.0),
    )
    out = manager.materialize(step, ["b"])
    assert torch.equal(out.hidden_states["b"][:512], kept[0][:512])
    assert torch.equal(out.mm_outputs[MM]["b"][:512], kept[1][:512])


def test_threaded_mode_keeps_a_small_steps_pool_write_off_the_engine_thread(
    manager: OmniPrefixCacheManager, threaded: bool
) -> None:
    """Threaded mode: a step under DIRECT_WRITE_MIN_BYTES is copied into its page and the
    committer thread writes the pool; inline mode writes it straight (D27)."""
    writers: list[str] = []
    manager._inject_fault("pool_write", lambda job: writers.append(threading.current_thread().name))
    blocks = {"a": _blocks(0, 8)}
    rows = _rows(8, 1.0)
    step = _save(manager, [_start("a", blocks["a"], 8)], {"a": 8}, {"a": 0}, blocks, rows)
    out = manager.materialize(step, ["a"])
    assert torch.equal(out.hidden_states["a"], rows[0])
    settle(manager)
    if threaded:
        assert writers == ["omni-prefix-cache-committer"]
        assert not _pages_untouched(manager)
    else:
        assert writers == [threading.current_thread().name]
        assert _pages_untouched(manager)


@pytest.mark.parametrize("big", [False, True], ids=["small", "big"])
def test_delayed_reader_of_the_previous_tenant_gets_the_previous_rows(
    manager: OmniPrefixCacheManager, big: bool
) -> None:
    """STEP-3, HIT-6: a's step is consumed only after b's step wrote other rows over a's
    blocks (a finished, its blocks reused); a's materialize still returns a's rows, and b's
    returns b's. With `big`, both steps wrote straight to the pool (D27)."""
    n = BIG if big else 24
    blocks = {"a": _blocks(0, n)}
    a_rows = _rows(n, 0.25)
    kept = (a_rows[0].clone(), a_rows[1].clone())
    step_a = _save(manager, [_start("a", blocks["a"], n)], {"a": n}, {"a": 0}, blocks, a_rows)
    a_rows[0].fill_(7.0)  # the caller reuses its buffers for the next step
    b_rows = _rows(n, 100.0)
    step_b = _save(
        manager,
        [PrefixCacheRequestEvent(req_id="a", kind=FINISHED), _start("b", blocks["a"], n)],
        {"b": n},
        {"b": 0},
        {"b": blocks["a"]},
        b_rows,
    )
    out_a = manager.materialize(step_a, ["a"])
    assert torch.equal(out_a.hidden_states["a"], kept[0])
    assert torch.equal(out_a.mm_outputs[MM]["a"], kept[1])
    out_b = manager.materialize(step_b, ["b"])
    assert torch.equal(out_b.hidden_states["b"], b_rows[0])


def test_delayed_reader_on_another_thread_while_the_slots_are_rewritten(
    manager: OmniPrefixCacheManager,
) -> None:
    """CONC-3, STEP-3: a builder thread materializes each step one step late while the engine
    thread's next save rewrites the same blocks from the same buffers; every step returns the
    rows it saved."""
    blocks = _blocks(0, BIG)
    rows = _rows(BIG, 0.0)
    errors: list[str] = []

    def build(step: int, req: str, want: torch.Tensor) -> None:
        got = manager.materialize(step, [req]).hidden_states[req]
        if not torch.equal(got, want):
            errors.append(f"step {step}: {int((got != want).any(dim=1).sum())} rows wrong")

    builder: threading.Thread | None = None
    for i in range(8):
        rows[0].copy_(_rows(BIG, 10.0 * i)[0])  # the caller's buffers, reused every step
        req = f"r{i}"
        events = [_start(req, blocks, BIG)]
        if i:
            events.insert(0, PrefixCacheRequestEvent(req_id=f"r{i - 1}", kind=FINISHED))
        step = _save(manager, events, {req: BIG}, {req: 0}, {req: blocks}, rows)
        if builder is not None:
            builder.join(10)
        builder = threading.Thread(target=build, args=(step, req, rows[0].clone()))
        builder.start()
    assert builder is not None
    builder.join(10)
    assert not errors, errors


def test_a_slot_twice_in_one_step_keeps_both_rows(manager: OmniPrefixCacheManager) -> None:
    """STEP-3: two requests of one step write the same block (the engine's choice); the pool
    keeps the later row (TASK-5), and the step's own materialize returns each request's rows."""
    blocks = {"x": [3], "y": [3]}
    rows = _rows(8, 2.0)
    try:
        step = _save(
            manager,
            [_start("x", [3], 4), _start("y", [3], 4)],
            {"x": 4, "y": 4},
            {"x": 0, "y": 0},
            blocks,
            rows,
        )
    except Exception as exc:  # pragma: no cover - the core may refuse a repeated slot
        pytest.skip(f"a repeated slot is refused: {exc}")
    rows_kept = rows[0].clone()
    rows[0].fill_(0.0)
    out = manager.materialize(step, ["x", "y"])
    assert torch.equal(out.hidden_states["x"], rows_kept[:4])
    assert torch.equal(out.hidden_states["y"], rows_kept[4:])
    settle(manager)
    pool = manager._state.pool.tensors[HIDDEN_KEY]
    assert torch.equal(pool[48:52], rows_kept[4:])  # the later row won the slot


def test_whole_blocks_twice_in_one_big_step_keep_both_rows(
    manager: OmniPrefixCacheManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    """D33, TASK-5: a `BIG` step whose two requests write the same whole blocks goes to the pool
    a block at a time; the pool keeps the later rows, the step's materialize returns each
    request's own, and the step's blocks are found once, for both keys and the repeat check."""
    found: list[int] = []
    write_blocks = _committer.write_blocks

    def counted(slots: Any, block_size: int) -> Any:
        found.append(len(slots))
        return write_blocks(slots, block_size)

    monkeypatch.setattr(_committer, "write_blocks", counted)
    half = BIG // 2
    shared = _blocks(3, half)
    rows = _rows(BIG, 4.0)
    step = _save(
        manager,
        [_start("x", shared, half), _start("y", shared, half)],
        {"x": half, "y": half},
        {"x": 0, "y": 0},
        {"x": shared, "y": shared},
        rows,
    )
    assert found == [BIG]
    rows_kept = rows[0].clone()
    rows[0].fill_(0.0)
    out = manager.materialize(step, ["x", "y"])
    assert torch.equal(out.hidden_states["x"], rows_kept[:half])
    assert torch.equal(out.hidden_states["y"], rows_kept[half:])
    settle(manager)
    pool = manager._state.pool.tensors[HIDDEN_KEY]
    assert torch.equal(pool[3 * BLOCK : 3 * BLOCK + half], rows_kept[half:])


@pytest.mark.parametrize("point", ["pool_write", "host_ready"])
def test_a_failed_direct_write_is_sticky(manager: OmniPrefixCacheManager, point: str) -> None:
    """FAIL-1: the write that runs in save_outputs fails; the save raises WriteFailedError and
    every later call raises it too."""

    def fail(job: Any) -> None:
        raise RuntimeError(f"injected {point} fault")

    manager._inject_fault(point, fail)
    blocks = {"a": _blocks(0, BIG)}
    with pytest.raises(WriteFailedError) as caught:
        _save(manager, [_start("a", blocks["a"], BIG)], {"a": BIG}, {"a": 0}, blocks, _rows(BIG, 1))
    assert f"injected {point} fault" in caught.value.reason
    manager._inject_fault(point, None)
    with pytest.raises(WriteFailedError):
        manager.new_step_starts(PrefixCacheStep(events=[], scheduled_tokens={}))
    with pytest.raises(WriteFailedError):
        manager.materialize(1, ["a"])
    assert manager.stats().writes_failed == 1


def test_a_failed_take_of_the_rows_leaves_no_trace(manager: OmniPrefixCacheManager) -> None:
    """STEP-5: the `page_copy` point, where a direct step takes its rows, fails the save with
    StagingCopyError inside its transaction; the next save of the same step works."""
    calls: list[str] = []

    def fail_mm(key: str) -> None:
        calls.append(key)
        if key == MM:
            raise RuntimeError("injected")

    manager._inject_fault("page_copy", fail_mm)
    blocks = {"a": _blocks(0, BIG)}
    rows = _rows(BIG, 3.0)
    manager.new_step_starts(
        PrefixCacheStep(events=[_start("a", blocks["a"], BIG)], scheduled_tokens={"a": BIG})
    )
    layout = PrefixCacheWriteLayout.from_block_tables(["a"], {"a": BIG}, {"a": 0}, blocks, BLOCK)
    with pytest.raises(StagingCopyError):
        manager.save_outputs(rows[0], {MM: rows[1]}, num_tokens_unpadded=BIG, write_layout=layout)
    assert calls == [HIDDEN_KEY, MM]
    stats = manager.stats()
    assert stats.pages_in_use == 0 and stats.steps_saved == 0 and stats.writes_failed == 0
    assert not manager._state.pool.tensors[HIDDEN_KEY].any()  # nothing reached the pool
    manager._inject_fault("page_copy", None)
    step = manager.save_outputs(
        rows[0], {MM: rows[1]}, num_tokens_unpadded=BIG, write_layout=layout
    )
    assert torch.equal(manager.materialize(step, ["a"]).hidden_states["a"], rows[0])


@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetch", "no-prefetch"])
def test_hit_requests_of_pool_rows_take_plain_gathers(
    threaded: bool, prefetch: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """HIT-3, D27: hit requests whose planned prefix rows are all pool rows are merged without
    the general per-row gather (a plain gather, or the prefetch's own buffer, HIT-7), inline and
    behind a page (threaded mode's small steps), and return the prefix then their own rows.
    With a fault hook on the gather point the same merge goes through the general gather,
    request by request, and returns the same rows."""
    gathered: list[str] = []
    gather = ConsumePath.gather

    def counted(self: ConsumePath, out: torch.Tensor, read: Any, *args: Any) -> None:
        gathered.append(read.req_id)
        gather(self, out, read, *args)

    monkeypatch.setattr(ConsumePath, "gather", counted)
    config = PrefixCacheConfig(num_blocks=256, block_size=BLOCK, staging_capacity_tokens=2048)
    with OmniPrefixCacheManager(config, device="cpu", threaded=threaded, prefetch=prefetch) as m:
        a_blocks = _blocks(0, 64)
        a_rows = _rows(64, 0.5)
        kept = (a_rows[0].clone(), a_rows[1].clone())
        step = _save(m, [_start("a", a_blocks, 64)], {"a": 64}, {"a": 0}, {"a": a_blocks}, a_rows)
        m.materialize(step, ["a"])
        settle(m)
        ended = [PrefixCacheRequestEvent(req_id="a", kind=FINISHED)]
        for round_, (first, hook) in enumerate(((8, False), (12, True))):
            if hook:
                m._inject_fault("gather", lambda read: None)  # a hook that lets every gather run
            # Two requests on a's first 32 tokens, 16 tokens of their own each; one without a hit.
            reqs = [f"b{round_}", f"c{round_}", f"d{round_}"]
            blocks = {
                reqs[0]: [*a_blocks[:2], first],
                reqs[1]: [*a_blocks[:2], first + 1],
                reqs[2]: [first + 2],
            }
            tokens = {reqs[0]: 16, reqs[1]: 16, reqs[2]: 16}
            computed = {reqs[0]: 32, reqs[1]: 32, reqs[2]: 0}
            events = [*ended, *(_start(r, blocks[r], 16, computed[r]) for r in reqs)]
            own = _rows(48, 10.0 * (round_ + 1))
            step = _save(m, events, tokens, computed, blocks, own)
            out = m.materialize(step, reqs)
            for i, req in enumerate(reqs[:2]):
                hidden, mm = out.hidden_states[req], out.mm_outputs[MM][req]
                assert torch.equal(hidden[:32], kept[0][:32]) and torch.equal(mm[:32], kept[1][:32])
                assert torch.equal(hidden[32:], own[0][16 * i : 16 * (i + 1)])
                assert torch.equal(mm[32:], own[1][16 * i : 16 * (i + 1)])
            assert torch.equal(out.hidden_states[reqs[2]], own[0][32:])
            # Two keys, two hit requests: through the general gather only with the hook.
            assert sorted(gathered) == (sorted(reqs[:2] * 2) if hook else [])
            gathered.clear()
            ended = [PrefixCacheRequestEvent(req_id=r, kind=FINISHED) for r in reqs]


def _hit_step(
    m: OmniPrefixCacheManager, reqs: list[str], first_block: int
) -> tuple[int, tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """A step of requests on the 32-token prefix of a request written first (each 16 tokens of
    its own); returns the step id, the prefix rows and the step's own rows."""
    prefix_blocks = _blocks(200, 32)
    rows = _rows(32, 0.5)
    kept = (rows[0].clone(), rows[1].clone())
    step = _save(
        m, [_start("p", prefix_blocks, 32)], {"p": 32}, {"p": 0}, {"p": prefix_blocks}, rows
    )
    m.materialize(step, ["p"])
    settle(m)
    blocks = {r: [*prefix_blocks, first_block + i] for i, r in enumerate(reqs)}
    events = [PrefixCacheRequestEvent(req_id="p", kind=FINISHED)]
    events += [_start(r, blocks[r], 16, 32) for r in reqs]
    own = _rows(16 * len(reqs), 50.0)
    step = _save(m, events, dict.fromkeys(reqs, 16), dict.fromkeys(reqs, 32), blocks, own)
    return step, kept, own


@pytest.mark.parametrize("cap_rows", [1, 48, 1000])
def test_hit_requests_gathered_together_in_groups_under_the_cap(
    threaded: bool, cap_rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """HIT-3, OUT-5, D27: with no prefetch, hit requests on pool rows are gathered together
    into buffers of at most `_TOGETHER_MAX_BYTES` (one request's rows alone when it is larger);
    every request gets its prefix then its own rows, whatever the grouping."""
    row_bytes = WIDTH * 4
    monkeypatch.setattr(_consume_path, "_TOGETHER_MAX_BYTES", cap_rows * row_bytes)
    config = PrefixCacheConfig(num_blocks=256, block_size=BLOCK, staging_capacity_tokens=2048)
    reqs = [f"h{i}" for i in range(5)]
    with OmniPrefixCacheManager(config, device="cpu", threaded=threaded, prefetch=False) as m:
        step, kept, own = _hit_step(m, reqs, 100)
        out = m.materialize(step, reqs)
    bases = {out.hidden_states[r].untyped_storage().data_ptr() for r in reqs}
    if not threaded:  # behind a page (threaded, small steps) each request has its own buffer
        assert len(bases) == {1: 5, 48: 5, 1000: 1}[cap_rows]  # 48 rows: one request per group
    for i, req in enumerate(reqs):
        assert torch.equal(out.hidden_states[req][:32], kept[0])
        assert torch.equal(out.mm_outputs[MM][req][:32], kept[1])
        assert torch.equal(out.hidden_states[req][32:], own[0][16 * i : 16 * (i + 1)])


def test_a_failed_gather_together_names_the_request_whose_prefix_fails(
    threaded: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """HIT-4: when the gather of several hit requests together fails, each prefix is gathered
    again alone, and the error names the request whose prefix cannot be read."""
    if threaded:
        pytest.skip("behind a page (threaded mode's small steps) each request is gathered alone")
    config = PrefixCacheConfig(num_blocks=256, block_size=BLOCK, staging_capacity_tokens=2048)
    reqs = ["x0", "x1", "x2"]
    select = torch.index_select
    failing: list[int] = []

    def index_select(source: torch.Tensor, dim: int, index: torch.Tensor, **kw: Any) -> Any:
        # Fails the gather of all three requests (144 rows: 3 prefixes of 32, 3 x 16 own rows),
        # then the second prefix gathered alone (the retry's second 32-row gather).
        if len(index) == 32:
            failing.append(1)
        if len(index) == 3 * 48 or (len(index) == 32 and len(failing) == 2):
            raise RuntimeError("injected gather failure")
        return select(source, dim, index, **kw)

    with OmniPrefixCacheManager(config, device="cpu", threaded=False, prefetch=False) as m:
        step, _, _ = _hit_step(m, reqs, 100)
        monkeypatch.setattr(_consume_path.torch, "index_select", index_select)
        with pytest.raises(HitUnreadableError) as caught:
            m.materialize(step, reqs)
    assert caught.value.req_id == "x1"
    assert "injected gather failure" in caught.value.reason
