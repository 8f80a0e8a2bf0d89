"""A broken model directory is refused by the frontend in one line naming the field or tensor and
what is allowed, before any rank starts: `LLM(..., topology="2A1F")` raises the line itself, not
a rank's start-up failure (a WorkerError carrying a traceback), for DeepSeek-V4's config fields
(attention layer types, compression rates), its hash tables (rows, expert ids) and missing
tensors, and for a missing tensor of another family."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from afdserve import LLM
from afdserve.model.checkpoint.loader import CheckpointError, load_model
from afdserve.model.checkpoint.preflight import preflight
from afdserve.model.fixtures.byte_tokenizer import VOCAB_SIZE
from afdserve.model.fixtures.deepseek_v4 import make_tiny_v4
from afdserve.model.fixtures.tiny import make_tiny_model
from afdserve.model.parts import ModelParts

TABLE = "model.layers.0.ffn.gate.tid2eid"


@pytest.fixture(scope="module")
def v4_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_v4(tmp_path_factory.mktemp("preflight") / "v4", seed=1)


def edited(src: Path, dst: Path, config=None, weights=None) -> Path:
    shutil.copytree(src, dst)
    if config is not None:
        raw = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps(config(raw)))
    if weights is not None:
        tensors = weights(load_file(src / "model.safetensors"))
        save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def _drop(name: str):
    return lambda w: {k: v for k, v in w.items() if k != name}


CASES = [
    (
        dict(config=lambda c: {**c, "layer_types": ["sliding_attention", "full_attention"] * 2}),
        ValueError,
        r"layer_types\[1\]='full_attention': one of \('sliding_attention', ",
    ),
    (
        dict(
            config=lambda c: {
                **c,
                "compress_rates": {
                    "compressed_sparse_attention": 1,
                    "heavily_compressed_attention": 4,
                },
            }
        ),
        ValueError,
        r"compress_rates\['compressed_sparse_attention'\]=1: must be an int >= 2",
    ),
    (
        dict(weights=lambda w: {**w, TABLE: w[TABLE][:-3]}),
        CheckpointError,
        rf"{TABLE}: {VOCAB_SIZE - 3} rows, fewer than vocab_size={VOCAB_SIZE}: every token id",
    ),
    (
        dict(weights=lambda w: {**w, TABLE: w[TABLE].index_fill(0, torch.tensor([7]), -1)}),
        CheckpointError,
        rf"{TABLE} holds expert id -1, outside \[0, 4\)",
    ),
    (
        dict(weights=lambda w: {**w, TABLE: w[TABLE].index_fill(0, torch.tensor([9]), 4)}),
        CheckpointError,
        rf"{TABLE} holds expert id 4, outside \[0, 4\)",
    ),
    (
        dict(weights=lambda w: {**w, TABLE: w[TABLE][:, :1].contiguous()}),
        CheckpointError,
        rf"{TABLE}: shape \({VOCAB_SIZE}, 1\) in the checkpoint, the config implies "
        rf"\({VOCAB_SIZE}, 2\)",
    ),
    (
        dict(weights=_drop("model.layers.3.attn.indexer.compressor.ape")),
        CheckpointError,
        r"missing tensors: layers\.3\.attn\.indexer\.compressor\.ape$",
    ),
]


@pytest.mark.parametrize(("edit", "error", "message"), CASES)
def test_broken_v4_is_refused_before_any_rank_starts(v4_dir, tmp_path, edit, error, message):
    path = edited(v4_dir, tmp_path / "broken", **edit)
    with pytest.raises(error, match=message) as err:
        LLM(str(path), topology="2A1F", dtype="float32")
    assert "\n" not in str(err.value)
    if error is CheckpointError:  # the rank's loader says the same (or, for ranges, alike)
        with pytest.raises(CheckpointError):
            load_model(path, ModelParts.colocated(), "float32")


def test_a_missing_tensor_of_another_family_too(tmp_path):
    model = make_tiny_model(tmp_path / "q", "qwen3_moe")
    name = sorted(n for n in load_file(model / "model.safetensors") if ".experts.2.up" in n)[0]
    path = edited(model, tmp_path / "broken", weights=_drop(name))
    with pytest.raises(CheckpointError, match=rf"missing tensors: {name}$"):
        LLM(str(path), topology="2A1F", dtype="float32")


def test_sound_dirs_pass_and_dummy_reads_no_checkpoint(v4_dir, tmp_path):
    assert preflight(v4_dir).family == "deepseek_v4"
    path = edited(v4_dir, tmp_path / "empty", weights=lambda w: {"unused": torch.zeros(1)})
    assert preflight(path, load_format="dummy").family == "deepseek_v4"
    with pytest.raises(CheckpointError, match="missing tensors"):
        preflight(path)
