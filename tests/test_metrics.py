"""The Prometheus collector: a scrape after a scripted run shows the counters it must."""

from __future__ import annotations

import gc
import importlib
import re
import sys

import pytest

pytest.importorskip("prometheus_client")

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from omni_cache_cuda import ModelCachePolicy
from omni_cache_cuda.metrics import OmniCacheCollector
from tests.obs_helpers import MM, cpu_manager, scripted_run, started, step

THINKER = {"model_name": "tiny-omni", "stage": "thinker"}


def _scrape(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Scrape through the text exposition format, as Prometheus does."""
    text = generate_latest(registry).decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def _value(samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted({**THINKER, **labels}.items())))]


def test_a_scrape_after_a_scripted_run_shows_the_expected_counters():
    """Every counter and gauge of the scripted run, read back from the exposition text."""
    registry = CollectorRegistry()
    collector = OmniCacheCollector.register(registry)
    with cpu_manager() as mgr:
        collector.add(mgr, **THINKER)
        scripted_run(mgr)
        samples = _scrape(registry)
        kept = mgr.stats().output_bytes_kept
    expected = {
        "omni_cache:steps_saved_total": 3,
        "omni_cache:steps_materialized_total": 2,
        "omni_cache:steps_discarded_total": 1,
        "omni_cache:hit_requests_total": 1,
        "omni_cache:device_to_host_bytes_total": 0,  # CPU tensors: nothing crosses a device
        # 11 rows per key: 12-byte hidden rows and 4-byte codes.audio rows.
        "omni_cache:pool_write_bytes_total": 11 * 12 + 11 * 4,
        "omni_cache:page_waits_total": 0,
        "omni_cache:page_wait_seconds_total": 0,
        "omni_cache:budget_flushes_total": 0,
        "omni_cache:timeouts_total": 0,
        "omni_cache:write_failures_total": 0,
        "omni_cache:staging_pages_in_use": 0,
        "omni_cache:staging_pages": 2,
        "omni_cache:gpu_budget_bytes_in_use": 0,
        "omni_cache:gpu_budget_bytes": 512 * 2**20,
        # 32 slots and 2 pages of 16 rows, each of 12 + 4 bytes.
        "omni_cache:host_pool_bytes": 32 * 16,
        "omni_cache:staging_bytes": 2 * 16 * 16,
    }
    for name, value in expected.items():
        assert _value(samples, name) == value, name
    # The 4-token hit of b, for both cached keys, came from the host pool.
    assert _value(samples, "omni_cache:hit_rows_total", source="pool") == 8
    for source in ("after_write", "task", "zeros", "this_step"):
        assert _value(samples, "omni_cache:hit_rows_total", source=source) == 0
    for key in ("__hidden_states__", MM):
        assert _value(samples, "omni_cache:rows_written_total", key=key) == 11
    assert _value(samples, "omni_cache:occupancy_bytes") > 0
    # The tests keep every returned buffer (D40): some are, within the staging pages' bytes.
    assert 0 < _value(samples, "omni_cache:output_bytes_kept") == kept <= 2 * 16 * 16


def test_the_exposition_has_help_and_type_lines_and_vllm_style_names():
    """Each family has a help text and a type; counters end in _total; all share the prefix."""
    registry = CollectorRegistry()
    OmniCacheCollector.register(registry).add(cpu_manager(), **THINKER)
    text = generate_latest(registry).decode()
    families = list(text_string_to_metric_families(text))
    assert len(families) == 21
    for family in families:
        assert family.name.startswith("omni_cache:")
        assert family.documentation, family.name
        if family.type == "counter":
            # The exposition names the family with or without _total, by client version.
            assert re.search(rf"^# TYPE {family.name}(_total)? counter$", text, re.M)
            assert all(s.name == family.name + "_total" for s in family.samples)
        else:
            assert family.type == "gauge", family.name
            assert f"# TYPE {family.name} gauge" in text


def test_scrapes_read_the_counters_at_scrape_time():
    """A scrape reflects the state at that moment: counters grow between scrapes."""
    registry = CollectorRegistry()
    collector = OmniCacheCollector.register(registry)
    with cpu_manager() as mgr:
        collector.add(mgr, **THINKER)
        assert _value(_scrape(registry), "omni_cache:steps_saved_total") == 0
        step_id = step(mgr, [started("a", [0], 3)], [("a", [0], 0, 3)])
        samples = _scrape(registry)
        assert _value(samples, "omni_cache:steps_saved_total") == 1
        # The step is saved but not consumed: its page is still held.
        assert _value(samples, "omni_cache:staging_pages_in_use") == 1
        mgr.discard_step(step_id)
        samples = _scrape(registry)
        assert _value(samples, "omni_cache:steps_discarded_total") == 1
        assert _value(samples, "omni_cache:staging_pages_in_use") == 0


def test_budget_flushes_and_bytes_in_use_are_exported():
    """A deferred key under a tiny GPU budget: the flush count and the budget gauge."""
    registry = CollectorRegistry()
    collector = OmniCacheCollector.register(registry)
    policy = ModelCachePolicy(deferred_keys=frozenset({MM}))
    with cpu_manager(policy, gpu_staging_bytes=40) as mgr:
        collector.add(mgr, **THINKER)
        s1 = step(mgr, [started("a", [0, 1], 8)], [("a", [0, 1], 0, 8)])
        # a's 8 deferred rows (32 bytes) stay charged while a is live.
        assert _value(_scrape(registry), "omni_cache:gpu_budget_bytes_in_use") == 32
        # b's 3 rows (12 bytes) do not fit beside them: a's write is flushed early.
        s2 = step(mgr, [started("b", [2], 3)], [("a", [0, 1], 8, 0), ("b", [2], 0, 3)])
        samples = _scrape(registry)
        mgr.discard_step(s1)
        mgr.discard_step(s2)
    assert _value(samples, "omni_cache:budget_flushes_total") == 1
    assert _value(samples, "omni_cache:gpu_budget_bytes_in_use") == 12
    assert _value(samples, "omni_cache:gpu_budget_bytes") == 40


def test_two_stages_are_told_apart_by_their_labels():
    """Two managers in one collector: one series each, labelled by stage."""
    registry = CollectorRegistry()
    collector = OmniCacheCollector.register(registry)
    thinker, talker = cpu_manager(), cpu_manager()
    collector.add(thinker, model_name="tiny-omni", stage="thinker")
    collector.add(talker, model_name="tiny-omni", stage="talker")
    scripted_run(thinker)
    samples = _scrape(registry)
    assert _value(samples, "omni_cache:steps_saved_total") == 3
    assert _value(samples, "omni_cache:steps_saved_total", stage="talker") == 0
    with pytest.raises(ValueError, match="already exported"):
        collector.add(cpu_manager(), model_name="tiny-omni", stage="talker")
    collector.remove(talker)
    samples = _scrape(registry)
    assert (
        "omni_cache:steps_saved_total",
        (("model_name", "tiny-omni"), ("stage", "talker")),
    ) not in samples
    thinker.shutdown()
    talker.shutdown()


def test_a_collected_manager_drops_out_of_the_scrape():
    """The collector holds managers weakly: a dropped one leaves no series behind."""
    registry = CollectorRegistry()
    collector = OmniCacheCollector.register(registry)
    mgr = cpu_manager()
    collector.add(mgr, **THINKER)
    assert ("omni_cache:steps_saved_total", tuple(sorted(THINKER.items()))) in _scrape(registry)
    mgr.shutdown()
    del mgr
    gc.collect()
    assert not any(name == "omni_cache:steps_saved_total" for name, _ in _scrape(registry))


def test_a_shut_down_manager_is_still_scraped():
    """Counters stay readable after shutdown (stats() works then)."""
    registry = CollectorRegistry()
    collector = OmniCacheCollector.register(registry)
    mgr = cpu_manager()
    collector.add(mgr, **THINKER)
    scripted_run(mgr)
    mgr.shutdown()
    assert _value(_scrape(registry), "omni_cache:steps_saved_total") == 3


def test_importing_without_prometheus_client_says_what_to_install(monkeypatch):
    """Without prometheus_client the import fails with a message naming the extra."""
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    monkeypatch.delitem(sys.modules, "omni_cache_cuda.metrics")
    with pytest.raises(ImportError, match=r"pip install 'omni-cache\[metrics\]'"):
        importlib.import_module("omni_cache_cuda.metrics")
