"""What a prefill's arithmetic is measured against: the model's active parameters per token (2
FLOPs each, the convention the issue's and vLLM's throughput figures use; attention's own
context-dependent FLOPs are left out) and the device's measured bf16 (or FP8) matmul rate."""

from __future__ import annotations

import statistics

import torch

from afdserve.bench.report import device_seconds
from afdserve.model.config import ModelConfig
from afdserve.model.families import model_class
from afdserve.model.layers.fp8 import SCALE_SUFFIX
from afdserve.model.parts import ModelParts

# Stacked routed experts hold every expert; a token runs top_k of num_experts of them.
ROUTED = ("experts.gate_up_proj", "experts.down_proj")


def active_parameters(config: ModelConfig) -> int:
    """Weights one token multiplies through: every matrix but the embedding, the routed experts
    at top_k / num_experts of their count (built on the meta device: no memory)."""
    with torch.device("meta"):
        model = model_class(config)(config, ModelParts.colocated())
    total = 0.0
    for name, tensor in model.state_dict(keep_vars=True).items():
        if name.endswith(SCALE_SUFFIX) or "embed_tokens" in name or tensor.dim() < 2:
            continue
        share = config.top_k / config.num_experts if name.endswith(ROUTED) else 1.0
        numel = tensor.numel() * (2 if tensor.dtype == torch.uint8 else 1)  # FP4: two a byte
        total += numel * share
    if config.tie_word_embeddings:  # the head is the embedding's matrix
        total += config.vocab_size * config.hidden_size
    return int(total)


def measure_matmul_tflops(device: torch.device, n: int = 8192, fp8: bool = False) -> float:
    """TFLOP/s of an n x n x n bf16 matmul on `device` (median of 10 after 3 warm-ups); with
    `fp8`, of torch's e4m3 scaled matmul (bf16 out), the rate FP8 weights are held to."""
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    if fp8:
        one = torch.ones((), dtype=torch.float32, device=device)
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()  # b column-major

        def step() -> torch.Tensor:
            return torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16)
    else:

        def step() -> torch.Tensor:
            return torch.mm(a, b)

    times = [device_seconds(step, device) for _ in range(13)][3:]
    return 2 * n**3 / statistics.median(times) / 1e12
