"""DeepSeek-V4 attention over one whole sequence (prefill form, no paged cache yet).

Three layer types share one block: shared-KV MQA (one `head_dim` head read as key and value)
over a sliding window, with partial interleaved rotary on each head's trailing
`qk_rope_head_dim` channels, a learned sink per head, and a grouped low-rank output projection.
Compressed layers add entries that summarise whole windows of `compress_rate` tokens:
- HCA (`heavily_compressed_attention`): every closed window is one entry; a query sees all entries
  whose window closed at or before it.
- CSA (`compressed_sparse_attention`): entries of width 2m and stride m (each mixes the previous
  window's first series with its own second), and each query sees only the `index_topk` closed
  entries the lightning indexer scores highest.
A query at position t may read entry w only when (w + 1) * m <= t + 1: every token it summarises
is at or before t.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from afdserve.model.config import ModelConfig
from afdserve.model.deepseek_v4.mhc import V4RMSNorm, unweighted_rms_norm


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, scaling: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [rows, rope_dim / 2], one per interleaved pair."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    return freqs.cos() * scaling, freqs.sin() * scaling


def rope_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the trailing 2 * cos.shape[-1] channels of x [rows, ..., dim] in interleaved pairs
    (x[2i], x[2i+1]) and keep that layout: V = K here, so the layout reaches the output
    projection and must stay the checkpoint's. cos/sin [rows, pairs]; pass -sin to undo."""
    width = 2 * cos.shape[-1]
    while cos.dim() < x.dim():
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    nope, rope = x[..., :-width], x[..., -width:].float()
    even, odd = rope[..., 0::2], rope[..., 1::2]
    rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
    return torch.cat((nope, rotated.to(x.dtype)), dim=-1)


def visible(positions: torch.Tensor, entries: int, rate: int) -> torch.Tensor:
    """[rows, entries] bool: entry w summarises tokens [w m, (w + 1) m), all at or before t."""
    closed = (positions + 1) // rate
    return torch.arange(entries, device=positions.device)[None, :] < closed[:, None]


class Compressor(nn.Module):
    """Softmax-gated pooling of each window of `rate` tokens into one entry of width `dim`.
    `overlap` (CSA and its indexer): the projections are 2 * dim wide, two series per token, and
    entry w pools window w-1's first series together with window w's second (2 * rate slots)."""

    def __init__(self, hidden: int, dim: int, rate: int, overlap: bool, eps: float) -> None:
        super().__init__()
        self.dim, self.rate, self.overlap = dim, rate, overlap
        width = 2 * dim if overlap else dim
        self.kv_proj = nn.Linear(hidden, width, bias=False)
        self.gate_proj = nn.Linear(hidden, width, bias=False)
        self.position_bias = nn.Parameter(torch.empty(rate, width))
        self.kv_norm = V4RMSNorm(dim, eps)

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]
                ) -> torch.Tensor:
        """x [rows, hidden] of one sequence from position 0 -> entries [rows // rate, dim],
        rotated at each window's first position (cos_sin: the compress rope at every row)."""
        m, d = self.rate, self.dim
        windows = x.shape[0] // m
        if windows == 0:
            return x.new_zeros(0, d)
        kv = self.kv_proj(x[: windows * m]).view(windows, m, -1)
        gate = self.gate_proj(x[: windows * m]).view(windows, m, -1) + self.position_bias
        if self.overlap:
            # Slots [0, m): the previous window's first series (none before window 0: weight 0);
            # slots [m, 2m): this window's second series.
            prev_kv = torch.cat((kv.new_zeros(1, m, d), kv[:-1, :, :d]))
            prev_gate = torch.cat((gate.new_full((1, m, d), float("-inf")), gate[:-1, :, :d]))
            kv = torch.cat((prev_kv, kv[..., d:]), dim=1)
            gate = torch.cat((prev_gate, gate[..., d:]), dim=1)
        weights = gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)
        entries = self.kv_norm((kv * weights).sum(dim=1))
        cos, sin = cos_sin
        starts = torch.arange(windows, device=x.device) * m
        return rope_tail(entries, cos[starts], sin[starts])


