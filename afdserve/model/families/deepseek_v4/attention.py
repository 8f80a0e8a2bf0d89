"""DeepSeek-V4 attention over consecutive rows of one sequence, with its state between calls
(`LayerState`: the window's rows, `CompressorState` per compressor; cache.py pages it).

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
is at or before t. Any chunking of the rows gives the whole sequence's result, up to GEMM rounding.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from afdserve.kernels import ops
from afdserve.model.config import ModelConfig
from afdserve.model.families.deepseek_v4.mhc import V4RMSNorm, unweighted_rms_norm, v4_rms_norm
from afdserve.model.layers.fp8 import Fp8Linear, linear_weight
from afdserve.model.layers.packed import PackedLinear

# Keys as the cache gives them back (an FP8 cache's round trip, cache.LayerPages.as_stored): applied
# to a chunk's own keys and entries, so a query reads every key alike wherever it came from.
Stored = Callable[[torch.Tensor], torch.Tensor]


def _same(values: torch.Tensor) -> torch.Tensor:
    return values


@dataclass(frozen=True)
class RopeTable:
    """One rope base ("main" or "compress"): inverse frequencies and the cos/sin scale."""

    inv_freq: torch.Tensor  # [rope_dim / 2] float32
    scaling: float

    def at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [rows, rope_dim / 2], one per interleaved pair."""
        fused = ops.rope_cos_sin(positions, self.inv_freq, self.scaling)
        if fused is not None:
            return fused
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        return freqs.cos() * self.scaling, freqs.sin() * self.scaling


@dataclass
class CompressorState:
    """One sequence's compressor between calls: what a paged cache must keep per CSA/HCA layer
    (and per indexer)."""

    entries: torch.Tensor  # [count, dim], rotated: every closed window so far
    pending_kv: torch.Tensor  # [< rate, width]: projected rows of the open window
    pending_gate: torch.Tensor  # [< rate, width], before the position bias
    prev_kv: torch.Tensor | None = None  # [rate, dim]: the last closed window's first series
    prev_gate: torch.Tensor | None = None  # the same gates, position bias added (overlap only)


@dataclass
class LayerState:
    """One sequence's attention cache of one layer: the sliding window (its last window - 1
    rotated KV rows, the most a later query can see) and the compressors' state."""

    window_kv: torch.Tensor  # [<= window - 1, head_dim]
    window_pos: torch.Tensor  # [<= window - 1] their positions
    compressor: CompressorState | None = None
    indexer: CompressorState | None = None


def rope_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the trailing 2 * cos.shape[-1] channels of x [rows, ..., dim] in interleaved pairs
    (x[2i], x[2i+1]) and keep that layout: V = K here, so the layout reaches the output
    projection and must stay the checkpoint's. cos/sin [rows, pairs]; pass -sin to undo."""
    width = 2 * cos.shape[-1]
    # cos/sin rounded to x's dtype first, the rotation itself in float32: as transformers does.
    cos, sin = cos.to(x.dtype).float(), sin.to(x.dtype).float()
    while cos.dim() < x.dim():
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    nope, rope = x[..., :-width], x[..., -width:].float()
    even, odd = rope[..., 0::2], rope[..., 1::2]
    rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
    return torch.cat((nope, rotated.to(x.dtype)), dim=-1)


