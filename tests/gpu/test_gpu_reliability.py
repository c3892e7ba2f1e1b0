"""The fault points, the memory plan and the leak checks on a CUDA device (D19, D20, FAIL-4).

The CPU tests (tests/test_fault_points.py, tests/test_memory_plan.py, tests/test_leaks.py) cover
the rules; these check what only CUDA has: the page copy launched on the copy stream, the event
waits, pieces of a deferred copy on the copy stream, pinned storage and its release.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from omni_cache_cuda import (
    HIDDEN_KEY,
    HitUnreadableError,
    HostAllocationError,
    ModelCachePolicy,
    OmniPrefixCacheManager,
    PrefixCacheConfig,
    PrefixCacheEventKind,
    PrefixCacheRequestEvent,
    PrefixCacheStep,
    PrefixCacheWriteLayout,
    StagingCopyError,
    WriteFailedError,
)
from omni_cache_cuda._storage import registered_pinned_bytes

BLOCK = 16
CODES = "codes.audio"
POLICY = ModelCachePolicy(deferred_keys={CODES})
KEYS: dict[str, tuple[Any, torch.dtype]] = {
    HIDDEN_KEY: (256, torch.bfloat16),
    CODES: (2, torch.int64),
}
Make = Callable[..., OmniPrefixCacheManager]


def _config(**overrides: Any) -> PrefixCacheConfig:
    fields: dict[str, Any] = {
        "num_blocks": 64,
        "block_size": BLOCK,
        "staging_depth": 3,
        "staging_capacity_tokens": 256,
        "staging_claim_timeout_s": 10.0,
        "copy_chunk_bytes": 64,
    }
    fields.update(overrides)
    return PrefixCacheConfig(**fields)


def _step(
    manager: OmniPrefixCacheManager,
    cuda: torch.device,
    req: str,
    blocks: list[int],
    n: int,
    *,
    computed: int = 0,
    events: tuple[PrefixCacheRequestEvent, ...] = (),
) -> int:
    """Save n rows of ``req`` (hidden, and codes deferred); rows encode their slot."""
    manager.new_step_starts(PrefixCacheStep(events=events, scheduled_tokens={req: n}))
    layout = PrefixCacheWriteLayout.from_block_tables(
        [req], {req: n}, {req: computed}, {req: blocks}, BLOCK
    )
    slots = layout.slots_cpu.to(cuda)
    hidden = slots[:, None].to(torch.bfloat16).repeat(1, 256)
    codes = slots[:, None].repeat(1, 2)
    return manager.save_outputs(hidden, {CODES: codes}, num_tokens_unpadded=n, write_layout=layout)


def _started(req: str, blocks: list[int], hit_end: int = 0) -> PrefixCacheRequestEvent:
    return PrefixCacheRequestEvent(
        req_id=req, kind=PrefixCacheEventKind.STARTED, hit_end=hit_end, block_ids=tuple(blocks)
    )


def _raise(detail: Any) -> None:
    raise RuntimeError("injected fault")


@pytest.mark.gpu
def test_page_copy_fault_on_the_copy_stream_leaves_no_trace(
    make_manager: Make, cuda: torch.device
) -> None:
    """A failed page copy on CUDA raises StagingCopyError; the next save's rows are exact."""
    manager = make_manager(_config(), policy=POLICY, threaded=True)
    manager._inject_fault("page_copy", _raise)
    with pytest.raises(StagingCopyError):
        _step(manager, cuda, "a", [0, 1], 16, events=(_started("a", [0, 1]),))
    manager._inject_fault("page_copy", None)
    stats = manager.stats()
    assert stats.steps_saved == 0 and stats.pages_in_use == 0
    step = _step(manager, cuda, "a", [0, 1], 16)
    out = manager.materialize(step, ["a"])
    assert out.hidden_states is not None
    assert out.hidden_states["a"][:, 0].tolist() == list(range(16))


