"""Build one half of a model and fill it from a local Hugging Face directory.

Checkpoints keep experts one by one (`mlp.experts.{e}.gate_proj.weight`; Mixtral:
`block_sparse_moe.experts.{e}.w1.weight`); afdserve stacks them into
`experts.gate_up_proj [E, 2I, H]` and `experts.down_proj [E, H, I]`. Already-stacked checkpoints
load as they are. A role reads only the tensors of its own half; a tensor the model lacks entirely
is reported as unexpected, and a missing one stops the load.

FP8 checkpoints (model/layers/fp8.py) load the same way: each quantized weight with its
`weight_scale_inv`, an expert's scales stacked beside its weights. With quantization="fp8" on a
checkpoint in another dtype, each quantized weight is quantized as it is read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import re
import sys
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from afdserve.config import LOAD_FORMATS
from afdserve.kernels.ops import quantize_fp4
from afdserve.model.config import ModelConfig
from afdserve.model.families import load_model_config, model_class
from afdserve.model.families.deepseek_v4 import names as v4_names
from afdserve.model.families.deepseek_v4.attention import V4Attention
from afdserve.model.families.deepseek_v4.quant import load_problem_v4, stored_form
from afdserve.model.families.gpt_oss import names as gpt_oss_names
from afdserve.model.families.gpt_oss import quant as gpt_oss_quant
from afdserve.model.layers.attention import GQAAttention
from afdserve.model.layers.common import GatedMLP, Rotary
from afdserve.model.layers.fp8 import (
    BLOCK_SPARSE_MOE_FAMILIES,
    SCALE_SUFFIX,
    is_fp8,
    load_problem,
    quantize_weight,
    scale_shape_error,
)
from afdserve.model.layers.moe import Experts, Router
from afdserve.model.parts import CausalLM, ModelParts
from afdserve.model.quantization import resolve_quantization

log = logging.getLogger(__name__)

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_PER_EXPERT = re.compile(
    r"^(.*\.)experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight(_scale_inv)?$"
)
_PART = {
    "gate_proj": "gate",
    "w1": "gate",
    "up_proj": "up",
    "w3": "up",
    "down_proj": "down",
    "w2": "down",
}


PROGRESS_DESC = "Loading safetensors checkpoint shards"
_EXPERT_STACKS = ("experts.gate_up_proj", "experts.down_proj")
# Stacked per expert too (gpt-oss): drawn and sharded expert by expert, as the stacks are.
_EXPERT_BIASES = ("experts.gate_up_proj_bias", "experts.down_proj_bias")


class CheckpointError(ValueError):
    """A checkpoint that does not match its config: names the tensors concerned."""


@dataclass
class LoadReport:
    loaded: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    skipped_other_half: int = 0
    skipped_by_name: int = 0  # tensors the family never reads (a vision tower, an MTP head)
    bytes: int = 0


def resolve_dtype(name: str, config: ModelConfig) -> torch.dtype:
    if name == "auto":
        name = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}.get(
            str(config.torch_dtype), "float32"
        )
    if name not in TORCH_DTYPES:
        raise ValueError(
            f"dtype={name!r} is not supported: one of {sorted(TORCH_DTYPES)} or 'auto'"
        )
    return TORCH_DTYPES[name]


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build_model(
    config: ModelConfig, parts: ModelParts, dtype: torch.dtype, device: torch.device | str
) -> CausalLM:
    """An uninitialised half on `device` (no host copy, no random init)."""
    with _default_dtype(dtype), torch.device("meta"):
        model = model_class(config)(config, parts)
    model = materialize(model, device)
    if parts.attention and isinstance(getattr(model, "rotary", None), Rotary):  # V4: its own
        inv = torch.tensor(config.rope_inv_freq, dtype=torch.float32, device=device)
        model.rotary.inv_freq = inv
    return model.eval()


def materialize(model: torch.nn.Module, device: torch.device | str) -> torch.nn.Module:
    """Storage on `device` for a module built on meta, with the dtypes and indexes its parts
    keep, and the layers that read the same rows packed into one GEMM (layers/packed.py: their
    weights load into views of it). An MTP draft goes through here too (checkpoint/draft.py)."""
    # Module.to_empty's empty_like of a meta tensor goes through torch._refs, whose first use
    # imports it (about two seconds of every rank's start); torch.empty of the shape does not.
    model = model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    if hasattr(model, "keep_float32"):  # modules a family keeps in float32
        model.keep_float32()
    for module in model.modules():
        if isinstance(module, Router) and hasattr(module, "e_score_correction_bias"):
            # The correction bias decides expert choice; keep it exact.
            module.e_score_correction_bias = module.e_score_correction_bias.float()
        if isinstance(module, Experts):
            module.index_held()  # to_empty left the shard's expert index unwritten
        if isinstance(module, GQAAttention):
            module.pack_qkv()
        elif isinstance(module, (V4Attention, GatedMLP)):
            module.pack()
    return model


def _checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        files = sorted({model_dir / name for name in weight_map.values()})
        missing = [str(p.name) for p in files if not p.is_file()]
        if missing:
            raise CheckpointError(f"{index} names shard files that do not exist: {missing}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{model_dir}: no *.safetensors files")
    return files


def _target(name: str, family: str) -> tuple[str, int | None, str | None]:
    """Checkpoint name -> (model tensor name, expert index, part) with Mixtral's and
    DeepSeek-V4's public names mapped."""
    if family == "deepseek_v4":
        name = v4_names.to_ours(name)
    elif family == "gpt_oss":
        name = gpt_oss_names.to_ours(name)
    name = name.replace(".block_sparse_moe.", ".mlp.")
    if family == "minimax_m2":  # its selection bias sits beside the gate, afdserve's in it
        name = name.replace(".mlp.e_score_correction_bias", ".mlp.gate.e_score_correction_bias")
    m = _PER_EXPERT.match(name)
    if m is None:
        return name, None, None
    prefix, expert, proj = m.group(1), int(m.group(2)), _PART[m.group(3)]
    stacked = "experts.down_proj" if proj == "down" else "experts.gate_up_proj"
    return prefix + stacked + (m.group(4) or ""), expert, proj


