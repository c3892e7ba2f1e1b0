"""The README's vLLM example runs as written in vLLM's real CPU engine (spawned, the default).

The example names ``model``, ``rows_dir`` and ``prompts``; the test gives it the tiny model, a
folder and token-id prompts over a shared prefix, and a `vllm.LLM` with the CPU build's
arguments (block size, eager mode, no tokenizer) bound in, since the example leaves them out.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

from tests.vllm_engine import require_engine

vllm = require_engine()

from tests.vllm_engine import harness as h  # noqa: E402

README = Path(__file__).resolve().parents[2] / "README.md"


def _example_source() -> str:
    section = README.read_text().split("### Switched on by configuration", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match is not None, "the README lost its vLLM example"
    return match.group(1)


def test_the_readme_example_writes_every_requests_rows(tmp_path: Any) -> None:
    model = h.build_model(str(tmp_path / "model"))
    head = list(range(3, 3 + 2 * h.BLOCK_SIZE))  # two shared blocks: later prompts hit them
    prompts = [{"prompt_token_ids": [*head, *range(100 + i, 110 + 3 * i)]} for i in range(6)]
    options = h.engine_kwargs(model, dtype="float32", num_blocks=32)
    del options["model"]
    namespace: dict[str, Any] = {"model": model, "rows_dir": str(tmp_path / "rows")}
    namespace["prompts"] = prompts
    with h._env("VLLM_ENABLE_V1_MULTIPROCESSING", "1"):
        source = _example_source().replace(
            "from vllm import LLM, SamplingParams", "from vllm import SamplingParams"
        )
        namespace["LLM"] = functools.partial(vllm.LLM, **options)
        exec(compile(source, str(README), "exec"), namespace)
        namespace["llm"].llm_engine.engine_core.shutdown()
    outputs = namespace["outputs"]
    assert len(outputs) == len(prompts)
    for out, prompt in zip(outputs, prompts, strict=True):
        rows = namespace["load_request_rows"](namespace["rows_dir"], out.request_id)
        n = len(prompt["prompt_token_ids"]) + len(out.outputs[0].token_ids) - 1
        assert rows.positions.tolist() == list(range(n))
        assert rows.hidden_states is not None and rows.hidden_states.shape == (n, h.HIDDEN)
