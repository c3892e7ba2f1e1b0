"""The ``omni_cache`` logger: one test per line kind, and silence on a normal step."""

from __future__ import annotations

import logging
import threading

import pytest

from omni_cache_cuda import (
    ModelCachePolicy,
    OmniPrefixCacheManager,
    PageTimeoutError,
    WaitTimeoutError,
    WriteFailedError,
)
from omni_cache_cuda._log import LOGGER_NAME
from tests.obs_helpers import MM, config, cpu_manager, finished, scripted_run, started, step


class _Records:
    """The ``omni_cache`` logger's records of the running test (caplog swaps its list per phase)."""

    def __init__(self, caplog: pytest.LogCaptureFixture) -> None:
        self._caplog = caplog

    def __iter__(self):
        return iter(self._caplog.records)

    def __len__(self) -> int:
        return len(self._caplog.records)

    def __getitem__(self, index):
        return self._caplog.records[index]

    def clear(self) -> None:
        self._caplog.clear()


@pytest.fixture
def records(caplog: pytest.LogCaptureFixture) -> _Records:
    """Every record of the ``omni_cache`` logger, DEBUG and up."""
    caplog.set_level(logging.DEBUG, logger=LOGGER_NAME)
    return _Records(caplog)


def _events(records: _Records, event: str) -> list[logging.LogRecord]:
    return [r for r in records if getattr(r, "omni_cache_event", None) == event]


def test_first_allocation_per_key_is_logged_once_with_its_bytes(records):
    """Each cached key's first save logs its pool and page bytes; later saves log nothing."""
    with cpu_manager() as mgr:
        scripted_run(mgr)
        cache_id = mgr._state.cache_id
    lines = _events(records, "key_allocated")
    assert [r.omni_cache_key for r in lines] == ["__hidden_states__", MM]
    hidden, mm = lines
    # 32 slots and 2 pages of 16 rows: 12-byte hidden rows, 4-byte mm rows.
    assert (hidden.omni_cache_pool_bytes, hidden.omni_cache_staging_bytes) == (384, 384)
    assert (mm.omni_cache_pool_bytes, mm.omni_cache_staging_bytes) == (128, 128)
    assert hidden.levelno == logging.INFO
    assert hidden.name == LOGGER_NAME
    assert hidden.omni_cache_id == cache_id
    message = hidden.getMessage()
    assert message.startswith(f"cache {cache_id}: allocated immediate key '__hidden_states__'")
    assert "host pool 384 bytes (32 slots)" in message
    assert "staging pages 384 bytes (2 pages of 16 rows)" in message


def test_a_normal_step_logs_nothing(records):
    """After the first step allocated its keys, steps, hits, finishes and discards are silent."""
    mgr = cpu_manager()
    s0 = step(mgr, [started("w", [7], 4)], [("w", [7], 0, 4)])
    mgr.materialize(s0, ["w"])
    allocated = len(records)
    assert allocated == 2  # the two keys
    scripted_run(mgr)
    for _ in range(3):
        s = step(mgr, [], [("w", [7], 4, 0)])
        mgr.discard_step(s)
    assert len(records) == allocated, [r.getMessage() for r in records[allocated:]]
    mgr.shutdown()
    assert [r.omni_cache_event for r in records[allocated:]] == ["shutdown"]


def test_a_page_timeout_is_logged_with_the_open_steps(records):
    """One page, never freed: the second save times out, and the line names step 1."""
    with cpu_manager(staging_depth=1, staging_claim_timeout_s=0.05) as mgr:
        s1 = step(mgr, [started("a", [0], 2)], [("a", [0], 0, 2)])
        with pytest.raises(PageTimeoutError):
            step(mgr, [], [("a", [0], 2, 1)])
        (line,) = _events(records, "wait_timeout")
        assert line.levelno == logging.WARNING
        assert line.omni_cache_wait == "page"
        assert line.omni_cache_step_ids == [s1]
        assert f"open step ids [{s1}] hold pages" in line.getMessage()
        assert "timed out after 0.05s" in line.getMessage()
        mgr.discard_step(s1)