def _our_name(model: CausalLM, name: str) -> str | None:
    """A checkpoint tensor's name in `model`, or None for one the family skips by name: a family
    whose checkpoints nest the model or carry tensors it never reads says so itself."""
    rename = getattr(model, "checkpoint_name", None)
    return name if rename is None else rename(name)


@dataclass
class _Targets:
    """The model tensors a load fills, and which (expert, part) pieces of each it has filled."""

    expected: dict[str, torch.Tensor]
    # Online FP8: scales are computed from the weights as they are read, not read themselves.
    computed: dict[str, torch.Tensor]
    held: dict[str, tuple[int, ...]]
    filled: dict[str, set] = field(default_factory=dict)


def _targets(model: CausalLM) -> _Targets:
    expected = model.expected_tensors()
    if model.config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    quant = model.config.quantization
    computed = {
        name: expected.pop(name)
        for name in list(expected)
        if quant is not None and quant.online and name.endswith(SCALE_SUFFIX)
    }
    filled: dict[str, set] = {name: set() for name in expected}
    return _Targets(expected, computed, _held_experts(model), filled)


def load_weights(
    model: CausalLM,
    model_dir: str | Path,
    known_names: set[str] | None = None,
    progress: bool | None = None,
) -> LoadReport:
    """Fill `model` from the checkpoint. `known_names`: every tensor name of the whole model, so a
    tensor of the other half counts as skipped rather than unexpected. `progress`: a bar over the
    shards on stderr; None draws it only when stderr is a terminal, so that logs and pipes get no
    carriage returns."""
    model_dir = Path(model_dir)
    files = _checkpoint_files(model_dir)
    targets = _targets(model)
    report = LoadReport()
    bar = tqdm(
        files,
        desc=PROGRESS_DESC,
        unit="shard",
        file=sys.stderr,
        dynamic_ncols=True,
        disable=None if progress is None else not progress,
    )
    for path in bar:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                _load_tensor(model, f, name, targets, known_names, report)
    missing = _missing(model.config, targets.expected, targets.filled, targets.held)
    if missing:
        shown = ", ".join(missing[:20]) + (
            f" ... ({len(missing)} in all)" if len(missing) > 20 else ""
        )
        raise CheckpointError(f"{model_dir}: checkpoint is missing tensors: {shown}")
    _check_hash_tables(model)
    if report.unexpected:
        log.warning(
            "%s: %d unexpected tensors ignored: %s",
            model_dir,
            len(report.unexpected),
            ", ".join(report.unexpected[:10]),
        )
    report.bytes = _tensor_bytes(targets.expected) + _tensor_bytes(targets.computed)
    return report


