"""The core's stateful machine drives the real adapter on the CPU, inline and threaded.

What differs from the pure-core machine (tests/test_core_stateful.py):

- The system under test is `OmniPrefixCacheManager` through `omni_cache_cuda.testing.TensorDriver`:
  every row is a tensor whose elements all carry the machine's write identity (a different width
  and dtype per key), decoded from what `materialize` returns, so a stale, torn or padding row
  fails the row-by-row comparison with the reference model. Steps are sometimes padded (OUT-2)
  and the engine's buffers are overwritten after each save (STEP-3).
- One more invariant: every COMMITTED pool row is the newest row the model saved for its
  (slot, key), so a wrong pool write shows up when it happens, not only when a hit reads it.
- Time is real. The manager's wait bound is a small `WAIT_S`; only waits that nothing will end
  (a page claim with every page held, a stalled save) run the clock down to their timeout.
  Waits for a write or a concurrent consume end on that event, however busy the machine is. The
  machine's "time passes" rule changes nothing.
- Inline: writes land inside the call that makes them, so nothing is ever in flight and no write
  failure is injected. Threaded: the committer parks before each pool write (the write-fault
  hook) and runs only when the machine lands a write or the adapter waits for one; failures are
  injected there (FAIL-1). A save that waits for a page runs on its own thread while the caller
  consumes a step (CONC-3).
- Fewer examples than the core machine (`EXAMPLES` x `STEPS`): each step runs real tensor work
  and threads, and the `ci` profile must keep this file near a minute on a busy 2-core machine.
  Failures and shutdown may come earlier in a run (`fail_after`, `shutdown_after`) so that the
  shorter runs still reach them. The `nightly` profile runs ten times more examples.
"""

from __future__ import annotations

import os
from typing import Any, ClassVar

import pytest
import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import invariant, run_state_machine_as_test

from omni_cache_core import HIDDEN_KEY, ReqId, StepId
from omni_cache_core.testing import (
    DEFERRED_KEY,
    MM_KEY,
    CacheMachine,
    DriverError,
    ModelMismatch,
    SaveSpec,
)
from omni_cache_cuda import (
    BadInputError,
    ModelCachePolicy,
    OmniPrefixCacheManager,
    PrefixCacheConfig,
    PrefixCacheEventKind,
    PrefixCacheRequestEvent,
    PrefixCacheStep,
    PrefixCacheWrite,
    PrefixCacheWriteLayout,
    ShutDownError,
    WriteFailedError,
)
from omni_cache_cuda.testing import TensorDriver, _decode

#: The manager's `staging_claim_timeout_s`: every expected timeout costs this much wall time.
WAIT_S = 0.02
NIGHTLY = os.environ.get("HYPOTHESIS_PROFILE", "ci") == "nightly"
EXAMPLES = 1000 if NIGHTLY else 100
STEPS = 40


class _AdapterMachine(CacheMachine):
    """The core's machine with `TensorDriver` as the system under test."""

    threaded: ClassVar[bool] = False
    shutdown_after = 34
    fail_after = 12

    @classmethod
    def _driver(
        cls, config: PrefixCacheConfig, policy: ModelCachePolicy, prefetch: bool
    ) -> TensorDriver:
        return TensorDriver(
            config, policy, prefetch=prefetch, threaded=cls.threaded, device="cpu", wait_s=WAIT_S
        )

    @invariant()
    def pool_holds_the_newest_rows(self) -> None:
        """Every committed pool row is the newest saved row of its (slot, key) (SLOT-2, SLOT-3)."""
        if not isinstance(self.driver, TensorDriver):
            return
        last = StepId(len(self.model.history))
        for key, rows in self.driver.committed_rows().items():
            for slot, value in rows.items():
                want = self.model.newest(key, slot, last)
                if value != want:
                    raise ModelMismatch(
                        f"pool row of slot {slot} ({key}) is {value}; newest saved: {want}"
                    )

    def teardown(self) -> None:
        """Stop the manager's threads, whatever state the run left it in."""
        if isinstance(self.driver, TensorDriver):
            self.driver.close()


class InlineAdapterMachine(_AdapterMachine):
    """Writes run in the caller's thread (threaded=False)."""

    threaded = False
    driver_factory = staticmethod(
        lambda config, policy, prefetch: InlineAdapterMachine._driver(config, policy, prefetch)
    )


class ThreadedAdapterMachine(_AdapterMachine):
    """Writes run on the committer thread, parked and landed by the machine."""

    threaded = True
    driver_factory = staticmethod(
        lambda config, policy, prefetch: ThreadedAdapterMachine._driver(config, policy, prefetch)
    )


_SETTINGS = settings(max_examples=EXAMPLES, stateful_step_count=STEPS)

TestInlineAdapterMachine = InlineAdapterMachine.TestCase
TestInlineAdapterMachine.settings = _SETTINGS
TestThreadedAdapterMachine = ThreadedAdapterMachine.TestCase
TestThreadedAdapterMachine.settings = _SETTINGS


# ---------------------------------------------------------------------------------------------
# The checks can fail.


def test_decode_refuses_a_torn_row() -> None:
    """A row whose elements come from two writes raises instead of decoding."""
    rows = torch.full((2, 4), 1001.0, dtype=torch.float64)
    assert _decode(HIDDEN_KEY, rows) == (1001, 1001)
    rows[1, 3] = 2001.0
    with pytest.raises(DriverError, match="mix several writes"):
        _decode(HIDDEN_KEY, rows)


