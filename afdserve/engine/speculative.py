"""Speculative decoding's drafts: n-gram prompt lookup (CPU, no model) or the MTP's
(engine/mtp.py), which requests may take them, and the acceptance counters vLLM's metrics report.

A decoding sequence given k drafts is scheduled with 1 + k new tokens (its last token and the
drafts): the step computes their KV and logits like any rows, the sampler verifies the drafts
(engine/rejection.py) and the scheduler keeps the accepted ones plus one more token, rolling
`num_computed_tokens` back past the rejected ones, whose KV slots a later step overwrites.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from afdserve.config import SpeculativeConfig
from afdserve.engine.sequence import Sequence


def ngram_drafts(tokens: list[int] | np.ndarray, k: int, min_n: int, max_n: int) -> tuple[int, ...]:
    """The up to `k` tokens that followed the earliest earlier occurrence of the longest suffix
    n-gram of `tokens` (min_n <= n <= max_n); () when no such n-gram occurs earlier.
    One pass over the tokens finds where the last token recurs; only those places are extended
    backwards, so a long sequence costs one vectorised comparison a step."""
    array = np.asarray(tokens, dtype=np.int64)
    length = len(array)
    if k < 1 or length < min_n + 1:
        return ()
    ends = np.flatnonzero(array[: length - 1] == array[-1])  # each occurrence's last position
    matched = np.ones(len(ends), dtype=np.int64)  # suffix tokens matched so far, per occurrence
    alive = ends
    for back in range(1, min(max_n, length - 1)):
        alive = alive[alive >= back]
        alive = alive[array[alive - back] == array[length - 1 - back]]
        if not alive.size:
            break
        matched[np.searchsorted(ends, alive)] += 1
    if not ends.size or matched.max() < min_n:
        return ()
    # The earliest occurrence of the longest n-gram ends first among those that match it.
    end = int(ends[np.argmax(matched >= matched.max())])
    return tuple(int(t) for t in array[end + 1 : end + 1 + k])


class TokenArray:
    """A sequence's tokens as a growing int64 array, so each step's lookup converts only the
    tokens appended since the last one."""

    def __init__(self) -> None:
        self.data = np.empty(64, dtype=np.int64)
        self.size = 0

    def sync(self, tokens: list[int]) -> np.ndarray:
        if len(tokens) > len(self.data):
            grown = np.empty(max(2 * len(self.data), len(tokens)), dtype=np.int64)
            grown[: self.size] = self.data[: self.size]
            self.data = grown
        self.data[self.size : len(tokens)] = tokens[self.size :]
        self.size = len(tokens)
        return self.data[: self.size]


def why_not_speculating(seq: Sequence) -> str | None:
    """Why this request takes no drafts, or None. Sampling that depends on the tokens before
    each position within the same step would need per-position state the verification does not
    carry: such a request simply decodes one token a step."""
    params = seq.params
    if params.penalized:
        return "penalties count the earlier output tokens"
    if params.bad_words:
        return "bad_words match the earlier output tokens"
    if params.structured_outputs is not None:
        return "a grammar advances with each token"
    if seq.num_output_tokens < params.min_tokens:
        return "min_tokens masks the stop tokens position by position"
    return None


@dataclass
class SpecStats:
    """Cumulative, since start (vLLM's vllm:spec_decode_* counters)."""

    num_drafts: int = 0  # sequences verified with at least one draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [k]: accepted at position i

    def record(self, drafted: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        for position in range(accepted):
            self.accepted_per_pos[position] += 1


class Drafter:
    """Proposes each decoding sequence's drafts for the coming step."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.stats = SpecStats(accepted_per_pos=[0] * config.num_speculative_tokens)

    def propose(self, seq: Sequence, limit: int) -> tuple[int, ...]:
        """At most `limit` drafts (the step's budget or max_model_len leave no more), and never
        more than the tokens `max_tokens` still allows after the one verification always adds."""
        k = min(
            self.config.num_speculative_tokens,
            limit,
            seq.params.max_tokens - seq.num_output_tokens - 1,
        )
        if k < 1 or why_not_speculating(seq) is not None:
            return ()
        if self.config.is_mtp:  # the MTP's, proposed after the last step (engine/mtp.py)
            proposed = seq.mtp_drafts
            if proposed is None or proposed[0] != seq.num_computed_tokens:
                return ()
            return proposed[1][:k]
        if seq.draft_lookup is None:
            seq.draft_lookup = TokenArray()
        tokens = seq.draft_lookup.sync(seq.token_ids)
        config = self.config
        return ngram_drafts(tokens, k, config.prompt_lookup_min, config.prompt_lookup_max)
