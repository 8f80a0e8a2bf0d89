"""Token sampling: logits processing (grammar, allowed_token_ids, bad_words, min_tokens,
logit_bias, penalties), greedy, temperature, min-p, top-k, top-p, per-request seeds, logprobs.
The order is documented on SamplingParams."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from afdserve.engine.logprobs import Entry, entries
from afdserve.engine.sequence import Sequence
from afdserve.engine.structured import GrammarState


@dataclass
class SampleResult:
    token_ids: list[int]
    # Per row: {token: Logprob} for the sampled token plus the top `params.logprobs` tokens,
    # from the unmodified log_softmax(logits); None where the request asked for no logprobs.
    logprobs: list[Entry | None]


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> SampleResult:
    """Sample one token per row of `logits` [n, vocab] for `seqs[row]`."""
    if logits.dim() != 2 or logits.shape[0] != len(seqs):
        raise ValueError(
            f"sample: logits of shape {tuple(logits.shape)} for {len(seqs)} sequences; "
            f"expected [{len(seqs)}, vocab]"
        )
    logits = logits.float()  # [n, vocab]
    processed = process_logits(logits, seqs)  # [n, vocab]

    greedy_rows = [row for row, seq in enumerate(seqs) if seq.params.greedy]
    random_rows = [row for row, seq in enumerate(seqs) if not seq.params.greedy]
    if not random_rows:  # all greedy: no gather, no index to copy over
        tokens = processed.argmax(dim=-1)
    else:
        tokens = torch.empty(len(seqs), dtype=torch.long, device=logits.device)
        if greedy_rows:
            index = torch.tensor(greedy_rows, device=logits.device)
            tokens[index] = processed[index].argmax(dim=-1)
        index = torch.tensor(random_rows, device=logits.device)
        tokens[index] = _draw(processed[index], [seqs[row] for row in random_rows])

    token_ids = tokens.tolist()
    return SampleResult(token_ids, _logprobs(logits, tokens, seqs))


def process_logits(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """min_tokens, logit_bias, then the penalties: what may change even a greedy choice.
    Returns `logits` itself when no row asks for any of them. [n, vocab] -> [n, vocab]"""
    vocab = logits.shape[-1]
    constrained = [row for row, s in enumerate(seqs) if s.params.structured_outputs is not None]
    if constrained:  # the grammar first: nothing below may bring back a token it forbids
        logits = constrain(logits, seqs, constrained)
    if any(s.params.allowed_token_ids is not None or s.params.bad_words for s in seqs):
        logits = ban(logits, seqs)
    masked = [row for row, s in enumerate(seqs) if s.num_output_tokens < s.params.min_tokens]
    biased = [row for row, s in enumerate(seqs) if s.params.logit_bias]
    penalized = [row for row, s in enumerate(seqs) if s.params.penalized]
    if not (masked or biased or penalized):
        return logits
    out = logits.clone()
    for row in masked:  # the stop tokens may not end the request yet
        seq = seqs[row]
        stops = set(seq.params.stop_token_ids)
        if not seq.params.ignore_eos and seq.eos_token_id is not None:
            stops.add(seq.eos_token_id)
        ids = [t for t in stops if t < vocab]
        out[row, ids] = -torch.inf
    for row in biased:
        bias = {t: v for t, v in seqs[row].params.logit_bias.items() if t < vocab}
        ids = torch.tensor(list(bias), dtype=torch.long, device=out.device)
        out[row, ids] += torch.tensor(list(bias.values()), device=out.device)
    if penalized:
        index = torch.tensor(penalized, device=out.device)
        out[index] = _penalize(out[index], [seqs[row] for row in penalized])
    # A row whose every token was masked (min_tokens over a stop list that covers the vocabulary)
    # has nothing to sample: it falls back to the model's own (grammar-masked) logits, not NaN.
    empty = ~torch.isfinite(out).any(dim=-1, keepdim=True)  # [n, 1]
    return torch.where(empty, logits, out)


def _penalize(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Repetition penalty over prompt and output tokens, then frequency and presence penalties
    over output tokens (OpenAI's formula). [m, vocab] -> [m, vocab]"""
    device, vocab = logits.device, logits.shape[-1]

    def counts(token_lists: list[list[int]]) -> torch.Tensor:  # [m, vocab]
        rows = [row for row, ids in enumerate(token_lists) for _ in ids]
        ids = [min(t, vocab - 1) for ids in token_lists for t in ids]
        result = torch.zeros(len(seqs), vocab, device=device)
        result.index_put_(
            (
                torch.tensor(rows, dtype=torch.long, device=device),
                torch.tensor(ids, dtype=torch.long, device=device),
            ),
            torch.ones(len(ids), device=device),
            accumulate=True,
        )
        return result

    output = counts([s.output_token_ids for s in seqs])
    prompt = counts([s.token_ids[: s.num_prompt_tokens] for s in seqs])
    repetition = torch.tensor([s.params.repetition_penalty for s in seqs], device=device)[:, None]
    frequency = torch.tensor([s.params.frequency_penalty for s in seqs], device=device)[:, None]
    presence = torch.tensor([s.params.presence_penalty for s in seqs], device=device)[:, None]
    seen = (output + prompt) > 0
    scaled = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(seen, scaled, logits)
    return logits - frequency * output - presence * (output > 0).float()


