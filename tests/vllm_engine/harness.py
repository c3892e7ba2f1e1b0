"""Run vLLM's real CPU engine with omni-cache switched on, and the same engine without it.

Only imported by the tests in this folder, once `conftest.py` found vLLM's CPU build.

The model: a tiny Llama (hidden 256, 2 layers, 4 heads of 64, vocabulary 512) with random
weights under a fixed seed, saved with ``save_pretrained`` into a temporary folder: nothing is
downloaded. The CPU attention backend needs a head size it has kernels for (64 is one) and a
block size that is a multiple of 32.

The oracle: `reference_rows` runs the same engine with prefix caching off on each request's
final token list (prompt and outputs) as a prompt, and records the forward's final hidden states
per (request, position) straight from the model runner (`ReferenceWorker`), with no code of
omni-cache in the path. Feeding the final tokens back as prompts makes the comparison
independent of sampling: a token that would come out differently in a second run (two logits
within rounding of each other) cannot make the two runs compute different positions.
"""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Iterator, Sequence
from typing import Any

import attrs
import torch
from vllm import LLM, SamplingParams
from vllm.v1.worker.cpu_worker import CPUWorker

from omni_cache_cuda.vllm import hidden_states_engine_args

BLOCK_SIZE = 32
HIDDEN = 256
VOCAB = 512
MAX_MODEL_LEN = 192

#: Rounding, as (absolute, relative) bounds for ``torch.allclose``: the same engine computes a
#: position in a prefill chunk, a decode step, a draft or a recompute, through other attention
#: kernels and with other batch neighbours, so the sums run in another order. float32 rows
#: differ by 2e-6 on an AVX-512 Xeon here and by 3e-5 on another CI machine's kernels; 2**-12
#: leaves a margin of 8 and still sits three orders below a wrong row (rows are of order 1).
#: bfloat16 rows differ by one of its ulps (2**-7 relative), so two are allowed.
TOLERANCE = {"float32": (2**-12, 2**-12), "bfloat16": (2**-6, 2**-6)}


def build_model(
    folder: str, *, seed: int = 0, hidden: int = HIDDEN, layers: int = 2, vocab: int = VOCAB
) -> str:
    """Save a random-weight Llama into ``folder`` (float32 weights) and return it: by default
    the tiny one; the benchmark asks for a larger one (heads of 64 either way)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 128),
        vocab_size=vocab,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    return folder


@attrs.frozen
class Workload:
    """Prompts over a few shared system prompts, and how long each request generates."""

    prompts: tuple[tuple[int, ...], ...]
    max_tokens: tuple[int, ...]

    @classmethod
    def shared_prefixes(
        cls,
        *,
        requests: int,
        seed: int,
        systems: int = 3,
        system_len: int = 2 * BLOCK_SIZE,
        tail: tuple[int, int] = (4, 90),
        max_tokens: tuple[int, int] = (6, 24),
    ) -> Workload:
        rng = random.Random(seed)
        heads = [[rng.randrange(3, VOCAB) for _ in range(system_len)] for _ in range(systems)]
        prompts = []
        lengths = []
        for _ in range(requests):
            body = [rng.randrange(3, VOCAB) for _ in range(rng.randint(*tail))]
            prompts.append((*rng.choice(heads), *body))
            lengths.append(rng.randint(*max_tokens))
        return cls(tuple(prompts), tuple(lengths))


def engine_kwargs(model: str, *, dtype: str, num_blocks: int, **overrides: Any) -> dict[str, Any]:
    """The engine arguments every run here shares (eager: torch.compile would take 30 s)."""
    return {
        "model": model,
        "skip_tokenizer_init": True,
        "block_size": BLOCK_SIZE,
        "dtype": dtype,
        "enforce_eager": True,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 128,
        "num_gpu_blocks_override": num_blocks,
        "max_model_len": MAX_MODEL_LEN,
        "seed": 0,
        # On the CPU this is the share of host memory vLLM checks is free at start-up (and
        # would size the KV cache from): the override above sets the cache's size.
        "gpu_memory_utilization": 0.1,
        **overrides,
    }


@contextlib.contextmanager
def engine(*, in_process: bool, **kwargs: Any) -> Iterator[LLM]:
    """A `vllm.LLM`, in this process or in vLLM's spawned engine process, shut down after."""
    with _env("VLLM_ENABLE_V1_MULTIPROCESSING", "0" if in_process else "1"):
        llm = LLM(**kwargs)
        try:
            yield llm
        finally:
            llm.llm_engine.engine_core.shutdown()


@contextlib.contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


@attrs.frozen
class Finished:
    """What the caller saw of one request."""

    tokens: tuple[int, ...]  # prompt and outputs
    prompt_len: int
    max_tokens: int
    finish_reason: str | None


