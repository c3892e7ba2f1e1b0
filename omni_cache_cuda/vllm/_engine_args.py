"""The switch: engine arguments that turn omni-cache on in a stock vLLM engine.

`hidden_states_engine_args` returns keyword arguments for ``vllm.LLM(...)`` / ``EngineArgs``:
prefix caching on, vLLM's worker replaced by `omni_cache_cuda.vllm.worker.HiddenStatesWorker`,
and the sinks named in ``additional_config["omni_cache"]``, which vLLM hands to every worker
process with the rest of its config. Nothing here imports vLLM: the arguments are plain values,
so the same switch works from the command line (README: the ``vllm serve`` flags).
"""

from __future__ import annotations

import importlib
import os
import re
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from omni_cache_core import ConfigError

__all__ = [
    "ADDITIONAL_CONFIG_KEY",
    "WORKER_CLS",
    "ExportOptions",
    "hidden_states_engine_args",
    "resolve_sink",
]

#: The worker class vLLM is told to build (its ``worker_cls``), by qualified name.
WORKER_CLS = "omni_cache_cuda.vllm.worker.HiddenStatesWorker"
#: Where the options travel to the workers: ``vllm_config.additional_config[ADDITIONAL_CONFIG_KEY]``.
ADDITIONAL_CONFIG_KEY = "omni_cache"

_SINK_NAME = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")

# Engine arguments the integration cannot serve with, and why (the same refusals as
# `VllmPrefixCache.from_vllm_config`, given here so the caller hears them before an engine starts).
_REFUSED: dict[str, str] = {
    "kv_transfer_config": "None: tokens a KV connector loads were never computed here, so a hit "
    "on them has no rows",
}


@attrs.frozen
class ExportOptions:
    """Where a worker sends the rows: what `hidden_states_engine_args` put in the config.

    Attributes:
        sink_dir: Absolute folder for one safetensors file per ended request, or None.
        sink: ``"package.module:callable"`` called with each materialized step, or None.
    """

    sink_dir: str | None = None
    sink: str | None = None

    def as_config(self) -> dict[str, Any]:
        """The JSON-able form carried in ``additional_config``."""
        return {"sink_dir": self.sink_dir, "sink": self.sink}

    @classmethod
    def from_additional_config(cls, additional_config: Any) -> ExportOptions:
        """Read the options a worker finds in ``vllm_config.additional_config``.

        Raises:
            ConfigError: The key is missing (the worker was named without
                `hidden_states_engine_args` or ``--additional-config``), has unknown fields, or
                names no sink.
        """
        entry = (additional_config or {}).get(ADDITIONAL_CONFIG_KEY)
        if not isinstance(entry, Mapping):
            raise ConfigError(
                field=f"additional_config[{ADDITIONAL_CONFIG_KEY!r}]",
                value=entry,
                expected='a mapping such as {"sink_dir": "/path"}: build the engine arguments '
                "with omni_cache_cuda.vllm.hidden_states_engine_args, or pass "
                "--additional-config (README)",
            )
        unknown = set(entry) - {"sink_dir", "sink"}
        if unknown:
            raise ConfigError(
                field=f"additional_config[{ADDITIONAL_CONFIG_KEY!r}]",
                value=sorted(unknown),
                expected="only the fields 'sink_dir' and 'sink'",
            )
        return _checked(entry.get("sink_dir"), entry.get("sink"))


def _checked(sink_dir: Any, sink: Any) -> ExportOptions:
    if sink_dir is None and sink is None:
        raise ConfigError(
            field="sink_dir, sink",
            value=None,
            expected="at least one: a folder for the rows, or 'package.module:callable'",
        )
    if sink_dir is not None:
        if not isinstance(sink_dir, str | os.PathLike) or not os.fspath(sink_dir):
            raise ConfigError(field="sink_dir", value=sink_dir, expected="a folder path")
        sink_dir = os.path.abspath(os.fspath(sink_dir))
    if sink is not None and (not isinstance(sink, str) or not _SINK_NAME.match(sink)):
        raise ConfigError(field="sink", value=sink, expected="'package.module:callable'")
    return ExportOptions(sink_dir=sink_dir, sink=sink)


