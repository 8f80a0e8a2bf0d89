"""DeepSeek-V4 as afdserve's two halves (see docs/design.md, "DeepSeek-V4").

attention half (layer i): streams h [rows, hc_mult, hidden] -> attn_hc -> input norm -> attention
  -> expand -> ffn_hc -> post-attention norm -> x [rows, hidden] (what crosses to the FFN), and the
  FFN hyper-connection's (h, post, comb), kept here;
FFN half (layer i): x, token_ids -> y [rows, hidden]: afdserve's MoE block (router or hash table,
  clamped SwiGLU experts, the shared expert), the same module every family's FFN rank runs;
the attention half then expands y into the streams: post * y + comb^T h.

`forward_full` runs one sequence from position 0 (the definition the tests hold against
transformers' full forward); `forward_chunk` runs the next rows of one sequence against its
`SequenceCache`, a contiguous per-sequence cache (the window, compressed entries and compressor
state of docs/design.md), so prefill in chunks and decode give the full forward's logits. How the
engine drives the halves is `V4CausalLM`'s docstring.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from afdserve.kernels.metadata import AttentionMetadata
from afdserve.model.config import ModelConfig
from afdserve.model.families.deepseek_v4.attention import LayerState, RopeTable, V4Attention
from afdserve.model.families.deepseek_v4.batched import step_attention
from afdserve.model.families.deepseek_v4.cache import LayerPages
from afdserve.model.families.deepseek_v4.geometry import LayerGeometry
from afdserve.model.families.deepseek_v4.mhc import (
    HyperConnection,
    HyperHead,
    V4RMSNorm,
    connect,
    update_streams,
)
from afdserve.model.families.deepseek_v4.quant import convert_to_quantized
from afdserve.model.families.deepseek_v4.rows import StepRows
from afdserve.model.layers.moe import Router, RouterHolder, Routing, make_ffn
from afdserve.model.parts import ModelParts

FFNHalf = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]
StreamState = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # h, post, comb


def window_cuts(geometry: LayerGeometry, lo: int, hi: int) -> list[tuple[int, int]]:
    """[lo, hi) cut into runs of at most window - 1 rows: the state after a run holds its last
    window - 1 rows, so writing each run's leaves every row in the window pages (as the batched
    path writes them: a row per position, whatever the chunk's length)."""
    step = max(1, geometry.window - 1)
    return [(a, min(a + step, hi)) for a in range(lo, hi, step)]


@dataclass
class SequenceCache:
    """Everything one sequence's later rows need from its earlier ones: per layer the attention
    state (mHC and the FFN keep none across tokens)."""

    layers: list[LayerState | None]
    length: int = 0  # rows seen so far = the next row's position


class V4DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, parts: ModelParts) -> None:
        super().__init__()
        v4, hidden, eps = config.family_config, config.hidden_size, config.rms_norm_eps
        if parts.attention:
            hc = (hidden, v4.hc_mult, v4.hc_sinkhorn_iters, v4.hc_eps, eps)
            self.attn_hc = HyperConnection(*hc)
            self.ffn_hc = HyperConnection(*hc)
            self.input_layernorm = V4RMSNorm(hidden, eps)
            self.self_attn = V4Attention(config, layer)
            self.post_attention_layernorm = V4RMSNorm(hidden, eps)
        if parts.ffn:
            self.mlp = make_ffn(
                config, layer, with_router=not parts.gate_on_attention, held=parts.experts
            )
            if parts.gate_on_attention and parts.attention:
                self.mlp.gate = Router(config, layer)
        elif parts.gate_on_attention:
            self.mlp = RouterHolder(config, layer)


class V4Body(nn.Module):
    def __init__(self, config: ModelConfig, parts: ModelParts) -> None:
        super().__init__()
        v4 = config.family_config
        if parts.attention:
            # No random init (the loader writes it): see model.model.uninitialized_embedding.
            shape = (config.vocab_size, config.hidden_size)
            self.embed_tokens = nn.Embedding(*shape, _weight=torch.empty(shape))
            self.hc_head = HyperHead(config.hidden_size, v4.hc_mult, v4.hc_eps, config.rms_norm_eps)
            self.norm = V4RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList(
            V4DecoderLayer(config, i, parts) for i in range(config.num_layers)
        )


