"""Test support: a simulated adapter over integers, a naive reference model, a stateful machine.

This package ships with the library so that the same stateful machine can drive the pure core
(through `IntPoolDriver`), and later the CPU and CUDA adapters (through a tensor driver), the way
``zarr.testing.stateful`` does. It needs hypothesis (the ``test`` extra); ``import
omni_cache_core`` never imports it. Every name is imported from here
(``from omni_cache_core.testing import CacheMachine``); the modules below hold them by role.

Pieces
------
- `IntPoolDriver` plays the adapter: it executes the core's effects against integer data. Every
  saved row carries a unique value (its *write identity*, see `row_value`), the pool is one dict
  ``slot -> value`` per key, pages hold a step's immediate rows, deferred writes keep their
  chunks, tombstones are honoured by pool writes, `Preserve` copies pool rows into reads. Its
  committer does nothing on its own: the test decides when each write task moves one stage
  (`land`) or fails (`fail`), so any interleaving across tasks can be explored; within one task
  the stages run in pipeline order (TASK-2). Reports reach the core at the next public call, as
  they do from a committer thread (D8).
- `ReferenceModel` is written differently from the core on purpose: it keeps an append-only
  history of the saves that succeeded and answers every query by replaying that history (the
  newest value of a (slot, key) as of a step's save, explicit absence, HIT-4, HIT-5), plus which
  step ids are open and which error a call must raise. Per admission of a request it keeps its
  next position, its delivery cursor and the positions handed out (LIFE, DLV): which positions a
  materialize hands out, which rows are cut below the cursor, and when one is refused (DLV-5).
- `CacheMachine` is a hypothesis `RuleBasedStateMachine` that drives a driver and the model side
  by side and compares every materialize row by row and position by position.

Modules
-------
- `_interface`: the driver interface, `CacheDriver` (its docstring lists every call the machine
  makes), and the terms of those calls: `SaveSpec`, `Delivered`, `Rows`, `row_value`, `MM_KEY`,
  `DEFERRED_KEY`.
- `_driver`: `IntPoolDriver`, the simulated adapter, and `DriverError`.
- `_model`: `ReferenceModel`, `ModelMismatch`, `Outcome` and `Refusal`.
- `_draws`: the machine's engine side, its base class: the request ids (`REQS`, `OUTSIDER`), the
  engine's view of its requests' blocks and KV, and the draws of save layouts, resumes and bad
  inputs.
- `_machine`: `CacheMachine`, its rules and checks, and `reach_every_case`.
"""

try:
    import hypothesis.stateful  # noqa: F401 (the machine's modules need it)
except ImportError as exc:  # pragma: no cover - only without the test extra
    raise ImportError(
        "omni_cache_core.testing needs hypothesis: pip install 'omni-cache[test]'"
    ) from exc

from omni_cache_core.testing._draws import OUTSIDER as OUTSIDER
from omni_cache_core.testing._draws import REQS as REQS
from omni_cache_core.testing._driver import DriverError, IntPoolDriver
from omni_cache_core.testing._interface import (
    DEFERRED_KEY,
    MM_KEY,
    CacheDriver,
    Delivered,
    Rows,
    SaveSpec,
    row_value,
)
from omni_cache_core.testing._machine import CacheMachine, reach_every_case
from omni_cache_core.testing._model import ModelMismatch, ReferenceModel
from omni_cache_core.testing._model import Outcome as Outcome
from omni_cache_core.testing._model import Refusal as Refusal

__all__ = [
    "DEFERRED_KEY",
    "MM_KEY",
    "CacheDriver",
    "CacheMachine",
    "Delivered",
    "DriverError",
    "IntPoolDriver",
    "ModelMismatch",
    "ReferenceModel",
    "Rows",
    "SaveSpec",
    "reach_every_case",
    "row_value",
]
