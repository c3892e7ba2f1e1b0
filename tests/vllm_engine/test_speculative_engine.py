"""N-gram speculative decoding inside vLLM's real CPU engine, omni-cache switched on (SPEC-1..6).

One engine run, shared by the tests of this module: requests over shared system prompts (prefix
hits), greedy, with vLLM's n-gram proposer drafting up to `K` tokens a step under synchronous
scheduling (SPEC-6: `hidden_states_engine_args` refuses a speculative config without
``async_scheduling=False``). The tiny random model repeats itself, so n-gram lookup over its
own outputs proposes drafts, some of which the rejection sampler refuses.

The oracle is the one the other real-engine tests use: each request's final token list run again
as a prompt through the same engine with prefix caching off and no speculation
(`harness.reference_rows`). A position's row depends only on the tokens up to it, so the rows
compare whatever the drafts were: a row delivered at a rejected position (SPEC-3) is the model's
output for a token the request does not have, and differs. Each delivered position comes once,
in order, from 0 (SPEC-1, SPEC-2, SPEC-4, DLV-2).

Why the engine runs in vLLM's spawned process: the n-gram proposer imports numba, and once
numba's llvmlite is loaded, vLLM 0.32's CPU build cannot start another engine in that process
(``CpuPlatform.register_triton_kernel_overrides`` scans every module's attributes and calls
``vars(value).get``; ``llvmlite.binding.ffi.lib`` answers ``__dict__`` with a function wrapper,
so the start raises ``AttributeError: '_lib_fn_wrapper' object has no attribute 'get'``). The
spawned process keeps numba out of this one, and the in-process reference engine starts.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest

from tests.vllm_engine import require_engine

vllm = require_engine()

import torch  # noqa: E402

from omni_cache_cuda.vllm import hidden_states_engine_args, load_request_rows  # noqa: E402
from omni_cache_cuda.vllm._export import ENDED_BY_ENGINE, ENDED_BY_SHUTDOWN  # noqa: E402
from tests.vllm_engine import harness as h  # noqa: E402
from tests.vllm_engine.sinks import FOLDER_ENV  # noqa: E402

K = 3
SPECULATIVE = {
    "method": "ngram",
    "num_speculative_tokens": K,
    "prompt_lookup_max": 4,
    "prompt_lookup_min": 2,
}
SINK = "tests.vllm_engine.sinks:record"
DRAFT_COUNTERS = (
    "draft_rows",
    "draft_rows_accepted",
    "draft_rows_rejected",
    "draft_rows_unconfirmed",
    "draft_rows_read_back",
)


def _draft_counts(worker: Any) -> dict[str, int]:
    """The cache core's draft counters on this worker (run in the engine process)."""
    worker = getattr(worker, "worker", worker)
    counters = worker.model_runner.omni_cache_export.cache.manager._state.core.counters
    return {name: int(getattr(counters, name)) for name in DRAFT_COUNTERS}


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Run the speculative engine once, then the reference; what both saw."""
    model = h.build_model(str(tmp_path_factory.mktemp("model")))
    root = tmp_path_factory.mktemp("speculative")
    sink_dir, callback_dir = str(root / "rows"), str(root / "callback")
    os.makedirs(callback_dir)
    workload = h.Workload.shared_prefixes(requests=16, seed=1, tail=(4, 60), max_tokens=(16, 40))
    kwargs = hidden_states_engine_args(
        sink_dir=sink_dir,
        sink=SINK,
        **h.engine_kwargs(
            model,
            dtype="float32",
            num_blocks=64,
            speculative_config=SPECULATIVE,
            async_scheduling=False,
            disable_log_stats=False,  # vLLM's spec decoding counters
        ),
    )
    longest = max(map(len, workload.prompts)) + max(workload.max_tokens)
    assert longest + K <= h.MAX_MODEL_LEN
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(FOLDER_ENV, callback_dir)
        # collective_rpc sends `_draft_counts` to the engine process by pickle.
        patch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        with h.engine(in_process=False, **kwargs) as llm:
            done = h.drive(llm, workload)
            (counts,) = llm.collective_rpc("omni_cache_counts")
            (drafts,) = llm.collective_rpc(_draft_counts)
            metrics = {m.name: m for m in llm.get_metrics()}
        assert "llvmlite.binding.ffi" not in sys.modules, (
            "numba is loaded in this process: vLLM's CPU build cannot start the reference engine"
        )
        references = h.reference_rows(model, [s.tokens for s in done.values()], dtype="float32")
    rows = {req: load_request_rows(sink_dir, req, timeout_s=30.0) for req in done}
    return {
        "done": done,
        "references": references,
        "rows": rows,
        "callback_dir": callback_dir,
        "counts": counts,
        "drafts": drafts,
        "spec_drafts": int(metrics["vllm:spec_decode_num_drafts"].value),
        "spec_draft_tokens": int(metrics["vllm:spec_decode_num_draft_tokens"].value),
        "spec_accepted": int(metrics["vllm:spec_decode_num_accepted_tokens"].value),
    }


def test_rows_under_ngram_speculation_equal_the_recompute(run: dict[str, Any]) -> None:
    """Every request's delivered rows, at the positions of its tokens, equal the recompute
    without prefix caching and without speculation; positions are 0..n-1, each once, and
    cover every computed position (n is at least the token count less one: SPEC-2, SPEC-4,
    SPEC-5). The run proposed drafts, some rejected, and started requests with prefix hits."""
    done, references = run["done"], run["references"]
    figures = {"requests": len(done), "rows": 0, "largest_difference": 0.0}
    for (req, seen), reference in zip(done.items(), references, strict=True):
        assert seen.finish_reason == "length", (req, seen.finish_reason)
        rows = run["rows"][req]
        n = rows.positions.numel()
        assert rows.positions.tolist() == list(range(n)), f"{req}: positions not 0..{n - 1}"
        tokens = len(seen.tokens)
        # A request's last output token was computed too when it came as an accepted draft.
        assert n >= tokens - 1, f"{req}: {n} rows for {tokens} tokens"
        assert rows.ended in (ENDED_BY_ENGINE, ENDED_BY_SHUTDOWN)
        assert rows.hidden_states is not None and rows.hidden_states.dtype == torch.float32
        m = min(n, tokens)  # rows past the last token: the next test
        got, want = rows.hidden_states[:m], reference[:m]
        atol, rtol = h.TOLERANCE["float32"]
        diff = (got - want).abs().max().item()
        assert torch.allclose(got, want, atol=atol, rtol=rtol), f"{req}: rows differ by {diff}"
        # The callable sink got the same rows, span after span.
        record = torch.load(os.path.join(run["callback_dir"], rows.request_id + ".pt"))
        spans = record["spans"]
        assert [s for s, _ in spans] == [0] + [e for _, e in spans[:-1]], f"{req}: {spans}"
        assert spans[-1][1] == n and torch.equal(record["rows"], rows.hidden_states), req
        figures["rows"] += m
        figures["largest_difference"] = max(figures["largest_difference"], diff)
    counts, drafts = run["counts"], run["drafts"]
    figures.update(
        {
            "vllm_drafts": run["spec_drafts"],
            "vllm_draft_tokens": run["spec_draft_tokens"],
            "vllm_accepted": run["spec_accepted"],
            **drafts,
            "hits": counts["started_with_hit"],
            "pool_hit_rows": counts["hit_rows"]["POOL"],
        }
    )
    print(f"\nn-gram k={K}: {figures}")
    # The run exercised what the test claims: drafts proposed, some accepted, some rejected,
    # by vLLM's counts and by the cache's (SPEC-1, SPEC-3); prefix hits.
    assert 0 < run["spec_accepted"] < run["spec_draft_tokens"]
    assert drafts["draft_rows"] == run["spec_draft_tokens"]
    assert drafts["draft_rows_accepted"] > 0 and drafts["draft_rows_rejected"] > 0
    assert figures["hits"] > 0 and figures["pool_hit_rows"] > 0
    assert counts["failed"] is None


def test_no_row_is_delivered_past_a_requests_last_token(run: dict[str, Any]) -> None:
    """A request's rows stop at its last token (SPEC-2, SPEC-3: a row past it belongs to a
    draft that vLLM dropped when the request reached ``max_tokens``, a token the request does
    not have; the glue cuts the sampled ids where the scheduler does)."""
    over = {
        req: (run["rows"][req].positions.numel(), len(seen.tokens))
        for req, seen in run["done"].items()
        if run["rows"][req].positions.numel() > len(seen.tokens)
    }
    assert not over, f"(rows, tokens) of requests with rows past their last token: {over}"
