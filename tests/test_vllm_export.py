"""The drop-in vLLM integration without vLLM: the engine-argument switch, the request files and
the export's stop on a failure (FAIL-6), with stand-in scheduler outputs.

``tests/vllm_engine`` runs the same code inside vLLM's real CPU engine.
"""

from __future__ import annotations

import os
import queue
import threading
from typing import Any

import pytest
import torch

from omni_cache_cuda import (
    ConfigError,
    OmniPrefixCacheManager,
    PrefixCacheConfig,
    ShutDownError,
    StageCacheOutputs,
    StagingCopyError,
)
from omni_cache_cuda._faults import OneShot
from omni_cache_cuda.vllm import (
    ExportStoppedError,
    HiddenStatesExport,
    VllmPrefixCache,
    hidden_states_engine_args,
    load_request_rows,
)
from omni_cache_cuda.vllm._engine_args import (
    ADDITIONAL_CONFIG_KEY,
    WORKER_CLS,
    ExportOptions,
)
from omni_cache_cuda.vllm._export import (
    ENDED_BY_ENGINE,
    ENDED_BY_SHUTDOWN,
    request_file_name,
    write_request_file,
)
from tests.test_vllm_glue import BS, new_req, output, rows_for

# ---------------------------------------------------------------------------------------------
# The switch.


def test_engine_args_switch_prefix_caching_and_the_worker_on(tmp_path: Any) -> None:
    args = hidden_states_engine_args(
        sink_dir=tmp_path / "rows", model="m", block_size=32, additional_config={"other": 1}
    )
    assert args["model"] == "m" and args["block_size"] == 32
    assert args["enable_prefix_caching"] is True
    assert args["worker_cls"] == WORKER_CLS
    carried = args["additional_config"]
    assert carried["other"] == 1
    assert carried[ADDITIONAL_CONFIG_KEY] == {"sink_dir": str(tmp_path / "rows"), "sink": None}
    # What the worker reads back is what was asked for; a relative folder is made absolute.
    options = ExportOptions.from_additional_config(carried)
    assert options == ExportOptions(sink_dir=str(tmp_path / "rows"))
    relative = hidden_states_engine_args(sink_dir="rows")["additional_config"]
    assert relative[ADDITIONAL_CONFIG_KEY]["sink_dir"] == os.path.abspath("rows")


def test_a_callable_sink_is_resolved_before_an_engine_starts() -> None:
    args = hidden_states_engine_args(sink="tests.test_vllm_export:collect")
    assert args["additional_config"][ADDITIONAL_CONFIG_KEY]["sink"] == (
        "tests.test_vllm_export:collect"
    )


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({}, "sink_dir, sink"),
        ({"sink_dir": ""}, "sink_dir"),
        ({"sink_dir": 3}, "sink_dir"),
        ({"sink": "no_colon"}, "sink"),
        ({"sink": "tests.no_such_module:f"}, "sink"),
        ({"sink": "tests.test_vllm_export:no_such_name"}, "sink"),
        ({"sink": "tests.test_vllm_export:NOT_CALLABLE"}, "sink"),
        ({"sink_dir": "d", "enable_prefix_caching": False}, "enable_prefix_caching"),
        ({"sink_dir": "d", "worker_cls": "my.Worker"}, "worker_cls"),
        ({"sink_dir": "d", "speculative_config": {"method": "ngram"}}, "async_scheduling"),
        ({"sink_dir": "d", "kv_transfer_config": {"kv_connector": "X"}}, "kv_transfer_config"),
        ({"sink_dir": "d", "additional_config": [1]}, "additional_config"),
        ({"sink_dir": "d", "additional_config": {ADDITIONAL_CONFIG_KEY: {}}}, "additional_config"),
    ],
)
def test_engine_args_refuse_what_the_integration_cannot_serve(
    kwargs: dict[str, Any], field: str
) -> None:
    with pytest.raises(ConfigError) as raised:
        hidden_states_engine_args(**kwargs)
    assert raised.value.field == field


@pytest.mark.parametrize(
    "additional",
    [None, {}, {ADDITIONAL_CONFIG_KEY: "x"}, {ADDITIONAL_CONFIG_KEY: {"sink_dir": "d", "x": 1}}],
)
def test_a_worker_without_its_options_refuses_to_start(additional: Any) -> None:
    with pytest.raises(ConfigError, match="additional_config"):
        ExportOptions.from_additional_config(additional)


