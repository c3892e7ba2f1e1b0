"""omni-cache in vLLM.

Two ways in:

- By configuration: `hidden_states_engine_args` returns engine arguments that switch omni-cache
  on in a stock vLLM engine (its worker, ``omni_cache_cuda.vllm.worker.HiddenStatesWorker``,
  wraps vLLM's own model runner), with the rows going to a folder of safetensors files
  (`load_request_rows` reads one back) or to a callable in the worker process.
- By hand, from a model runner of one's own (vLLM-Omni's mix-in): `VllmPrefixCache`, the glue
  that reads vLLM's scheduler outputs and calls the cache at the three call sites.

Checked against vLLM 0.33.0's scheduler (`VLLM_VERSION_CHECKED`) and inside vLLM 0.32.0's real
CPU engine (`VLLM_CPU_VERSION_CHECKED`). Importing this package does not import vLLM.
"""

from omni_cache_cuda.vllm._engine_args import hidden_states_engine_args
from omni_cache_cuda.vllm._export import (
    ExportStoppedError,
    HiddenStatesExport,
    RequestRows,
    load_request_rows,
)
from omni_cache_cuda.vllm._glue import (
    VLLM_CPU_VERSION_CHECKED,
    VLLM_VERSION_CHECKED,
    RequestIdReuseError,
    VllmPrefixCache,
    should_build_prefix_cache,
)

__all__ = [
    "VLLM_CPU_VERSION_CHECKED",
    "VLLM_VERSION_CHECKED",
    "ExportStoppedError",
    "HiddenStatesExport",
    "RequestIdReuseError",
    "RequestRows",
    "VllmPrefixCache",
    "hidden_states_engine_args",
    "load_request_rows",
    "should_build_prefix_cache",
]
