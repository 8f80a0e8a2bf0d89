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
    sampled = [(seq, d) for seq, d in zip(seqs, drafts, strict=True) if not seq.params.greedy]
    picked = iter(())
    if sampled:
        index = torch.tensor(sampled_rows, device=logits.device)
        probs, sorted_ids = filtered_probs(processed[index], [row_seqs[r] for r in sampled_rows])
        picked = iter(_sampled(sampled, probs, sorted_ids))
    results, start = [], 0
    for seq, draft in zip(seqs, drafts, strict=True):
        if seq.params.greedy:
            results.append(_greedy(argmax[start : start + len(draft) + 1], draft))
        else:
            results.append(next(picked))
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
    sampled: list[tuple[Sequence, tuple[int, ...]]], probs: torch.Tensor, sorted_ids: torch.Tensor
) -> list[list[int]]:
    """Each sampled sequence's tokens. probs, sorted_ids: [sum(k + 1), vocab], every row's
    filtered distribution (sampler's order), the sequences' rows in turn. Two host syncs for the
    whole batch: each draft's probability, then one draw per sequence (the residual of its first
    rejected row, or its bonus row), so no sync per draft."""
    proposed = [t for _, draft in sampled for t in (*draft, -1)]  # -1: a bonus row has no draft
    hit = sorted_ids == torch.tensor(proposed, device=probs.device)[:, None]  # [rows, vocab]
    mass = probs.double()
    total = mass.sum(dim=-1)
    p_draft = torch.where(total > 0, (mass * hit).sum(dim=-1) / total, 0.0).tolist()
    tokens: list[list[int]] = []
    rows, uniforms, rejected, start = [], [], [], 0
    for seq, draft in sampled:
        accepted: list[int] = []
        for j, token in enumerate(draft):
            u, p = draw_uniform(seq).item(), p_draft[start + j]
            if u < p:
                accepted.append(token)
                continue
            # Rejected: (u - p) / (1 - p) is again uniform, and draws from p without the draft.
            rows.append(start + j)
            uniforms.append(min(max((u - p) / (1.0 - p), 0.0), 1.0 - 1e-16))
            rejected.append(True)
            break
        else:
            rows.append(start + len(draft))
            uniforms.append(draw_uniform(seq).item())
            rejected.append(False)
        tokens.append(accepted)
        start += len(draft) + 1
    index = torch.tensor(rows, device=probs.device)
    chosen = probs[index]
    drop = hit[index] & torch.tensor(rejected, device=probs.device)[:, None]
    residual = chosen.masked_fill(drop, 0.0)
    # All mass on the draft: rejection had probability 0 (reached only by rounding).
    residual = torch.where((residual > 0).any(dim=-1, keepdim=True), residual, chosen)
    uniform = torch.tensor(uniforms, dtype=torch.float64, device=probs.device)
    for accepted, token in zip(tokens, pick(residual, sorted_ids[index], uniform).tolist()):
        accepted.append(token)
    return tokens