def resolve_sink(name: str) -> Callable[..., Any]:
    """Import ``"package.module:callable"`` and return the callable.

    Raises:
        ConfigError: The module does not import, has no such attribute, or it is not callable.
    """
    module_name, _, attr_path = name.partition(":")
    try:
        target: Any = importlib.import_module(module_name)
        for part in attr_path.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(
            field="sink", value=name, expected=f"an importable callable ({exc})"
        ) from exc
    if not callable(target):
        raise ConfigError(field="sink", value=name, expected="a callable")
    return target  # type: ignore[no-any-return]


def hidden_states_engine_args(
    *, sink_dir: str | os.PathLike[str] | None = None, sink: str | None = None, **options: Any
) -> dict[str, Any]:
    """Engine arguments that switch omni-cache on in a stock vLLM engine.

    ``vllm.LLM(**hidden_states_engine_args(sink_dir="rows", model=path))``: every other engine
    argument passes through ``options``. The result turns prefix caching on, names the
    integration's worker (``worker_cls``) and carries the sinks in
    ``additional_config["omni_cache"]``. It works in vLLM's default multi-process mode and
    in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), on the GPU and CPU workers; on the GPU
    the v1 model runner is needed (``VLLM_USE_V2_MODEL_RUNNER=0``): the v2 runner calls the
    model inside its own loop and offers no place to save the rows.

    Args:
        sink_dir: A folder: when a request ends, its rows are written to
            ``<sink_dir>/<worker request id>.safetensors`` (`load_request_rows` reads one back).
        sink: ``"package.module:callable"``, imported in the worker process and called there
            with every materialized step's `StageCacheOutputs` (rows and positions per request).
            If the callable has a ``request_finished`` attribute, that is called with each
            request id once its last rows were handed over.
        **options: Any other vLLM engine arguments.

    Returns:
        A new dict of engine arguments.

    Raises:
        ConfigError: Neither sink is given, a sink is malformed or does not import, or an engine
            argument contradicts the integration (prefix caching off, another ``worker_cls``,
            speculative decoding without ``async_scheduling=False``, a KV connector, an ``additional_config`` that is not a
            mapping). The worker still checks the final config with the refusals of
            `VllmPrefixCache.from_vllm_config`.
    """
    chosen = _checked(sink_dir, sink)
    if chosen.sink is not None:
        resolve_sink(chosen.sink)  # fail here, not in a spawned engine process
    if options.get("enable_prefix_caching", True) is not True:
        raise ConfigError(
            field="enable_prefix_caching",
            value=options["enable_prefix_caching"],
            expected="True (or left out): without prefix caching there is no hit to serve",
        )
    if options.get("worker_cls", WORKER_CLS) not in (WORKER_CLS, "auto"):
        raise ConfigError(
            field="worker_cls", value=options["worker_cls"], expected=f"left out, or {WORKER_CLS}"
        )
    for field, expected in _REFUSED.items():
        if options.get(field) is not None:
            raise ConfigError(field=field, value=options[field], expected=expected)
    if (
        options.get("speculative_config") is not None
        and options.get("async_scheduling") is not False
    ):
        # SPEC-2: the next step's scheduler output must say which drafts were accepted.
        raise ConfigError(
            field="async_scheduling",
            value=options.get("async_scheduling"),
            expected="False with a speculative_config: under async scheduling the next "
            "step is scheduled before this one's drafts are accepted or rejected",
        )
    extra = options.get("additional_config") or {}
    if not isinstance(extra, Mapping) or ADDITIONAL_CONFIG_KEY in extra:
        raise ConfigError(
            field="additional_config",
            value=extra,
            expected=f"a mapping without the key {ADDITIONAL_CONFIG_KEY!r} (set through sink_dir "
            "and sink)",
        )
    return {
        **options,
        "enable_prefix_caching": True,
        "worker_cls": WORKER_CLS,
        "additional_config": {**extra, ADDITIONAL_CONFIG_KEY: chosen.as_config()},
    }
