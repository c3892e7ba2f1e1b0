"""Drive vLLM's real scheduler with speculative decoding and a fake runner that proposes drafts.

Only imported by the tests in this folder, after ``pytest.importorskip("vllm")``.

`SpecEngine` is a `harness.Engine` (the tiny offline model config, one full-attention KV group,
the real v1 `Scheduler`, the fake runner, the builder thread, the exactly-once oracle) with an
n-gram `SpeculativeConfig` of ``K`` draft tokens, built offline from the target model and
parallel configs (``shared/notes/vllm-speculative.md``), under synchronous scheduling: the cache
refuses speculative decoding with async scheduling (SPEC-6).

The engine loop is vLLM's sync engine core: ``schedule`` -> execute -> ``update_from_output``
-> ``update_draft_token_ids`` with the runner's drafts. The runner is `harness.Engine`'s: a row
at a draft position is the model's output for the *draft* token, so a wrong draft gives a wrong
row (SPEC-3 says it must never be delivered) and an accepted one gives the oracle row; it
samples like vLLM's rejection sampler with a greedy target (the drafts equal to the true tokens,
as a prefix, plus the next true token: its ``ModelRunnerOutput.sampled_token_ids`` entry). This
engine adds the drafter: for every request sampled for, up to ``K`` drafts, each (seeded RNG)
either the token the model will sample at that position or a wrong one, so steps accept all,
none or some of their drafts.

Materialize modes (`Mode`):

- ``LATE``: a builder thread materializes each step after the next step's ``step_begin``
  (whose ``num_computed_tokens`` confirms the drafts, SPEC-2): it hands out exactly the
  accepted rows of every confirmed draft.
- ``EARLY``: right after the save, without sampled ids: the step hands out its confirmed rows,
  the request's next step reads the accepted ones back (SPEC-4).
- ``SAMPLED``: right after the save, with the step's sampled token ids: the step hands out
  exactly its accepted rows itself.
- ``LATE_SAMPLED``: a builder thread after the next step_begin, with the sampled ids (what the
  drop-in worker does): exactly the accepted rows, even of a request that ended meanwhile.

In LATE and EARLY the accepted drafts of a step whose request is finished, aborted or
preempted before its next step are never confirmed, so that step does not hand them out
(SPEC-5); the oracle treats those positions as not promised, unless a later hit covers them
(the cache leaves their rows as written and vLLM hashes their block: the hit serves them) or
they are recomputed after a resume, and checks that each delivered row is right and delivered
once.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from typing import Any

from vllm.config import ParallelConfig, SpeculativeConfig, VllmConfig
from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput
from vllm.v1.request import RequestStatus

from tests.vllm.harness import (
    VOCAB,
    Admission,
    Counts,
    Engine,
    StepOfRequest,
    make_vllm_config,
)


class Mode(enum.Enum):
    LATE = "late"  # builder thread, after the next step_begin, no sampled ids
    EARLY = "early"  # right after the save, no sampled ids
    SAMPLED = "sampled"  # right after the save, with sampled_token_ids
    LATE_SAMPLED = "late-sampled"  # builder thread, after the next step_begin, with sampled ids


def make_spec_vllm_config(k: int, *, async_scheduling: bool = False, **kwargs: Any) -> VllmConfig:
    """`harness.make_vllm_config` plus an n-gram speculative config of ``k`` drafts."""
    base = make_vllm_config(async_scheduling=async_scheduling, **kwargs)
    parallel = ParallelConfig()
    speculative = SpeculativeConfig(
        method="ngram",
        num_speculative_tokens=k,
        target_model_config=base.model_config,
        target_parallel_config=parallel,
    )
    return VllmConfig(
        model_config=base.model_config,
        cache_config=base.cache_config,
        scheduler_config=base.scheduler_config,
        device_config=base.device_config,
        parallel_config=parallel,
        speculative_config=speculative,
    )


@dataclasses.dataclass
class SpecCounts(Counts):
    verifications: int = 0  # request-steps that carried drafts
    drafts: int = 0  # draft tokens scheduled
    placeholder_drafts: int = 0  # [-1] drafts the scheduler padded a request with
    accepted: int = 0
    rejected: int = 0
    all_accepted: int = 0  # verifications accepting every draft
    none_accepted: int = 0
    some_accepted: int = 0  # 0 < accepted < drafts
    preempted_unconfirmed: int = 0  # preempted with its last step's drafts unconfirmed
    resumes_after_rejection: int = 0  # the step before the preemption rejected drafts
    stop_inside_drafts: int = 0  # the stop token was an accepted draft with tokens after it
    cut_by_max_tokens: int = 0  # accepted tokens past max_tokens that vLLM dropped
    rows_read_back: int = 0  # accepted rows handed out by the request's next step (SPEC-4)
    rows_past_end: int = 0  # accepted rows at positions >= final length - 1 (delivered)
    hits_over_unconfirmed: int = 0  # a hit on rows of drafts accepted but unconfirmed at an end
    hit_rows_over_unconfirmed: int = 0  # their positions, each delivered once and checked
    rows_not_promised: int = 0  # below final length - 1, accepted, never confirmed (SPEC-5)

    def line(self) -> str:
        return (
            f"drafts={self.drafts} accepted={self.accepted} rejected={self.rejected} "
            f"all/none/some={self.all_accepted}/{self.none_accepted}/{self.some_accepted} "
            f"preemptions={self.preemptions} resumes_after_rejection="
            f"{self.resumes_after_rejection} stop_inside_drafts={self.stop_inside_drafts} "
            f"aborts={self.aborts} same_step_hits={self.same_step_hits} "
            f"read_back={self.rows_read_back} past_end={self.rows_past_end} "
            f"not_promised={self.rows_not_promised} "
            f"hits_over_unconfirmed={self.hits_over_unconfirmed} "
            f"hit_rows_over_unconfirmed={self.hit_rows_over_unconfirmed} "
            f"rows_checked={self.rows_checked}"
        )


class SpecAdmission(Admission):
    """An admission with the positions owed to it and its drafts awaiting confirmation."""

    def __init__(self, req_id: str, number: int, prompt: Sequence[int]) -> None:
        super().__init__(req_id, number, prompt)
        self.promised: set[int] = set()  # positions the cache must deliver
        self.pending: StepOfRequest | None = None  # last drafted step awaiting confirmation
        self.last_rejected = False  # the last step rejected drafts

    def __repr__(self) -> str:
        return f"SpecAdmission({self.req_id!r}#{self.number})"


class SpecEngine(Engine):
    """The real sync `Scheduler` with speculative decoding, a fake drafting runner, the cache."""

    counts_type = SpecCounts
    admission_type = SpecAdmission
    # The ends of unconfirmed drafts are keyed by request id (`before_step_begin`).
    reuses_ids = False
    counts: SpecCounts
    admissions: list[SpecAdmission]  # type: ignore[assignment]
    current: dict[str, SpecAdmission]  # type: ignore[assignment]

    def __init__(
        self,
        *,
        k: int,
        mode: Mode,
        v2_runner: bool,
        threaded: bool,
        monkeypatch: Any,
        num_blocks: int = 34,
        max_num_seqs: int = 12,
        **engine: Any,
    ) -> None:
        self.k = k
        self.mode = mode
        # Slots holding rows of drafts the sampler accepted but the cache had not confirmed when
        # their request was preempted or ended (SPEC-5 leaves them as written), until rewritten.
        self.unconfirmed_slots: set[int] = set()
        self.unconfirmed_hits: list[str] = []  # what each such hit was, for the report
        # (admission, positions) of every hit over such slots: the oracle's checks of them.
        self.hits_over: list[tuple[SpecAdmission, set[int]]] = []
        super().__init__(
            async_scheduling=False,
            v2_runner=v2_runner,
            threaded=threaded,
            num_blocks=num_blocks,
            max_num_seqs=max_num_seqs,
            monkeypatch=monkeypatch,
            **engine,
        )

    def make_config(self, **kwargs: Any) -> VllmConfig:
        return make_spec_vllm_config(self.k, **kwargs)

    # --- confirmation of drafts (SPEC-2, SPEC-5) ---

    def _confirm(self, adm: SpecAdmission) -> None:
        """The cache learned the acceptance of the admission's pending drafted step."""
        p = adm.pending
        if p is not None:
            with adm.lock:
                adm.promised.update(range(p.confirmed_end, p.accepted_end))
            adm.pending = None

    def _end_unconfirmed(self, adm: SpecAdmission) -> None:
        """The admission is preempted or ends before a step_begin confirmed its last drafts."""
        p = adm.pending
        if p is None:
            return
        self.counts.preempted_unconfirmed += adm.req_id in self.preempted
        self.unconfirmed_slots.update(p.slots[p.confirmed_end - p.start : p.accepted_end - p.start])
        if self.mode is Mode.LATE_SAMPLED:
            self._confirm(adm)  # its materialize will report the sampled ids (SPEC-2)
        adm.pending = None

    # --- the hooks of `Engine` ---

    def before_step_begin(self, so: Any) -> None:
        # No step_begin will confirm the last drafts of these (SPEC-5).
        for rid in so.preempted_req_ids or ():
            self._end_unconfirmed(self.current[rid])
        for rid in so.finished_req_ids:
            if rid in self.current:
                self._end_unconfirmed(self.current[rid])

    def running(self, adm: Admission) -> None:
        # SPEC-2: this step's count confirms the request's last drafts.
        assert isinstance(adm, SpecAdmission)
        self._confirm(adm)

    def joined(self, adm: Admission, hit: int, resumed: bool) -> None:
        assert isinstance(adm, SpecAdmission)
        self.counts.resumes_after_rejection += resumed and adm.last_rejected
        with adm.lock:
            adm.promised.update(range(hit))

    def computed(self, adm: Admission, step: StepOfRequest, drafts: list[int]) -> None:
        assert isinstance(adm, SpecAdmission)
        kd = len(drafts)
        a = step.accepted_end - step.confirmed_end
        if kd:
            c = self.counts
            c.verifications += 1
            c.drafts += kd
            c.placeholder_drafts += sum(t == -1 for t in drafts)
            c.accepted += a
            c.rejected += kd - a
            c.all_accepted += a == kd
            c.none_accepted += a == 0
            c.some_accepted += 0 < a < kd
        adm.last_rejected = a < kd
        with adm.lock:
            adm.promised.update(range(step.start, step.confirmed_end))
        adm.pending = step if kd else None

    def after_forward(
        self, joining: list[tuple[str, int, list[int]]], written: dict[int, int]
    ) -> None:
        bs = self.block_size
        # Rewritten slots hold this step's rows (a same-step hit reads those).
        self.unconfirmed_slots -= written.keys()
        for rid, hit, blocks in joining:
            # vLLM hashes a block once its tokens are known, accepted drafts included: a hit
            # may cover rows no count confirmed, left as written (SPEC-5).
            over = {
                p
                for p in range(hit // bs * bs)
                if blocks[p // bs] * bs + p % bs in self.unconfirmed_slots
            }
            if over:
                adm = self.current[rid]
                self.counts.hits_over_unconfirmed += 1
                self.hits_over.append((adm, over))
                self.unconfirmed_hits.append(
                    f"step {self.step_index}: {adm} joined with a hit of {hit} covering "
                    f"{len(over)} slot(s) of accepted drafts unconfirmed when their request was "
                    "preempted or ended"
                )

    def deliver(
        self,
        step_id: int,
        order: tuple[str, ...],
        admissions: dict[str, Admission],
        sampled: dict[str, list[int]],
    ) -> None:
        if self.mode in (Mode.LATE, Mode.LATE_SAMPLED):
            ids = sampled if self.mode is Mode.LATE_SAMPLED else None
            self.hand_to_builder((step_id, order, admissions, ids))
        else:
            ids = sampled if self.mode is Mode.SAMPLED else None
            if ids is not None:
                # SPEC-2: the materialize's sampled ids confirm the drafts.
                for rid in order:
                    adm = admissions[rid]
                    assert isinstance(adm, SpecAdmission)
                    self._confirm(adm)
            self.check_step(step_id, order, admissions, ids)

    def checked(self, adm: Admission, step: StepOfRequest, start: int, end: int) -> None:
        if not step.joining and start < step.start:
            self.counts.rows_read_back += min(end, step.start) - start

    # --- the drafter, in the engine loop ---

    def update(self, so: Any, out: ModelRunnerOutput) -> None:
        super().update(so, out)
        sampled = {r: out.sampled_token_ids[out.req_id_to_index[r]] for r in out.req_ids}
        for rid, ids in sampled.items():
            adm = self.current[rid]
            request = adm.request
            assert request is not None
            if ids and request.is_finished():
                kept = len(request.all_token_ids) - (len(self.runner_tokens[rid]) - len(ids))
                if kept < len(ids):  # vLLM dropped accepted tokens after the end
                    if request.status == RequestStatus.FINISHED_STOPPED:
                        self.counts.stop_inside_drafts += 1
                    else:
                        self.counts.cut_by_max_tokens += 1
        # The engine core hands the runner's drafts to the scheduler (sync scheduling).
        self.scheduler.update_draft_token_ids(self.propose(sampled))

    def propose(self, sampled: dict[str, list[int]]) -> DraftTokenIds:
        """The drafter: up to K drafts per request sampled for, right or wrong (seeded)."""
        req_ids, drafts = [], []
        for rid, out in sampled.items():
            if not out:
                continue
            adm = self.current[rid]
            n = len(self.runner_tokens[rid])
            adm.truth.extend_to(n + self.k)
            true = adm.truth.tokens[n : n + self.k]
            r = self.rng.random()
            if r < 0.3:
                right = [True] * self.k  # all accepted
            elif r < 0.5:
                right = [False] + [self.rng.random() < 0.5 for _ in range(self.k - 1)]
            else:
                right = [self.rng.random() < 0.7 for _ in range(self.k)]
            ids = [
                t if ok else 1 + (t + self.rng.randrange(VOCAB - 2)) % (VOCAB - 1)
                for t, ok in zip(true, right, strict=True)
            ]
            for t, ok, x in zip(true, right, ids, strict=True):
                assert (x == t) == ok
            if self.rng.random() < 0.1:
                ids = ids[: self.rng.randrange(self.k + 1)]  # the n-gram matched less
            req_ids.append(rid)
            drafts.append(ids)
        return DraftTokenIds(req_ids, drafts)

    # --- the oracle ---

    def owed(self, adm: Admission) -> set[int]:
        """The promised positions below the final length - 1; the last token's own position
        (computed when it was an accepted draft) may come at most once, and no position past
        it: accepted drafts vLLM dropped after a stop or the length cap are not tokens of the
        request (SPEC-2: the glue cuts sampled ids where the scheduler does)."""
        assert isinstance(adm, SpecAdmission)
        request = adm.request
        assert request is not None and request.is_finished(), adm
        final = len(request.all_token_ids)
        delivered = set(adm.delivered)
        past = sorted(p for p in delivered if p >= final)
        assert not past, f"{adm}: rows delivered past its last token (length {final}): {past}"
        self.counts.rows_past_end += sum(1 for p in delivered if p >= final - 1)
        self.counts.rows_not_promised += sum(1 for p in adm.accepted - delivered if p < final - 1)
        return {p for p in adm.promised if p < final - 1}

    def check_exactly_once(self) -> None:
        super().check_exactly_once()
        # SPEC-5: every row a hit read over accepted drafts no count confirmed came once.
        for adm, over in self.hits_over:
            twice_or_never = sorted(p for p in over if adm.delivered[p] != 1)
            assert not twice_or_never, (
                f"{adm}: hit rows over unconfirmed drafts not delivered once: {twice_or_never}"
            )
            self.counts.hit_rows_over_unconfirmed += len(over)
