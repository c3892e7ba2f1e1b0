"""Pure, sans-IO core of the prefix cache for per-token stage outputs.

The core holds every rule that is about state (steps, staging pages, KV-slot occupancy, write
tasks, requests, the GPU-byte budget, hit planning, deadlines) as a deterministic state machine.
It imports no torch, no threads and no clock; the `omni_cache_cuda` adapter executes its effects.
This package re-exports the contract types and the error classes.
"""

from omni_cache_core._contract import (
    HIDDEN_KEY,
    ModelCachePolicy,
    PrefixCacheConfig,
    PrefixCacheEventKind,
    PrefixCacheRequestEvent,
    PrefixCacheStep,
    ReqId,
    StepId,
    TensorName,
    Tid,
    WriteSchedule,
    is_hidden_key,
    without_hidden,
)
from omni_cache_core._errors import (
    BadInputError,
    ConfigError,
    HitUnreadableError,
    IllegalTransitionError,
    InvariantError,
    OmniPrefixCacheStagingTimeoutError,
    OmniPrefixCacheUnmatchError,
    OversizeStepError,
    PageTimeoutError,
    RequestEventError,
    ShutDownError,
    StepAlreadyConsumedError,
    UnknownStepError,
    WaitTimeoutError,
    WriteFailedError,
)

__all__ = [
    "HIDDEN_KEY",
    "BadInputError",
    "ConfigError",
    "HitUnreadableError",
    "IllegalTransitionError",
    "InvariantError",
    "ModelCachePolicy",
    "OmniPrefixCacheStagingTimeoutError",
    "OmniPrefixCacheUnmatchError",
    "OversizeStepError",
    "PageTimeoutError",
    "PrefixCacheConfig",
    "PrefixCacheEventKind",
    "PrefixCacheRequestEvent",
    "PrefixCacheStep",
    "ReqId",
    "RequestEventError",
    "ShutDownError",
    "StepAlreadyConsumedError",
    "StepId",
    "TensorName",
    "Tid",
    "UnknownStepError",
    "WaitTimeoutError",
    "WriteFailedError",
    "WriteSchedule",
    "is_hidden_key",
    "without_hidden",
]

# Core state machine exports are appended below.
