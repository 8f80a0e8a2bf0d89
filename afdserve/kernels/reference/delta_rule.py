"""One decode step of the gated delta rule over state slots, in plain torch: the CPU path and the
oracle of kernels/triton/delta_rule.py.

Per value head, with q and k L2-normalised and q scaled by 1/sqrt(dk), a state S [dk, dv] moves
one token: S <- exp(g) S (g per head, or per key channel: each row of S its own decay);
u = beta (v - S^T k); S <- S + k u^T; o = S^T q. Sums in float32.
"""

from __future__ import annotations

import torch


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def recurrent_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of b sequences: q, k [b, hk, dk], v [b, hv, dv], g [b, hv] or
    [b, hv, dk], beta [b, hv], state [b, hv, dk, dv] float32 -> (out [b, hv, dv] float32, the
    new states)."""
    heads = v.shape[1]
    if q.shape[1] != heads:
        q = q.repeat_interleave(heads // q.shape[1], dim=1)
        k = k.repeat_interleave(heads // k.shape[1], dim=1)
    q, k = l2_normalize(q.float()), l2_normalize(k.float())
    q = q * q.shape[-1] ** -0.5
    decay = g.float().exp()
    s = state * (decay[..., None, None] if decay.dim() == 2 else decay[..., None])
    remembered = (s * k[..., None]).sum(-2)  # S^T k: [b, hv, dv]
    u = (v.float() - remembered) * beta.float()[..., None]
    s = s + k[..., None] * u[..., None, :]
    return (s * q[..., None]).sum(-2), s


def step_slots(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    slots: torch.Tensor,
    fresh: torch.Tensor,
) -> torch.Tensor:
    """`recurrent_step` from `states[slots]` [slots, hv, dk, dv] float32 (an empty state where
    `fresh` [b]), written back in place. Slot -1 is the pad marker, its output zero: the Triton
    kernel skips it; here it reads and writes `states[-1]`, which must be the caller's scratch
    row (no host sync, so a graph captures it). Returns out [b, hv, dv] float32."""
    state = torch.where(fresh[:, None, None, None], 0.0, states[slots])
    out, states[slots] = recurrent_step(q, k, v, g, beta, state)
    return torch.where((slots < 0)[:, None, None], 0.0, out)