def _draw(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Temperature, then min-p, top-k, top-p, then one inverse-CDF draw per row.
    [m, vocab] -> [m]"""
    probs, sorted_ids = filtered_probs(logits, seqs)
    # Uniforms come from each row's own CPU generator when seeded, else from torch's default CPU
    # generator; one [m] copy to the device instead of moving [m, vocab] probabilities. Exactly
    # one draw per row: a resumed sequence skips one per token it had (sequence.skip_draws).
    uniform = torch.stack([draw_uniform(s) for s in seqs]).to(logits.device)
    return pick(probs, sorted_ids, uniform)


def draw_uniform(seq: Sequence) -> torch.Tensor:
    """One float64 uniform in [0, 1) from the sequence's generator (torch's default unseeded)."""
    return torch.rand((), generator=seq.generator, dtype=torch.float64)


def filtered_probs(logits: torch.Tensor, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's sampling distribution after temperature, min-p, top-k and top-p, sorted by
    descending logit: (probs [m, vocab] summing to 1, the token of each column [m, vocab])."""
    device, vocab = logits.device, logits.shape[-1]
    temperature = torch.tensor([s.params.temperature for s in seqs], device=device)
    # Clipped to the vocabulary here, in Python: a huge top_k would not fit a torch integer.
    top_k = torch.tensor(
        [min(s.params.top_k, vocab) if s.params.top_k >= 1 else vocab for s in seqs],
        device=device,
    )
    top_p = torch.tensor([s.params.top_p for s in seqs], device=device)
    min_p = torch.tensor([s.params.min_p for s in seqs], device=device)

    # Stable sort: ties keep vocabulary order, so a row's result never depends on its batch.
    sorted_logits, sorted_ids = torch.sort(
        logits / temperature[:, None], dim=-1, descending=True, stable=True
    )  # [m, vocab]
    rank = torch.arange(vocab, device=device)
    probs = torch.softmax(sorted_logits, dim=-1)
    # min-p: drop tokens less likely than min_p times the most likely one (column 0 once sorted).
    probs = probs.masked_fill(probs < min_p[:, None] * probs[:, :1], 0.0)
    probs = probs.masked_fill(rank >= top_k[:, None], 0.0)
    probs = probs / probs.sum(dim=-1, keepdim=True)
    # Keep a token while the mass strictly before it is below top_p: the smallest prefix whose
    # mass reaches top_p, never empty. top_p == 1 keeps all, whatever the rounding of the sums.
    mass_before = torch.cumsum(probs, dim=-1) - probs
    keep = (mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0)
    probs = probs.masked_fill(~keep, 0.0)
    return probs, sorted_ids


def pick(probs: torch.Tensor, sorted_ids: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """The inverse-CDF draw of each row at `uniform` [m] (float64 in [0, 1)): the token whose
    mass interval holds uniform x the row's total. [m, vocab] -> [m]"""
    cdf = torch.cumsum(probs.double(), dim=-1)  # [m, vocab]
    target = uniform[:, None] * cdf[:, -1:]
    position = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    # u * total can round up to total; the draw must still land on a token with mass: at most
    # the last column that has some (a row with no mass at all, NaN logits, takes column 0).
    columns = torch.arange(probs.shape[-1], device=probs.device)
    last = torch.where(probs > 0, columns, 0).amax(dim=-1)
    position = torch.minimum(position, last)
    return sorted_ids.gather(-1, position[:, None]).squeeze(-1)


def _logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, seqs: list[Sequence]
) -> list[Entry | None]:
    wanted = [seq.params.logprobs for seq in seqs]
    if all(k is None for k in wanted):
        return [None] * len(seqs)
    return entries(torch.log_softmax(logits, dim=-1), tokens, wanted)  # [n, vocab] in


def banned_tokens(seq: Sequence) -> list[int]:
    """vLLM's bad_words over the output so far: a one-token word is always banned; a longer
    word's last token is banned when the output ends with the word's other tokens."""
    ids = seq.params.bad_words_token_ids
    if seq.params.bad_words and ids is None:
        raise ValueError(f"bad_words of {seq.request_id!r} reached the sampler untokenized")
    output = seq.output_token_ids
    banned = []
    for word in ids or ():
        prefix = word[:-1]
        if len(prefix) <= len(output) and (not prefix or tuple(output[-len(prefix) :]) == prefix):
            banned.append(word[-1])
    return banned


def ban(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """allowed_token_ids keeps only its tokens; bad_words masks theirs. A row they mask
    entirely (an allowed set that is all bad words) keeps the logits it came with rather than
    turning into NaN, as `process_logits` does for min_tokens. [n, vocab] -> [n, vocab]"""
    out = logits.clone()
    vocab = logits.shape[-1]
    for row, seq in enumerate(seqs):
        allowed = seq.params.allowed_token_ids
        if allowed is not None:
            keep = torch.zeros(vocab, dtype=torch.bool, device=out.device)
            keep[[t for t in allowed if t < vocab]] = True
            out[row] = out[row].masked_fill(~keep, -torch.inf)
        banned = [t for t in banned_tokens(seq) if t < vocab]
        if banned:
            out[row, banned] = -torch.inf
    empty = ~torch.isfinite(out).any(dim=-1, keepdim=True)  # [n, 1]
    return torch.where(empty, logits, out)


def constrain(logits: torch.Tensor, seqs: list[Sequence], rows: list[int]) -> torch.Tensor:
    """Masks the forbidden tokens of every constrained row. [n, vocab] -> [n, vocab]"""
    out = logits.clone()
    vocab = logits.shape[-1]
    for row in rows:
        seq = seqs[row]
        if seq.grammar is None:
            seq.grammar = GrammarState(seq.params.structured_outputs)
        allowed = seq.grammar.allowed(seq.output_token_ids, vocab, logits.device)
        out[row] = out[row].masked_fill(~allowed, -torch.inf)
    return out