def test_decode_refuses_a_wrong_row_shape() -> None:
    """Rows of another width or dtype than the key's raise instead of decoding."""
    with pytest.raises(DriverError, match="dtype"):
        _decode(MM_KEY, torch.zeros((1, 3), dtype=torch.int64))
    with pytest.raises(DriverError, match="shape"):
        _decode(DEFERRED_KEY, torch.zeros((1, 4), dtype=torch.int64))


def test_padding_rows_never_come_back() -> None:
    """A padded step's rows past its tokens are not cached: only identities come back (OUT-2)."""
    config = PrefixCacheConfig(num_blocks=4, block_size=2, staging_claim_timeout_s=1.0)
    policy = ModelCachePolicy(deferred_keys={DEFERRED_KEY})
    driver = TensorDriver(config, policy)
    try:
        req = ReqId("r0")
        driver.start(
            [PrefixCacheRequestEvent(req_id=req, kind=PrefixCacheEventKind.STARTED, block_ids=(0,))]
        )
        values = ((HIDDEN_KEY, (11, 21)), (MM_KEY, (12, 22)), (DEFERRED_KEY, (13, 23)))
        # The first save of a driver is padded by one row, mm keys included.
        step = driver.save(SaveSpec(req_ids=(req,), slots=((0, 1),), values=values))
        rows = driver.materialize(step, (req,))
        assert rows == {key: {req: vals} for key, vals in values}
    finally:
        driver.close()


def test_machine_catches_a_write_that_reads_the_live_slot_ids(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An adapter whose step write reads the engine's live slot-id buffer fails the machine."""
    stage = OmniPrefixCacheManager._stage

    def live_slots(
        self: OmniPrefixCacheManager,
        parts: Any,
        n: int,
        page: int,
        layout: PrefixCacheWriteLayout,
        slot_ids: torch.Tensor,
    ) -> Any:
        # STEP-3 broken on purpose: the write keeps the buffer the engine refills every step.
        return stage(self, parts, n, page, layout, layout.slots_cpu)

    monkeypatch.setattr(OmniPrefixCacheManager, "_stage", live_slots)
    with pytest.raises(AssertionError, match="pool row of slot"):
        run_state_machine_as_test(
            ThreadedAdapterMachine,
            settings=settings(
                max_examples=50,
                stateful_step_count=STEPS,
                phases=[Phase.generate],
                derandomize=True,
                deadline=None,
                database=None,
                report_multiple_bugs=False,
                suppress_health_check=list(HealthCheck),
            ),
        )


# ---------------------------------------------------------------------------------------------
# Regressions the machine found, as plain examples.


def _bad_save(manager: OmniPrefixCacheManager) -> None:
    """A one-row save whose hidden states are missing (OUT-3)."""
    layout = PrefixCacheWriteLayout(
        [PrefixCacheWrite("r0", 0, 1)], torch.zeros(1, dtype=torch.int64)
    )
    manager.save_outputs(None, {}, num_tokens_unpadded=1, write_layout=layout)


@pytest.mark.parametrize("threaded", [False, True])
def test_bad_save_after_shutdown_says_shut_down(threaded: bool) -> None:
    """A save with bad input on a shut-down cache raises ShutDownError, not BadInputError (FAIL-4)."""
    config = PrefixCacheConfig(num_blocks=4, block_size=2, staging_claim_timeout_s=1.0)
    manager = OmniPrefixCacheManager(config, device="cpu", threaded=threaded)
    with pytest.raises(BadInputError):
        _bad_save(manager)  # the same call on an open cache: the input is at fault
    manager.shutdown()
    with pytest.raises(ShutDownError):
        _bad_save(manager)


@pytest.mark.parametrize("threaded", [False, True])
def test_failed_then_shut_down_cache_says_shut_down(threaded: bool) -> None:
    """A cache shut down after a write failed raises ShutDownError from every call (FAIL-4 over FAIL-1)."""
    config = PrefixCacheConfig(num_blocks=4, block_size=2, staging_claim_timeout_s=1.0)
    manager = OmniPrefixCacheManager(config, device="cpu", threaded=threaded)
    manager._inject_write_fault(lambda job: _fail_write())
    manager.new_step_starts(
        PrefixCacheStep(
            events=[PrefixCacheRequestEvent(req_id="r0", kind=PrefixCacheEventKind.STARTED)]
        )
    )
    layout = PrefixCacheWriteLayout(
        [PrefixCacheWrite("r0", 0, 1)], torch.zeros(1, dtype=torch.int64)
    )
    hidden = torch.ones((1, 4))
    try:
        step = manager.save_outputs(hidden, {}, num_tokens_unpadded=1, write_layout=layout)
        manager.discard_step(step)
        manager.save_outputs(hidden, {}, num_tokens_unpadded=1, write_layout=layout)
    except WriteFailedError:
        pass  # inline: the save that ran the write; threaded: the next save's barrier
    with pytest.raises(WriteFailedError):
        _bad_save(manager)  # FAIL-1: sticky, bad input or not
    manager.shutdown()
    with pytest.raises(ShutDownError):
        _bad_save(manager)
    with pytest.raises(ShutDownError):
        manager.save_outputs(hidden, {}, num_tokens_unpadded=1, write_layout=layout)
    with pytest.raises(ShutDownError):
        manager.new_step_starts(PrefixCacheStep(events=[]))


def _fail_write() -> None:
    raise RuntimeError("pool write failed")