class V4CausalLM(nn.Module):
    """The halves `parts` names. The engine drives the layers through `embed`, `attention_half`,
    `add_ffn_output` and `logits`, the interface `MoECausalLM` gives it: the residual it carries
    from layer to layer is the streams (and, between the halves, the FFN hyper-connection's post
    and comb), so mHC never leaves the attention side; each sequence's attention reads and writes
    its state in the paged cache (cache.py) through its block table, every sequence of a ubatch at
    once (batched.py) when the step carries device segments."""

    def __init__(self, config: ModelConfig, parts: ModelParts | None = None) -> None:
        super().__init__()
        if config.family_config is None:
            raise ValueError(f"V4CausalLM needs a deepseek_v4 config, not {config.family!r}")
        self.config = config
        self.parts = parts or ModelParts.colocated()
        # The activations' dtype, as MoECausalLM.dtype (some weights stay float32).
        self.dtype = torch.get_default_dtype()
        self._rope_tables: dict[str, dict[str, RopeTable]] = {}  # per device, built on first use
        self.model = V4Body(config, self.parts)
        if self.parts.attention and not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.quantization is not None:  # FP8 projections, FP4 or FP8 experts
            convert_to_quantized(self, config)

    # What transformers keeps in float32 whatever the model's dtype (mHC, sinks, position
    # biases, every norm weight): rounding them to bf16 would change what the checkpoint says.
    FLOAT32 = (".attn_hc.", ".ffn_hc.", "hc_head.", ".sinks", ".position_bias", "norm.weight")

    @staticmethod
    def checkpoint_name(name: str) -> str | None:
        """The MTP layer's `mtp.*` tensors are the draft's (mtp.py), skipped here by name."""
        return None if name.removeprefix("model.").startswith("mtp.") else name

    def keep_float32(self) -> None:
        """Make the FLOAT32 parameters float32 (called by the loader before it fills them)."""
        for module_name, module in self.named_modules():
            for name, param in list(module.named_parameters(recurse=False)):
                full = f"{module_name}.{name}"
                if param.dtype != torch.float32 and any(k in full for k in self.FLOAT32):
                    setattr(module, name, nn.Parameter(param.float(), requires_grad=False))

    # ----- attention half -----
    def ropes(self, device: torch.device | str) -> dict[str, RopeTable]:
        """Both rope bases. From the config's tuples, not buffers, so a model built on the meta
        device and moved with to_empty needs nothing refilled."""
        c, v4 = self.config, self.config.family_config
        main = torch.tensor(c.rope_inv_freq, dtype=torch.float32, device=device)
        comp = torch.tensor(v4.compress_inv_freq, dtype=torch.float32, device=device)
        return {
            "main": RopeTable(main, v4.main_attention_scaling),
            "compress": RopeTable(comp, v4.compress_attention_scaling),
        }

    def new_cache(self) -> SequenceCache:
        return SequenceCache([None] * self.config.num_layers)

    def sequence_attention_half(
        self,
        layer: int,
        h: torch.Tensor,
        positions: torch.Tensor,
        ropes: dict[str, RopeTable],
        cache: SequenceCache | None = None,
    ) -> tuple[torch.Tensor, StreamState]:
        """h [rows, hc_mult, hidden] -> (x [rows, hidden], the FFN input; the state `expand_ffn`
        needs when the FFN output is back). With `cache`, the rows follow what it holds and
        this layer's entry is advanced past them."""
        block = self.model.layers[layer]
        h, x, post, comb = connect(block.attn_hc, block.input_layernorm, h, None)
        attn = block.self_attn
        own = ropes["main"] if attn.kind == "sliding_attention" else ropes["compress"]
        state = None if cache is None else cache.layers[layer]
        y, state = attn(x, positions, own, ropes["compress"], state)
        if cache is not None:
            cache.layers[layer] = state
        h, x, post, comb = connect(block.ffn_hc, block.post_attention_layernorm, h, (y, post, comb))
        return x, (h, post, comb)

    @staticmethod
    def expand_ffn(state: StreamState, ffn_out: torch.Tensor) -> torch.Tensor:
        return update_streams(state[0], ffn_out, state[1], state[2])

    def route_on_attention(
        self,
        layer: int,
        x: torch.Tensor,
        token_ids: torch.Tensor,
        ffn_view: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> Routing | None:
        """As MoECausalLM's: `ffn_view` is x as the FFN half will read it (the A2E format)."""
        if not self.parts.gate_on_attention:
            return None
        return self.model.layers[layer].mlp.gate(ffn_view(x) if ffn_view else x, token_ids)

    # ----- attention half, as the engine drives it (engine/model_runner.py) -----
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token ids [rows] -> the streams [rows, hc_mult, hidden], every stream the embedding."""
        embedded = self.model.embed_tokens(token_ids)
        return embedded.unsqueeze(1).expand(-1, self.config.family_config.hc_mult, -1).contiguous()

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Nothing precomputed ([rows, 0] each): V4 rotates inside its attention, by two bases,
        and its compressed entries at their windows' first positions, not at the rows'."""
        empty = positions.new_zeros(positions.shape[0], 0, dtype=torch.float32)
        return empty, empty

    def attention_half(
        self,
        layer: int,
        residual: torch.Tensor | StreamState,
        ffn_out: torch.Tensor | None,
        meta: AttentionMetadata,
        cache: LayerPages,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, StreamState]:
        """The engine's form: `residual` is the streams [rows, hc_mult, hidden] at layer 0, after
        that the previous layer's StreamState, into which `ffn_out` is expanded first. Each
        segment of `meta` (consecutive rows of one sequence) attends over the state its block
        table addresses in `cache` and writes its own rows back; rows of no segment (pad rows)
        get a zero attention output. With device metadata (`meta.batched`) every sequence of
        the ubatch runs at once (batched.py; a decode ubatch is the form a CUDA graph captures),
        without it one at a time (`_per_sequence`, the oracle the tests hold it to). -> (x
        [rows, hidden], what crosses to the FFN; the state kept here)."""
        h, update = residual, None
        if ffn_out is not None:  # the previous layer's streams, post and comb
            h, update = residual[0], (ffn_out, residual[1], residual[2])
        block = self.model.layers[layer]
        h, x, post, comb = connect(block.attn_hc, block.input_layernorm, h, update)
        attn, ropes = block.self_attn, self._ropes_on(x.device)
        own = ropes["main"] if attn.kind == "sliding_attention" else ropes["compress"]
        rows = StepRows.find(meta)
        if rows is None:
            y = self._per_sequence(attn, cache, x, meta, own, ropes["compress"])
        else:
            y = step_attention(attn, cache, x, rows, own, ropes["compress"])
        h, x, post, comb = connect(block.ffn_hc, block.post_attention_layernorm, h, (y, post, comb))
        return x, (h, post, comb)

    @staticmethod
    def _per_sequence(
        attn: V4Attention,
        cache: LayerPages,
        x: torch.Tensor,
        meta: AttentionMetadata,
        own: RopeTable,
        compress: RopeTable,
    ) -> torch.Tensor:
        """One segment at a time from the host-side segments (a step without device metadata):
        `V4Attention.forward` over `read`'s state, then `write`, block by block where blocks
        resume (`LayerGeometry.pieces`: each block's end state written); the oracle of
        batched.py."""
        y = torch.zeros_like(x)
        windows = (meta.window or meta).segments  # the window's rows: its pool's table
        for seg, window in zip(meta.segments, windows, strict=True):
            start, table, slot = seg.context_len - seg.num_rows, seg.block_table, seg.state_slot
            state = cache.read(table, start, x.dtype, slot, window.block_table)
            for lo, hi in cache.geometry.pieces(start, seg.context_len):
                for a, b in window_cuts(cache.geometry, lo, hi):
                    rows = slice(seg.row_start + a - start, seg.row_start + b - start)
                    out, state = attn(
                        x[rows], meta.positions[rows], own, compress, state, cache.as_stored
                    )
                    cache.write_window(window.block_table, a, state)
                    y[rows] = out
                cache.write(table, lo, hi, state, slot, window.block_table)
        return y

    def add_ffn_output(self, residual: StreamState, ffn_out: torch.Tensor) -> torch.Tensor:
        """After the last layer: the streams with the FFN output expanded in (`logits` reads
        them)."""
        return self.expand_ffn(residual, ffn_out)

    def _ropes_on(self, device: torch.device) -> dict[str, RopeTable]:
        key = str(device)
        if key not in self._rope_tables:
            self._rope_tables[key] = self.ropes(device)
        return self._rope_tables[key]

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """h [rows, hc_mult, hidden] after the last layer -> logits [rows, vocab] float32."""
        x = self.model.norm(self.model.hc_head(h))
        weight = (
            self.model.embed_tokens.weight
            if self.config.tie_word_embeddings
            else self.lm_head.weight
        )
        return torch.nn.functional.linear(x, weight).float()

    @torch.inference_mode()
    def forward_full(self, token_ids: torch.Tensor, ffn: FFNHalf | None = None) -> torch.Tensor:
        """One sequence [rows] from position 0 -> logits [rows, vocab]. `ffn(layer, x, ids)` is
        the FFN half (by default this model's own; an FFN-only model's `ffn_half` for a split
        run): x and ids are exactly what would cross the AFD boundary."""
        return self.forward_chunk(token_ids, None, ffn)

    @torch.inference_mode()
    def forward_chunk(
        self, token_ids: torch.Tensor, cache: SequenceCache | None, ffn: FFNHalf | None = None
    ) -> torch.Tensor:
        """The next rows [rows] of the sequence `cache` holds (None: a whole sequence, nothing
        kept) -> logits [rows, vocab]; the cache is advanced past them."""
        ffn = ffn or self.ffn_half
        start = 0 if cache is None else cache.length
        positions = torch.arange(start, start + token_ids.shape[0], device=token_ids.device)
        ropes = self.ropes(token_ids.device)
        embedded = self.model.embed_tokens(token_ids)
        h = embedded.unsqueeze(1).expand(-1, self.config.family_config.hc_mult, -1).contiguous()
        for layer in range(self.config.num_layers):
            x, state = self.sequence_attention_half(layer, h, positions, ropes, cache)
            h = self.expand_ffn(state, ffn(layer, x, token_ids))
        if cache is not None:
            cache.length += token_ids.shape[0]
        return self.logits(h)

    # ----- FFN half -----
    def ffn_half(
        self, layer: int, x: torch.Tensor, token_ids: torch.Tensor, routing: Routing | None = None
    ) -> torch.Tensor:
        return self.model.layers[layer].mlp(x, token_ids, routing)

    def expected_tensors(self) -> dict[str, torch.Tensor]:
        return dict(self.state_dict(keep_vars=True))
