"""In-process 1A1F on one GPU holds both halves in one process: its KV cache is sized once both
are loaded, so under the same gpu_memory_utilization it gets the colocated engine's room (the
same weights on the device), not the room an attention rank alone would have."""

from __future__ import annotations

import gc
import json

import pytest
import torch

from afdserve import LLM

from .conftest import WIDE_EXPERT_BYTES

pytestmark = pytest.mark.gpu


def kv_blocks(model: str, topology: str, connector: str) -> int:
    with LLM(
        model,
        topology=topology,
        connector=connector,
        device="cuda",
        dtype="bfloat16",
        load_format="dummy",
        gpu_memory_utilization=0.3,
        graph_mode="none",
        max_num_seqs=8,
        use_tqdm_on_load=False,
    ) as llm:
        return llm.engine.core_client.core.limits.num_blocks


def test_in_process_1a1f_leaves_the_experts_their_room(wide_model):
    """Experts of 6.4 GB against KV blocks of a few KB: sizing the cache before the experts are
    loaded would give it their room."""
    blocks = {}
    for topology, connector in (("colocated", "auto"), ("1A1F", "inprocess")):
        gc.collect()
        torch.cuda.empty_cache()
        blocks[topology] = kv_blocks(str(wide_model), topology, connector)
    config = json.loads((wide_model / "config.json").read_text())
    per_block = (
        2
        * config["num_hidden_layers"]
        * 16
        * config["num_key_value_heads"]
        * config["head_dim"]
        * 2
    )  # K and V, block size 16, bf16
    experts_in_blocks = WIDE_EXPERT_BYTES / per_block
    assert abs(blocks["1A1F"] - blocks["colocated"]) < 0.05 * experts_in_blocks, blocks
