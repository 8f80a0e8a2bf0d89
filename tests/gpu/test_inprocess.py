"""In-process 1A1F on one GPU holds both halves in one process: its KV cache is sized once both
are loaded, so under the same gpu_memory_utilization it gets the colocated engine's room (the
same weights on the device), not the room an attention rank alone would have."""

from __future__ import annotations

import gc
import json

import pytest
import torch

from afdserve import LLM
from afdserve.model.presets import preset_hf_config

pytestmark = pytest.mark.gpu


def kv_blocks(model: str, topology: str, connector: str) -> int:
    with LLM(model, topology=topology, connector=connector, device="cuda", dtype="bfloat16",
             load_format="dummy", gpu_memory_utilization=0.3, graph_mode="none",
             max_num_seqs=8, use_tqdm_on_load=False) as llm:
        return llm.engine.core.limits.num_blocks


def test_in_process_1a1f_leaves_the_experts_their_room(tmp_path):
    """Experts of 6.4 GB in bf16 (64 x 3 x 1024 x 2048 x 8 layers x 2 bytes) against KV blocks of
    a few hundred KB: sizing the cache before the experts are loaded would give it ~6 GB more."""
    config = preset_hf_config("tiny")
    config.update(hidden_size=1024, moe_intermediate_size=2048, num_experts=64,
                  num_hidden_layers=8, torch_dtype="bfloat16")
    model = tmp_path / "wide"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(config))
    blocks = {}
    for topology, connector in (("colocated", "auto"), ("1A1F", "inprocess")):
        gc.collect()
        torch.cuda.empty_cache()
        blocks[topology] = kv_blocks(str(model), topology, connector)
    experts_in_blocks = 6.4e9 / (2 * 8 * 16 * config["num_key_value_heads"]
                                 * config["head_dim"] * 2)
    assert abs(blocks["1A1F"] - blocks["colocated"]) < 0.05 * experts_in_blocks, blocks
