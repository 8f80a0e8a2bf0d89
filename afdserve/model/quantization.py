"""config.json's `quantization_config` and the engine's `quantization` option -> an `Fp8Spec`
(model/layers/fp8.py describes the format). No torch: the frontend checks a model's quantization
before any rank starts."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from afdserve.config import QUANTIZATIONS

# The one block size of every published FP8 checkpoint, and the one afdserve reads.
BLOCK = (128, 128)
# What a quantization_config may say for afdserve to honour it (anything else is refused by name).
# MiniMax-M2 spells it as the torch dtype.
_FMTS = ("e4m3", "float8_e4m3fn")
_ACTIVATION_SCHEMES = ("dynamic",)
# DeepSeek-V3.1 marks its float32 scales as powers of two ("ue8m0"): the same dequantization;
# DeepSeek-V4 stores them as such, one byte each (float8_e8m0fnu), which the loader widens.
_SCALE_FMTS = (None, "ue8m0")
# The routed experts' format: FP8 like the rest, or (DeepSeek-V4) FP4 e2m1 with a ue8m0 scale per
# 32 inputs (kernels/reference/fp4.py).
EXPERT_DTYPES = ("fp8", "fp4")


@dataclass(frozen=True)
class Fp8Spec:
    """How a model's FP8 weights are laid out. `online`: quantized at load from a checkpoint (or
    dummy weights) in another dtype, rather than read in FP8."""

    block: tuple[int, int] = BLOCK
    modules_to_not_convert: tuple[str, ...] = ()
    online: bool = False
    scale_fmt: str | None = None
    expert_dtype: str = "fp8"
    # The checkpoint's quant_method: "fp8", or "mxfp4" (gpt-oss: FP4 experts, nothing in FP8).
    method: str = "fp8"

    def converts(self, *names: str) -> bool:
        """Whether a module spelled `names` (the checkpoint's name, and afdserve's where it
        differs) is quantized: not when a pattern of modules_to_not_convert matches it as
        transformers' `should_convert_module` reads them (a prefix up to a module boundary, a
        regex with the same boundary, or a suffix)."""
        boundary = r"(?:(?<=\.)|(?=\.|$))"
        for pattern in self.modules_to_not_convert:
            for name in names:
                if re.match(rf"(?:{pattern}){boundary}", name) or name.endswith(pattern):
                    return False
        return True


def parse_quantization_config(
    raw: dict[str, Any], fp4_experts: bool = False, mxfp4_experts: bool = False
) -> Fp8Spec | None:
    """config.json's quantization_config -> the spec, None without one. A config afdserve cannot
    honour is a ValueError naming the field: serving FP8 weights read any other way (their
    scales dropped) would produce wrong tokens without an error. `fp4_experts`: the family reads
    expert_dtype='fp4' (DeepSeek-V4's parser says so); `mxfp4_experts`: quant_method 'mxfp4'
    (gpt-oss), its routed experts FP4 and everything else unquantized."""
    qc = raw.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ValueError(f"quantization_config={qc!r}: expected an object")
    method = qc.get("quant_method")
    if method == "mxfp4" and mxfp4_experts:
        return _mxfp4_spec(qc)
    if method != "fp8":
        raise ValueError(
            f"quantization_config.quant_method={method!r} is not supported: afdserve reads "
            "'fp8' checkpoints (float8_e4m3fn weights, float32 weight_scale_inv per 128x128 "
            "block) only"
        )
    fmt = qc.get("fmt", "e4m3")
    if fmt not in _FMTS:
        raise ValueError(f"quantization_config.fmt={fmt!r} is not supported: one of {_FMTS}")
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme not in _ACTIVATION_SCHEMES:
        raise ValueError(
            f"quantization_config.activation_scheme={scheme!r} is not supported: one of "
            f"{_ACTIVATION_SCHEMES} (static activation scales are not read)"
        )
    block = qc.get("weight_block_size")
    if block is None or list(block) != list(BLOCK):
        raise ValueError(
            f"quantization_config.weight_block_size={block!r} is not supported: "
            f"{list(BLOCK)} (per-tensor FP8 and other block sizes are not)"
        )
    scale_fmt = qc.get("scale_fmt")
    if scale_fmt not in _SCALE_FMTS:
        raise ValueError(
            f"quantization_config.scale_fmt={scale_fmt!r} is not supported: one of {_SCALE_FMTS}"
        )
    skip = list(qc.get("modules_to_not_convert") or []) + list(qc.get("ignored_layers") or [])
    if not all(isinstance(s, str) for s in skip):
        raise ValueError(f"quantization_config.modules_to_not_convert={skip!r}: names expected")
    # DeepSeek-V4 says it at the top level of config.json; transformers moves it into
    # quantization_config, and so does V4.1.
    expert_dtype = qc.get("expert_dtype", raw.get("expert_dtype")) or "fp8"
    if expert_dtype not in EXPERT_DTYPES:
        raise ValueError(
            f"quantization_config.expert_dtype={expert_dtype!r} is not supported: "
            f"one of {EXPERT_DTYPES}"
        )
    if expert_dtype == "fp4" and not fp4_experts:
        raise ValueError(
            f"quantization_config.expert_dtype='fp4' for model_type="
            f"{raw.get('model_type')!r}: FP4 experts are read for deepseek_v4 only"
        )
    return Fp8Spec(tuple(block), tuple(skip), scale_fmt=scale_fmt, expert_dtype=expert_dtype)


# What an MXFP4 quantization_config may say besides its method and skipped modules.
_MXFP4_KEYS = ("quant_method", "modules_to_not_convert", "dequantize")


def _mxfp4_spec(qc: dict[str, Any]) -> Fp8Spec:
    """gpt-oss's MXFP4: the routed experts as e2m1 pairs with a ue8m0 scale per 32 inputs (the
    format of DeepSeek-V4's FP4 experts); `modules_to_not_convert` names what stays unquantized
    (attention, router, embeddings, head: no other module is ever quantized here)."""
    unknown = sorted(k for k in qc if k not in _MXFP4_KEYS)
    if unknown:
        raise ValueError(
            f"quantization_config.{unknown[0]} is not supported for quant_method='mxfp4': "
            f"allowed keys {_MXFP4_KEYS}"
        )
    skip = list(qc.get("modules_to_not_convert") or [])
    if not all(isinstance(s, str) for s in skip):
        raise ValueError(f"quantization_config.modules_to_not_convert={skip!r}: names expected")
    if any(re.match(rf"(?:{p})(?:\.|$)", "model.layers.0.mlp.experts") for p in skip):
        raise ValueError(
            f"quantization_config.modules_to_not_convert={skip!r} keeps the routed experts "
            "unquantized: MXFP4 quantizes only them"
        )
    # `dequantize` asks transformers to widen the experts at load; afdserve keeps them FP4
    # and reads them as such (the same values), so the flag changes nothing here.
    return Fp8Spec(
        modules_to_not_convert=tuple(skip), scale_fmt="ue8m0", expert_dtype="fp4", method="mxfp4"
    )


def resolve_quantization(checkpoint: Fp8Spec | None, quantization: str | None) -> Fp8Spec | None:
    """The checkpoint's spec together with the engine's `quantization` option: an FP8 checkpoint
    is read as it is (None and "fp8" both agree with it); "fp8" on any other checkpoint
    quantizes it at load."""
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(
            f"quantization={quantization!r} is not supported: None or one of {QUANTIZATIONS}"
        )
    if checkpoint is None and quantization == "fp8":
        return Fp8Spec(online=True)
    if checkpoint is not None and checkpoint.method == "mxfp4" and quantization == "fp8":
        raise ValueError(
            "quantization='fp8' on an MXFP4 checkpoint is not supported: its experts are read "
            "in MXFP4 as published and nothing else is quantized; allowed: None"
        )
    return checkpoint


def check_quantization(model_dir: str | Path, quantization: str | None) -> None:
    """Refuse a checkpoint's quantization (or the option) before any rank starts."""
    with open(Path(model_dir) / "config.json") as f:
        raw = json.load(f)
    v4 = raw.get("model_type") == "deepseek_v4"  # the family whose experts may be FP4
    mxfp4 = raw.get("model_type") == "gpt_oss"  # the family whose experts may be MXFP4
    spec = parse_quantization_config(raw, fp4_experts=v4, mxfp4_experts=mxfp4)
    resolve_quantization(spec, quantization)
