"""The drop-in worker: vLLM's own worker and model runner, with omni-cache's three call sites.

vLLM builds ``HiddenStatesWorker`` when its ``worker_cls`` names it (`hidden_states_engine_args`
does that). The class is made on first access, in the worker's process, on top of the worker
vLLM would have built for the platform (`CPUWorker` on the CPU build, ``Worker`` on CUDA), so
one name serves every platform and the worker stays vLLM's in everything else. After vLLM makes
its model runner, the worker moves that runner onto a subclass with `HiddenStatesRunnerMixin`
in front, which adds the three call sites:

- ``initialize_kv_cache``: build the cache with `VllmPrefixCache.from_vllm_config` (its
  refusals apply) on the one rank `should_build_prefix_cache` names, and its export;
- ``execute_model``: `HiddenStatesExport.step_begin` before vLLM updates its states;
- ``_model_forward`` (the method vLLM documents for overriding the forward): the save, with the
  final hidden states in the persistent batch's own row order (``input_batch.req_ids``, which
  vLLM reorders; the scheduler's order is not the rows' order).

Why ``worker_cls`` and not the other mechanisms vLLM offers: ``worker_extension_cls`` only adds
methods (it is appended to the worker's bases, so it cannot wrap ``execute_model``), and a
plugin entry point runs in every vLLM process of the environment whether or not omni-cache was
asked for. ``worker_cls`` is per engine, set by configuration alone, and reaches vLLM's spawned
engine process with the rest of the config (spec/DESIGN.md D21).

vLLM is imported here only inside functions, in the worker's process.
"""

from __future__ import annotations

import functools
from typing import Any

from omni_cache_core import ConfigError, ModelCachePolicy
from omni_cache_cuda.vllm._engine_args import ExportOptions, resolve_sink
from omni_cache_cuda.vllm._export import HiddenStatesExport
from omni_cache_cuda.vllm._glue import VllmPrefixCache, should_build_prefix_cache

__all__ = ["HiddenStatesRunnerMixin", "HiddenStatesWorker"]  # noqa: F822 (made on first access)


class HiddenStatesRunnerMixin:
    """Put in front of vLLM's v1 ``GPUModelRunner`` (or ``CPUModelRunner``): the call sites."""

    omni_cache_export: HiddenStatesExport | None = None
    _omni_cache_options: ExportOptions | None = None
    # The scheduler output of the step being executed, until its forward saved it.
    _omni_cache_step: Any = None

    def initialize_kv_cache(self, kv_cache_config: Any, *args: Any, **kwargs: Any) -> None:
        super().initialize_kv_cache(kv_cache_config, *args, **kwargs)  # type: ignore[misc]
        profiling = kwargs.get("is_profiling", args[0] if args else False)
        if profiling or self._omni_cache_options is None:
            return
        self.close_omni_cache()  # a KV cache built again gets a cache of its size
        if not should_build_prefix_cache():
            return
        options = self._omni_cache_options
        sink = resolve_sink(options.sink) if options.sink is not None else None
        runner: Any = self
        cache = VllmPrefixCache.from_vllm_config(
            runner.vllm_config,
            kv_cache_config,
            policy=ModelCachePolicy.from_model(runner.model),
            device=runner.device,
        )
        try:
            self.omni_cache_export = HiddenStatesExport(cache, sink_dir=options.sink_dir, sink=sink)
        except BaseException:
            cache.shutdown()
            raise

    def execute_model(self, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        export = self.omni_cache_export
        if export is None:
            return super().execute_model(scheduler_output, *args, **kwargs)  # type: ignore[misc]
        export.step_begin(scheduler_output)
        self._omni_cache_step = scheduler_output
        try:
            return super().execute_model(scheduler_output, *args, **kwargs)  # type: ignore[misc]
        finally:
            self._omni_cache_step = None

    def _model_forward(self, *args: Any, **kwargs: Any) -> Any:
        output = super()._model_forward(*args, **kwargs)  # type: ignore[misc]
        step = self._omni_cache_step
        export = self.omni_cache_export
        if step is None or export is None:  # a warm-up or profiling forward
            return output
        self._omni_cache_step = None  # one save per step
        hidden = output[0] if isinstance(output, tuple) else output  # EAGLE-3: (hidden, aux)
        runner: Any = self
        export.save(
            hidden,
            req_ids=list(runner.input_batch.req_ids),
            num_tokens_unpadded=step.total_num_scheduled_tokens,
            num_tokens_padded=hidden.shape[0],
        )
        return output

    def sample_tokens(self, *args: Any, **kwargs: Any) -> Any:
        output = super().sample_tokens(*args, **kwargs)  # type: ignore[misc]
        export = self.omni_cache_export
        if export is not None and output is not None:
            export.step_sampled(output)  # SPEC-5: a step's acceptance, for its materialize
        return output

    def close_omni_cache(self) -> None:
        """Write what the export holds and shut its cache down (idempotent)."""
        export, self.omni_cache_export = self.omni_cache_export, None
        if export is not None:
            export.close()


class _WorkerHooks:
    """Put in front of vLLM's platform worker: move its runner onto the mix-in, close at the end."""

    def init_device(self) -> None:
        super().init_device()  # type: ignore[misc]
        worker: Any = self
        runner = worker.model_runner
        options = ExportOptions.from_additional_config(worker.vllm_config.additional_config)
        # Typed as a plain type: mypy does not take type[Any] as the cache's Hashable argument.
        runner_type: type = type(runner)
        runner.__class__ = _runner_class(runner_type)
        runner._omni_cache_options = options

    def omni_cache_counts(self) -> dict[str, Any] | None:
        """The export's counts on this worker (``LLM.collective_rpc("omni_cache_counts")``), or
        None on a rank that builds no cache."""
        export = getattr(getattr(self, "model_runner", None), "omni_cache_export", None)
        return export.counts() if export is not None else None

    def shutdown(self) -> None:
        try:
            runner = getattr(self, "model_runner", None)
            if isinstance(runner, HiddenStatesRunnerMixin):
                runner.close_omni_cache()
        finally:
            super().shutdown()  # type: ignore[misc]


@functools.cache
def _runner_class(base: type) -> type:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if not issubclass(base, GPUModelRunner):
        raise ConfigError(
            field="model runner",
            value=f"{base.__module__}.{base.__qualname__}",
            expected="vLLM's v1 model runner (GPUModelRunner or CPUModelRunner): set "
            "VLLM_USE_V2_MODEL_RUNNER=0, the v2 runner has no forward to wrap",
        )
    return type(f"HiddenStates{base.__name__}", (HiddenStatesRunnerMixin, base), {})


@functools.cache
def _worker_class() -> type:
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from vllm.v1.worker.cpu_worker import CPUWorker as base
    elif current_platform.is_cuda_alike():
        from vllm.v1.worker.gpu_worker import Worker as base
    else:
        raise ConfigError(
            field="platform",
            value=type(current_platform).__name__,
            expected="the CPU or a CUDA-like platform (the workers omni-cache was checked with)",
        )
    return type("HiddenStatesWorker", (_WorkerHooks, base), {"__module__": __name__})


def __getattr__(name: str) -> Any:
    if name == "HiddenStatesWorker":
        return _worker_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
