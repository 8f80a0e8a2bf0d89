"""The gated delta rule's chunked form and its short convolution in plain torch: the CPU prefill
path and the oracle of kernels/triton/delta_chunked.py (a decode step is delta_rule.py's).

Per value head, with q and k L2-normalised and q scaled by 1/sqrt(dk), a state S [dk, dv] moves
token by token: S <- exp(g) S; u = beta (v - S^T k); S <- S + k u^T; o = S^T q.
`chunked` computes the same over chunks of C tokens. Within a chunk, with G_i the running sum of g
from its start, every u_j depends on S at the chunk start (S0) and on the u of earlier tokens only
through a strictly lower-triangular system, (I + A) U = beta V - (beta e^G K) S0 with
A[j, m] = beta_j e^(G_j - G_m) k_j . k_m (m < j), solved once per chunk; the outputs and the state
at the chunk's end then follow from S0 and U by matrix products. Sums run in float32 throughout.

Kimi Delta Attention decays each key channel on its own: g is [n, h, dk] instead of [n, h], and
exp(g) scales the state's rows. `chunked` then takes the per-channel form, whose pairwise decays
e^(G_i - G_j) are [C, C, dk] per head and chunk.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from afdserve.kernels.reference.delta_rule import l2_normalize

CHUNK = 64


def _prepare(q, k, v, g, beta, heads: int):
    """[n, h, d] inputs -> float32 [heads, n, d], the key heads repeated to the value heads."""
    if q.shape[1] != heads:
        q = q.repeat_interleave(heads // q.shape[1], dim=1)
        k = k.repeat_interleave(heads // k.shape[1], dim=1)
    q, k = l2_normalize(q.float()), l2_normalize(k.float())
    q = q * q.shape[-1] ** -0.5
    return (
        q.transpose(0, 1),
        k.transpose(0, 1),
        v.float().transpose(0, 1),
        g.float().transpose(0, 1),
        beta.float().transpose(0, 1),
    )


def chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's n tokens: q, k [n, hk, dk], v [n, hv, dv], g, beta [n, hv], state
    [hv, dk, dv] float32 or None (empty) -> (out [n, hv, dv] float32, state after them)."""
    n, heads, dk, dv = v.shape[0], v.shape[1], k.shape[-1], v.shape[-1]
    if g.dim() == 3:
        return _chunked_per_channel(q, k, v, g, beta, state, chunk)
    q, k, v, g, beta = _prepare(q, k, v, g, beta, heads)
    pad = -n % chunk
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    blocks = (n + pad) // chunk
    # [heads, blocks, chunk, d] and [heads, blocks, chunk]
    q, k, v = (t.reshape(heads, blocks, chunk, -1) for t in (q, k, v))
    g, beta = g.reshape(heads, blocks, chunk), beta.reshape(heads, blocks, chunk)
    cum = g.cumsum(-1)  # G_i
    later = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    # e^(G_i - G_j) for j <= i, 0 above the diagonal: [heads, blocks, chunk, chunk]
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(later, float("-inf")).exp()
    kb = k * beta[..., None]
    eye = torch.eye(chunk, device=q.device)
    system = ((kb @ k.transpose(-1, -2)) * decay).tril(-1) + eye  # I + A
    solve = torch.linalg.solve_triangular
    u_free = solve(system, v * beta[..., None], upper=False, unitriangular=True)
    u_of_state = solve(system, kb * cum.exp()[..., None], upper=False, unitriangular=True)
    scores = (q @ k.transpose(-1, -2)) * decay  # q_i . k_j e^(G_i - G_j), j <= i
    q_decayed = q * cum.exp()[..., None]
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]
    end_decay = cum[..., -1].exp()[..., None, None]
    s = torch.zeros(heads, dk, dv, device=q.device) if state is None else state.float()
    out = torch.empty(heads, blocks, chunk, dv, device=q.device)
    for b in range(blocks):
        u = u_free[:, b] - u_of_state[:, b] @ s
        out[:, b] = q_decayed[:, b] @ s + scores[:, b] @ u
        s = s * end_decay[:, b] + k_to_end[:, b].transpose(-1, -2) @ u
    return out.reshape(heads, -1, dv)[:, :n].transpose(0, 1), s