def _load_tensor(
    model: CausalLM,
    f,
    name: str,
    targets: _Targets,
    known_names: set[str] | None,
    report: LoadReport,
) -> None:
    """Copy checkpoint tensor `name` (of the open shard `f`) into its place in `model`, checked
    and, for online FP8, quantized; or count it as another half's, or as unexpected."""
    config = model.config
    ours = _our_name(model, name)
    if ours is None:
        report.skipped_by_name += 1
        return
    target, expert, part = _target(ours, config.family)
    if target not in targets.expected:
        if known_names is not None and target in known_names:
            report.skipped_other_half += 1
        elif not (config.tie_word_embeddings and target == "lm_head.weight"):
            report.unexpected.append(name)
        return
    read = _read_held(f, name, expert, targets.held.get(target), config.num_experts)
    if read is None:
        report.skipped_other_half += 1
        return
    slot, tensor = read
    dst, quant = targets.expected[target], config.quantization
    if config.family == "deepseek_v4":  # ue8m0 scales, FP4 experts
        problem = load_problem_v4(name, target, tensor, dst, quant)
        tensor = tensor if problem else stored_form(tensor, dst, target)
    elif config.family == "gpt_oss":  # stacked experts transposed, interleaved; MXFP4 bytes
        problem = gpt_oss_quant.load_problem(name, tensor, dst)
        tensor = tensor if problem else gpt_oss_names.stored_form(name, tensor)
    else:
        problem = load_problem(name, tensor, dst, quant)
    if problem:
        raise CheckpointError(problem)
    scale = targets.computed.get(target + SCALE_SUFFIX)
    if scale is not None:  # online FP8: quantized here, on its own grid(s)
        stacked = target.endswith("gate_up_proj") and part is None
        tensor, grid = quantize_weight(tensor, stacked, quant.block)
        _copy_into(scale, grid, slot, part, name + SCALE_SUFFIX, True)
    _copy_into(dst, tensor, slot, part, name, target.endswith(SCALE_SUFFIX))
    targets.filled[target].add((expert, part))
    report.loaded.append(name)


def _read_held(
    f, name: str, expert: int | None, shard: tuple[int, ...] | None, num_experts: int
) -> tuple[int | None, torch.Tensor] | None:
    """(slot in the model's stack, tensor) of what this half holds of checkpoint tensor `name`;
    None for an expert that another expert-parallel shard holds."""
    if shard is None:
        return expert, f.get_tensor(name)
    if expert is None:  # an already-stacked checkpoint: slice the shard out
        return None, f.get_tensor(name)[list(shard)]
    # An expert-parallel shard reads only its own experts, one by one.
    if expert >= num_experts:
        raise CheckpointError(f"{name}: expert {expert} but the config has {num_experts}")
    if expert not in shard:
        return None
    return shard.index(expert), f.get_tensor(name)


def _check_hash_tables(model: CausalLM) -> None:
    """A hash layer's table must name real experts: an id out of range would index past the
    stacked experts (or silently hit a wrong one on an expert-parallel shard)."""
    experts = model.config.num_experts
    for name, module in model.named_modules():
        table = getattr(module, "tid2eid", None) if isinstance(module, Router) else None
        if table is None or table.is_meta or table.numel() == 0:
            continue
        low, high = int(table.min()), int(table.max())
        if low < 0 or high >= experts:
            bad = low if low < 0 else high
            raise CheckpointError(
                f"{name}.tid2eid holds expert id {bad}, outside "
                f"[0, {experts}) (the config's number of routed experts)"
            )


