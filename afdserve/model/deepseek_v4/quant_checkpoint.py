"""Write a DeepSeek-V4 checkpoint in the published DeepSeek-V4-Flash precision and spelling.

`quantize_v4_checkpoint(dir, expert_dtype)` rewrites a bf16/fp32 V4 checkpoint in place, naming
every tensor as DeepSeek's files do (`embed.weight`, `layers.0.attn.wq_a.weight`, `hc_head_fn`:
no `model.` prefix) and storing:

- the attention projections `wq_a`, `wq_b`, `wkv`, `wo_a`, `wo_b`, the indexer's `wq_b` and the
  shared expert's `w1`/`w2`/`w3` as float8_e4m3fn, each with `<module>.scale`, float8_e8m0fnu
  [ceil(out / 128), ceil(in / 128)]: per block the power of two at or above amax / 448;
- the routed experts (`ffn.experts.E.w1/w2/w3`) as FP4 (`expert_dtype="fp4"`): int8 [out, in / 2]
  of e2m1 pairs and `.scale` float8_e8m0fnu [out, in / 32] (kernels/fp4.py), or as FP8 like the
  projections (`expert_dtype="fp8"`, the variant DeepSeek's README describes: no expert_dtype);
- everything else (compressors, the indexer's weights_proj, routers, norms, mHC, embeddings and
  head) as it was.

config.json gains Flash's `quantization_config` and, for FP4, its top-level `expert_dtype`. The
names are matched on DeepSeek's own spelling, independently of model/deepseek_v4/quant.py's
choice of modules, so a test of one against the other means something.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from afdserve.kernels.fp4 import quantize_fp4
from afdserve.kernels.fp8 import FP8_DTYPE, FP8_MAX, quantize_blockwise
from afdserve.model.quantization import BLOCK, EXPERT_DTYPES

_FP8 = re.compile(r"^layers\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)"
                  r"|ffn\.shared_experts\.(w1|w2|w3))\.weight$")  # fmt: skip
_EXPERT = re.compile(r"^layers\.\d+\.ffn\.experts\.\d+\.(w1|w2|w3)\.weight$")
_TOP = {"embed_tokens.weight": "embed.weight", "hc_head.hc_fn": "hc_head_fn",
        "hc_head.hc_base": "hc_head_base", "hc_head.hc_scale": "hc_head_scale",
        "lm_head.weight": "head.weight"}  # fmt: skip


def quantization_config() -> dict[str, object]:
    """DeepSeek-V4-Flash's config.json entry."""
    return {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
            "scale_fmt": "ue8m0", "weight_block_size": list(BLOCK)}  # fmt: skip


def public_name(name: str) -> str:
    bare = name.removeprefix("model.")
    return _TOP.get(bare, bare)


@torch.no_grad()
def quantize_fp8_ue8m0(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] -> (float8_e4m3fn values, float8_e8m0fnu scales per 128 x 128 block):
    each block's scale is rounded up to a power of two, then the values divided by it (so none
    exceeds 448), as transformers' Fp8Quantize does for scale_fmt='ue8m0'."""
    _, scale = quantize_blockwise(weight, BLOCK)  # amax / 448 per block (1 for zero blocks)
    scale = torch.exp2(torch.ceil(torch.log2(scale)))
    rows, cols = weight.shape
    full = scale.repeat_interleave(BLOCK[0], 0).repeat_interleave(BLOCK[1], 1)[:rows, :cols]
    q = (weight.float() / full).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale.to(torch.float8_e8m0fnu)


def quantize_v4_checkpoint(model_dir: str | Path, expert_dtype: str = "fp4") -> Path:
    """Rewrite the single-file V4 checkpoint in `model_dir` (see the module docstring)."""
    if expert_dtype not in EXPERT_DTYPES:
        raise ValueError(f"expert_dtype={expert_dtype!r} is not supported: one of "
                         f"{EXPERT_DTYPES}")  # fmt: skip
    model_dir = Path(model_dir)
    config_path = model_dir / "config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    if "quantization_config" in config:
        raise ValueError(f"{model_dir}: config.json already has a quantization_config")
    path = model_dir / "model.safetensors"
    tensors: dict[str, torch.Tensor] = {}
    with safe_open(str(path), framework="pt", device="cpu") as f:
        for name in f.keys():
            key, tensor = public_name(name), f.get_tensor(name)
            module = key.removesuffix(".weight")
            if _EXPERT.match(key) and expert_dtype == "fp4":
                packed, scale = quantize_fp4(tensor)
                tensors[key] = packed.view(torch.int8)  # DeepSeek's files say I8
                tensors[module + ".scale"] = scale.view(torch.float8_e8m0fnu)
            elif _FP8.match(key) or _EXPERT.match(key):
                tensors[key], tensors[module + ".scale"] = quantize_fp8_ue8m0(tensor)
            else:
                tensors[key] = tensor
    staged = path.with_name(path.name + ".partial")  # the tensors read may still map the file
    save_file(tensors, staged, metadata={"format": "pt"})
    staged.replace(path)
    config["quantization_config"] = quantization_config()
    if expert_dtype == "fp4":
        config["expert_dtype"] = "fp4"
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return model_dir
