"""Logprob entries: what the sampler and the prompt's forward report for a token position.

An entry is `{token id: Logprob}` holding the position's own token (the sampled one, or the
prompt's next token) and the top k of the model's unmodified distribution. `Logprob` is vLLM's
shape (`.logprob`, `.rank`, `.decoded_token`) and is also the float it holds, so that code that
reads entries as numbers (sums, JSON, comparisons) keeps working unchanged.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# Rows of logits turned into log-softmax at once for a long prompt: [rows, vocab] float32 of a
# 150k vocabulary is 600 kB per row.
PROMPT_ROWS_PER_PASS = 256


class Logprob(float):
    """A token's logprob, its rank in the distribution (1 = most likely; vLLM's rule: how many
    tokens are at least as likely) and its text (filled by the frontend; None without it)."""

    __slots__ = ("rank", "decoded_token")

    def __new__(
        cls, logprob: float, rank: int | None = None, decoded_token: str | None = None
    ) -> Logprob:
        self = super().__new__(cls, logprob)
        self.rank, self.decoded_token = rank, decoded_token
        return self

    @property
    def logprob(self) -> float:
        return float(self)

    def __reduce__(self):  # pickled across the rank channel with its fields
        return (Logprob, (float(self), self.rank, self.decoded_token))

    def __repr__(self) -> str:
        return (
            f"Logprob(logprob={float(self)!r}, rank={self.rank!r}, "
            f"decoded_token={self.decoded_token!r})"
        )


Entry = dict[int, Logprob]


def entries(
    logprobs: torch.Tensor, tokens: torch.Tensor, wanted: list[int | None]
) -> list[Entry | None]:
    """Per row of `logprobs` [n, vocab] (log-softmax): its own token `tokens[row]` first, then
    the top `wanted[row]` tokens, best first; None where wanted is None."""
    if all(k is None for k in wanted):
        return [None] * len(wanted)
    own = logprobs.gather(-1, tokens[:, None])  # [n, 1]
    ranks = (logprobs >= own).sum(dim=-1).tolist()
    own_values = own.squeeze(-1).tolist()
    token_ids = tokens.tolist()
    max_k = max(k for k in wanted if k is not None)
    top_values: list[list[float]] = [[] for _ in wanted]
    top_ids: list[list[int]] = [[] for _ in wanted]
    if max_k:
        values, ids = logprobs.topk(max_k, dim=-1)  # [n, max_k]
        top_values, top_ids = values.tolist(), ids.tolist()
    result: list[Entry | None] = []
    for row, k in enumerate(wanted):
        if k is None:
            result.append(None)
            continue
        entry = {token_ids[row]: Logprob(own_values[row], ranks[row])}
        for rank, (token, value) in enumerate(zip(top_ids[row][:k], top_values[row][:k]), 1):
            entry.setdefault(token, Logprob(value, rank))
        result.append(entry)
    return result


def prompt_entries(
    logits_of: Callable[[torch.Tensor], torch.Tensor],
    rows: torch.Tensor,
    next_tokens: list[int],
    k: list[int],
) -> list[Entry]:
    """The entries of prompt positions: `logits_of(rows)` gives their logits, the model's
    prediction of `next_tokens`; computed PROMPT_ROWS_PER_PASS rows at a time."""
    out: list[Entry] = []
    targets = torch.tensor(next_tokens, dtype=torch.long, device=rows.device)
    for lo in range(0, len(next_tokens), PROMPT_ROWS_PER_PASS):
        hi = lo + PROMPT_ROWS_PER_PASS
        logprobs = torch.log_softmax(logits_of(rows[lo:hi]).float(), dim=-1)  # [m, vocab]
        out += entries(logprobs, targets[lo:hi], list(k[lo:hi]))  # type: ignore[arg-type]
    return out
