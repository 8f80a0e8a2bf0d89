"""Token-budget scheduler of one attention rank.

There is no prefill phase and no decode phase. Every sequence has `num_computed_tokens` (positions
whose KV is in the cache) and `num_tokens`; a step moves some sequences' `num_computed_tokens`
forward. A decode is just a sequence that is one token behind; a prompt is a sequence that is many
tokens behind and may be caught up over several steps (chunked prefill). A step samples a token for
every sequence it brings level with the end of its `token_ids`. The policy is `Scheduler.schedule`'s
docstring; preemption (by recompute) is `Scheduler._make_room`'s. With speculative decoding a
decoding sequence may also carry drafts (engine/speculative.py): rows past its `token_ids` that
the step verifies, keeping the accepted ones (`Scheduler.update`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from afdserve.engine.block_manager import BlockManager
from afdserve.engine.sequence import Sequence, SequenceStatus
from afdserve.engine.speculative import Drafter

FINISH_REASONS = ("stop", "length", "abort")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 512
    chunked_prefill: bool = True

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"SchedulerConfig.{name}={value!r}: must be an integer >= 1")
        if not isinstance(self.chunked_prefill, bool):
            raise ValueError(
                f"SchedulerConfig.chunked_prefill={self.chunked_prefill!r}: must be a bool"
            )
        # Without chunking a whole sequence (up to max_model_len - 1 tokens after a preemption)
        # must fit in one step, or it could never be scheduled.
        if not self.chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"SchedulerConfig.max_num_batched_tokens={self.max_num_batched_tokens}: must be "
                f">= max_model_len={self.max_model_len} when chunked_prefill is False"
            )


@dataclass
class ScheduledSeq:
    """Computes positions `[seq.num_computed_tokens, + num_new_tokens)` of `seq` this step;
    with `draft_ids`, the last of them are the drafts that follow `token_ids`."""

    seq: Sequence
    num_new_tokens: int
    draft_ids: tuple[int, ...] = ()
    # Fixed at construction: `update` advances the sequence, and the answer must not change.
    _samples: bool = field(init=False, repr=False)

    def __post_init__(self) -> None:
        end = self.seq.num_computed_tokens + self.num_new_tokens
        limit = self.seq.num_tokens + len(self.draft_ids)
        if self.num_new_tokens < 1 or end > limit or (self.draft_ids and end != limit):
            raise ValueError(
                f"ScheduledSeq.num_new_tokens={self.num_new_tokens}: must be in "
                f"[1, {self.seq.num_uncomputed_tokens}] for {self.seq!r}, reaching its "
                f"{len(self.draft_ids)} drafts' end when it has any"
            )
        self._samples = end == limit

    @property
    def samples(self) -> bool:
        """The step reaches the end of `token_ids`, so a token is sampled for this sequence."""
        return self._samples


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq]
    preempted: list[Sequence]

    @property
    def num_tokens(self) -> int:
        return sum(entry.num_new_tokens for entry in self.scheduled)

    @property
    def num_reqs(self) -> int:
        return len(self.scheduled)

    @property
    def uniform_decode(self) -> bool:
        """Every sequence decodes: its last token, and its drafts when it has any (at most
        num_speculative_tokens, which the decode graphs' query length allows for)."""
        return bool(self.scheduled) and all(
            entry.num_new_tokens == 1 + len(entry.draft_ids) and entry.samples
            for entry in self.scheduled
        )

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, block_manager: BlockManager, drafter: Drafter | None = None
    ) -> None:
        self.config = config
        self.block_manager = block_manager
        self.drafter = drafter
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: the last one is preempted first
        self._unfinished: dict[str, Sequence] = {}
        self.num_preemptions = 0  # since start

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def add(self, seq: Sequence) -> None:
        if seq.status is not SequenceStatus.WAITING or seq.num_computed_tokens or seq.block_table:
            raise ValueError(f"Scheduler.add: {seq!r} must be a new waiting sequence")
        if seq.request_id in self._unfinished:
            raise ValueError(f"Scheduler.add: request_id {seq.request_id!r} is already in use")
        if seq.num_tokens >= self.config.max_model_len:
            raise ValueError(
                f"Scheduler.add: prompt of {seq.request_id!r} has {seq.num_tokens} tokens; it must "
                f"be shorter than max_model_len={self.config.max_model_len} to leave room for "
                f"one generated token"
            )
        self._unfinished[seq.request_id] = seq
        self.waiting.append(seq)

    def abort(self, request_id: str) -> Sequence | None:
        seq = self._unfinished.get(request_id)
        if seq is not None:
            self.finish(seq, "abort")
        return seq

    def finish(self, seq: Sequence, reason: str) -> None:
        if reason not in FINISH_REASONS:
            raise ValueError(
                f"Scheduler.finish: reason={reason!r}: must be one of {FINISH_REASONS}"
            )
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self._retire(seq, reason)

    def schedule(self) -> SchedulerOutput:
        """One step's work, within a budget of `max_num_batched_tokens` tokens:
        1. Running sequences first, in admission order: each takes `min(uncomputed, budget)`
           tokens, i.e. 1 for a decode, a chunk for a prefill still in progress.
        2. Then waiting sequences, strictly FIFO (a waiting sequence never overtakes an earlier
           one), while budget, `max_num_seqs` and free blocks for this chunk allow; a prompt is
           cut to the remaining budget when `chunked_prefill`, else admitted only whole. No
           admission in a step that had to preempt.
        With prefix caching a waiting sequence first takes the cached blocks of its longest cached
        prefix (engine/block_manager.py) and starts at `num_computed_tokens` = their positions:
        the step counts, and the plan sees, only the tokens it computes. Blocks are allocated for
        exactly the positions computed in the step. A decoding sequence also takes its drafts
        (`_drafts`) as more new tokens."""
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        preempted: list[Sequence] = []

        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            num_new = min(seq.num_uncomputed_tokens, budget)
            drafts = self._drafts(seq, budget)
            num_new += len(drafts)
            if not self._make_room(seq, num_new, preempted):
                break  # `seq` preempted itself; it was the last running sequence
            self.block_manager.allocate(seq, seq.num_computed_tokens + num_new)
            scheduled.append(ScheduledSeq(seq, num_new, drafts))
            budget -= num_new
            index += 1

        while (
            not preempted
            and self.waiting
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            seq = self.waiting[0]
            bm = self.block_manager
            cached = bm.cached_prefix(seq)
            num_cached = len(cached) * bm.block_size
            num_new = seq.num_tokens - num_cached
            if num_new > budget:
                if not self.config.chunked_prefill:
                    break
                num_new = budget
            if not bm.fits_alone(num_cached + num_new):
                raise self._too_small(seq, num_cached + num_new)
            if not bm.can_admit(seq, cached, num_cached + num_new):
                break
            self.waiting.popleft()
            if bm.prefix_caching:
                bm.take_cached(seq, cached)
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = num_cached
            bm.allocate(seq, num_cached + num_new)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new

        return SchedulerOutput(scheduled, preempted)

    def update(
        self, output: SchedulerOutput, sampled: list[int | list[int] | None]
    ) -> list[Sequence]:
        """`sampled`: per scheduled sequence its sampled token, or for one with drafts the
        accepted drafts and the token after them (engine/rejection.py); None when it does not
        sample. Stop conditions are checked token by token: a stop ends the list there."""
        if len(sampled) != len(output.scheduled):
            raise ValueError(
                f"Scheduler.update: {len(sampled)} sampled entries for "
                f"{len(output.scheduled)} scheduled sequences"
            )
        finished: list[Sequence] = []
        for entry, token in zip(output.scheduled, sampled, strict=True):
            seq = entry.seq
            tokens = [token] if isinstance(token, int) else token
            if entry.samples != (tokens is not None) or (
                tokens is not None and not 1 <= len(tokens) <= len(entry.draft_ids) + 1
            ):
                raise ValueError(
                    f"Scheduler.update: {seq.request_id!r} samples={entry.samples} with "
                    f"{len(entry.draft_ids)} drafts but got {token!r}"
                )
            if seq.is_finished:
                continue  # aborted while its step was in flight; its blocks are already free
            # Rejected drafts' positions are not computed: their KV slots are overwritten later,
            # and no block holding them is registered for prefix reuse.
            rejected = len(entry.draft_ids) - (len(tokens) - 1 if tokens else 0)
            computed = seq.num_computed_tokens + entry.num_new_tokens - rejected
            reason = None
            for new in tokens or ():
                seq.token_ids.append(new)
                reason = self._stop_reason(seq, new)
                if reason is not None:
                    break
            seq.num_computed_tokens = min(computed, seq.num_tokens)
            self.block_manager.register(seq)
            if reason is not None and seq.params.logprobs is not None:
                del seq.output_logprobs[seq.num_output_tokens :]  # of the tokens a stop cut off
            if reason is not None:
                self._retire(seq, reason)
                finished.append(seq)
        if finished:
            self.running = [seq for seq in self.running if not seq.is_finished]
        return finished

    def _drafts(self, seq: Sequence, budget: int) -> tuple[int, ...]:
        """Drafts for a decoding sequence, within the step's budget, max_model_len (the drafts
        and the token after them must fit) and the blocks free now: drafts never preempt."""
        if self.drafter is None or seq.num_uncomputed_tokens != 1:
            return ()
        limit = min(budget - 1, self.config.max_model_len - seq.num_tokens - 1)
        drafts = self.drafter.propose(seq, limit)
        if drafts and not self.block_manager.can_grow(seq, seq.num_tokens + len(drafts)):
            return ()
        return drafts

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        params = seq.params
        # The sampler masks stop tokens during min_tokens; this also covers a row it had to
        # leave unmasked (every token was a stop token).
        may_stop = seq.num_output_tokens > params.min_tokens
        if may_stop and token in params.stop_token_ids:
            return "stop"
        eos = not params.ignore_eos and seq.eos_token_id is not None and token == seq.eos_token_id
        if may_stop and eos:
            return "stop"
        if seq.num_output_tokens >= params.max_tokens:
            return "length"
        if seq.num_tokens >= self.config.max_model_len:
            return "length"
        return None

    def _make_room(self, seq: Sequence, num_new: int, preempted: list[Sequence]) -> bool:
        """Preempt from the back of `running` (the most recently admitted first) until `seq` can
        get the blocks for `num_new` more positions. Returns False when `seq` itself had to be
        preempted. Preemption is by recompute: a victim frees its blocks, drops to
        `num_computed_tokens = 0` and returns to the front of the waiting queue, keeping its
        generated tokens, which are recomputed like prompt tokens. Sampling is therefore
        unaffected: each token is still sampled exactly once, from the same prefix."""
        positions = seq.num_computed_tokens + num_new
        while not self.block_manager.can_grow(seq, positions):
            # Alone yet short: where slots live in the pool's pages, its own slot may sit low
            # in the pages its blocks need; preempted, it comes back into the topmost slot.
            bm = self.block_manager
            alone = self.running[-1] is seq and len(self.running) == 1
            if alone and not (bm.slot_pages and bm.fits_alone(positions)):
                raise self._too_small(seq, num_new)
            victim = self.running.pop()
            self.block_manager.free(victim)
            victim.num_computed_tokens = 0
            victim.status = SequenceStatus.WAITING
            # Victims leave newest first, so each goes in front of the one preempted before it:
            # the waiting queue keeps admission order.
            self.waiting.appendleft(victim)
            preempted.append(victim)
            self.num_preemptions += 1
            if victim is seq:
                return False
        return True

    def _too_small(self, seq: Sequence, num_new: int) -> RuntimeError:
        positions = seq.num_computed_tokens + num_new
        bm = self.block_manager
        slot = f" and its state slot's {bm.slot_pages}" if bm.slot_pages else ""
        return RuntimeError(
            f"KV cache too small: request {seq.request_id!r} alone needs "
            f"{bm.blocks_for(positions)} blocks for {positions} positions{slot}, but the cache "
            f"holds {bm.num_blocks} blocks of {bm.block_size} tokens "
            f"({bm.num_blocks * bm.block_size} positions)"
        )

    def _retire(self, seq: Sequence, reason: str) -> None:
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        del self._unfinished[seq.request_id]
