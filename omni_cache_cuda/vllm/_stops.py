"""Where vLLM cuts a drafted step's sampled tokens: the stop rules the scheduler applies.

A drafted step's sampler returns the accepted drafts and one more token for each request
(``ModelRunnerOutput.sampled_token_ids``). The scheduler then appends them one by one and stops
at the first that ends the request (``vllm/v1/core/sched/utils.py`` ``check_stop``: the EOS
token, a stop token id, the length cap of ``max_tokens`` or ``max_model_len``; ``min_tokens`` is
kept by the sampler, which never samples a stop before it), dropping the rest. Accepted drafts
after that point are not tokens of the request, so their rows must not be handed out: a
computed count taken from the sampled ids is cut where the scheduler cuts them (SPEC-2). The
rules are read from the request's ``SamplingParams`` when it is scheduled new.

A request with repetition detection (``SamplingParams.repetition_detection``) can be stopped by
a rule not repeated here: `stop_rule_of` returns None for it, and the caller leaves that
request's drafts to the next step's records.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["NO_STOP_RULE", "StopRule", "stop_rule_of"]


class StopRule:
    """One request's stop conditions, as the scheduler checks them after each new token."""

    __slots__ = ("eos", "max_len", "max_tokens", "prompt_len", "stops")

    def __init__(
        self,
        *,
        prompt_len: int,
        max_tokens: int | None,
        max_len: int | None,
        eos: int | None,
        stops: Sequence[int],
    ) -> None:
        self.prompt_len = prompt_len
        self.max_tokens = max_tokens
        self.max_len = max_len
        self.eos = eos
        self.stops = frozenset(stops)

    def kept(self, num_tokens: int, sampled: Sequence[int]) -> int:
        """How many of `sampled`, appended to a request of `num_tokens` tokens, the scheduler
        keeps: up to and including the first that stops the request."""
        out = num_tokens - self.prompt_len
        for j, token in enumerate(sampled, 1):
            if token == self.eos or token in self.stops:
                return j
            if (self.max_len is not None and num_tokens + j >= self.max_len) or (
                self.max_tokens is not None and out + j >= self.max_tokens
            ):
                return j
        return len(sampled)


#: For a request without sampling parameters (nothing the scheduler would stop it on).
NO_STOP_RULE = StopRule(prompt_len=0, max_tokens=None, max_len=None, eos=None, stops=())


def stop_rule_of(new_request: Any, max_len: int | None) -> StopRule | None:
    """The stop rule of a request scheduled new (vLLM's ``NewRequestData``, read duck-typed),
    or None when the request's stops are not all known here (see the module docstring)."""
    params = getattr(new_request, "sampling_params", None)
    if params is None:
        return NO_STOP_RULE
    if getattr(params, "repetition_detection", None) is not None:
        return None
    prompt = getattr(new_request, "prompt_token_ids", None)
    if prompt is None:
        embeds = getattr(new_request, "prompt_embeds", None)
        if embeds is None:
            return None
        prompt_len = int(embeds.shape[0])
    else:
        prompt_len = len(prompt)
    return StopRule(
        prompt_len=prompt_len,
        max_tokens=getattr(params, "max_tokens", None),
        max_len=max_len,
        eos=getattr(params, "eos_token_id", None),
        stops=getattr(params, "stop_token_ids", None) or (),
    )