def _chunked_per_channel(q, k, v, g, beta, state, chunk: int):
    """`chunked` with g [n, h, dk]: the same system, each pairwise decay per key channel."""
    n, heads, dk, dv = v.shape[0], v.shape[1], k.shape[-1], v.shape[-1]
    q, k, v, g, beta = _prepare(q, k, v, g, beta, heads)  # g: [heads, n, dk]
    pad = -n % chunk
    if pad:
        q, k, v, g = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v, g))
        beta = F.pad(beta, (0, pad))
    blocks = (n + pad) // chunk
    q, k, v, g = (t.reshape(heads, blocks, chunk, -1) for t in (q, k, v, g))
    beta = beta.reshape(heads, blocks, chunk)
    cum = g.cumsum(2)  # G_i per channel: [heads, blocks, chunk, dk]
    later = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    eye = torch.eye(chunk, device=q.device)
    s = torch.zeros(heads, dk, dv, device=q.device) if state is None else state.float()
    out = torch.empty(heads, blocks, chunk, dv, device=q.device)
    for b in range(blocks):
        gb = cum[:, b]
        # e^(G_i - G_j) per channel for j <= i, 0 above the diagonal: [heads, C, C, dk]
        pair = (gb[:, :, None] - gb[:, None, :]).masked_fill(later[..., None], float("-inf"))
        pair = pair.exp()
        kb = k[:, b] * beta[:, b, :, None]
        system = (kb[:, :, None] * k[:, b, None] * pair).sum(-1).tril(-1) + eye
        solve = torch.linalg.solve_triangular
        u_free = solve(system, v[:, b] * beta[:, b, :, None], upper=False, unitriangular=True)
        u_of_state = solve(system, kb * gb.exp(), upper=False, unitriangular=True)
        u = u_free - u_of_state @ s
        scores = (q[:, b, :, None] * k[:, b, None] * pair).sum(-1)
        out[:, b] = (q[:, b] * gb.exp()) @ s + scores @ u
        end = gb[:, -1:]  # [heads, 1, dk]
        s = s * end.exp().transpose(1, 2) + (k[:, b] * (end - gb).exp()).transpose(1, 2) @ u
    return out.reshape(heads, -1, dv)[:, :n].transpose(0, 1), s


def causal_conv(
    x: torch.Tensor, window: torch.Tensor | None, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution and SiLU of one sequence's n new rows x [n, channels], after
    the window [channels, K - 1] of the inputs before them (None: zeros, the sequence's start);
    weight [channels, K]. Returns (out [n, channels], the window after them)."""
    width = weight.shape[-1] - 1
    if window is None:
        window = x.new_zeros(x.shape[1], width)
    seq = torch.cat((window.to(x.dtype), x.T), dim=-1)  # [channels, K - 1 + n]
    out = F.conv1d(seq[None], weight[:, None, :].to(x.dtype), groups=x.shape[1])[0]
    return F.silu(out).T, seq[:, seq.shape[1] - width :]


def conv_spans(
    x: torch.Tensor, weight: torch.Tensor, windows: torch.Tensor, spans: torch.Tensor
) -> torch.Tensor:
    """`causal_conv` of each span's rows: x [rows, channels], weight [channels, K], windows
    [slots, channels, K - 1] (each span's slot read, then written in place), spans [n, 4] int
    (row_start, row_end, state_slot, fresh: the span starts at position 0, an empty window; a
    span of slot -1 is skipped, the pad marker of tables sized by capacity).
    Returns out [rows, channels]; rows outside every span are zero."""
    out = torch.zeros_like(x)
    for r0, r1, slot, fresh in spans.tolist():
        if slot < 0:
            continue
        window = None if fresh else windows[slot]
        out[r0:r1], windows[slot] = causal_conv(x[r0:r1], window, weight)
    return out


def chunked_spans(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    spans: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """`chunked` over each span's rows (spans as in `conv_spans`) from its slot of states
    [slots, hv, dk, dv] float32 (empty where fresh), the final state written back in place, the
    output into out [rows, hv, dv] (rows outside every span untouched, slot -1 skipped)."""
    for r0, r1, slot, fresh in spans.tolist():
        if slot < 0:
            continue
        rows = slice(r0, r1)
        got, states[slot] = chunked(
            q[rows], k[rows], v[rows], g[rows], beta[rows], None if fresh else states[slot]
        )
        out[rows] = got.to(out.dtype)
