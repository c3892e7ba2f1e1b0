"""Helpers for the fault, leak and bad-input tests: bounded calls, a one-shot fault, checks.

`bounded` runs a call on a helper thread and fails the test when it has not returned within a
generous bound (a hang), so a fault turned into a hang fails instead of stalling the suite; it
asserts no speed. `usable` proves a cache still serves correct rows after something went wrong:
it runs a fresh request with a prefix hit on blocks it writes itself, materializes and checks
every row, then checks the core's invariants.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

import pytest
import torch

from omni_cache_cuda import (
    OmniPrefixCacheManager,
    PrefixCacheStep,
    PrefixCacheWriteLayout,
    WriteFailedError,
)
from omni_cache_cuda._faults import InjectedFault, OneShot
from omni_cache_cuda._probes import library_threads
from tests.adapter_helpers import Engine, policy, settle

__all__ = [
    "HANG_S",
    "InjectedFault",
    "OneShot",
    "assert_sticky",
    "bounded",
    "library_threads",
    "usable",
]

T = TypeVar("T")

#: A call that has not returned after this long is a hang (no test waits anywhere near it).
HANG_S = 60.0


def bounded(call: Callable[[], T], what: str = "call") -> T:
    """Run ``call`` on a helper thread; fail when it does not return within `HANG_S`."""
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = call()
        except BaseException as exc:
            result["error"] = exc

    thread = threading.Thread(target=run, name="bounded-call", daemon=True)
    thread.start()
    thread.join(HANG_S)
    assert not thread.is_alive(), f"{what} hung (no return after {HANG_S}s)"
    if "error" in result:
        raise result["error"]
    return result["value"]  # type: ignore[no-any-return]


def assert_sticky(manager: OmniPrefixCacheManager, tids: tuple[int, ...]) -> None:
    """FAIL-1: every later call raises the same WriteFailedError; stats still work."""
    layout = PrefixCacheWriteLayout([], torch.zeros(0, dtype=torch.int64))
    calls: list[Callable[[], Any]] = [
        lambda: manager.new_step_starts(PrefixCacheStep()),
        lambda: manager.save_outputs(None, {}, num_tokens_unpadded=0, write_layout=layout),
        lambda: manager.materialize(1, []),
        lambda: manager.discard_step(1),
        lambda: manager.register_policy(policy()),
        lambda: manager.reserve({"codes.more": (2, torch.float32)}),
    ]
    for call in calls:
        with pytest.raises(WriteFailedError) as caught:
            bounded(call)
        assert caught.value.tids == tids
    stats = manager.stats()
    assert stats.writes_failed == 1
    # FAIL-1: the failed write gave back its page and its budget; open steps keep theirs.
    with manager._state.lock:
        assert stats.pages_in_use == len(manager._state.core.open_step_ids)
        assert manager._state.core.task_states().keys().isdisjoint(tids)
        manager._state.core.check_invariants()


def usable(manager: OmniPrefixCacheManager, blocks: tuple[int, int, int] = (13, 14, 15)) -> None:
    """The cache serves exact rows: a request writes two blocks, a second one hits them.

    Uses its own request ids and the given blocks (untouched by the caller's test), checks
    every returned row against what was written, then the core's invariants.
    """
    engine = Engine(manager)
    a, b, c = blocks
    engine.start("usable-a", [a, b])
    engine.materialize(bounded(lambda: engine.step({"usable-a": 8}), "save"))
    engine.finish("usable-a")
    engine.start("usable-b", [a, b, c], hit_end=8)
    saved = bounded(lambda: engine.step({"usable-b": 2}), "save")
    out = bounded(lambda: engine.materialize(saved), "materialize")
    assert out.positions["usable-b"] == (0, 10)
    engine.finish("usable-b")
    last = bounded(lambda: engine.step({}), "save")
    manager.discard_step(last.step_id)
    settle(manager)
    with manager._state.lock:
        manager._state.core.check_invariants()