@pytest.mark.parametrize("point", ["host_ready", "deferred_piece", "pool_write"])
@pytest.mark.gpu
def test_committer_faults_on_cuda_are_sticky(
    make_manager: Make, cuda: torch.device, point: str
) -> None:
    """A fault in the committer's CUDA work fails the write for good (FAIL-1); nothing hangs."""
    manager = make_manager(_config(), policy=POLICY, threaded=True)
    manager._inject_fault(point, _raise)
    finish = PrefixCacheRequestEvent(req_id="a", kind=PrefixCacheEventKind.FINISHED)
    with pytest.raises(WriteFailedError):
        step = _step(manager, cuda, "a", [0, 1], 16, events=(_started("a", [0, 1]),))
        manager.discard_step(step)
        # The deferred write copies at the finish (TASK-4); wait for the committer's report.
        manager.new_step_starts(PrefixCacheStep(events=[finish]))
        deadline = time.monotonic() + 10.0
        while manager.stats().writes_failed == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        manager.new_step_starts(PrefixCacheStep())
    assert manager.stats().writes_failed >= 1
    with pytest.raises(WriteFailedError):
        manager.discard_step(1)


@pytest.mark.gpu
def test_gather_fault_on_cuda_fails_that_materialize(
    make_manager: Make, cuda: torch.device
) -> None:
    """A failed hit gather raises HitUnreadableError and leaves the cache serving."""
    manager = make_manager(_config(), policy=POLICY, threaded=True)
    manager.materialize(
        _step(manager, cuda, "a", [0, 1], 32, events=(_started("a", [0, 1]),)), ["a"]
    )
    finish = PrefixCacheRequestEvent(req_id="a", kind=PrefixCacheEventKind.FINISHED)
    manager._inject_fault("gather", _raise)
    step = _step(
        manager, cuda, "b", [0, 1, 2], 1, computed=32, events=(finish, _started("b", [0, 1, 2], 32))
    )
    with pytest.raises(HitUnreadableError):
        manager.materialize(step, ["b"])
    manager._inject_fault("gather", None)
    out = manager.materialize(_step(manager, cuda, "b", [0, 1, 2], 1, computed=33), ["b"])
    assert out.hidden_states is not None and out.hidden_states["b"][:, 0].tolist() == [33]


@pytest.mark.gpu
def test_reserve_pins_what_host_bytes_says_and_shutdown_unpins_it(make_manager: Make) -> None:
    """reserve() pins exactly the planned pool and pages; shutdown() gives every byte back."""
    gc.collect()
    gc.disable()
    try:
        before = registered_pinned_bytes()
        manager = make_manager(_config(), policy=POLICY, threaded=True)
        plan = manager.host_bytes(KEYS)
        manager.reserve(KEYS)
        pinned = registered_pinned_bytes() - before
        stats = manager.stats()
        assert pinned == sum(p.pool + p.pages for p in plan.values())
        assert stats.host_pinned_bytes == pinned and stats.host_unpinned_bytes == 0
        manager.shutdown()
    finally:
        gc.enable()
    gc.collect()
    assert registered_pinned_bytes() == before


@pytest.mark.gpu
def test_a_refused_pin_keeps_nothing_pinned(make_manager: Make) -> None:
    """A pin refused at reserve raises HostAllocationError and leaves no byte pinned."""
    gc.collect()
    before = registered_pinned_bytes()
    manager = make_manager(_config(), policy=POLICY, threaded=True)
    calls: list[Any] = []

    def refuse_second(detail: Any) -> None:
        calls.append(detail)
        if len(calls) == 2:
            raise RuntimeError("pin refused")

    manager._inject_fault("pin", refuse_second)
    with pytest.raises(HostAllocationError) as caught:
        manager.reserve(KEYS)
    assert caught.value.pinned
    gc.collect()
    assert registered_pinned_bytes() == before
    assert manager.stats().host_pinned_bytes == 0
    manager._inject_fault("pin", None)
    manager.reserve(KEYS)
    assert manager.stats().host_pinned_bytes > 0