def test_a_barrier_timeout_is_logged_with_the_write_it_waited_for(records):
    """A write held back by a slow pool write: the next save's barrier times out and says so."""
    release = threading.Event()
    mgr = OmniPrefixCacheManager(config(staging_claim_timeout_s=0.05), device="cpu", threaded=True)
    mgr._inject_write_fault(lambda job: release.wait(10))
    try:
        s1 = step(mgr, [started("a", [0], 2)], [("a", [0], 0, 2)])
        with pytest.raises(WaitTimeoutError) as exc:
            step(mgr, [], [("a", [0], 2, 1)])
        (line,) = _events(records, "wait_timeout")
        assert line.omni_cache_wait == "save barrier"
        assert line.omni_cache_tids == [exc.value.tid]
        assert f"waiting for write tid {exc.value.tid}" in line.getMessage()
        assert line.getMessage().split(": ", 1)[1].startswith("save_outputs timed out")
    finally:
        release.set()
        mgr.discard_step(s1)
        mgr.shutdown()


def test_budget_flushes_are_logged_at_most_once_per_interval(records):
    """Four flushes in a row: one line; with no interval, one line per flush with the count."""
    policy = ModelCachePolicy(deferred_keys=frozenset({MM}))
    for interval, lines in ((60.0, 1), (0.0, 3)):
        records.clear()
        with cpu_manager(policy, gpu_staging_bytes=40, staging_claim_timeout_s=1.0) as mgr:
            mgr._state.flush_log.interval_s = interval
            # Each request's 8 deferred rows (32 bytes) fill the budget; the next start
            # forces the previous one's write out.
            for i in range(4):
                blocks = [2 * i, 2 * i + 1]
                s = step(mgr, [started(f"r{i}", blocks, 8)], [(f"r{i}", blocks, 0, 8)])
                mgr.discard_step(s)
            assert mgr.stats().budget_flushes == 3
        flushes = _events(records, "budget_flush")
        assert len(flushes) == lines, interval
        first = flushes[0]
        assert first.levelno == logging.INFO
        assert first.omni_cache_budget_flushes == 1
        assert len(first.omni_cache_tids) == 1
        assert f"deferred writes {first.omni_cache_tids} forced out early" in first.getMessage()
        assert "of 40 GPU budget bytes in use" in first.getMessage()


def test_the_first_failed_write_is_logged_once_with_its_error(records):
    """Two deferred writes fail in one escalation: one ERROR line, with the traceback."""
    policy = ModelCachePolicy(needs_full_hidden_states=False, deferred_keys=frozenset({MM}))
    mgr = cpu_manager(policy)

    def fail(job):
        raise OSError("host memory went away")

    s1 = step(
        mgr, [started("a", [0], 2), started("b", [1], 2)], [("a", [0], 0, 2), ("b", [1], 0, 2)]
    )
    mgr.discard_step(s1)
    mgr._inject_write_fault(fail)
    with pytest.raises(WriteFailedError):
        mgr.new_step_starts(_step([finished("a"), finished("b")]))
    assert mgr.stats().writes_failed == 2
    (line,) = _events(records, "write_failed")
    assert line.levelno == logging.ERROR
    assert line.omni_cache_reason == "OSError: host memory went away"
    assert line.omni_cache_keys == [MM]
    assert line.exc_info is not None and line.exc_info[0] is OSError
    assert f"deferred write tid {line.omni_cache_tids[0]} of keys ['{MM}'] (2 rows)" in (
        line.getMessage()
    )
    mgr.shutdown()


def test_shutdown_is_logged_once_with_what_was_open(records):
    """The shutdown line names the step ids still open; a second shutdown logs nothing."""
    mgr = cpu_manager()
    s1 = step(mgr, [started("a", [0], 2)], [("a", [0], 0, 2)])
    mgr.shutdown()
    mgr.shutdown()
    (line,) = _events(records, "shutdown")
    assert line.levelno == logging.INFO
    assert line.omni_cache_step_ids == [s1]
    assert line.omni_cache_committer_stopped is True
    assert line.getMessage().endswith(
        f"shut down; step ids still open: [{s1}]; writes not landed (tids): none"
    )


def test_log_lines_of_two_managers_carry_their_own_ids(records):
    """Two caches in one process: each line says which one it is about."""
    first, second = cpu_manager(), cpu_manager()
    first.shutdown()
    second.shutdown()
    ids = [r.omni_cache_id for r in _events(records, "shutdown")]
    assert ids == [first._state.cache_id, second._state.cache_id] and ids[0] != ids[1]


def _step(events):
    from omni_cache_cuda import PrefixCacheStep

    return PrefixCacheStep(events=list(events), scheduled_tokens={})