def _copy_into(
    dst: torch.Tensor,
    src: torch.Tensor,
    expert: int | None,
    part: str | None,
    name: str,
    scale: bool = False,
) -> None:
    if expert is not None:
        if expert >= dst.shape[0]:
            raise CheckpointError(f"{name}: expert {expert} but the config has {dst.shape[0]}")
        dst = dst[expert]
        if part != "down":
            half = dst.shape[0] // 2
            dst = dst[:half] if part == "gate" else dst[half:]
    if tuple(src.shape) != tuple(dst.shape) and scale:
        raise CheckpointError(
            scale_shape_error(
                name, tuple(src.shape), tuple(dst.shape), fp4=dst.dtype == torch.uint8
            )
        )
    if name.endswith("tid2eid") and src.dim() == 2 and src.shape[0] < dst.shape[0]:
        raise CheckpointError(
            f"{name}: {src.shape[0]} rows, fewer than vocab_size="
            f"{dst.shape[0]}: every token id needs its experts"
        )
    if tuple(src.shape) != tuple(dst.shape):
        raise CheckpointError(
            f"{name}: shape {tuple(src.shape)} in the checkpoint, the config implies "
            f"{tuple(dst.shape)}"
        )
    with torch.no_grad():
        dst.copy_(src)


def _held_experts(model: CausalLM) -> dict[str, tuple[int, ...]]:
    """Stacked expert tensor name -> the experts its shard holds (expert-parallel halves only)."""
    held = {}
    for name, module in model.named_modules():
        if isinstance(module, Experts) and module.held is not None:
            for tensor in ("gate_up_proj", "down_proj"):
                held[f"{name}.{tensor}"] = held[f"{name}.{tensor}{SCALE_SUFFIX}"] = module.held
                held[f"{name}.{tensor}_bias"] = module.held
    return held


def _missing(
    config: ModelConfig, expected: dict, filled: dict[str, set], held: dict[str, tuple[int, ...]]
) -> list[str]:
    missing = []
    for name, tensor in expected.items():
        got = filled[name]
        if (None, None) in got:
            continue
        experts = held.get(name, range(tensor.shape[0]))
        stack = name.removesuffix(SCALE_SUFFIX)
        if stack.endswith("experts.gate_up_proj"):
            want = {(e, p) for e in experts for p in ("gate", "up")}
        elif stack.endswith("experts.down_proj"):
            want = {(e, "down") for e in experts}
        else:
            want = {(None, None)}
        for expert, part in sorted(want - got, key=str):
            missing.append(_checkpoint_name(config, name, expert, part))
    return missing


_MIXTRAL_PROJ = {"gate": "w1", "down": "w2", "up": "w3"}


def _checkpoint_name(config: ModelConfig, name: str, expert: int | None, part: str | None) -> str:
    """A missing tensor as the family's checkpoints spell it (the inverse of `_target`)."""
    mixtral = config.family in BLOCK_SPARSE_MOE_FAMILIES
    v4 = config.family == "deepseek_v4"
    if config.family == "minimax_m2":
        name = name.replace(".mlp.gate.e_score_correction_bias", ".mlp.e_score_correction_bias")
    if config.family == "gpt_oss":
        return gpt_oss_names.to_public(name, config.quantization is not None)
    if expert is not None:
        stacked = "experts.down_proj" if part == "down" else "experts.gate_up_proj"
        proj = _MIXTRAL_PROJ[part] if mixtral or v4 else f"{part}_proj"
        # `...gate_up_proj_scale_inv` -> `...gate_proj.weight_scale_inv`
        name = name.replace(stacked, f"experts.{expert}.{proj}.weight")
    if v4:
        return v4_names.to_public(name)
    return name.replace(".mlp.", ".block_sparse_moe.") if mixtral else name


def all_tensor_names(config: ModelConfig) -> set[str]:
    with torch.device("meta"):
        full = model_class(config)(config, ModelParts.colocated())
    return set(full.state_dict().keys())


