"""A deterministic workload with shared prefixes: a few "system prompts" and random user turns."""

from __future__ import annotations

import numpy as np
from attrs import field, frozen
from attrs.validators import ge, gt

__all__ = ["RequestSpec", "WorkloadConfig", "make_workload"]


@frozen(kw_only=True)
class RequestSpec:
    """One request of the workload.

    Attributes:
        req_id: Request id.
        prompt: Prompt token ids.
        max_tokens: Output length at which the request finishes.
        arrival_step: First engine step at which the request may be scheduled.
        abort_after: Output length at which the client aborts it, or None if it runs to the end.
    """

    req_id: str
    prompt: tuple[int, ...]
    max_tokens: int = field(validator=gt(0))
    arrival_step: int = field(validator=ge(0))
    abort_after: int | None = None


@frozen(kw_only=True)
class WorkloadConfig:
    """Sizes of the workload; every length range is inclusive.

    Attributes:
        num_requests: Number of requests.
        num_system_prompts: Number of shared prefixes the requests draw from.
        system_len: Range of system prompt lengths.
        user_len: Range of per-request suffix lengths.
        output_len: Range of output lengths.
        no_system_every: Every n-th request has no system prompt at all (0: never).
        abort_every: Every n-th request is aborted half way through its output (0: never).
        arrivals_per_step: Mean number of requests arriving per engine step.
        vocab_size: Token ids are drawn from ``1 .. vocab_size - 1``.
        seed: Seed of every random choice.
    """

    num_requests: int = field(default=200, validator=gt(0))
    num_system_prompts: int = field(default=8, validator=gt(0))
    system_len: tuple[int, int] = (48, 192)
    user_len: tuple[int, int] = (4, 80)
    output_len: tuple[int, int] = (1, 24)
    no_system_every: int = field(default=10, validator=ge(0))
    abort_every: int = field(default=17, validator=ge(0))
    arrivals_per_step: float = field(default=3.0, validator=gt(0))
    vocab_size: int = field(default=512, validator=gt(1))
    seed: int = field(default=0, validator=ge(0))


def make_workload(config: WorkloadConfig) -> tuple[RequestSpec, ...]:
    """Draw the requests of a workload.

    System prompts are picked with a skewed (Zipf-like) popularity, so a few prefixes stay hot in
    the KV prefix cache while the cold ones are evicted and recomputed now and then.

    Args:
        config: Sizes and seed.

    Returns:
        The requests in arrival order.
    """
    rng = np.random.default_rng(config.seed)

    def draw_len(bounds: tuple[int, int]) -> int:
        return int(rng.integers(bounds[0], bounds[1] + 1))

    def draw_tokens(n: int) -> tuple[int, ...]:
        return tuple(int(t) for t in rng.integers(1, config.vocab_size, size=n))

    systems = [draw_tokens(draw_len(config.system_len)) for _ in range(config.num_system_prompts)]
    weights = 1.0 / np.arange(1, config.num_system_prompts + 1)
    weights /= weights.sum()
    gaps = rng.exponential(1.0 / config.arrivals_per_step, size=config.num_requests)
    arrivals = np.floor(np.cumsum(gaps) - gaps[0]).astype(int)
    specs = []
    for i in range(config.num_requests):
        number = i + 1
        no_system = config.no_system_every and number % config.no_system_every == 0
        system = () if no_system else systems[int(rng.choice(len(systems), p=weights))]
        prompt = system + draw_tokens(draw_len(config.user_len))
        max_tokens = draw_len(config.output_len)
        aborted = config.abort_every and number % config.abort_every == 0 and max_tokens >= 2
        specs.append(
            RequestSpec(
                req_id=f"req-{i:04d}",
                prompt=prompt,
                max_tokens=max_tokens,
                arrival_step=int(arrivals[i]),
                abort_after=max_tokens // 2 if aborted else None,
            )
        )
    return tuple(specs)
