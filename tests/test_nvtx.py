"""NVTX ranges on the CPU: the flag is accepted and emits nothing; the wiring, with NVTX faked.

The CUDA check, with real NVTX calls, is `tests/gpu/test_gpu_nvtx.py`.
"""

from __future__ import annotations

import threading
from collections import Counter

import pytest
import torch

from omni_cache_cuda import _manager, _nvtx
from tests.obs_helpers import cpu_manager, scripted_run, started, step


class _Recorder:
    """Stands in for ``torch.cuda.nvtx.range_push/range_pop``; checks nesting per thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pushed: list[tuple[str, str]] = []
        self.stacks: dict[int, list[str]] = {}
        self.unbalanced: list[str] = []

    def push(self, name: str) -> int:
        with self.lock:
            stack = self.stacks.setdefault(threading.get_ident(), [])
            stack.append(name)
            self.pushed.append((threading.current_thread().name, name))
            return len(stack) - 1

    def pop(self) -> int:
        with self.lock:
            stack = self.stacks.get(threading.get_ident(), [])
            if not stack:
                self.unbalanced.append(threading.current_thread().name)
                return -1
            stack.pop()
            return len(stack)

    def names(self) -> Counter[str]:
        return Counter(name for _, name in self.pushed)


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> _Recorder:
    """Record NVTX calls instead of making them (the CPU build of torch has no NVTX)."""
    rec = _Recorder()
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", rec.push)
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", rec.pop)
    return rec


@pytest.mark.parametrize(
    ("value", "on"),
    [("1", True), ("true", True), ("ON", True), ("yes", True), ("", False), ("0", False)],
)
def test_the_flag_is_read_from_the_environment(monkeypatch, value, on):
    """OMNI_CACHE_NVTX switches the ranges; anything but a yes leaves them off."""
    monkeypatch.setenv(_nvtx.ENV_VAR, value)
    assert _nvtx.flag_set() is on
    expected = _nvtx.nvtx_ranges if on else _nvtx.no_ranges
    assert _nvtx.ranges_for(torch.device("cuda")) is expected


def test_on_the_cpu_the_flag_is_accepted_and_emits_nothing(monkeypatch, recorder):
    """A CPU manager with the flag set runs as without it: no NVTX call at all."""
    monkeypatch.setenv(_nvtx.ENV_VAR, "1")
    assert _nvtx.ranges_for(torch.device("cpu")) is _nvtx.no_ranges
    with cpu_manager() as mgr:
        assert mgr._state.ranges is _nvtx.no_ranges
        outs = scripted_run(mgr)
    assert outs[1].hidden_states["b"][:, 0].tolist() == [0, 1, 2, 3, 20, 21]
    assert recorder.pushed == []


def test_the_off_range_is_one_shared_no_op():
    """Ranges off cost a call returning one preallocated context: nothing is built per range."""
    assert _nvtx.no_ranges("a") is _nvtx.no_ranges("b")
    with _nvtx.no_ranges("x"):
        pass


@pytest.mark.parametrize("threaded", [False, True])
def test_ranges_are_entered_around_copies_gathers_and_writes(monkeypatch, recorder, threaded):
    """With ranges forced on (as on CUDA), a scripted run marks each phase, balanced per thread."""
    monkeypatch.setattr(_manager, "ranges_for", lambda device: _nvtx.nvtx_ranges)
    from omni_cache_cuda import OmniPrefixCacheManager
    from tests.obs_helpers import config

    with OmniPrefixCacheManager(config(), device="cpu", threaded=threaded) as mgr:
        scripted_run(mgr)
    names = recorder.names()
    assert names["omni_cache.step_copy"] == 3  # one per save
    assert names["omni_cache.pool_write"] == 3  # one per step write
    # b's 4-row hit, gathered for the two cached keys; inline writes have landed by b's start,
    # so its rows are prefetched (HIT-7); a committer thread may still be writing them.
    assert names["omni_cache.hit_gather"] == 2
    assert names["omni_cache.hit_prefetch"] <= 2
    if not threaded:
        assert names["omni_cache.hit_prefetch"] == 2
    assert not recorder.unbalanced
    assert all(not stack for stack in recorder.stacks.values())
    threads = {thread for thread, name in recorder.pushed if name == "omni_cache.pool_write"}
    assert threads == ({"omni-prefix-cache-committer"} if threaded else {"MainThread"})


def test_a_page_wait_is_marked(monkeypatch, recorder):
    """A save that waits for a staging page marks the wait."""
    monkeypatch.setattr(_manager, "ranges_for", lambda device: _nvtx.nvtx_ranges)
    with cpu_manager(staging_depth=1, staging_claim_timeout_s=5.0) as mgr:
        s1 = step(mgr, [started("a", [0], 2)], [("a", [0], 0, 2)])
        timer = threading.Timer(0.05, mgr.discard_step, (s1,))
        timer.start()
        s2 = step(mgr, [], [("a", [0], 2, 1)])
        timer.join()
        mgr.discard_step(s2)
        assert mgr.stats().page_waits == 1
    assert recorder.names()["omni_cache.wait.page"] >= 1
    assert not recorder.unbalanced
