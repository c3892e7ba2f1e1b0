"""Where the glue cuts a drafted step's sampled token ids: vLLM's stop rules (SPEC-2).

The scheduler appends a step's sampled tokens one by one and drops those after the first that
ends the request; a computed count taken from the sampled ids must stop there too, so no row
past the request's last token is handed out.
"""

from __future__ import annotations

from types import SimpleNamespace

from omni_cache_cuda.vllm._stops import NO_STOP_RULE, StopRule, stop_rule_of


def _new(prompt: int = 4, **params: object) -> SimpleNamespace:
    fields: dict[str, object] = {
        "max_tokens": 100,
        "eos_token_id": 2,
        "stop_token_ids": [7],
        "repetition_detection": None,
    }
    fields.update(params)
    return SimpleNamespace(
        req_id="a", prompt_token_ids=list(range(prompt)), sampling_params=SimpleNamespace(**fields)
    )


def test_spec_2_sampled_ids_are_cut_at_the_first_stop() -> None:
    """EOS or a stop token id ends the request with it: the tokens after it are dropped."""
    rule = stop_rule_of(_new(), max_len=None)
    assert rule is not None
    assert rule.kept(10, [5, 6, 8, 9]) == 4  # no stop: every sampled token is kept
    assert rule.kept(10, [5, 2, 8, 9]) == 2  # EOS second
    assert rule.kept(10, [7, 2, 8]) == 1  # a stop token id first
    assert rule.kept(10, [5, 6, 8, 2]) == 4  # EOS last: nothing dropped


def test_spec_2_sampled_ids_are_cut_at_the_length_caps() -> None:
    """``max_tokens`` counts output tokens (the prompt is 4 here), ``max_model_len`` all."""
    rule = stop_rule_of(_new(max_tokens=8, eos_token_id=None), max_len=None)
    assert rule is not None
    assert rule.kept(10, [5, 6, 8, 9]) == 2  # 6 output tokens so far, 8 allowed
    assert rule.kept(12, [5, 6]) == 1 and rule.kept(9, [5, 6]) == 2
    capped = stop_rule_of(_new(eos_token_id=None), max_len=12)
    assert capped is not None and capped.kept(10, [5, 6, 8]) == 2


def test_spec_2_unknown_rules() -> None:
    """Without sampling parameters nothing stops the request; with repetition detection the
    rule is not known here, and the caller leaves the count to the next step's records."""
    bare = SimpleNamespace(req_id="a", prompt_token_ids=[1, 2], sampling_params=None)
    assert stop_rule_of(bare, max_len=None) is NO_STOP_RULE
    assert NO_STOP_RULE.kept(10, [2, 7, 9]) == 3
    assert stop_rule_of(_new(repetition_detection=object()), max_len=None) is None
    embeds = SimpleNamespace(
        req_id="a",
        prompt_token_ids=None,
        prompt_embeds=SimpleNamespace(shape=(6, 16)),
        sampling_params=SimpleNamespace(max_tokens=5, eos_token_id=None, stop_token_ids=None),
    )
    rule = stop_rule_of(embeds, max_len=None)
    assert isinstance(rule, StopRule) and rule.prompt_len == 6 and rule.kept(9, [1, 1, 1]) == 2
