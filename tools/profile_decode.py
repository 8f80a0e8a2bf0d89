"""Profile decode steps as `afdserve bench decode` runs them (its DecodeSteps, graphs replayed),
and print the kernels by GPU time per step, on CUDA.

    PYTHONPATH=. python tools/profile_decode.py --preset deepseek-v4-flash:4 --context-len 8192 \
        --batch 64 [--quantization fp8] [--kv-cache-dtype fp8] [--graph-mode none]
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from afdserve.bench.decode import DecodeBench
from afdserve.bench.decode_steps import DecodeSteps, build_halves
from afdserve.bench.report import WARMUP_STEPS
from afdserve.model.presets import hf_config_of

p = argparse.ArgumentParser()
p.add_argument("--preset", required=True)
p.add_argument("--context-len", type=int, default=1024)
p.add_argument("--batch", type=int, default=64)
p.add_argument("--quantization", default=None)
p.add_argument("--kv-cache-dtype", default="auto")
p.add_argument("--graph-mode", default="full_decode_only")
p.add_argument("--steps", type=int, default=5)
p.add_argument("--rows", type=int, default=30)
a = p.parse_args()
spec = DecodeBench(
    preset=a.preset,
    random_weights=True,
    context_len=a.context_len,
    graph_mode=a.graph_mode,
    quantization=a.quantization,
    kv_cache_dtype=a.kv_cache_dtype,
    batch_sizes=(a.batch,),
    steps=a.steps,
)
attn, ffn = build_halves(spec, hf_config_of(spec.preset, None))
steps = DecodeSteps(attn, ffn, spec, a.batch)
for _ in range(WARMUP_STEPS):
    steps.step()
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
    times = [steps.step()[1] for _ in range(a.steps)]
    torch.cuda.synchronize()
print(
    f"{a.preset} ctx {a.context_len} batch {a.batch} quant {a.quantization} kv {a.kv_cache_dtype}"
    f" graph {a.graph_mode}: step ms {[round(t * 1e3, 2) for t in times]}"
)
ka = prof.key_averages()
total = sum(e.device_time_total for e in ka if e.device_type.name == "CUDA") or 1
rows = sorted((e for e in ka if e.device_time_total > 0), key=lambda e: -e.self_device_time_total)
print(f"GPU time per step (sum of kernels): {total / a.steps / 1e3:.2f} ms")
# Kernels per step, both halves: every GPU kernel event (graph replays' included) counts.
launches = sum(e.count for e in ka if e.device_type.name == "CUDA") / a.steps
layers = attn.config.num_layers
print(f"GPU kernels per step: {launches:.0f}, {launches / layers:.1f} per layer of {layers}")
for e in rows[: a.rows]:
    print(
        f"{e.self_device_time_total / a.steps:10.1f} us/step  {e.count // a.steps:5d}/step  "
        f"{e.key[:110]}"
    )
sys.stdout.flush()
