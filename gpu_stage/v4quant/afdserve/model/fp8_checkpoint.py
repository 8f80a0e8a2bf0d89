"""Write a checkpoint in the public block-scaled FP8 layout (DeepSeek-V3, Qwen3-*-FP8).

`quantize_checkpoint(dir)` rewrites a Hugging Face checkpoint in place: every linear weight of
attention, dense MLPs, shared experts and routed experts (one tensor per expert, as published)
becomes float8_e4m3fn plus a float32 `<name>_scale_inv` of one scale per 128 x 128 block (the
grid ceil(out / 128) x ceil(in / 128): a partial block at the end of a dimension, as in vLLM and
DeepSeek's own conversion), and config.json gains the `quantization_config` those checkpoints
carry. Embeddings, norms, routers, lm_head and any module named in `modules_to_not_convert` keep
their dtype. The names are matched on the checkpoint's own spelling, independently of how
afdserve's model quantizes, so a test of one against the other means something.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from afdserve.kernels.fp8 import quantize_blockwise
from afdserve.model.fp8 import SCALE_SUFFIX
from afdserve.model.quantization import BLOCK, Fp8Spec

# The linear weights published FP8 checkpoints quantize (GQA, MLA, dense / shared / routed MLPs).
_QUANTIZED = re.compile(
    r"\.(self_attn\.(q_proj|k_proj|v_proj|o_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj)"
    r"|(mlp|block_sparse_moe)\.(shared_experts\.)?(experts\.\d+\.)?"
    r"(gate_proj|up_proj|down_proj|w1|w2|w3))\.weight$")


def quantization_config(modules_to_not_convert: tuple[str, ...] = ()) -> dict[str, object]:
    """config.json's entry, as DeepSeek-V3's and Qwen3-*-FP8's say it."""
    config: dict[str, object] = {"quant_method": "fp8", "fmt": "e4m3",
                                 "activation_scheme": "dynamic",
                                 "weight_block_size": list(BLOCK)}  # fmt: skip
    if modules_to_not_convert:
        config["modules_to_not_convert"] = list(modules_to_not_convert)
    return config


def quantized_in_checkpoint(name: str, modules_to_not_convert: tuple[str, ...] = ()) -> bool:
    """Whether a published FP8 checkpoint stores tensor `name` in FP8."""
    module = name.removesuffix(".weight")
    return bool(_QUANTIZED.search(name)) and Fp8Spec(
        modules_to_not_convert=modules_to_not_convert).converts(module)


def quantize_checkpoint(model_dir: str | Path,
                        modules_to_not_convert: tuple[str, ...] = ()) -> Path:
    """Rewrite every safetensors file of `model_dir` (and its index) in the FP8 layout."""
    model_dir = Path(model_dir)
    config_path = model_dir / "config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    if "quantization_config" in config:
        raise ValueError(f"{model_dir}: config.json already has a quantization_config")
    index_path = model_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text()) if index_path.is_file() else None
    total = 0
    for path in sorted(model_dir.glob("*.safetensors")):
        tensors: dict[str, torch.Tensor] = {}
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                if quantized_in_checkpoint(name, modules_to_not_convert):
                    q, scale = quantize_blockwise(tensor, BLOCK)
                    tensors[name], tensors[name + SCALE_SUFFIX] = q, scale
                    if index is not None:
                        index["weight_map"][name + SCALE_SUFFIX] = path.name
                else:
                    tensors[name] = tensor
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        # Written beside, then moved over: the tensors read may still map the old file.
        staged = path.with_name(path.name + ".partial")
        save_file(tensors, staged, metadata={"format": "pt"})
        staged.replace(path)
    if index is not None:
        index.setdefault("metadata", {})["total_size"] = total
        index_path.write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    config["quantization_config"] = quantization_config(modules_to_not_convert)
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return model_dir