def load_model(
    model_dir: str | Path,
    parts: ModelParts,
    dtype: str = "auto",
    device: str = "cpu",
    load_format: str = "auto",
    seed: int = 0,
    progress: bool | None = None,
    quantization: str | None = None,
) -> tuple[CausalLM, LoadReport]:
    """One half of the model in `model_dir`. `load_format`: "auto" and "safetensors" read the
    checkpoint; "dummy" reads config.json only and draws random weights from `seed` (the same
    tensor gets the same values in every half that holds it: see `init_random_weights`).
    `quantization`: None (as the checkpoint says) or "fp8" (block-scaled FP8, quantized at load
    unless the checkpoint already is)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format={load_format!r} is not allowed: one of {LOAD_FORMATS}")
    config = load_model_config(model_dir)
    config = dataclasses.replace(
        config, quantization=resolve_quantization(config.quantization, quantization)
    )
    model = build_model(config, parts, resolve_dtype(dtype, config), device)
    if load_format == "dummy":
        init_random_weights(model, seed)
        return model, LoadReport(bytes=_tensor_bytes(model.expected_tensors()))
    report = load_weights(model, model_dir, all_tensor_names(config), progress)
    return model, report


def _tensor_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _tensor_seed(seed: int, name: str, expert: int | None = None) -> int:
    """A generator seed that depends on the tensor's name (and expert), not on which other
    tensors the half holds or in what order. 32 bits: the CPU generator keeps no more."""
    key = f"{seed}:{name}" if expert is None else f"{seed}:{name}#{expert}"
    return zlib.crc32(key.encode())


@torch.no_grad()
def init_random_weights(model: CausalLM, seed: int = 0, std: float = 0.02) -> None:
    """Random weights for benchmarks at real sizes (presets), drawn on the model's device.

    Every tensor draws from its own generator seeded by (seed, name), and each routed expert of
    a stacked expert tensor by (seed, name, global expert id): a colocated model, the attention
    and FFN halves of AFD ranks, and expert-parallel shards built with the same seed hold equal
    values for every tensor they share (on the same device type and dtype).

    An FP8 weight draws the same values in the model dtype and is quantized (its scales with
    it), so an FP8 model's dummy weights are the quantized dummy weights of the plain model; an
    FP4 expert stack (DeepSeek-V4) likewise, one expert at a time."""
    gen = torch.Generator(device=next(model.parameters()).device)
    held = _held_experts(model)
    state = model.state_dict(keep_vars=True)
    for name, stored in state.items():
        if name.endswith(SCALE_SUFFIX):
            continue  # computed with its weight
        stack = name.endswith(_EXPERT_STACKS + _EXPERT_BIASES)
        # An FP8 weight's values in the model dtype first (a stack's one expert at a time).
        staged = is_fp8(stored) and not stack
        tensor = torch.empty_like(stored, dtype=model.dtype) if staged else stored
        if stored.dtype == torch.uint8 and name.endswith(_EXPERT_STACKS):  # FP4 experts
            scale = state[name + SCALE_SUFFIX]
            for index, expert in enumerate(held.get(name, range(stored.shape[0]))):
                gen.manual_seed(_tensor_seed(seed, name, expert))
                values = torch.empty(
                    *stored.shape[1:-1],
                    2 * stored.shape[-1],
                    dtype=model.dtype,
                    device=stored.device,
                )
                stored[index], scale[index] = quantize_fp4(values.normal_(0.0, std, generator=gen))
            continue
        if name.endswith("tid2eid"):
            experts = model.config.num_experts
            gen.manual_seed(_tensor_seed(seed, name))
            keys = torch.rand(tensor.shape[0], experts, generator=gen, device=tensor.device)
            tensor.copy_(keys.argsort(dim=-1)[:, : tensor.shape[1]])
        elif name.endswith("norm.weight"):
            tensor.fill_(1.0)
        elif stack:
            experts = held.get(name, range(stored.shape[0]))
            for index, expert in enumerate(experts):  # [E, out, in]: one slice per expert
                gen.manual_seed(_tensor_seed(seed, name, expert))
                if not is_fp8(stored):
                    stored[index].normal_(0.0, std, generator=gen)
                    continue
                values = torch.empty_like(stored[index], dtype=model.dtype)
                _quantize_into(model, name, state, values.normal_(0.0, std, generator=gen), index)
            continue
        else:
            gen.manual_seed(_tensor_seed(seed, name))
            spread = 0.01 if name.endswith("e_score_correction_bias") else std
            tensor.normal_(0.0, spread, generator=gen)
        if tensor is not stored:
            _quantize_into(model, name, state, tensor)


def _quantize_into(
    model: CausalLM,
    name: str,
    state: dict[str, torch.Tensor],
    values: torch.Tensor,
    expert: int | None = None,
) -> None:
    """An FP8 weight's values (or those of one expert of a stack: a float32 copy of a whole
    stack is tens of GB at DeepSeek's sizes) quantized into the model with their scales."""
    quantized, grid = quantize_weight(
        values, name.endswith("gate_up_proj"), model.config.quantization.block
    )
    stored, scales = state[name], state[name + SCALE_SUFFIX]
    if expert is not None:
        stored, scales = stored[expert], scales[expert]
    stored.copy_(quantized)
    scales.copy_(grid)
