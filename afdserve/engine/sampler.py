"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds, logprobs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from afdserve.engine.sequence import Sequence


@dataclass
class SampleResult:
    token_ids: list[int]
    # Per row: {token: logprob} for the sampled token plus the top `params.logprobs` tokens, taken
    # from the unmodified log_softmax(logits); None where the request asked for no logprobs.
    logprobs: list[dict[int, float] | None]


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> SampleResult:
    """Sample one token per row of `logits` [n, vocab] for `seqs[row]`."""
    if logits.dim() != 2 or logits.shape[0] != len(seqs):
        raise ValueError(
            f"sample: logits of shape {tuple(logits.shape)} for {len(seqs)} sequences; "
            f"expected [{len(seqs)}, vocab]"
        )
    logits = logits.float()  # [n, vocab]
    tokens = torch.empty(len(seqs), dtype=torch.long, device=logits.device)

    greedy_rows = [row for row, seq in enumerate(seqs) if seq.params.greedy]
    random_rows = [row for row, seq in enumerate(seqs) if not seq.params.greedy]
    if greedy_rows:
        index = torch.tensor(greedy_rows, device=logits.device)
        tokens[index] = logits[index].argmax(dim=-1)
    if random_rows:
        index = torch.tensor(random_rows, device=logits.device)
        tokens[index] = _draw(logits[index], [seqs[row] for row in random_rows])

    token_ids = tokens.tolist()
    return SampleResult(token_ids, _logprobs(logits, tokens, token_ids, seqs))


def _draw(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Temperature, then top-k, then top-p, then one inverse-CDF draw per row. [m, vocab] -> [m]"""
    device, vocab = logits.device, logits.shape[-1]
    temperature = torch.tensor([s.params.temperature for s in seqs], device=device)
    top_k = torch.tensor(
        [s.params.top_k if s.params.top_k >= 1 else vocab for s in seqs], device=device
    )
    top_p = torch.tensor([s.params.top_p for s in seqs], device=device)

    # Stable sort: ties keep vocabulary order, so a row's result never depends on its batch.
    sorted_logits, sorted_ids = torch.sort(
        logits / temperature[:, None], dim=-1, descending=True, stable=True
    )  # [m, vocab]
    rank = torch.arange(vocab, device=device)
    probs = torch.softmax(sorted_logits, dim=-1).masked_fill(rank >= top_k[:, None], 0.0)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    # Keep a token while the mass strictly before it is below top_p: the smallest prefix whose
    # mass reaches top_p, never empty. top_p == 1 keeps all, whatever the rounding of the sums.
    mass_before = torch.cumsum(probs, dim=-1) - probs
    keep = (mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0)
    probs = probs.masked_fill(~keep, 0.0)

    # Uniforms come from each row's own CPU generator when seeded, else from torch's default CPU
    # generator; one [m] copy to the device instead of moving [m, vocab] probabilities.
    uniform = torch.stack(
        [torch.rand((), generator=s.generator, dtype=torch.float64) for s in seqs]
    ).to(device)
    cdf = torch.cumsum(probs.double(), dim=-1)  # [m, vocab]
    target = uniform[:, None] * cdf[:, -1:]
    position = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    # u * total can round up to total; the draw must still land on a token with mass. Those form
    # a prefix of the sorted row: the filters and underflow only zero its tail.
    position = torch.minimum(position, (probs > 0).sum(dim=-1) - 1)
    return sorted_ids.gather(-1, position[:, None]).squeeze(-1)


def _logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, token_ids: list[int], seqs: list[Sequence]
) -> list[dict[int, float] | None]:
    wanted = [seq.params.logprobs for seq in seqs]
    if all(k is None for k in wanted):
        return [None] * len(seqs)
    logprobs = torch.log_softmax(logits, dim=-1)  # [n, vocab]
    sampled = logprobs.gather(-1, tokens[:, None]).squeeze(-1).tolist()
    max_k = max(k for k in wanted if k is not None)
    top_values: list[list[float]] = [[] for _ in seqs]
    top_ids: list[list[int]] = [[] for _ in seqs]
    if max_k:
        values, ids = logprobs.topk(max_k, dim=-1)  # [n, max_k]
        top_values, top_ids = values.tolist(), ids.tolist()

    result: list[dict[int, float] | None] = []
    for row, k in enumerate(wanted):
        if k is None:
            result.append(None)
            continue
        entry = {token_ids[row]: sampled[row]}
        for token, value in zip(top_ids[row][:k], top_values[row][:k], strict=True):
            entry.setdefault(token, value)
        result.append(entry)
    return result
