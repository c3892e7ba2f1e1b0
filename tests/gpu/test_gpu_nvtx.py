"""NVTX ranges on CUDA: a step under ``OMNI_CACHE_NVTX=1`` emits the named ranges, and only then.

The real ``torch.cuda.nvtx`` calls are made (an Nsight Systems capture of the same run shows the
ranges); a wrapper around them records the names and checks that every thread's pushes and pops
balance.
"""

from __future__ import annotations

import threading
from collections import Counter

import pytest
import torch

from omni_cache_cuda import ModelCachePolicy, _nvtx
from tests.obs_helpers import MM, config, scripted_run

pytestmark = pytest.mark.gpu


class _Recording:
    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.lock = threading.Lock()
        self.names: Counter[str] = Counter()
        self.depth: dict[int, int] = {}
        self.errors: list[str] = []
        real_push, real_pop = torch.cuda.nvtx.range_push, torch.cuda.nvtx.range_pop

        def push(name: str) -> int:
            with self.lock:
                self.names[name] += 1
                ident = threading.get_ident()
                self.depth[ident] = self.depth.get(ident, 0) + 1
            return real_push(name)

        def pop() -> int:
            with self.lock:
                ident = threading.get_ident()
                if self.depth.get(ident, 0) == 0:
                    self.errors.append(f"pop without push on {threading.current_thread().name}")
                self.depth[ident] = self.depth.get(ident, 0) - 1
            return real_pop()

        monkeypatch.setattr(torch.cuda.nvtx, "range_push", push)
        monkeypatch.setattr(torch.cuda.nvtx, "range_pop", pop)


@pytest.mark.parametrize("threaded", [True, False])
def test_a_profiled_step_contains_the_ranges(monkeypatch, make_manager, cuda, threaded):
    """Copies, the pool write, the hit gather and the copy waits are marked, balanced per thread."""
    monkeypatch.setenv(_nvtx.ENV_VAR, "1")
    rec = _Recording(monkeypatch)
    mgr = make_manager(config(), threaded=threaded)
    outs = scripted_run(mgr, cuda)
    mgr.shutdown()
    assert outs[1].hidden_states["b"][:, 0].tolist() == [0, 1, 2, 3, 20, 21]
    assert rec.names["omni_cache.step_copy"] == 3
    assert rec.names["omni_cache.pool_write"] == 3
    assert rec.names["omni_cache.hit_gather"] == 2
    # Each materialize waits for its step's device-to-host copy; each write waits for it too.
    assert rec.names["omni_cache.wait.step_copy"] >= 2
    assert not rec.errors
    assert all(depth == 0 for depth in rec.depth.values())


def test_a_deferred_write_marks_its_copy(monkeypatch, make_manager, cuda):
    """A deferred key's device-to-host copy on the committer is marked too."""
    monkeypatch.setenv(_nvtx.ENV_VAR, "1")
    rec = _Recording(monkeypatch)
    mgr = make_manager(config(), policy=ModelCachePolicy(deferred_keys=frozenset({MM})))
    scripted_run(mgr, cuda)
    mgr.shutdown()
    assert rec.names["omni_cache.deferred_copy"] >= 1
    assert rec.names["omni_cache.pool_write"] >= 4  # three step writes and a's deferred write
    assert not rec.errors


def test_without_the_flag_no_range_is_emitted(monkeypatch, make_manager, cuda):
    """The default: a CUDA manager makes no NVTX call."""
    monkeypatch.delenv(_nvtx.ENV_VAR, raising=False)
    rec = _Recording(monkeypatch)
    mgr = make_manager(config())
    scripted_run(mgr, cuda)
    mgr.shutdown()
    assert sum(rec.names.values()) == 0