class Indexer(Compressor):
    """The lightning indexer of a CSA layer: its own overlapping compressor at `index_head_dim`
    (its keys) and `index_n_heads` query heads; score(t, s) = sum_h w_h(t) relu(q_h(t) . k_s)."""

    def __init__(self, config: ModelConfig) -> None:
        v4 = config.v4
        super().__init__(config.hidden_size, v4.index_head_dim, v4.csa_rate, True,
                         config.rms_norm_eps)
        self.heads, self.topk = v4.index_n_heads, v4.index_topk
        self.q_b_proj = nn.Linear(config.q_lora_rank, self.heads * self.dim, bias=False)
        self.weights_proj = nn.Linear(config.hidden_size, self.heads, bias=False)

    def forward(self, x: torch.Tensor, q_residual: torch.Tensor, positions: torch.Tensor,
                cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """-> [rows, entries] bool: which compressed entries each query attends to."""
        keys = super().forward(x, cos_sin)  # [entries, dim]
        rows, entries = x.shape[0], keys.shape[0]
        if entries == 0:
            return torch.zeros(rows, 0, dtype=torch.bool, device=x.device)
        q = self.q_b_proj(q_residual).view(rows, self.heads, self.dim)
        q = rope_tail(q, *cos_sin)
        scores = F.relu(torch.einsum("rhd,ed->rhe", q.float(), keys.float())) * self.dim**-0.5
        weights = self.weights_proj(x).float() * self.heads**-0.5
        scores = (scores * weights.unsqueeze(-1)).sum(dim=1)  # [rows, entries]
        closed = visible(positions, entries, self.rate)
        scores = scores.masked_fill(~closed, float("-inf"))
        best = scores.topk(min(self.topk, entries), dim=-1).indices
        chosen = torch.zeros_like(closed).scatter_(1, best, True)
        return chosen & closed  # a query with fewer closed entries than topk picks all of them


class V4Attention(nn.Module):
    """One layer's attention: `layer_types[layer]` picks the window only, HCA or CSA."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        v4 = config.v4
        hidden, heads, dim = config.hidden_size, config.num_heads, config.head_dim
        self.kind = v4.attention_types[layer]
        self.heads, self.dim, self.window = heads, dim, v4.sliding_window
        self.groups, self.eps, self.scale = v4.o_groups, config.rms_norm_eps, dim**-0.5
        self.q_a_proj = nn.Linear(hidden, config.q_lora_rank, bias=False)
        self.q_a_norm = V4RMSNorm(config.q_lora_rank, config.rms_norm_eps)
        self.q_b_proj = nn.Linear(config.q_lora_rank, heads * dim, bias=False)
        self.kv_proj = nn.Linear(hidden, dim, bias=False)
        self.kv_norm = V4RMSNorm(dim, config.rms_norm_eps)
        # Grouped output projection: group g maps its heads' heads*dim/g channels to o_lora_rank
        # (o_a_proj holds the g blocks stacked), o_b_proj mixes the g * o_lora_rank to hidden.
        self.o_a_proj = nn.Linear(heads * dim // self.groups, self.groups * v4.o_lora_rank,
                                  bias=False)
        self.o_b_proj = nn.Linear(self.groups * v4.o_lora_rank, hidden, bias=False)
        self.sinks = nn.Parameter(torch.empty(heads))
        self.compressor: Compressor | None = None
        if self.kind != "sliding_attention":
            rate = v4.compress_rate(layer)
            csa = self.kind == "compressed_sparse_attention"
            self.compressor = Compressor(hidden, dim, rate, csa, config.rms_norm_eps)
            if csa:
                self.compressor.indexer = Indexer(config)

    def forward(self, x: torch.Tensor, positions: torch.Tensor,
                cos_sin: tuple[torch.Tensor, torch.Tensor],
                compress_cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x [rows, hidden]: one whole sequence, positions 0..rows-1. cos_sin: this layer's rope
        (main on sliding layers, compress on the others); compress_cos_sin: the compressors'."""
        rows = x.shape[0]
        q_residual = self.q_a_norm(self.q_a_proj(x))
        q = unweighted_rms_norm(self.q_b_proj(q_residual).view(rows, self.heads, self.dim),
                                self.eps)
        q = rope_tail(q, *cos_sin)
        kv = rope_tail(self.kv_norm(self.kv_proj(x)), *cos_sin)  # [rows, dim]: K and V
        key = torch.arange(rows, device=x.device)
        # Causal sliding window: query t sees keys s with t - window < s <= t.
        allowed = (key[None, :] <= positions[:, None]) & (key[None, :] > positions[:, None]
                                                          - self.window)
        if self.compressor is not None:
            entries = self.compressor(x, compress_cos_sin)
            if self.kind == "compressed_sparse_attention":
                seen = self.compressor.indexer(x, q_residual, positions, compress_cos_sin)
            else:
                seen = visible(positions, entries.shape[0], self.compressor.rate)
            kv = torch.cat((kv, entries))
            allowed = torch.cat((allowed, seen), dim=1)
        out = self._attend(q, kv, allowed)
        out = rope_tail(out, cos_sin[0], -cos_sin[1])  # V carried the keys' rotation: undo it
        return self._output(out)

    def _attend(self, q: torch.Tensor, kv: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """Softmax over the allowed keys plus one sink logit per head (which takes probability
        mass and gives no value). q [rows, heads, dim], kv [keys, dim] -> [rows, heads, dim]."""
        scores = torch.matmul(q.transpose(0, 1), kv.t()) * self.scale  # [heads, rows, keys]
        scores = scores.masked_fill(~allowed, float("-inf"))
        sinks = self.sinks.to(scores.dtype).view(-1, 1, 1).expand(-1, scores.shape[1], 1)
        logits = torch.cat((scores, sinks), dim=-1)
        logits = logits - logits.amax(dim=-1, keepdim=True)
        probs = F.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1].to(kv.dtype)
        return torch.matmul(probs, kv).transpose(0, 1)

    def _output(self, out: torch.Tensor) -> torch.Tensor:
        rows = out.shape[0]
        grouped = out.reshape(rows, self.groups, -1).transpose(0, 1)  # [groups, rows, in]
        w = self.o_a_proj.weight.view(self.groups, -1, grouped.shape[-1]).transpose(1, 2)
        low = torch.bmm(grouped, w).transpose(0, 1).reshape(rows, -1)  # [rows, groups * rank]
        return self.o_b_proj(low)
