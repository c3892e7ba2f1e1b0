"""What the drop-in worker costs a real vLLM engine: tokens per second with and without it.

vLLM's CPU build (``bash .ci/setup-vllm cpu``), in-process (the export's output thread then
shares the interpreter with the engine, as it does in a real worker), prefix caching on in
both. A random-weight Llama large enough that the forward dominates (default hidden 2048, 8
layers, heads of 64: about 0.4 B parameters), requests over shared system prompts (prefix
hits), greedy decoding with ``ignore_eos`` so every round does the same work. Each round builds a fresh engine with and
one without omni-cache (file sink into a temporary folder), alternating which goes first, and
times only the generation. The hooks' own engine-thread time per step (``step_begin``, which
materializes the step before, and ``save``, with the copy of the step's rows into the pool) and
the output thread's (the request files) are measured inside the worker.

Prints per round the tokens per second of both and their ratio, and the process CPU time per
generated token (all threads: steadier than wall time where the machine is shared), then the
minimum, median and maximum rate of each, the median ratios, and the hooks' time per step
against the step's time.

    PYTHONPATH=. .venv-vllm-cpu/bin/python bench/vllm_engine.py [--rounds R] [--requests N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

from omni_cache_cuda.vllm import hidden_states_engine_args
from tests.vllm_engine import harness as h


def _time_hooks(worker: Any) -> None:
    """Wrap the export's engine-thread hooks with thread-CPU timers (instance attributes)."""
    export = getattr(worker, "worker", worker).model_runner.omni_cache_export
    export.hook_s = 0.0
    export.hook_wall_s = 0.0
    export.hook_calls = 0
    for name in ("step_begin", "save"):
        inner = getattr(export, name)

        def timed(*args: Any, _inner: Any = inner, **kwargs: Any) -> Any:
            start, wall = time.thread_time(), time.perf_counter()
            try:
                return _inner(*args, **kwargs)
            finally:
                export.hook_s += time.thread_time() - start
                export.hook_wall_s += time.perf_counter() - wall
                export.hook_calls += 1

        setattr(export, name, timed)


def _hook_figures(worker: Any) -> tuple[float, float, int, float]:
    export = getattr(worker, "worker", worker).model_runner.omni_cache_export
    counts = export.counts()
    return export.hook_s, export.hook_wall_s, counts["steps"], counts["output_thread_cpu_s"]


def one_run(model: str, workload: h.Workload, *, omni: bool, sink_dir: str) -> dict[str, float]:
    # The larger model needs its weights inside the memory share vLLM checks on the CPU.
    base = h.engine_kwargs(model, dtype="float32", num_blocks=256, gpu_memory_utilization=0.4)
    kwargs = hidden_states_engine_args(sink_dir=sink_dir, **base) if omni else base
    with h.engine(in_process=True, **kwargs) as llm:
        if omni:
            llm.collective_rpc(_time_hooks)
        start, cpu = time.perf_counter(), time.process_time()
        done = h.drive(llm, workload)
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        hook_s, hook_wall_s, steps, output_s = (
            llm.collective_rpc(_hook_figures)[0] if omni else (0, 0, 0, 0)
        )
    tokens = sum(len(f.tokens) - f.prompt_len for f in done.values())
    return {
        "tok_s": tokens / wall,
        "cpu_ms_per_token": cpu / tokens * 1e3,
        "wall": wall,
        "hook_s": hook_s,
        "hook_wall_s": hook_wall_s,
        "output_s": output_s,
        "steps": steps,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    folder = tempfile.mkdtemp(prefix="omni-cache-bench-")
    model = h.build_model(
        os.path.join(folder, "model"), hidden=args.hidden, layers=args.layers, vocab=4096
    )
    workload = h.Workload.shared_prefixes(
        requests=args.requests, seed=0, tail=(8, 40), max_tokens=(24, 24)
    )
    with_omni: list[dict[str, float]] = []
    without: list[float] = []
    without_cpu: list[float] = []
    for r in range(args.rounds):
        order = (True, False) if r % 2 == 0 else (False, True)
        for omni in order:
            sink_dir = tempfile.mkdtemp(dir=folder)
            run = one_run(model, workload, omni=omni, sink_dir=sink_dir)
            if omni:
                with_omni.append(run)
            else:
                without.append(run["tok_s"])
                without_cpu.append(run["cpu_ms_per_token"])
        print(
            f"round {r}: without {without[-1]:8.1f} tok/s   with {with_omni[-1]['tok_s']:8.1f} "
            f"tok/s   ratio {with_omni[-1]['tok_s'] / without[-1]:.3f}   process CPU per token "
            f"{without_cpu[-1]:.2f} -> {with_omni[-1]['cpu_ms_per_token']:.2f} ms",
            flush=True,
        )
    rates = [run["tok_s"] for run in with_omni]
    ratios = [a / b for a, b in zip(rates, without, strict=True)]
    print(f"\nmodel: hidden {args.hidden}, {args.layers} layers; {args.requests} requests x 24")
    for name, values in (("without omni-cache", without), ("with omni-cache", rates)):
        print(
            f"{name:20s} tok/s  min {min(values):8.1f}  median {statistics.median(values):8.1f}"
            f"  max {max(values):8.1f}"
        )
    print(f"median ratio with/without: {statistics.median(ratios):.3f} (target >= 0.97)")
    cpu_ratios = [w["cpu_ms_per_token"] / c for w, c in zip(with_omni, without_cpu, strict=True)]
    print(
        "process CPU per token, median ratio with/without: "
        f"{statistics.median(cpu_ratios):.3f} (the throughput ratio's inverse when nothing else "
        "runs; steadier on a shared machine)"
    )
    per_step = [run["hook_s"] / run["steps"] * 1e3 for run in with_omni]
    output_ms = [run["output_s"] / run["steps"] * 1e3 for run in with_omni]
    wall_ms = [run["hook_wall_s"] / run["steps"] * 1e3 for run in with_omni]
    step_ms = [run["wall"] / run["steps"] * 1e3 for run in with_omni]
    print(
        f"hooks on the engine thread: median {statistics.median(per_step):.3f} ms per step "
        f"(thread CPU: step_begin with the materialize, save) of a {statistics.median(step_ms):.1f} ms step "
        f"({statistics.median(p / s for p, s in zip(per_step, step_ms, strict=True)):.1%})"
    )
    print(
        f"hooks on the engine thread, wall time: median {statistics.median(wall_ms):.3f} ms per step"
    )
    print(
        f"output thread (request files): median {statistics.median(output_ms):.3f} ms CPU per step"
    )


if __name__ == "__main__":
    main()