collected: list[StageCacheOutputs] = []
NOT_CALLABLE = 3


def collect(out: StageCacheOutputs) -> None:
    collected.append(out)


# ---------------------------------------------------------------------------------------------
# Request files.


def part(start: int, end: int, width: int = 3) -> tuple[int, int, torch.Tensor, dict[str, Any]]:
    rows = torch.arange(start, end, dtype=torch.float32)[:, None].repeat(1, width)
    return (start, end, rows, {"talker.h": rows[:, :1] * 2})


def test_a_request_file_holds_each_position_once_in_order(tmp_path: Any) -> None:
    path = write_request_file(
        str(tmp_path), "r1-abcd1234", [part(0, 5), part(5, 5), part(5, 9)], ended=ENDED_BY_ENGINE
    )
    assert path == os.path.join(tmp_path, "r1-abcd1234.safetensors")
    assert os.listdir(tmp_path) == ["r1-abcd1234.safetensors"]  # no temporary file left
    for asked in ("r1", "r1-abcd1234"):  # the caller's id or the workers'
        rows = load_request_rows(tmp_path, asked, timeout_s=0)
        assert rows.request_id == "r1-abcd1234" and rows.ended == ENDED_BY_ENGINE
        assert rows.positions.tolist() == list(range(9))
        assert rows.hidden_states is not None
        assert rows.hidden_states[:, 0].tolist() == [float(p) for p in range(9)]
        assert rows.mm_outputs["talker.h"][:, 0].tolist() == [2.0 * p for p in range(9)]


def test_odd_request_ids_make_safe_file_names(tmp_path: Any) -> None:
    assert request_file_name("../x/y z") == "..%2Fx%2Fy%20z.safetensors"
    write_request_file(str(tmp_path), "a/b", [part(0, 2)], ended=ENDED_BY_SHUTDOWN)
    assert load_request_rows(tmp_path, "a/b", timeout_s=0).ended == ENDED_BY_SHUTDOWN


@pytest.mark.parametrize("parts", [[(1, 3)], [(0, 2), (3, 4)], [(0, 3), (2, 4)]])
def test_delivered_positions_with_a_gap_or_overlap_write_no_file(
    tmp_path: Any, parts: list[tuple[int, int]]
) -> None:
    with pytest.raises(ValueError, match="contiguous"):
        write_request_file(str(tmp_path), "r", [part(s, e) for s, e in parts], ended="x")
    assert os.listdir(tmp_path) == []


def test_a_request_without_rows_writes_no_file(tmp_path: Any) -> None:
    assert write_request_file(str(tmp_path), "r", [part(0, 0)], ended=ENDED_BY_ENGINE) is None
    with pytest.raises(FileNotFoundError, match="'r'"):
        load_request_rows(tmp_path, "r", timeout_s=0)


def test_two_files_for_one_caller_id_are_refused(tmp_path: Any) -> None:
    for suffix in ("aaaaaaaa", "bbbbbbbb"):
        write_request_file(str(tmp_path), f"r-{suffix}", [part(0, 1)], ended=ENDED_BY_ENGINE)
    with pytest.raises(ValueError, match="several files"):
        load_request_rows(tmp_path, "r", timeout_s=0)


def test_a_reader_waits_for_the_file(tmp_path: Any) -> None:
    later = threading.Timer(
        0.2, write_request_file, (str(tmp_path), "r-12345678", [part(0, 2)]), {"ended": "x"}
    )
    later.start()
    try:
        assert load_request_rows(tmp_path, "r", timeout_s=10).positions.tolist() == [0, 1]
    finally:
        later.join()


# ---------------------------------------------------------------------------------------------
# The export: the output thread, the sinks and the stop on a failure (FAIL-6).


class Sink:
    """A callable sink that records what it gets, or raises at a given step."""

    def __init__(self, fail_at: int = 0) -> None:
        self.got: queue.SimpleQueue[StageCacheOutputs] = queue.SimpleQueue()
        self.finished: list[str] = []
        self.calls = 0
        self.fail_at = fail_at

    def __call__(self, out: StageCacheOutputs) -> None:
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("sink broke")
        self.got.put(out)

    def request_finished(self, req_id: str) -> None:
        self.finished.append(req_id)


