"""The drop-in integration inside vLLM's real CPU engine, model runner and forward.

Every test switches omni-cache on with `hidden_states_engine_args` alone, runs requests over
shared system prompts through a small KV cache (prefix hits, same-step hits, chunked prefill,
forced preemptions, aborts), and compares, request by request and position by position, the
rows both sinks received with the rows of the same engine run with prefix caching off
(`harness.reference_rows`). Each test also asserts that its run exercised what it claims.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from tests.vllm_engine import require_engine

vllm = require_engine()

import torch  # noqa: E402

from omni_cache_cuda import ShutDownError  # noqa: E402
from omni_cache_cuda._faults import FAULT_ERRORS, OneShot  # noqa: E402
from omni_cache_cuda.vllm import (  # noqa: E402
    VLLM_CPU_VERSION_CHECKED,
    ExportStoppedError,
    load_request_rows,
)
from omni_cache_cuda.vllm._export import ENDED_BY_ENGINE, ENDED_BY_SHUTDOWN  # noqa: E402
from tests.vllm_engine import harness as h  # noqa: E402
from tests.vllm_engine.sinks import FOLDER_ENV  # noqa: E402

SINK = "tests.vllm_engine.sinks:record"
FAILING_SINK = "tests.vllm_engine.sinks:failing"


def test_the_cpu_build_checked_is_the_one_installed() -> None:
    assert vllm.__version__.startswith(VLLM_CPU_VERSION_CHECKED)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return h.build_model(str(tmp_path_factory.mktemp("model")))


@pytest.fixture
def folders(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> tuple[str, str]:
    """The file sink's folder, and the callable sink's (through the environment: it reaches
    vLLM's spawned engine process)."""
    sink_dir, callback_dir = str(tmp_path / "rows"), str(tmp_path / "callback")
    os.makedirs(callback_dir)
    monkeypatch.setenv(FOLDER_ENV, callback_dir)
    return sink_dir, callback_dir


def compare(
    done: dict[str, h.Finished],
    references: list[torch.Tensor],
    sink_dir: str,
    callback_dir: str | None,
    *,
    dtype: str,
    wait_s: float,
    engine_runs_ahead: bool,
) -> dict[str, Any]:
    """Check every request's file (and callable-sink record) against the recompute."""
    figures: dict[str, Any] = {
        "requests": len(done),
        "rows": 0,
        "largest_difference": 0.0,
        "aborted_with_rows": 0,
        "aborted_without_rows": 0,
        "rows_after_the_abort": 0,
        "chunked_prefills": 0,
        "ended_at_shutdown": 0,
    }
    for (req, seen), reference in zip(done.items(), references, strict=True):
        aborted = seen.finish_reason == "abort"
        try:
            rows = load_request_rows(sink_dir, req, timeout_s=wait_s)
        except FileNotFoundError:
            # Only a request aborted before any of its positions was computed has no rows.
            assert aborted, f"{req} ended ({seen.finish_reason}) without a file"
            figures["aborted_without_rows"] += 1
            continue
        n = rows.positions.numel()
        assert rows.positions.tolist() == list(range(n)), f"{req}: positions not 0..{n - 1}"
        # The positions whose tokens the caller saw: those the recompute can check.
        known = n
        if aborted:
            # A spawned engine steps on its own while the caller reads: an abort can reach it
            # some steps after the caller's last output, and positions computed in between have
            # rows but no token the caller saw. Their count is bounded by the request's budget.
            limit = seen.prompt_len + seen.max_tokens - 1 if engine_runs_ahead else len(seen.tokens)
            assert n <= limit, f"{req}: {n} rows, at most {limit} possible"
            known = min(n, len(seen.tokens))
            figures["aborted_with_rows"] += 1
            figures["rows_after_the_abort"] += n - known
        else:
            assert n == len(seen.tokens) - 1, f"{req}: {n} rows for {len(seen.tokens)} tokens"
        assert rows.hidden_states is not None and rows.hidden_states.shape == (n, h.HIDDEN)
        assert rows.hidden_states.dtype == getattr(torch, dtype)
        got, want = rows.hidden_states[:known].float(), reference[:known].float()
        atol, rtol = h.TOLERANCE[dtype]
        diff = (got - want).abs().max().item()
        assert torch.allclose(got, want, atol=atol, rtol=rtol), f"{req}: rows differ by {diff}"
        figures["largest_difference"] = max(figures["largest_difference"], diff)
        figures["rows"] += known
        assert rows.ended in (ENDED_BY_ENGINE, ENDED_BY_SHUTDOWN)
        figures["ended_at_shutdown"] += rows.ended == ENDED_BY_SHUTDOWN
        if callback_dir is None:
            continue
        record = torch.load(os.path.join(callback_dir, rows.request_id + ".pt"))
        spans = record["spans"]
        assert [s for s, _ in spans] == [0] + [e for _, e in spans[:-1]], f"{req}: {spans}"
        assert spans[-1][1] == n, f"{req}: the callable got {spans[-1][1]} of {n} positions"
        assert torch.equal(record["rows"], rows.hidden_states), f"{req}: sinks disagree"
        figures["chunked_prefills"] += spans[0][1] < seen.prompt_len
    return figures


def run_and_compare(
    model: str,
    folders: tuple[str, str],
    *,
    dtype: str,
    in_process: bool,
    requests: int = 32,
    seed: int = 1,
) -> dict[str, Any]:
    sink_dir, callback_dir = folders
    workload = h.Workload.shared_prefixes(requests=requests, seed=seed)
    kwargs = h.omni_engine_kwargs(model, dtype=dtype, num_blocks=8, sink_dir=sink_dir, sink=SINK)
    with h.engine(in_process=in_process, **kwargs) as llm:
        # Two requests aborted in the middle of their outputs, one (likely) before it ran.
        long = [i for i, n in enumerate(workload.max_tokens) if n >= 12]
        mid = dict.fromkeys(long[:2], 4)
        done = h.drive(llm, workload, abort_at={long[-1]: 2}, abort_after=mid)
        (counts,) = llm.collective_rpc("omni_cache_counts")
    references = h.reference_rows(model, [seen.tokens for seen in done.values()], dtype=dtype)
    figures = compare(
        done,
        references,
        sink_dir,
        callback_dir,
        dtype=dtype,
        wait_s=0.0 if in_process else 30.0,
        engine_runs_ahead=not in_process,
    )
    figures.update(
        {
            "hits": counts["started_with_hit"],
            "same_step_hit_rows": counts["hit_rows"]["THIS_STEP"],
            "pool_hit_rows": counts["hit_rows"]["POOL"],
            "preemptions": counts["preempted"],
            "resumes_with_hit": counts["resumed_with_hit"],
        }
    )
    print(f"\n{dtype} {'in-process' if in_process else 'spawned'}: {figures}")
    # The run exercised what the test claims.
    assert figures["hits"] > 0 and figures["pool_hit_rows"] > 0
    assert figures["same_step_hit_rows"] > 0
    assert figures["preemptions"] > 0 and figures["resumes_with_hit"] > 0
    assert figures["chunked_prefills"] > 0
    assert figures["aborted_with_rows"] > 0
    assert (
        max(len(p) for p in workload.prompts)
        > h.engine_kwargs(model, dtype=dtype, num_blocks=8)["max_num_batched_tokens"]
    )
    # Every step but the last is materialized by now (the last one at the engine's shutdown).
    assert counts["steps_saved"] - 1 <= counts["steps_consumed"] <= counts["steps_saved"]
    assert counts["steps_exported"] <= counts["steps_consumed"]
    return figures


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_in_process_engine_delivers_every_position_as_recomputed(
    model: str, folders: tuple[str, str], dtype: str
) -> None:
    figures = run_and_compare(model, folders, dtype=dtype, in_process=True)
    # In-process, vLLM stops after the last output: the last requests are named ended only
    # by the shutdown, and their files are written then.
    assert figures["ended_at_shutdown"] > 0


def test_spawned_engine_process_delivers_every_position_as_recomputed(
    model: str, folders: tuple[str, str]
) -> None:
    figures = run_and_compare(model, folders, dtype="float32", in_process=False, seed=2)
    assert figures["ended_at_shutdown"] == 0  # the engine process runs the step that names them


# ---------------------------------------------------------------------------------------------
# A failure in a hook stops the export: nothing after it is served or written.


def _arm(worker: Any, point: str, skip: int) -> None:
    worker = getattr(worker, "worker", worker)
    worker.model_runner.omni_cache_export.cache.manager._inject_fault(point, OneShot(skip=skip))


def _export_of(worker: Any) -> Any:
    return getattr(worker, "worker", worker).model_runner.omni_cache_export


@pytest.mark.parametrize(
    ("point", "skip"),
    [("page_copy", 40), ("pool_write", 40), ("gather", 5), ("sink", 30)],
    ids=["save copy", "pool write", "hit gather", "callable sink"],
)
def test_a_failure_stops_the_engine_and_no_row_is_served_after_it(
    model: str,
    folders: tuple[str, str],
    monkeypatch: pytest.MonkeyPatch,
    point: str,
    skip: int,
) -> None:
    sink_dir, _ = folders
    workload = h.Workload.shared_prefixes(requests=32, seed=3)
    monkeypatch.setenv("OMNI_CACHE_TEST_FAIL_AT", str(skip))
    sink = FAILING_SINK if point == "sink" else None
    kwargs = h.omni_engine_kwargs(
        model, dtype="float32", num_blocks=8, sink_dir=sink_dir, sink=sink
    )
    seen: dict[str, h.Finished] = {}
    with h.engine(in_process=True, **kwargs) as llm:
        if point != "sink":
            llm.collective_rpc(_arm, args=(point, skip))
        with pytest.raises(Exception) as raised:  # which one: the chain is checked below
            h.drive(llm, workload, seen=seen)
        chain = []
        error: BaseException | None = raised.value
        while error is not None:
            chain.append(error)
            error = error.__cause__ or error.__context__
        wanted = RuntimeError if point == "sink" else FAULT_ERRORS[point]
        assert any(isinstance(e, wanted) for e in chain), chain
        (export,) = llm.collective_rpc(_export_of)
        written = sorted(os.listdir(sink_dir))
        assert export.counts()["failed"] is not None
        # Every later hook refuses, and the cache serves nothing more.
        with pytest.raises(ExportStoppedError):
            export.save(
                torch.zeros(1, h.HIDDEN), req_ids=[], num_tokens_unpadded=0, num_tokens_padded=1
            )
        with pytest.raises(ShutDownError):
            export.cache.materialize(0, [])
    assert sorted(os.listdir(sink_dir)) == written, "a file was written after the failure"
    # The files written before the failure are complete and equal the recompute.
    ended = {r: s for r, s in seen.items() if s.finish_reason is not None}
    files = {r: s for r, s in ended.items() if os.path.exists(_file_of(sink_dir, r))}
    assert files, "no request finished before the failure: move the fault later"
    references = h.reference_rows(model, [s.tokens for s in files.values()], dtype="float32")
    figures = compare(
        files, references, sink_dir, None, dtype="float32", wait_s=0.0, engine_runs_ahead=False
    )
    print(f"\nfault at {point}: {figures}, files {len(written)}")


def _file_of(sink_dir: str, req: str) -> str:
    try:
        return load_request_rows(sink_dir, req, timeout_s=0.0).path
    except FileNotFoundError:
        return os.path.join(sink_dir, "missing")
