"""Verification of drafts against the target model: lossless for greedy and sampled requests.

A sequence with drafts d_0 .. d_{k-1} has k + 1 logit rows: row j is the target distribution p_j
of the token at the position d_j proposes (row k: the position after the last draft). Greedy
accepts d_j while it is row j's argmax and then takes the argmax of the first row that differs
(or of row k: the bonus token), so the tokens are exactly those of one-token steps.

Sampled requests follow the rejection sampler of speculative sampling (vLLM's), whose draft
distribution q is here one-hot (an n-gram drafts deterministically): d_j is accepted with
probability min(1, p_j(d_j) / q(d_j)) = p_j(d_j); on rejection the token is drawn from
max(0, p_j - q) renormalised, i.e. p_j without d_j. Every token is thus distributed as p_j.
One uniform u serves each emitted token: u < p(d) accepts, and on rejection (u - p(d)) /
(1 - p(d)) is again uniform on [0, 1) and draws from the residual. So a sequence still draws
exactly one uniform per token, as sequence.skip_draws counts for a resumed request.
"""

from __future__ import annotations

import torch

from afdserve.engine.sampler import draw_uniform, filtered_probs, pick, process_logits
from afdserve.engine.sequence import Sequence


def verify(
    logits: torch.Tensor, seqs: list[Sequence], drafts: list[tuple[int, ...]]
) -> list[list[int]]:
    """Each sequence's accepted drafts and the one token after them. `logits`
    [sum(1 + len(d)), vocab]: each sequence's k + 1 rows in order. Only position-independent
    processing reaches here (speculative.why_not_speculating keeps the rest out)."""
    counts = [len(d) + 1 for d in drafts]
    if logits.dim() != 2 or logits.shape[0] != sum(counts):
        raise ValueError(
            f"verify: logits of shape {tuple(logits.shape)} for {sum(counts)} verification rows"
        )
    row_seqs = [seq for seq, count in zip(seqs, counts, strict=True) for _ in range(count)]
    processed = process_logits(logits.float(), row_seqs)  # [rows, vocab]
    argmax = processed.argmax(dim=-1).tolist()
    sampled_rows = [row for row, seq in enumerate(row_seqs) if not seq.params.greedy]
    probs = sorted_ids = None
    if sampled_rows:
        index = torch.tensor(sampled_rows, device=logits.device)
        probs, sorted_ids = filtered_probs(processed[index], [row_seqs[r] for r in sampled_rows])
        place = {row: i for i, row in enumerate(sampled_rows)}
    results, start = [], 0
    for seq, draft in zip(seqs, drafts, strict=True):
        if seq.params.greedy:
            results.append(_greedy(argmax[start : start + len(draft) + 1], draft))
        else:
            first = place[start]
            rows = slice(first, first + len(draft) + 1)
            results.append(_sampled(seq, draft, probs[rows], sorted_ids[rows]))
        start += len(draft) + 1
    return results


def _greedy(targets: list[int], draft: tuple[int, ...]) -> list[int]:
    tokens = []
    for proposed, target in zip(draft, targets, strict=False):
        if proposed != target:
            break
        tokens.append(proposed)
    tokens.append(targets[len(tokens)])
    return tokens


def _sampled(
    seq: Sequence, draft: tuple[int, ...], probs: torch.Tensor, sorted_ids: torch.Tensor
) -> list[int]:
    """probs, sorted_ids: [k + 1, vocab], each row's filtered distribution (sampler's order)."""
    tokens = []
    for j, proposed in enumerate(draft):
        u = draw_uniform(seq)
        row = probs[j].double()
        column = (sorted_ids[j] == proposed).nonzero()
        total = row.sum()
        p_draft = (row[column[0, 0]] / total).item() if column.numel() and total > 0 else 0.0
        if u.item() < p_draft:
            tokens.append(proposed)
            continue
        residual = probs[j].clone()
        if column.numel():
            residual[column[0, 0]] = 0.0
        if not (residual > 0).any():  # all mass on the draft: rejection has probability 0
            residual = probs[j]
        rest = ((u - p_draft) / (1.0 - p_draft)).clamp(0.0, 1.0 - 1e-16)
        tokens.append(int(pick(residual[None], sorted_ids[j][None], rest[None].to(row.device))))
        return tokens
    u = draw_uniform(seq).to(probs.device)
    tokens.append(int(pick(probs[-1:], sorted_ids[-1:], u[None])))
    return tokens
