"""A Gated DeltaNet layer over its state slots: projections -> short causal convolution (SiLU)
-> the gated delta rule per value head -> RMSNorm gated by z -> out_proj.

Each segment reads and writes `state[seg.state_slot]`; a segment that starts at position 0
starts from an empty state, whatever the slot held before (a finished sequence's, or this one's
before a preemption). Chunked prefill carries the state from chunk to chunk; decode rows (one
row, after position 0) of every sequence step the recurrence together, gathered by slot.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from afdserve.kernels import ops
from afdserve.kernels.metadata import AttentionMetadata, Segment
from afdserve.model.config import ModelConfig
from afdserve.model.families.gated_deltanet.cache import LinearState


class GatedRMSNorm(nn.Module):
    """rms_norm(x) * weight, then times silu(z) in float32 (transformers' RMSNormGated)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        f = x.float()
        f = f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + self.eps)
        out = (self.weight * f.to(x.dtype)) * F.silu(z.float())
        return out.to(x.dtype)


class DeltaRuleLayer(nn.Module):
    """What every delta-rule layer shares: per segment its slot's state, the short convolution
    over q, k and v, the delta rule. A subclass projects (`_inputs`), lays out q, k and v
    (`_split`) and finishes the output (`_output`)."""

    def _inputs(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [rows, hidden] -> (qkv [rows, conv_dim], gate, g (log decay), beta)."""
        raise NotImplementedError

    def _split(self, mixed: torch.Tensor) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def _output(self, core: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def conv_weight(self) -> torch.Tensor:
        """[conv_dim, K]."""
        return self.conv1d.weight[:, 0]

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, state: LinearState) -> torch.Tensor:
        qkv, gate, g, beta = self._inputs(x)
        core = x.new_zeros(x.shape[0], self.hv, self.dv)  # pad rows stay zero
        steps, stepped = _recurrence_steps(meta)
        if steps is not None:
            self._step(*steps, qkv, g, beta, state, core)
        chunked = [seg for seg in meta.segments if not stepped(seg)]
        if chunked:
            self._prefill(chunked, qkv, g, beta, state, core)
        return self._output(core, gate)

    def _prefill(self, segments: list[Segment], qkv, g, beta, state: LinearState, core) -> None:
        """Segments that do not step the recurrence once: together, the chunked form, each from
        its slot's state (one launch each for the convolution and the delta rule on CUDA)."""
        spans = [
            # A segment that starts at position 0 starts from an empty window and state.
            (s.row_start, s.row_end, s.state_slot, int(s.context_len == s.num_rows))
            for s in segments
        ]
        spans = torch.tensor(spans, dtype=torch.int32).to(qkv.device)  # [n, 4]
        mixed = ops.causal_conv_spans(qkv, self.conv_weight(), state.conv, spans)
        q, k, v = self._split(mixed)
        ops.delta_rule_spans(q, k, v, g, beta, state.delta, spans, core)

    def _step(self, rows, slots, fresh, qkv, g, beta, state: LinearState, core) -> None:
        """One row of each of b sequences: rows, slots [b] (slot -1: a pad segment, sent to the
        scratch slot), fresh [b] (the row is position 0: an empty state). No host sync, so a
        decode graph captures it."""
        slots = torch.where(slots < 0, state.scratch, slots)
        weight = self.conv_weight().to(qkv.dtype)  # [conv_dim, K]
        window = state.conv_all[slots].to(qkv.dtype)  # [b, conv_dim, K - 1]
        window = torch.where(fresh[:, None, None], 0.0, window)
        seq = torch.cat((window, qkv[rows][..., None]), dim=-1)
        state.conv_all[slots] = seq[..., 1:].to(state.conv_all.dtype)
        mixed = F.silu((seq * weight).sum(-1))  # [b, conv_dim]
        q, k, v = self._split(mixed)
        out = ops.delta_rule_step(q, k, v, g[rows], beta[rows], state.delta_all, slots, fresh)
        core[rows] = out.to(core.dtype)


class GatedDeltaNet(DeltaRuleLayer):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        c = config.family_config
        self.hk, self.hv, self.dk, self.dv = (
            c.num_key_heads,
            c.num_value_heads,
            c.key_head_dim,
            c.value_head_dim,
        )
        self.key_dim, self.value_dim = self.hk * self.dk, c.value_dim
        self.packed = c.packed_projections
        hidden = config.hidden_size
        if self.packed:  # Qwen3-Next: [q k v z] and [b a], grouped per key head
            self.in_proj_qkvz = nn.Linear(hidden, 2 * self.key_dim + 2 * self.value_dim, bias=False)
            self.in_proj_ba = nn.Linear(hidden, 2 * self.hv, bias=False)
        else:  # Qwen3.5: [q k v], z, b, a each head after head
            self.in_proj_qkv = nn.Linear(hidden, c.conv_dim, bias=False)
            self.in_proj_z = nn.Linear(hidden, self.value_dim, bias=False)
            self.in_proj_b = nn.Linear(hidden, self.hv, bias=False)
            self.in_proj_a = nn.Linear(hidden, self.hv, bias=False)
        # [conv_dim, 1, K]: the checkpoint's depthwise Conv1d weight.
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.empty(c.conv_dim, 1, c.conv_kernel))
        self.dt_bias = nn.Parameter(torch.empty(self.hv))
        self.A_log = nn.Parameter(torch.empty(self.hv))
        self.norm = GatedRMSNorm(self.dv, config.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, hidden, bias=False)

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [rows, hidden] -> (qkv [rows, conv_dim] as q, k, v head after head, z [rows, hv, dv],
        b, a [rows, hv])."""
        rows = x.shape[0]
        if not self.packed:
            z = self.in_proj_z(x).view(rows, self.hv, self.dv)
            return self.in_proj_qkv(x), z, self.in_proj_b(x), self.in_proj_a(x)
        per = self.hv // self.hk  # value heads per key head
        qkvz = self.in_proj_qkvz(x).view(rows, self.hk, 2 * self.dk + 2 * per * self.dv)
        q, k, v, z = qkvz.split([self.dk, self.dk, per * self.dv, per * self.dv], dim=-1)
        b, a = self.in_proj_ba(x).view(rows, self.hk, 2 * per).split(per, dim=-1)
        qkv = torch.cat([t.flatten(1) for t in (q, k, v)], dim=-1)
        return qkv, z.reshape(rows, self.hv, self.dv), b.flatten(1), a.flatten(1)

    def _split(self, mixed: torch.Tensor) -> tuple[torch.Tensor, ...]:
        rows = mixed.shape[0]
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        return (
            q.reshape(rows, self.hk, self.dk),
            k.reshape(rows, self.hk, self.dk),
            v.reshape(rows, self.hv, self.dv),
        )

    def _inputs(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        qkv, z, b, a = self._project(x)
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)  # [rows, hv]
        return qkv, z, g, b.sigmoid()

    def _output(self, core: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        out = self.norm(core.reshape(-1, self.dv), gate.reshape(-1, self.dv))
        return self.out_proj(out.view(core.shape[0], self.value_dim))


def _recurrence_steps(meta: AttentionMetadata):
    """(rows, slots, fresh) of the segments that step the recurrence once, or None, and which
    host segments they cover. A step whose segments are all one row (a decode step, captured or
    not) reads the device segments; otherwise the one-row segments past position 0 go together
    and the others run chunked."""
    batched = meta.batched
    if batched is not None and batched.state_slots is None:  # no segment at all (pad rows only)
        return None, lambda seg: False
    if batched is not None and all(seg.num_rows == 1 for seg in meta.segments):
        # Under a captured decode graph there are no host segments: every segment is one row.
        steps = (
            batched.query_start[:-1].long(),
            batched.state_slots.long(),
            batched.context_lens == 1,
        )
        return steps, lambda seg: True
    one = [s for s in meta.segments if s.num_rows == 1 and s.context_len > 1]
    if not one:
        return None, lambda seg: False
    dev = meta.positions.device
    rows = torch.tensor([s.row_start for s in one], device=dev)
    slots = torch.tensor([s.state_slot for s in one], device=dev)
    fresh = torch.zeros(len(one), dtype=torch.bool, device=dev)
    return (rows, slots, fresh), lambda seg: seg.num_rows == 1 and seg.context_len > 1
