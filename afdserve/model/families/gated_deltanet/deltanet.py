"""A Gated DeltaNet layer over its state slots: projections -> short causal convolution (SiLU)
-> the gated delta rule per value head -> RMSNorm gated by z -> out_proj.

Each segment reads and writes `state[seg.state_slot]`; a segment that starts at position 0
starts from an empty state, whatever the slot held before (a finished sequence's, or this one's
before a preemption). Chunked prefill carries the state from chunk to chunk; one-row segments
(decode rows) of every sequence step the recurrence together, gathered by slot. Which segment
runs which form is read from the ubatch's device spans (spans.py), never on the host.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from afdserve.kernels import ops
from afdserve.kernels.metadata import AttentionMetadata
from afdserve.model.config import ModelConfig
from afdserve.model.families.gated_deltanet.cache import LinearState
from afdserve.model.families.gated_deltanet.spans import DeltaSpans


class GatedRMSNorm(nn.Module):
    """rms_norm(x) * weight, then times silu(z) in float32 (transformers' RMSNormGated)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return ops.gated_rms_norm(x, z, self.weight, self.eps)


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
        """Every segment's convolution in one launch, then its delta rule: a one-row segment
        steps the recurrence, a longer one runs the chunked form, each launch over every
        segment, skipping the other's (spans.py). No host sync, no shape read from the
        segments' contents: a graph of a mixed step captures it."""
        qkv, gate, g, beta = self._inputs(x)
        spans = DeltaSpans.find(meta)
        rows = x.shape[0]
        # Pad rows stay zero; the last row is the sink of step entries that do not step.
        core = x.new_zeros(rows + 1, self.hv, self.dv)
        mixed = ops.causal_conv_spans(qkv, self.conv_weight(), state.conv, spans.conv)
        q, k, v = self._split(mixed)
        if not spans.decode:
            ops.delta_rule_spans(q, k, v, g, beta, state.delta, spans.chunked, core[:rows])
        if rows:
            src = spans.step_src
            q, k, v, g, beta = (t[src] for t in (q, k, v, g, beta))
            slots, fresh = spans.step_slots, spans.step_fresh
            out = ops.delta_rule_step(q, k, v, g, beta, state.delta_all, slots, fresh)
            core[spans.step_dst] = out.to(core.dtype)
        return self._output(core[:rows], gate)


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
