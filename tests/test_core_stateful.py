"""The stateful machine drives the pure core through the integer driver against the model.

`TestCacheMachine` runs the machine with the profile from HYPOTHESIS_PROFILE (tests/conftest.py);
every example runs 60 rules. The controls break one rule of the core on purpose and check that
the machine notices, so a passing run means something.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from omni_cache_core import InvariantError, TensorName
from omni_cache_core._core import CacheCore
from omni_cache_core._occupancy import ABSENT, COMMITTED, OccupancyTable
from omni_cache_core._values import Preserve, SlotArray, Tombstone
from omni_cache_core.testing import CacheMachine, DriverError, ModelMismatch

TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(stateful_step_count=60)


def _skip_copy_on_write(self: CacheCore, slots: SlotArray) -> list[Preserve]:
    """A core that forgets HIT-6: no older read is protected before its slots change."""
    return []


def _commit_ignoring_owners(
    self: OccupancyTable, tid: int, slots: SlotArray, *, intact: bool = False
) -> None:
    """A core that forgets SLOT-3: a landing write commits slots a newer write took."""
    self.owner[slots] = COMMITTED


_REAL_TAKE = CacheCore._take


def _no_explicit_absence(
    self: CacheCore, key: TensorName, slots: SlotArray, owner: int | npt.NDArray[np.int32]
) -> list[Tombstone]:
    """A core that forgets SLOT-4: a key a step did not emit keeps its older rows."""
    if isinstance(owner, int) and owner == ABSENT:
        return []
    return _REAL_TAKE(self, key, slots, owner)


_BROKEN: dict[str, tuple[type, str, Callable[..., object]]] = {
    "copy-on-write skipped (HIT-6)": (CacheCore, "_copy_on_write", _skip_copy_on_write),
    "commit ignores owners (SLOT-3)": (OccupancyTable, "commit", _commit_ignoring_owners),
    "no explicit absence (SLOT-4)": (CacheCore, "_take", _no_explicit_absence),
}


@pytest.mark.parametrize("broken", sorted(_BROKEN))
def test_machine_finds_a_broken_rule(broken: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With one rule of the core broken on purpose, the machine finds a disagreement."""
    owner, name, replacement = _BROKEN[broken]
    monkeypatch.setattr(owner, name, replacement)
    quick = settings(
        # The search stops at the first failure, usually within a few hundred examples; the
        # bound leaves room for the long tail (a derandomized run is fixed per environment).
        max_examples=3000,
        stateful_step_count=60,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.generate],  # the first failure is enough; shrinking it costs minutes
        suppress_health_check=list(HealthCheck),
    )
    # Any of the machine's own checks may be the one that notices.
    with pytest.raises((ModelMismatch, DriverError, InvariantError)):
        run_state_machine_as_test(CacheMachine, settings=quick)


def test_controls_leave_the_core_intact() -> None:
    """The controls patch the core only inside their own test."""
    assert CacheCore._copy_on_write is not _skip_copy_on_write
    assert CacheCore._take is _REAL_TAKE
    table = OccupancyTable(4)
    table.owner[:] = 7
    table.commit(3, np.arange(4, dtype=np.int64))
    assert table.owner.tolist() == [7, 7, 7, 7]
