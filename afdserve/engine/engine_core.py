"""One attention rank's engine: requests in, scheduled steps through the model, token ids out.

Each step yields one `TokenDelta` per request that changed: its new token ids and logprobs, no
text. Detokenizing and stop strings are the frontend's (frontend/output_processor.py), so that the
rank's step does no per-token Python work beyond sampling.

The step is split so that the control plane fits in the middle: `schedule()` -> report
`RankStep` -> (every rank plans the same step) -> `execute(out, plan, forward, step)`. The
attention driver (engine/step_loop.py) runs that loop for every topology, colocated included.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from afdserve.config import SpeculativeConfig
from afdserve.engine.block_manager import BlockManager
from afdserve.engine.cuda_graphs import PlannedForward
from afdserve.engine.logprobs import entries, prompt_entries
from afdserve.engine.model_runner import ModelRunner, StepInputs
from afdserve.engine.mtp import MTPProposer
from afdserve.engine.rejection import verify
from afdserve.engine.requests import RequestError, RequestLimits, TokenDelta, check_request
from afdserve.engine.sampler import sample
from afdserve.engine.sampling_params import SamplingParams
from afdserve.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from afdserve.engine.sequence import Sequence
from afdserve.engine.speculative import Drafter
from afdserve.layout.plan import AttentionRankPlan, RankStep
from afdserve.model.cache import PagedCache
from afdserve.model.config import ModelConfig
from afdserve.model.parts import CausalLM, MTPDraft

log = logging.getLogger(__name__)


@dataclass
class _Tracked:
    seq: Sequence
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    emitted_tokens: int = 0
    emitted_prompt_logprobs: int = 0


class EngineCore:
    def __init__(
        self,
        model: CausalLM,
        tokenizer,
        kv_cache: PagedCache,
        scheduler_config: SchedulerConfig,
        device: torch.device,
        prefix_caching: bool = False,
        speculative: SpeculativeConfig | None = None,
        draft: MTPDraft | None = None,
    ) -> None:
        """`draft`: the MTP layer (model/checkpoint/draft.py) where `speculative` is mtp."""
        # The tokenizer only gives the eos token when the config names none: text is the
        # frontend's (frontend/output_processor.py).
        self.model, self.device = model, device
        self.config: ModelConfig = model.config
        self.kv_cache = kv_cache
        self.block_manager = BlockManager(
            kv_cache.num_blocks,
            kv_cache.block_size,
            prefix_caching,
            kv_cache.layout.blocks_for,
            kv_cache.num_slots,
            kv_cache.layout.window if kv_cache.num_window_blocks is not None else None,
            kv_cache.num_window_blocks or 0,
            kv_cache.slot_pages,
        )
        self.drafter = Drafter(speculative) if speculative is not None else None
        self.scheduler = Scheduler(scheduler_config, self.block_manager, self.drafter)
        self.runner = ModelRunner(model, kv_cache, device)
        self.mtp = None
        if speculative is not None and speculative.is_mtp:
            k = speculative.num_speculative_tokens
            self.mtp = MTPProposer(draft, model, kv_cache, device, k)
        self.max_model_len = scheduler_config.max_model_len
        self.requests: dict[str, _Tracked] = {}
        eos = self.config.eos_token_ids
        self.eos_token_id = eos[0] if eos else getattr(tokenizer, "eos_token_id", None)
        self.extra_stop_ids = tuple(eos[1:])
        self.limits = RequestLimits(
            self.max_model_len,
            self.config.vocab_size,
            kv_cache.num_blocks,
            kv_cache.block_size,
            kv_cache.slot_pages,
        )

    # ----- requests -----
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        check_request(prompt_token_ids, params, self.limits)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        output_token_ids: list[int] | tuple[int, ...] = (),
    ) -> None:
        """`output_token_ids`: a request resumed after its engine failed, with the tokens it had
        generated there. Its deltas go on counting from them; only new tokens are sent."""
        if request_id in self.requests:
            raise RequestError(f"request_id: {request_id!r} is already running")
        self.validate(prompt_token_ids, params)
        if len(output_token_ids) >= params.max_tokens or (
            len(prompt_token_ids) + len(output_token_ids) >= self.max_model_len
        ):
            raise RequestError(
                f"request {request_id!r} resumed with {len(output_token_ids)} generated tokens: "
                f"it had already reached max_tokens={params.max_tokens} or "
                f"max_model_len={self.max_model_len}",
                request_id,
            )
        if self.extra_stop_ids:
            params = _with_stop_ids(params, self.extra_stop_ids)
        seq = Sequence(request_id, prompt_token_ids, params, self.eos_token_id, output_token_ids)
        if params.logprobs is not None:  # positions the frontend already has: never sent again
            seq.output_logprobs = [None] * len(output_token_ids)
        tracked = _Tracked(seq, time.monotonic(), emitted_tokens=len(output_token_ids))
        self.requests[request_id] = tracked
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        tracked = self.requests.pop(request_id, None)
        if tracked is None:
            return False
        self.scheduler.abort(request_id)
        return True

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    # ----- steps -----
    def schedule(self) -> tuple[SchedulerOutput, RankStep]:
        out = self.scheduler.schedule()
        now = time.monotonic()
        for entry in out.scheduled:
            tracked = self.requests.get(entry.seq.request_id)
            if tracked is not None and tracked.first_scheduled_time is None:
                tracked.first_scheduled_time = now
        return out, RankStep(out.num_tokens, out.num_reqs, out.uniform_decode)

    def idle_work(self) -> SchedulerOutput:
        """What a warm-up step executes: no request, only the pad rows the plan gives."""
        return SchedulerOutput([], [])

    def execute(
        self, out: SchedulerOutput, plan: AttentionRankPlan, forward: PlannedForward, step: int
    ) -> list[TokenDelta]:
        """Runs this rank's part of a planned step. A rank with no real rows still runs its pad rows
        when the plan gives it any, so that its FFN rank receives every tile it expects."""
        if plan.padded_rows == 0 and not any(plan.tile_rows):
            return []
        inputs = self.runner.prepare(out, plan.padded_rows)
        hidden = forward(inputs, plan, step)
        if inputs.prompt_spans:
            self._prompt_logprobs(hidden, inputs)
        sampled: list[int | list[int] | None] = [None] * len(out.scheduled)
        if inputs.sample_seqs:
            sampled = self._sample(out, self.runner.logits(hidden, inputs))
        # The MTP's rows need the tokens the step kept, and the blocks a finishing sequence
        # still holds until `update` retires it; its drafts need the sequences after `update`.
        written = None
        if self.mtp is not None:
            written = self.mtp.write(out, sampled, hidden, plan, forward.boundary, step)
        self.scheduler.update(out, sampled)
        if written is not None:
            self.mtp.propose(written)
        return self._collect(out)

    def _sample(self, out: SchedulerOutput, logits: torch.Tensor) -> list[int | list[int] | None]:
        """Per scheduled sequence: its sampled token, the verified tokens of one with drafts
        (engine/rejection.py), or None. `logits`: the sampling rows in scheduled order, k + 1
        for a sequence with k drafts."""
        plain_rows, plain, spec_rows, spec = [], [], [], []
        row = 0
        for entry in out.scheduled:
            if not entry.samples:
                continue
            rows = list(range(row, row + 1 + len(entry.draft_ids)))
            if entry.draft_ids:
                spec_rows += rows
                spec.append(entry)
            else:
                plain_rows += rows
                plain.append(entry.seq)
            row += len(rows)
        by_seq: dict[int, int | list[int]] = {}
        if plain:
            # Without drafts every row samples plainly: no index to copy over (a copy from
            # pageable memory waits for the step's forward).
            rows = logits[torch.tensor(plain_rows, device=logits.device)] if spec else logits
            result = sample(rows, plain)
            by_seq.update(zip((id(s) for s in plain), result.token_ids))
            for seq, entry in zip(plain, result.logprobs, strict=True):
                if seq.params.logprobs is not None:
                    seq.output_logprobs.append(entry)
        if spec:
            index = torch.tensor(spec_rows, device=logits.device)
            drafts = [entry.draft_ids for entry in spec]
            verified = verify(logits[index], [entry.seq for entry in spec], drafts)
            for entry, tokens in zip(spec, verified, strict=True):
                by_seq[id(entry.seq)] = tokens
                self.drafter.stats.record(len(entry.draft_ids), len(tokens) - 1)
            self._verified_logprobs(logits[index], spec, verified)
        return [by_seq.get(id(entry.seq)) for entry in out.scheduled]

    def _verified_logprobs(self, logits: torch.Tensor, spec: list, verified: list) -> None:
        """Each emitted token's entry from its own row (the model's unmodified distribution
        there, as a one-token step would give it). `logits`: k + 1 rows per entry of `spec`."""
        rows, tokens, wanted, owners, at = [], [], [], [], 0
        for entry, emitted in zip(spec, verified, strict=True):
            if entry.seq.params.logprobs is not None:
                rows += range(at, at + len(emitted))
                tokens += emitted
                wanted += [entry.seq.params.logprobs] * len(emitted)
                owners += [entry.seq] * len(emitted)
            at += len(entry.draft_ids) + 1
        if not rows:
            return
        index = torch.tensor(rows, device=logits.device)
        found = entries(
            torch.log_softmax(logits[index].float(), dim=-1),
            torch.tensor(tokens, device=logits.device),
            wanted,
        )
        for seq, entry in zip(owners, found, strict=True):
            seq.output_logprobs.append(entry)

    def _prompt_logprobs(self, hidden: torch.Tensor, inputs: StepInputs) -> None:
        """The prompt's logprobs from this step's hidden rows (the prefill's own forward, on
        the attention rank, whatever the topology): each chunk adds its positions' entries."""
        targets, wanted, owners = [], [], []
        at = 0
        for seq, first, count in inputs.prompt_spans:
            if first != seq.prompt_logprobs_done:
                raise RuntimeError(
                    f"prompt logprobs of {seq.request_id!r}: position {first} "
                    f"follows {seq.prompt_logprobs_done} reported"
                )
            targets += seq.token_ids[first + 1 : first + 1 + count]
            wanted += [seq.params.prompt_logprobs] * count
            owners.append((seq, at, at + count))
            at += count
        with torch.inference_mode():
            found = prompt_entries(
                lambda r: self.model.logits(hidden[r]), inputs.prompt_rows, targets, wanted
            )
        for seq, lo, hi in owners:
            seq.prompt_logprobs.extend(found[lo:hi])

    def _collect(self, out: SchedulerOutput) -> list[TokenDelta]:
        results = []
        for entry in out.scheduled:
            tracked = self.requests.get(entry.seq.request_id)
            if tracked is not None:
                result = self._advance(tracked)
                if result is not None:
                    results.append(result)
        return results

    def _advance(self, t: _Tracked) -> TokenDelta | None:
        seq = t.seq
        new_ids = tuple(seq.token_ids[seq.num_prompt_tokens + t.emitted_tokens :])
        if not new_ids and not seq.is_finished:
            return None
        if new_ids and t.first_token_time is None:
            t.first_token_time = time.monotonic()
        # output_logprobs runs along the output tokens when logprobs were asked for, else is empty.
        new_logprobs = tuple(seq.output_logprobs[t.emitted_tokens :])
        # The prompt's logprobs go out with the first token (the last chunk of the prefill).
        new_prompt = tuple(seq.prompt_logprobs[t.emitted_prompt_logprobs :])
        t.emitted_prompt_logprobs += len(new_prompt)
        t.emitted_tokens += len(new_ids)
        if seq.is_finished:
            self.requests.pop(seq.request_id, None)
        return TokenDelta(
            seq.request_id,
            new_ids,
            new_logprobs,
            seq.is_finished,
            seq.finish_reason,
            t.emitted_tokens,
            t.arrival_time,
            t.first_scheduled_time,
            t.first_token_time,
            seq.num_cached_tokens,
            new_prompt,
        )


def _with_stop_ids(params: SamplingParams, extra: tuple[int, ...]) -> SamplingParams:
    from dataclasses import replace

    return replace(params, stop_token_ids=tuple(params.stop_token_ids) + extra)