def norm_rope(
    x: torch.Tensor,
    norm: tuple[torch.Tensor | None, float] | None,
    cos_sin: tuple[torch.Tensor, torch.Tensor] | None,
    negate: bool = False,
) -> torch.Tensor:
    """x [rows, heads, dim] normalised per head (norm: (None, eps) unweighted, (weight, eps) as
    V4RMSNorm) and rotated on its trailing pairs (`rope_tail`; `negate`: back), each optional:
    one launch on CUDA (ops.v4_norm_rope), these torch forms elsewhere."""
    fused = ops.v4_norm_rope(x, norm, cos_sin, negate)
    if fused is not None:
        return fused
    if norm is not None:
        weight, eps = norm
        x = unweighted_rms_norm(x, eps) if weight is None else v4_rms_norm(x, weight, eps)
    if cos_sin is not None:
        cos, sin = cos_sin
        x = rope_tail(x, cos, -sin if negate else sin)
    return x


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
        # A CSA layer's compressor carries the layer's lightning indexer (the checkpoint names it
        # `attn.indexer.*`, transformers `self_attn.compressor.indexer.*`).
        self.indexer: Indexer | None = None
        self.packed: PackedLinear | None = None  # set by pack

    def pack(self) -> None:
        """kv and gate, and the indexer's kv, gate and head weights (they read the same rows), as
        one GEMM: one launch a ubatch where there were two (CSA five). Call once the weights are
        allocated."""
        self.packed = PackedLinear.of(self._projections())

    def _projections(self) -> list[nn.Module]:
        own = [self.kv_proj, self.gate_proj]
        if self.indexer is None:
            return own
        return own + [self.indexer.kv_proj, self.indexer.gate_proj, self.indexer.weights_proj]

    def project(
        self, x: torch.Tensor
    ) -> tuple[
        tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    ]:
        """x [rows, hidden] -> ((kv, gate), the indexer's (kv, gate, head weights) or None): once
        packed, column slices of one GEMM's output (rows strided alike)."""
        if self.packed is None:
            out = [p(x) for p in self._projections()]
        else:
            out = self.packed.split(x)
        return (out[0], out[1]), (None if len(out) == 2 else (out[2], out[3], out[4]))

    def extend(
        self,
        x: torch.Tensor,
        state: CompressorState | None,
        rope: RopeTable,
        stored: Stored = _same,
    ) -> CompressorState:
        """Feed the rows x [rows, hidden] that follow `state` (None: the sequence's first rows):
        every window they close becomes an entry, rotated at the window's first position; the
        rest waits in the returned state. A whole sequence in one call gives the same entries
        as any split of it (up to GEMM rounding)."""
        m, d = self.rate, self.dim
        kv, gate = self.kv_proj(x), self.gate_proj(x)
        if state is None:
            state = CompressorState(x.new_zeros(0, d), kv[:0], gate[:0])
        kv, gate = torch.cat((state.pending_kv, kv)), torch.cat((state.pending_gate, gate))
        windows = kv.shape[0] // m
        closed = windows * m
        done = CompressorState(
            state.entries, kv[closed:], gate[closed:], state.prev_kv, state.prev_gate
        )
        if windows == 0:
            return done
        kv = kv[:closed].view(windows, m, -1)
        gate = gate[:closed].view(windows, m, -1) + self.position_bias
        if self.overlap:
            # Slots [0, m): the previous window's first series (none before window 0: weight 0);
            # slots [m, 2m): this window's second series.
            first_kv = kv.new_zeros(1, m, d) if state.prev_kv is None else state.prev_kv[None]
            first_gate = (
                gate.new_full((1, m, d), float("-inf"))
                if state.prev_gate is None
                else state.prev_gate[None]
            )
            done.prev_kv, done.prev_gate = kv[-1, :, :d], gate[-1, :, :d]
            kv, gate = self.overlap_slots(
                torch.cat((first_kv, kv[:-1, :, :d])),
                torch.cat((first_gate, gate[:-1, :, :d])),
                kv,
                gate,
            )
        count = state.entries.shape[0]
        starts = (count + torch.arange(windows, device=x.device)) * m
        done.entries = torch.cat((state.entries, stored(self.pool(kv, gate, starts, rope))))
        return done

    def overlap_slots(
        self, first_kv: torch.Tensor, first_gate: torch.Tensor, kv: torch.Tensor, gate: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """CSA's 2m slots per window [n, 2m, dim]: the previous window's first series
        `first_* [n, m, dim]` (gate with the position bias), then this window's second series
        (kv, gate [n, m, 2 dim], the gate biased)."""
        d = self.dim
        return (
            torch.cat((first_kv, kv[..., d:]), dim=1),
            torch.cat((first_gate, gate[..., d:]), dim=1),
        )

    def pool(
        self, kv: torch.Tensor, gate: torch.Tensor, starts: torch.Tensor, rope: RopeTable
    ) -> torch.Tensor:
        """Windows kv, gate [n, slots, dim] (gate biased) -> their entries [n, dim]: the
        softmax-gated sum, kv_norm, rotary at each window's first position `starts [n]`."""
        weights = gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)
        new = self.kv_norm((kv * weights).sum(dim=1))
        return rope_tail(new, *rope.at(starts))


