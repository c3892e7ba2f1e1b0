"""Test support: a simulated adapter over integers, a naive reference model, a stateful machine.

The pieces live in `omni_cache_core.testing._machine` for now; every name is imported from here.
"""

from omni_cache_core.testing._machine import (
    DEFERRED_KEY,
    MM_KEY,
    CacheDriver,
    CacheMachine,
    Delivered,
    DriverError,
    IntPoolDriver,
    ModelMismatch,
    ReferenceModel,
    Rows,
    SaveSpec,
    reach_every_case,
    row_value,
)
from omni_cache_core.testing._machine import OUTSIDER as OUTSIDER
from omni_cache_core.testing._machine import REQS as REQS
from omni_cache_core.testing._machine import Outcome as Outcome
from omni_cache_core.testing._machine import Refusal as Refusal

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