def make_export(tmp_path: Any, sink: Sink | None = None) -> HiddenStatesExport:
    manager = OmniPrefixCacheManager(
        PrefixCacheConfig(num_blocks=32, block_size=BS), device="cpu", threaded=False
    )
    return HiddenStatesExport(
        VllmPrefixCache(manager, block_size=BS), sink_dir=str(tmp_path / "rows"), sink=sink
    )


def step(export: HiddenStatesExport, so: Any) -> int | None:
    export.step_begin(so)
    order = list(so.num_scheduled_tokens)
    if not order:
        return None
    hidden = rows_for(export.cache, order)
    return export.save(
        hidden, req_ids=order, num_tokens_unpadded=hidden.shape[0], num_tokens_padded=len(hidden)
    )


def a_life(export: HiddenStatesExport) -> None:
    """``a`` prefills 6 tokens over two steps and decodes one; ``b`` hits ``a``'s first block."""
    step(export, output({"a": 4}, new=[new_req("a", [0, 1])]))
    step(export, output({"a": 2, "b": 2}, new=[new_req("b", [0, 2], 4)], cached=[("a", None, 4)]))
    step(export, output({"a": 1}, cached=[("a", None, 6)]))


def test_each_ended_request_gets_its_file_and_the_sink_every_step(tmp_path: Any) -> None:
    sink = Sink()
    export = make_export(tmp_path, sink)
    try:
        a_life(export)
        step(export, output({}, finished={"a"}))  # vLLM names a request ended a step later
        export.close()
        rows = load_request_rows(tmp_path / "rows", "a", timeout_s=0)
        assert rows.ended == ENDED_BY_ENGINE
        assert rows.positions.tolist() == list(range(7))
        assert rows.hidden_states is not None
        assert rows.hidden_states[:, 0].tolist() == [float(p) for p in range(7)]
        # b never was named ended: the shutdown wrote what it had (the hit rows, then its own).
        b = load_request_rows(tmp_path / "rows", "b", timeout_s=0)
        assert b.ended == ENDED_BY_SHUTDOWN and b.positions.tolist() == list(range(6))
        assert sink.calls == 3 and sorted(sink.finished) == ["a", "b"]
        assert export.counts()["files_written"] == 2
    finally:
        export.close()


def test_fail_6_a_failed_save_stops_the_export_and_the_cache(tmp_path: Any) -> None:
    export = make_export(tmp_path)
    export.cache.manager._inject_fault("page_copy", OneShot(skip=1))
    try:
        step(export, output({"a": 4}, new=[new_req("a", [0, 1])]))
        with pytest.raises(StagingCopyError):
            step(export, output({"a": 2}, cached=[("a", None, 4)]))
        # Every later hook raises from the first failure, and the cache serves nothing more.
        with pytest.raises(ExportStoppedError) as stopped:
            step(export, output({"a": 1}, cached=[("a", None, 6)]))
        assert isinstance(stopped.value.__cause__, StagingCopyError)
        with pytest.raises(ShutDownError):
            export.cache.materialize(1, ["a"])
        export.close()
        assert os.listdir(tmp_path / "rows") == []  # no file for a request not fully delivered
        assert export.counts()["failed"] is not None
    finally:
        export.close()


def test_fail_6_a_failing_sink_stops_the_export_at_the_next_hook(tmp_path: Any) -> None:
    export = make_export(tmp_path, Sink(fail_at=1))
    try:
        step(export, output({"a": 4}, new=[new_req("a", [0, 1])]))
        export.step_begin(output({}))  # hands step 1's rows to the sink, which raises there
        export._thread.join(10)  # the output thread stops on the failure
        assert not export._thread.is_alive()
        with pytest.raises(ExportStoppedError) as stopped:
            step(export, output({"a": 2}, cached=[("a", None, 4)]))
        assert isinstance(stopped.value.__cause__, RuntimeError)
        with pytest.raises(ShutDownError):
            export.cache.materialize(1, ["a"])
        export.close()
        assert os.listdir(tmp_path / "rows") == []
    finally:
        export.close()
