"""The stateful machine drives the pure core through the integer driver against the model.

`test_life_dlv_the_machine_agrees_with_the_model` runs the machine with the profile from
HYPOTHESIS_PROFILE (tests/conftest.py); every example runs 60 rules, and within a few seeded
runs (`reach_every_case`) the machine must reach every lifecycle and delivery case in `CASES`. The controls break one rule of the core on purpose
and check that the machine notices, so a passing run means something.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import ClassVar

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from omni_cache_core import InvariantError, TensorName, _commit
from omni_cache_core._delivery import Admissions
from omni_cache_core._occupancy import ABSENT, COMMITTED, OccupancyTable, SlotTables
from omni_cache_core._reads import HitReads
from omni_cache_core._steps import Steps
from omni_cache_core._tasks import WriteTasks
from omni_cache_core._values import Effect, Preserve, SlotArray
from omni_cache_core.testing import CacheMachine, DriverError, ModelMismatch, reach_every_case

#: What the machine's runs must reach, as `CacheMachine` counts it (LIFE-1..4, DLV-2..5).
CASES = (
    "preempted",
    "ended while preempted",
    "id reused",
    "resume without a hit",
    "resume hit below the cursor",
    "resume hit at the cursor",
    "resume hit above the cursor",
    "resume hit beyond what was computed",
    "resume hit over blocks that stayed cached",
    "resume hit delivered",
    "rows cut below the cursor",
    "gap passed over",
    # A discard, then a preemption and a resume whose hit covers the discarded rows before a
    # later step passes over them (DLV-4).
    "discarded positions served by a resume hit",
    "delivery order refused",
    "late materialize of a preempted request",
    "late materialize of an ended admission",
    "refused: resume a running request",
    "refused: preempt twice",
    "refused: preempt after the end",
    "refused: start a preempted request",
    "refused: start and resume in one step",
)


class _CountedMachine(CacheMachine):
    """The machine with counts of its own."""

    coverage: ClassVar[Counter[str]] = Counter()


def test_life_dlv_the_machine_agrees_with_the_model() -> None:
    """The machine agrees with the model on every rule it checks, and reaches every case.

    Besides steps, pages, slots, writes and hits, that is the request lifecycle (LIFE-1..4:
    preempt, resume with hits around the delivery cursor, end while preempted, id reuse, every
    illegal record refused with nothing changed) and delivery (DLV-1..7: positions, each once per
    admission, rows cut below the cursor, discards passed over or served by a resume hit, order
    refusals that change nothing, every row the newest write of its position).
    """
    seen = reach_every_case(_CountedMachine, CASES, settings(stateful_step_count=60))
    print(f"\nreached: {dict(sorted(seen.items()))}")


def _skip_copy_on_write(self: HitReads, slots: SlotArray, tables: SlotTables) -> list[Preserve]:
    """A core that forgets HIT-6: no older read is protected before its slots change."""
    return []


def _commit_ignoring_owners(
    self: OccupancyTable, tid: int, slots: SlotArray, *, intact: bool = False
) -> None:
    """A core that forgets SLOT-3: a landing write commits slots a newer write took."""
    self.owner[slots] = COMMITTED


_REAL_CLAIM = _commit._claim


def _no_explicit_absence(
    keys: tuple[TensorName, ...] | list[TensorName],
    slots: SlotArray,
    owner: int | npt.NDArray[np.int32],
    busy: set[TensorName],
    writes: WriteTasks,
    tables: SlotTables,
    effects: list[Effect],
) -> None:
    """A core that forgets SLOT-4: a key a step did not emit keeps its older rows."""
    if isinstance(owner, int) and owner == ABSENT:
        return
    _REAL_CLAIM(keys, slots, owner, busy, writes, tables, effects)


Int64Array = npt.NDArray[np.int64]


def _deliver_again(
    self: Admissions, entries: Int64Array, cursor: Int64Array, lo: Int64Array, hi: Int64Array
) -> tuple[Int64Array, Int64Array, None]:
    """A core that forgets DLV-2: a step hands out all it carries, below the cursor too."""
    self.cursor[entries] = np.maximum(cursor, hi)
    return lo, hi, None


def _no_delivery_order(self: Steps, *args: object) -> None:
    """A core that forgets DLV-5: a later step of a request may be read before an earlier one."""


class _SlotMachine(CacheMachine):
    """The machine without preemption and with late reads: every rule on slots and writes."""

    slots_only = True


#: Per control: what it breaks, and the machine that must notice.
_BROKEN: dict[str, tuple[object, str, Callable[..., object], type[CacheMachine]]] = {
    "copy-on-write skipped (HIT-6)": (
        HitReads,
        "copy_on_write",
        _skip_copy_on_write,
        _SlotMachine,
    ),
    "commit ignores owners (SLOT-3)": (
        OccupancyTable,
        "commit",
        _commit_ignoring_owners,
        _SlotMachine,
    ),
    "no explicit absence (SLOT-4)": (_commit, "_claim", _no_explicit_absence, _SlotMachine),
    "positions handed out again (DLV-2)": (Admissions, "deliver", _deliver_again, CacheMachine),
    "no delivery order (DLV-5)": (
        Steps,
        "check_delivery_order",
        _no_delivery_order,
        CacheMachine,
    ),
}


@pytest.mark.parametrize("broken", sorted(_BROKEN))
def test_machine_finds_a_broken_rule(broken: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With one rule of the core broken on purpose, the machine finds a disagreement.

    One control per parameter: HIT-6, SLOT-3 and SLOT-4 on runs without preemption and with
    late reads; DLV-2 (a consume that hands out positions below the cursor again) and DLV-5 (no
    order check) on the machine with preemption.
    """
    owner, name, replacement, machine = _BROKEN[broken]
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
        run_state_machine_as_test(machine, settings=quick)


def test_controls_leave_the_core_intact() -> None:
    """The controls patch the core only inside their own test."""
    assert HitReads.copy_on_write is not _skip_copy_on_write
    assert _commit._claim is _REAL_CLAIM
    assert Admissions.deliver is not _deliver_again
    assert Steps.check_delivery_order is not _no_delivery_order
    table = OccupancyTable(4)
    table.owner[:] = 7
    table.commit(3, np.arange(4, dtype=np.int64))
    assert table.owner.tolist() == [7, 7, 7, 7]