class Indexer(Compressor):
    """The lightning indexer of a CSA layer: its own overlapping compressor at `index_head_dim`
    (its keys) and `index_n_heads` query heads; score(t, s) = sum_h w_h(t) relu(q_h(t) . k_s)."""

    def __init__(self, config: ModelConfig) -> None:
        v4 = config.family_config
        super().__init__(
            config.hidden_size, v4.index_head_dim, v4.csa_rate, True, config.rms_norm_eps
        )
        self.heads, self.topk = v4.index_n_heads, v4.index_topk
        self.weight_scale = self.heads**-0.5  # the head weights' scale, applied in float32
        self.q_b_proj = nn.Linear(config.q_lora_rank, self.heads * self.dim, bias=False)
        self.weights_proj = nn.Linear(config.hidden_size, self.heads, bias=False)

    def scores(
        self,
        x: torch.Tensor,
        q_residual: torch.Tensor,
        positions: torch.Tensor,
        rope: RopeTable,
        state: CompressorState | None,
        stored: Stored = _same,
    ) -> tuple[torch.Tensor, CompressorState]:
        """-> (score [rows, entries] of every compressed entry for every query, -inf where its
        window is still open; the indexer's own compressor state after these rows)."""
        state = self.extend(x, state, rope, stored)
        keys = state.entries  # [entries, dim]
        rows, entries = x.shape[0], keys.shape[0]
        if entries == 0:
            return x.new_zeros(rows, 0, dtype=torch.float32), state
        scores = self.score_keys(x, q_residual, positions, rope, keys)
        closed = visible(positions, entries, self.rate)
        return scores.masked_fill(~closed, float("-inf")), state

    def score_keys(
        self,
        x: torch.Tensor,
        q_residual: torch.Tensor,
        positions: torch.Tensor,
        rope: RopeTable,
        keys: torch.Tensor,
    ) -> torch.Tensor:
        """score [rows, entries] of keys [entries, dim] (every row the same) or [rows, entries,
        dim] (each row its own), unmasked."""
        return self.score(*self.queries(x, q_residual, rope.at(positions)), keys)

    def queries(
        self,
        x: torch.Tensor,
        q_residual: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        projected: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (the query heads q [rows, heads, dim] rotated by `cos_sin` (the compress base at the
        rows' positions), their weights [rows, heads] as projected: `score` and the fused kernels
        take them to float32 times `weight_scale`). `projected`: q_b_proj(q_residual) and
        weights_proj(x), where packed GEMMs made them."""
        if projected is None:
            projected = (self.q_b_proj(q_residual), self.weights_proj(x))
        q_rows, weights = projected
        q = norm_rope(q_rows.view(q_rows.shape[0], self.heads, self.dim), None, cos_sin)
        return q, weights

    def score(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """sum_h w_h relu(q_h . k) / sqrt(dim) for keys as `score_keys` takes them; w_h: the
        weights `queries` gives, in float32 times `weight_scale`."""
        spec = "rhd,ed->rhe" if keys.dim() == 2 else "rhd,red->rhe"
        scores = F.relu(torch.einsum(spec, q.float(), keys.float())) * self.dim**-0.5
        weights = weights.float() * self.weight_scale
        return (scores * weights.unsqueeze(-1)).sum(dim=1)

    def ranked(self, scores: torch.Tensor) -> torch.Tensor:
        """The indices [rows, min(topk, entries)] of each row's best scores, best first.
        Exact ties happen (relu zeroes every head: score 0.0). torch.topk breaks them in an
        order that depends on the tensor's shape, so a decode step and the full forward could
        pick different entries; a stable sort takes the earliest of equal entries, always (and
        -inf entries, never visible, come after every visible one)."""
        order = scores.sort(dim=-1, descending=True, stable=True).indices
        return order[:, : self.topk]

    def select(
        self,
        x: torch.Tensor,
        q_residual: torch.Tensor,
        positions: torch.Tensor,
        rope: RopeTable,
        state: CompressorState | None,
        stored: Stored = _same,
    ) -> tuple[torch.Tensor, CompressorState]:
        """-> ([rows, entries] bool: the entries each query attends to, the state after)."""
        scores, state = self.scores(x, q_residual, positions, rope, state, stored)
        closed = visible(positions, scores.shape[1], self.rate)
        chosen = torch.zeros_like(closed).scatter_(1, self.ranked(scores), True)
        # A query with fewer closed entries than topk takes all of them (and no open one).
        return chosen & closed, state


class V4Attention(nn.Module):
    """One layer's attention: `layer_types[layer]` picks the window only, HCA or CSA."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        v4 = config.family_config
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
        self.o_a_proj = nn.Linear(
            heads * dim // self.groups, self.groups * v4.o_lora_rank, bias=False
        )
        self.o_b_proj = nn.Linear(self.groups * v4.o_lora_rank, hidden, bias=False)
        self.sinks = nn.Parameter(torch.empty(heads))
        self.q_a_kv: PackedLinear | None = None  # set by pack
        self.q_b: PackedLinear | None = None  # CSA: with the indexer's, set by pack
        self.compressor: Compressor | None = None
        if self.kind != "sliding_attention":
            rate = v4.compress_rate(layer)
            csa = self.kind == "compressed_sparse_attention"
            self.compressor = Compressor(hidden, dim, rate, csa, config.rms_norm_eps)
            if csa:
                self.compressor.indexer = Indexer(config)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rope: RopeTable,
        compress_rope: RopeTable,
        state: LayerState | None = None,
        stored: Stored = _same,
    ) -> tuple[torch.Tensor, LayerState]:
        """x [rows, hidden]: consecutive rows of one sequence at `positions`, following `state`
        (None: they start the sequence). rope: this layer's base (main on sliding layers,
        compress on the others); compress_rope: the compressors'; stored: the cache's round
        trip of keys and entries. -> (output, the state after these rows)."""
        cos_sin = rope.at(positions)
        q_residual, q, kv, _ = self.project(x, cos_sin)
        kv = stored(kv)
        keys, key_pos = kv, positions
        if state is not None:
            keys = torch.cat((state.window_kv, kv))
            key_pos = torch.cat((state.window_pos, positions))
        # Causal sliding window: query t sees keys s with t - window < s <= t.
        allowed = (key_pos[None, :] <= positions[:, None]) & (
            key_pos[None, :] > positions[:, None] - self.window
        )
        keep = max(0, keys.shape[0] - (self.window - 1))
        after = LayerState(keys[keep:], key_pos[keep:])
        if self.compressor is not None:
            before = state or LayerState(kv[:0], positions[:0])
            after.compressor = self.compressor.extend(x, before.compressor, compress_rope, stored)
            entries = after.compressor.entries
            if self.kind == "compressed_sparse_attention":
                seen, after.indexer = self.compressor.indexer.select(
                    x, q_residual, positions, compress_rope, before.indexer, stored
                )
            else:
                seen = visible(positions, entries.shape[0], self.compressor.rate)
            keys = torch.cat((keys, entries))
            allowed = torch.cat((allowed, seen), dim=1)
        out = self._attend(q, keys, allowed)
        return self.finish(out, cos_sin), after

    def pack(self) -> None:
        """q_a and kv (both read the layer's input) as one GEMM, CSA's q_b with its indexer's
        (both read the q residual) as another, and the compressor's projections as a third
        (model/layers/packed.py). Call once the weights are allocated."""
        self.q_a_kv = PackedLinear.of((self.q_a_proj, self.kv_proj))
        if self.compressor is not None:
            self.compressor.pack()
            if self.compressor.indexer is not None:
                self.q_b = PackedLinear.of((self.q_b_proj, self.compressor.indexer.q_b_proj))

    def project(
        self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """x [rows, hidden] at the rows' rotary cos_sin -> (the q low-rank residual the indexer
        reads, q [rows, heads, dim], kv [rows, dim]: K and V, both rotated; the indexer's
        q_b_proj(q residual) where packed with q_b (`pack`), else None)."""
        rows = x.shape[0]
        if self.q_a_kv is None:
            q_a, kv = self.q_a_proj(x), self.kv_proj(x)
        else:
            q_a, kv = self.q_a_kv.split(x)
        q_a_norm = (self.q_a_norm.weight, self.q_a_norm.eps)
        q_residual = norm_rope(q_a[:, None], q_a_norm, None)[:, 0]
        if self.q_b is None:
            q, index_q = self.q_b_proj(q_residual), None
        else:
            q, index_q = self.q_b.split(q_residual)
        q = norm_rope(q.view(rows, self.heads, self.dim), (None, self.eps), cos_sin)
        kv_norm = (self.kv_norm.weight, self.kv_norm.eps)
        return q_residual, q, norm_rope(kv[:, None], kv_norm, cos_sin)[:, 0], index_q

    def finish(self, out: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The attention output [rows, heads, dim] -> [rows, hidden]."""
        out = norm_rope(out, None, cos_sin, negate=True)  # V carried the keys' rotation: undo it
        return self._output(out)

    def _attend(self, q: torch.Tensor, kv: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """Softmax over the allowed keys plus one sink logit per head (which takes probability
        mass and gives no value). q [rows, heads, dim], kv [keys, dim] -> [rows, heads, dim]."""
        scores = torch.matmul(q.transpose(0, 1), kv.t()) * self.scale  # [heads, rows, keys]
        probs = self.sink_softmax(
            scores.masked_fill(~allowed, float("-inf")), self.sinks.view(-1, 1, 1)
        )
        return torch.matmul(probs.to(kv.dtype), kv).transpose(0, 1)

    def attend_batched(
        self, q: torch.Tensor, kv: torch.Tensor, allowed: torch.Tensor
    ) -> torch.Tensor:
        """`_attend` with every row its own keys: q [rows, heads, dim], kv [rows, keys, dim],
        allowed [rows, keys] -> [rows, heads, dim]."""
        scores = torch.matmul(q, kv.transpose(1, 2)) * self.scale  # [rows, heads, keys]
        probs = self.sink_softmax(
            scores.masked_fill(~allowed[:, None], float("-inf")), self.sinks.view(1, -1, 1)
        )
        return torch.matmul(probs.to(kv.dtype), kv)

    @staticmethod
    def sink_softmax(scores: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
        """Softmax over scores' last axis beside one sink logit per head (`sinks` broadcasts to
        scores[..., :1]), the sink's probability dropped. The sinks stay float32, and so does
        the softmax beside them (over scores in x's dtype). Never NaN: the sink is finite even
        where every key is masked."""
        logits = torch.cat((scores.float(), sinks.float().expand_as(scores[..., :1])), dim=-1)
        logits = logits - logits.amax(dim=-1, keepdim=True)
        return F.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1]

    def _output(self, out: torch.Tensor) -> torch.Tensor:
        rows = out.shape[0]
        o_a = self.o_a_proj
        if isinstance(o_a, Fp8Linear):  # on CUDA one w8a8 launch from the FP8 weight as stored
            args = (o_a.weight, o_a.weight_scale_inv, self.groups, o_a.block)
            low = ops.fp8_grouped_linear(out.reshape(rows, -1), *args)
            if low is not None:
                return self.o_b_proj(low)
        grouped = out.reshape(rows, self.groups, -1).transpose(0, 1)  # [groups, rows, in]
        weight = linear_weight(self.o_a_proj, out.dtype)  # dequantized when FP8
        w = weight.view(self.groups, -1, grouped.shape[-1]).transpose(1, 2)
        low = torch.bmm(grouped, w).transpose(0, 1).reshape(rows, -1)  # [rows, groups * rank]
        return self.o_b_proj(low)
