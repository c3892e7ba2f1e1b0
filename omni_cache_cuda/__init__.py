"""The torch adapter of the prefix cache: the manager an engine's model runner calls.

Everything an engine needs is importable from here, the contract types of `omni_cache_core`
included.
"""

from omni_cache_core import (
    HIDDEN_KEY,
    BadInputError,
    ConfigError,
    HitUnreadableError,
    IllegalTransitionError,
    InvariantError,
    ModelCachePolicy,
    OmniPrefixCacheStagingTimeoutError,
    OmniPrefixCacheUnmatchError,
    OversizeStepError,
    PageTimeoutError,
    PrefixCacheConfig,
    PrefixCacheEventKind,
    PrefixCacheRequestEvent,
    PrefixCacheStep,
    ReqId,
    RequestEventError,
    ShutDownError,
    StepAlreadyConsumedError,
    StepId,
    TensorName,
    Tid,
    UnknownStepError,
    WaitTimeoutError,
    WriteFailedError,
    WriteSchedule,
    is_hidden_key,
    without_hidden,
)
from omni_cache_cuda._layout import PrefixCacheWrite, PrefixCacheWriteLayout
from omni_cache_cuda._manager import OmniPrefixCacheManager
from omni_cache_cuda._outputs import StageCacheOutputs
from omni_cache_cuda._stats import CacheStats

__all__ = [
    "HIDDEN_KEY",
    "BadInputError",
    "CacheStats",
    "ConfigError",
    "HitUnreadableError",
    "IllegalTransitionError",
    "InvariantError",
    "ModelCachePolicy",
    "OmniPrefixCacheManager",
    "OmniPrefixCacheStagingTimeoutError",
    "OmniPrefixCacheUnmatchError",
    "OversizeStepError",
    "PageTimeoutError",
    "PrefixCacheConfig",
    "PrefixCacheEventKind",
    "PrefixCacheRequestEvent",
    "PrefixCacheStep",
    "PrefixCacheWrite",
    "PrefixCacheWriteLayout",
    "ReqId",
    "RequestEventError",
    "ShutDownError",
    "StageCacheOutputs",
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
