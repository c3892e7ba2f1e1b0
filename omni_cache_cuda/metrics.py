"""Prometheus metrics of the cache, read from `OmniPrefixCacheManager.stats` at scrape time.

Needs ``prometheus_client`` (``pip install 'omni-cache[metrics]'``); importing this module
without it raises an `ImportError` that says so. Nothing here runs on the engine's path: the
collector calls `~OmniPrefixCacheManager.stats` (one short hold of the state lock) only when
Prometheus scrapes.

Usage, one collector per process, one `~OmniCacheCollector.add` per manager::

    from prometheus_client import start_http_server
    from omni_cache_cuda.metrics import OmniCacheCollector

    collector = OmniCacheCollector.register()  # into prometheus_client's default registry
    collector.add(cache, model_name="Qwen/Qwen2.5-Omni-7B", stage="thinker")
    start_http_server(8000)

The names follow vLLM's (``vllm:prefix_cache_hits_total``): an ``omni_cache:`` prefix, counters
ending in ``_total``, every series labelled with ``model_name`` and ``stage``:

=============================================  =======  ==================  ===========================
name                                           type     extra labels        from `CacheStats`
=============================================  =======  ==================  ===========================
``omni_cache:steps_saved_total``               counter                      ``steps_saved``
``omni_cache:steps_materialized_total``        counter                      ``steps_consumed``
``omni_cache:steps_discarded_total``           counter                      ``steps_discarded``
``omni_cache:hit_requests_total``              counter                      ``hit_requests``
``omni_cache:hit_rows_total``                  counter  ``source``          ``hit_rows``
``omni_cache:rows_written_total``              counter  ``key``             ``rows_written``
``omni_cache:device_to_host_bytes_total``      counter                      ``bytes_device_to_host``
``omni_cache:pool_write_bytes_total``          counter                      ``bytes_to_pool``
``omni_cache:page_waits_total``                counter                      ``page_waits``
``omni_cache:page_wait_seconds_total``         counter                      ``page_wait_s``
``omni_cache:budget_flushes_total``            counter                      ``budget_flushes``
``omni_cache:timeouts_total``                  counter                      ``timeouts``
``omni_cache:write_failures_total``            counter                      ``writes_failed``
``omni_cache:staging_pages_in_use``            gauge                        ``pages_in_use``
``omni_cache:staging_pages``                   gauge                        config ``staging_depth``
``omni_cache:gpu_budget_bytes_in_use``         gauge                        ``budget_bytes_in_use``
``omni_cache:gpu_budget_bytes``                gauge                        config ``gpu_staging_bytes``
``omni_cache:host_pool_bytes``                 gauge                        ``pool_bytes``
``omni_cache:staging_bytes``                   gauge                        ``staging_bytes``
``omni_cache:occupancy_bytes``                 gauge                        ``occupancy_bytes``
``omni_cache:output_bytes_kept``               gauge                        ``output_bytes_kept``
=============================================  =======  ==================  ===========================

``source`` is one of ``pool``, ``after_write``, ``task``, ``zeros`` and ``this_step`` (see
``hit_rows`` in `CacheStats`); ``key`` is the cached tensor's name (``__hidden_states__`` for the hidden
states). The hit rate over a window is
``rate(omni_cache:hit_rows_total[5m])`` summed over ``source``, against the rows the engine
computed.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING

try:
    from prometheus_client import REGISTRY, CollectorRegistry
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
    from prometheus_client.registry import Collector
except ImportError as exc:  # pragma: no cover - exercised by a test that hides the package
    raise ImportError(
        "omni_cache_cuda.metrics needs prometheus_client, which is not installed: "
        "pip install 'omni-cache[metrics]' (or pip install prometheus_client)"
    ) from exc

if TYPE_CHECKING:
    from omni_cache_cuda._manager import OmniPrefixCacheManager
    from omni_cache_cuda._stats import CacheStats

__all__ = ["PREFIX", "OmniCacheCollector"]

#: The prefix of every metric name.
PREFIX = "omni_cache:"

_LABELS = ("model_name", "stage")

# (name without prefix and _total, help text, CacheStats field) of the plain counters.
_COUNTERS = (
    ("steps_saved", "Steps whose outputs save_outputs saved (step ids issued).", "steps_saved"),
    ("steps_materialized", "Step ids consumed by materialize.", "steps_consumed"),
    ("steps_discarded", "Step ids consumed by discard_step.", "steps_discarded"),
    ("hit_requests", "Requests that started with a prefix hit.", "hit_requests"),
    (
        "device_to_host_bytes",
        "Bytes copied from the device into staging pages or host rows.",
        "bytes_device_to_host",
    ),
    ("pool_write_bytes", "Bytes written into the host pool.", "bytes_to_pool"),
    ("page_waits", "Saves that found no free staging page and waited.", "page_waits"),
    ("page_wait_seconds", "Seconds saves waited for a staging page.", "page_wait_s"),
    (
        "budget_flushes",
        "Deferred writes forced out early by the GPU-byte budget.",
        "budget_flushes",
    ),
    (
        "timeouts",
        "Waits that ran out of time (page claims, save barriers, budget flushes, hit joins).",
        "timeouts",
    ),
    (
        "write_failures",
        "Writes that failed; the first one leaves the cache unusable (WriteFailedError).",
        "writes_failed",
    ),
)

# (name without prefix, help text, CacheStats field) of the gauges read from the stats.
_GAUGES = (
    ("staging_pages_in_use", "Staging pages held right now.", "pages_in_use"),
    (
        "gpu_budget_bytes_in_use",
        "Device clone bytes charged against the GPU-byte budget right now.",
        "budget_bytes_in_use",
    ),
    ("host_pool_bytes", "Bytes of the host pool (one row per KV slot per key).", "pool_bytes"),
    ("staging_bytes", "Bytes of the host staging pages.", "staging_bytes"),
    ("occupancy_bytes", "Bytes of the slot occupancy tables.", "occupancy_bytes"),
    (
        "output_bytes_kept",
        "Bytes of returned rows' buffers kept to hand out again once dropped.",
        "output_bytes_kept",
    ),
)


class OmniCacheCollector(Collector):
    """A Prometheus collector over one or more managers, each labelled by model and stage.

    It holds its managers weakly: a manager that is garbage-collected drops out of the scrape.
    A manager that is shut down is still scraped (its counters stay readable).
    """

    def __init__(self) -> None:
        """Create a collector with no manager; `add` them, then register it."""
        self._lock = threading.Lock()
        self._managers: list[tuple[weakref.ref[OmniPrefixCacheManager], str, str]] = []

    @classmethod
    def register(cls, registry: CollectorRegistry = REGISTRY) -> OmniCacheCollector:
        """Create a collector and register it with ``registry`` (the default one if omitted).

        Args:
            registry: Where the metrics are exposed; ``prometheus_client.REGISTRY`` by default.

        Returns:
            The registered collector.
        """
        collector = cls()
        registry.register(collector)
        return collector

    def add(self, manager: OmniPrefixCacheManager, *, model_name: str, stage: str = "") -> None:
        """Export ``manager``'s counters under the labels ``model_name`` and ``stage``.

        Args:
            manager: The cache manager.
            model_name: The served model's name, as vLLM's ``model_name`` label.
            stage: The stage of a multi-stage model (``thinker``, ``talker``, ...), or "".

        Raises:
            ValueError: Another manager of this collector already has these labels.
        """
        with self._lock:
            self._prune()
            for ref, model, st in self._managers:
                if (model, st) == (model_name, stage) and ref() is not manager:
                    raise ValueError(
                        f"a manager with model_name={model_name!r}, stage={stage!r} is already "
                        "exported by this collector"
                    )
            self._managers = [(r, m, s) for r, m, s in self._managers if r() is not manager]
            self._managers.append((weakref.ref(manager), model_name, stage))

    def remove(self, manager: OmniPrefixCacheManager) -> None:
        """Stop exporting ``manager``; nothing happens if it was not added."""
        with self._lock:
            self._managers = [(r, m, s) for r, m, s in self._managers if r() is not manager]

    def _prune(self) -> None:
        self._managers = [entry for entry in self._managers if entry[0]() is not None]

    def collect(self) -> Iterator[Metric]:
        """Read every manager's `~OmniPrefixCacheManager.stats` now and yield the metric families."""
        with self._lock:
            self._prune()
            entries = list(self._managers)
        snapshots: list[tuple[tuple[str, str], CacheStats, OmniPrefixCacheManager]] = []
        for ref, model, stage in entries:
            manager = ref()
            if manager is not None:
                snapshots.append(((model, stage), manager.stats(), manager))

        for name, text, field in _COUNTERS:
            counter = CounterMetricFamily(PREFIX + name, text, labels=_LABELS)
            for labels, stats, _ in snapshots:
                counter.add_metric(labels, float(getattr(stats, field)))
            yield counter

        hit_rows = CounterMetricFamily(
            PREFIX + "hit_rows",
            "Hit prefix rows handed out by materialize, by where they were read: pool (the "
            "host mirror), after_write (the mirror once a write in flight landed), task (a "
            "deferred write's own rows), this_step (a producer of the same step), zeros (an mm "
            "key absent there).",
            labels=(*_LABELS, "source"),
        )
        for labels, stats, _ in snapshots:
            for source, count in stats.hit_rows.items():
                hit_rows.add_metric((*labels, source.lower()), float(count))
        yield hit_rows

        rows_written = CounterMetricFamily(
            PREFIX + "rows_written",
            "Rows written into the host pool, by cached key.",
            labels=(*_LABELS, "key"),
        )
        for labels, stats, _ in snapshots:
            for key, count in sorted(stats.rows_written.items()):
                rows_written.add_metric((*labels, key), float(count))
        yield rows_written

        for name, text, field in _GAUGES:
            gauge = GaugeMetricFamily(PREFIX + name, text, labels=_LABELS)
            for labels, stats, _ in snapshots:
                gauge.add_metric(labels, float(getattr(stats, field)))
            yield gauge

        pages = GaugeMetricFamily(
            PREFIX + "staging_pages",
            "Staging pages configured (staging_depth).",
            labels=_LABELS,
        )
        budget = GaugeMetricFamily(
            PREFIX + "gpu_budget_bytes",
            "The GPU-byte budget of device clones (gpu_staging_bytes).",
            labels=_LABELS,
        )
        for labels, _, manager in snapshots:
            pages.add_metric(labels, float(manager.config.staging_depth))
            budget.add_metric(labels, float(manager.config.gpu_staging_bytes))
        yield pages
        yield budget
