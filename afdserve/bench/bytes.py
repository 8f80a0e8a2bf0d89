"""What a decode step must read, for `afdserve bench decode`: the device's copy bandwidth, the
routed experts a batch touches, and the weight and KV bytes of one step.

Bytes are those held in memory: a block-scaled FP8 weight (`quantization="fp8"`) counts one byte
per element plus its float32 scale grid, a routed expert's scales only for the experts touched
(as its weights); an FP8 KV cache counts one byte per cached element."""

from __future__ import annotations

import statistics

import torch

from afdserve.model.fp8 import SCALE_SUFFIX
from afdserve.model.model import MoECausalLM
from afdserve.model.moe import Experts


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


def touched_experts(steps, ffn: MoECausalLM) -> dict[str, int]:
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


# The routed-expert stacks and, for FP8 experts, their scale grids (model/fp8.py).
EXPERT_STACKS = tuple(f"experts.{stack}{suffix}" for stack in ("gate_up_proj", "down_proj")
                      for suffix in ("", SCALE_SUFFIX))  # fmt: skip


def step_weight_bytes(attn: MoECausalLM, ffn: MoECausalLM, batch: int, hit: dict[str, int]) -> int:
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


def step_kv_bytes(model: MoECausalLM, batch: int, mean_context: float, itemsize: int) -> int:
    """`itemsize`: bytes per cached element (the cache's dtype: 1 for the FP8 cache)."""
    c = model.config
    tensors = 1 if c.attention == "mla" else 2
    per_token = c.num_layers * tensors * c.num_cache_heads * c.kv_cache_dim * itemsize
    return int(batch * mean_context * per_token)
