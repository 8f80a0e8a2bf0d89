"""Loads the MTP draft of a loaded main model from the same checkpoint (speculative decoding's
`mtp` method): the family builds it (`Family.mtp_draft`), this fills it as the loader fills a
model, or draws it from the seed for dummy weights."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from afdserve.model.checkpoint.loader import (
    _checkpoint_files,
    _default_dtype,
    all_tensor_names,
    init_random_weights,
    load_weights,
    materialize,
)
from afdserve.model.config import read_hf_config
from afdserve.model.families import family_of, model_class
from afdserve.model.parts import CausalLM, ModelParts, MTPDraft


def checkpoint_names(model_dir: str | Path) -> set[str]:
    """Every tensor name of the checkpoint (headers only)."""
    names: set[str] = set()
    for path in _checkpoint_files(Path(model_dir)):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            names.update(f.keys())
    return names


def mtp_refusal(model_dir: str | Path, main_family: str) -> str | None:
    """Why the checkpoint in `model_dir` gives no MTP draft, before anything is loaded."""
    build = family_of(main_family).mtp_draft
    if build is None:
        return f"model family {main_family!r} has no MTP layers afdserve builds"
    raw = read_hf_config(model_dir)
    count = raw.get("num_nextn_predict_layers", 0) or 0
    if count < 1:
        return (
            "the checkpoint has no next-token-prediction layers "
            f"(config.json num_nextn_predict_layers={count})"
        )
    return None


def load_draft(
    model_dir: str | Path,
    main: CausalLM,
    load_format: str,
    seed: int,
    device: torch.device | str,
    progress: bool | None = None,
) -> MTPDraft:
    """The MTP draft of `main` on `device`: its layer read from the checkpoint, or drawn from
    `seed` where load_format is "dummy" (the tensors' names seed them, as the main model's)."""
    why = mtp_refusal(model_dir, main.config.family)
    if why is not None:
        raise ValueError(why)
    raw = read_hf_config(model_dir)
    names = None if load_format == "dummy" else checkpoint_names(model_dir)
    build = family_of(main.config.family).mtp_draft
    with _default_dtype(main.dtype), torch.device("meta"):
        draft = build(main, raw, names)
    draft = materialize(draft, device).eval()
    if names is None:
        init_random_weights(draft, seed)
    else:
        # The main model's tensors, and the other half's of the layer, are another part's.
        known = all_tensor_names(main.config) | _whole_draft_names(main, raw, names, build)
        load_weights(draft, model_dir, known, progress)
    return draft


def _whole_draft_names(main: CausalLM, raw: dict, names: set[str] | None, build) -> set[str]:
    """Every tensor name of the layer with both halves (an attention or FFN rank loads one)."""
    with torch.device("meta"):
        whole = model_class(main.config)(main.config, ModelParts.colocated())
        return set(build(whole, raw, names).state_dict())


def config_refusal(raw: dict, main_family: str) -> str | None:
    """Why a model of config.json `raw` gives no MTP draft (a bench's preset has no folder)."""
    if family_of(main_family).mtp_draft is None:
        return f"model family {main_family!r} has no MTP layers afdserve builds"
    if (raw.get("num_nextn_predict_layers", 0) or 0) < 1:
        return "its config has no next-token-prediction layers (num_nextn_predict_layers)"
    return None


def random_draft(main: CausalLM, raw: dict, seed: int, device: torch.device | str) -> MTPDraft:
    """The MTP draft of `main` (config.json `raw`) with weights drawn from `seed` as dummy
    weights are, each tensor by its name: every half equals its part of the colocated draft."""
    build = family_of(main.config.family).mtp_draft
    with _default_dtype(main.dtype), torch.device("meta"):
        draft = build(main, raw, None)
    draft = materialize(draft, device).eval()
    init_random_weights(draft, seed)
    return draft