def drive(
    llm: LLM,
    workload: Workload,
    *,
    abort_at: dict[int, int] | None = None,
    abort_after: dict[int, int] | None = None,
    seen: dict[str, Finished] | None = None,
) -> dict[str, Finished]:
    """Feed every request in, step the engine until all ended, abort some on the way.

    ``abort_at`` maps a request index to the engine step after which it is aborted (if it is
    still running), ``abort_after`` to the number of output tokens it is aborted at. Request
    ids are ``"r<index>"`` (the caller's ids; the workers see them with vLLM's suffix). What the
    caller saw is kept in ``seen`` as it comes (so a run that raises leaves it filled in).
    """
    engine_ = llm.llm_engine
    seen = {} if seen is None else seen
    for i, (prompt, n) in enumerate(zip(workload.prompts, workload.max_tokens, strict=True)):
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        engine_.add_request(f"r{i}", {"prompt_token_ids": list(prompt)}, params)
        seen[f"r{i}"] = Finished(
            tokens=prompt, prompt_len=len(prompt), max_tokens=n, finish_reason=None
        )
    pending = dict(abort_at or {})
    step = 0
    while engine_.has_unfinished_requests():
        for out in engine_.step():
            was = seen[out.request_id]
            seen[out.request_id] = attrs.evolve(
                was,
                tokens=(*was.tokens[: was.prompt_len], *out.outputs[0].token_ids),
                finish_reason=out.outputs[0].finish_reason if out.finished else None,
            )
        step += 1
        due = [f"r{i}" for i, at in pending.items() if at == step]
        due += [
            f"r{i}"
            for i, n in (abort_after or {}).items()
            if len(seen[f"r{i}"].tokens) - seen[f"r{i}"].prompt_len >= n
        ]
        live = [r for r in due if seen[r].finish_reason is None]
        if live:
            engine_.abort_request(live)
            for r in live:
                seen[r] = attrs.evolve(seen[r], finish_reason="abort")
        pending = {i: at for i, at in pending.items() if at != step}
    return seen


# ---------------------------------------------------------------------------------------------
# The oracle: the same engine, prefix caching off, rows taken from the model runner.

_CAPTURED: dict[str, dict[int, torch.Tensor]] = {}


class _CaptureRunner:
    """Records every forward row by (request, position), from vLLM's own batch and positions."""

    _reference_step: Any = None

    def execute_model(self, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        self._reference_step = scheduler_output
        try:
            return super().execute_model(scheduler_output, *args, **kwargs)  # type: ignore[misc]
        finally:
            self._reference_step = None

    def _model_forward(self, *args: Any, **kwargs: Any) -> Any:
        hidden = super()._model_forward(*args, **kwargs)  # type: ignore[misc]
        step = self._reference_step
        if step is not None:
            positions = kwargs["positions"].tolist()
            row = 0
            for req_id in self.input_batch.req_ids:  # type: ignore[attr-defined]
                n = step.num_scheduled_tokens[req_id]
                rows = _CAPTURED.setdefault(req_id, {})
                for k in range(n):
                    rows[positions[row + k]] = hidden[row + k].detach().clone()
                row += n
        return hidden


class ReferenceWorker(CPUWorker):
    """vLLM's CPU worker whose runner records its rows into this module (in-process only)."""

    def init_device(self) -> None:
        super().init_device()
        runner = self.model_runner
        runner.__class__ = type(
            "Capture" + type(runner).__name__, (_CaptureRunner, type(runner)), {}
        )


def reference_rows(
    model: str, token_lists: Sequence[Sequence[int]], *, dtype: str
) -> list[torch.Tensor]:
    """Each token list's rows at positions ``0 .. len - 1``, from an engine without prefix caching."""
    _CAPTURED.clear()
    kwargs = engine_kwargs(
        model,
        dtype=dtype,
        num_blocks=64,
        enable_prefix_caching=False,
        worker_cls=f"{__name__}.ReferenceWorker",
    )
    with engine(in_process=True, **kwargs) as llm:
        engine_ = llm.llm_engine
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        for i, tokens in enumerate(token_lists):
            engine_.add_request(f"ref{i}", {"prompt_token_ids": list(tokens)}, params)
        internal: dict[str, str] = {}
        while engine_.has_unfinished_requests():
            engine_.step()
        for req_id in _CAPTURED:
            internal[req_id.rsplit("-", 1)[0]] = req_id
    out = []
    for i, tokens in enumerate(token_lists):
        rows = _CAPTURED[internal[f"ref{i}"]]
        out.append(torch.stack([rows[p] for p in range(len(tokens))]))
    _CAPTURED.clear()
    return out


def omni_engine_kwargs(model: str, *, dtype: str, num_blocks: int, **sinks: Any) -> dict[str, Any]:
    """`engine_kwargs` through the switch under test."""
    return hidden_states_engine_args(
        **sinks, **engine_kwargs(model, dtype=dtype, num_blocks=num_blocks)
    )
