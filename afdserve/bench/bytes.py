"""What a decode step must read, for `afdserve bench decode`: the device's copy bandwidth, the
routed experts a batch touches, and the weight and KV bytes of one step.

Bytes are those held in memory: a block-scaled FP8 weight (`quantization="fp8"`) counts one byte
per element plus its float32 scale grid, a routed expert's scales only for the experts touched
(as its weights); an FP8 KV cache counts one byte per cached element. DeepSeek-V4's paged cache
(model/families/deepseek_v4/cache.py) counts what its attention reads per layer type
(`v4_layer_kv_bytes`).
"""

from __future__ import annotations

import statistics

import torch

from afdserve.model.config import ModelConfig
from afdserve.model.families import cache_layout
from afdserve.model.families.deepseek_v4.config import V4Config
from afdserve.model.families.dsa.config import DSAConfig
from afdserve.model.layers.fp8 import SCALE_SUFFIX
from afdserve.model.layers.moe import Experts
from afdserve.model.parts import CausalLM


def measure_copy_bandwidth(device: torch.device, size_bytes: int = 2 << 30) -> float:
    """GB/s of a device-to-device copy, counting bytes read plus bytes written (median of 10)."""
    src = torch.empty(size_bytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    times = []
    for i in range(13):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    return 2 * size_bytes / statistics.median(times) / 1e9


def touched_experts(steps, ffn: CausalLM) -> dict[str, int]:
    """Distinct routed experts each MoE layer uses in one step of this batch (all ubatches)."""
    ids: dict[str, list[torch.Tensor]] = {}
    hooks = []
    for name, module in ffn.named_modules():
        if isinstance(module, Experts):

            def record(mod, args, out, name=name):
                ids.setdefault(name, []).append(args[1][0].reshape(-1))

            hooks.append(module.register_forward_hook(record))
    try:
        steps.step(eager=True)
    finally:
        for hook in hooks:
            hook.remove()
    return {name: int(torch.cat(got).unique().numel()) for name, got in ids.items()}


# The routed-expert stacks and, when quantized, their scales (FP8 grids, FP4 ue8m0 bytes), and
# gpt-oss's expert biases: a step reads the slices of the experts it touches, in the precision
# they are held in.
EXPERT_STACKS = tuple(
    f"experts.{stack}{suffix}"
    for stack in ("gate_up_proj", "down_proj")
    for suffix in ("", SCALE_SUFFIX, "_bias")
)


def step_weight_bytes(attn: CausalLM, ffn: CausalLM, batch: int, hit: dict[str, int]) -> int:
    """Bytes of the parameters one step reads, each in its stored dtype (FP8 one byte, FP4 half a
    byte as packed pairs): every non-expert weight once, the touched experts' slices, one
    embedding row per sequence (the whole table when lm_head is tied to it)."""
    total, seen = 0, set()
    for model in (attn, ffn):
        for name, p in model.named_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            size = p.numel() * p.element_size()
            if name.endswith(EXPERT_STACKS):  # [experts, ...]: per touched expert
                layer = name.rsplit(".", 1)[0]
                total += size // p.shape[0] * hit.get(layer, 0)
            elif name.endswith("embed_tokens.weight"):
                rows = min(batch, p.shape[0])
                tied = attn.config.tie_word_embeddings
                total += size if tied else size // p.shape[0] * rows
            else:
                total += size
    return total


def step_kv_bytes(model: CausalLM, batch: int, mean_context: float, itemsize: int) -> int:
    """`itemsize`: bytes per cached element (the cache's dtype: 1 for the FP8 cache)."""
    c = model.config
    tensors = 1 if c.attention == "mla" else 2
    per_token = c.num_layers * tensors * c.num_cache_heads * c.kv_cache_dim * itemsize
    return int(batch * mean_context * per_token)


def v4_layer_kv_bytes(config: ModelConfig, layer: int, position: int, itemsize: int) -> int:
    """Bytes one sequence's decode query at `position` reads of DeepSeek-V4 layer `layer`'s pages:
    the state `LayerPages.read(table, position)` hands `V4Attention` (model/deepseek_v4/
    cache.py, attention.py), in the pages' dtypes (`itemsize` bytes, `prev_gate` float32; an
    FP8 cache, itemsize 1, keeps the rotated channels and the compressor's state bf16).

    W = sliding_window, d = head_dim, m = the layer's compress rate, closed = position // m
    (the windows pooled into entries so far), open = position % m (rows of the open window):
    - every layer: the window's last min(position, W - 1) rows, d wide;
    - HCA: all `closed` entries (d), and the open window's kv and gate rows (d each);
    - CSA: of its entries only the min(index_topk, closed) the indexer selects (the CPU
      reference gathers every entry and masks, a sparse kernel reads just these), the open
      window's kv and gate rows (2 d each: two series per token), and the last closed window's
      first series (m rows of kv at d, of gate at d in float32) once a window has closed;
      its indexer: all `closed` keys (index_head_dim wide), it scores every one, and its own
      open rows and last closed series at index_head_dim, as the compressor's.
    Writes (the new row, an entry its window closes) are left out, as for every family."""
    v4, d, f32 = config.family_config, config.head_dim, 4
    kind, rate = v4.attention_types[layer], v4.compress_rate(layer)
    state = 2 if itemsize == 1 else itemsize  # the compressor's rows: bf16 in an FP8 cache
    rope = config.qk_rope_head_dim

    def key(width: int) -> int:  # one row of a window or entries page
        return (width - rope) * itemsize + rope * state

    total = min(position, v4.sliding_window - 1) * key(d)
    if not rate:
        return total
    closed, open_rows = divmod(position, rate)
    if kind == "heavily_compressed_attention":
        return total + closed * key(d) + 2 * open_rows * d * state

    def compressor(width: int, entries: int) -> int:
        prev = rate * width * (state + f32) if closed else 0
        return entries * key(width) + 2 * open_rows * 2 * width * state + prev

    selected = min(v4.index_topk, closed)
    return total + compressor(d, selected) + compressor(v4.index_head_dim, closed)


ITEMSIZE_DTYPES = {1: torch.float8_e4m3fn, 2: torch.bfloat16, 4: torch.float32}


def dsa_layer_kv_bytes(config: ModelConfig, layer: int, position: int, itemsize: int) -> int:
    """Bytes one decode query at `position` reads of a DSA layer (DeepSeek-V3.2, GLM-5;
    model/families/dsa/): the latents of the min(index_topk, position + 1) selected tokens, and,
    where the layer runs its indexer, the keys of all position + 1 (it scores every one)."""
    dsa, context = config.family_config, position + 1
    latent = config.kv_lora_rank + config.qk_rope_head_dim
    keys = context * dsa.index_head_dim if dsa.has_indexer(layer) else 0
    return (min(dsa.index_topk, context) * latent + keys) * itemsize


def timed_kv_bytes(model: CausalLM, batch: int, positions: range, itemsize: int) -> int:
    """KV bytes of one step of `batch` sequences, averaged over decode steps at `positions`:
    GQA and MLA read the cache of position + 1 tokens (the new token's row included), gpt-oss's
    sliding layers at most their window of them, a layout with state slots that and each slot
    read and written, DeepSeek-V4 and DSA what `v4_layer_kv_bytes` and `dsa_layer_kv_bytes` say
    of each layer."""
    c = model.config
    mean_context = sum(p + 1 for p in positions) / len(positions)
    layout, dtype = cache_layout(c), ITEMSIZE_DTYPES[itemsize]
    v4 = isinstance(c.family_config, V4Config)
    if layout.bytes_per_slot(dtype) and not v4:
        # Linear attention: its state slot read and written whole each step, beside the paged
        # layers' context (V4's open rows in its slots are counted by v4_layer_kv_bytes).
        paged = mean_context * layout.bytes_per_block(1, dtype)
        return int(batch * (paged + 2 * layout.bytes_per_slot(dtype)))
    dsa = isinstance(c.family_config, DSAConfig)
    if c.attention in ("gqa", "mla") and not dsa and not hasattr(c.family_config, "window"):
        return step_kv_bytes(model, batch, mean_context, itemsize)
    if hasattr(c.family_config, "window"):  # gpt-oss: a sliding layer reads its window only
        per_token = 2 * c.num_kv_heads * c.head_dim * itemsize
        per_step = [
            sum(min(p + 1, c.family_config.window(i) or p + 1) for i in range(c.num_layers))
            for p in positions
        ]
        return int(batch * per_token * sum(per_step) / len(per_step))
    per_layer = dsa_layer_kv_bytes if dsa else v4_layer_kv_bytes
    per_step = [
        sum(per_layer(c, layer, p, itemsize) for layer in range(c.num_layers)) for p in positions
    ]
    return int(batch * sum(per_step) / len(per_step))
