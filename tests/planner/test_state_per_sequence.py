"""The planner's memory model counts a hybrid model's fixed state per sequence beside its KV: the
blocks its slot takes of the engine's pool, where the slots live in the pages."""

from __future__ import annotations

import torch

from afdserve.model.families import cache_layout
from afdserve.model.presets import preset_config
from afdserve.planner.memory import max_batch, model_bytes


def test_the_planner_counts_the_state_per_sequence() -> None:
    config = preset_config("qwen3-next-80b-a3b:8")
    sizes = model_bytes(config)
    layout = cache_layout(config)
    slot = layout.bytes_per_slot(torch.bfloat16)
    state = layout.slot_pages(16, torch.bfloat16) * layout.bytes_per_block(16, torch.bfloat16)
    assert sizes.state_per_sequence == state >= slot > 0
    room = 100e9 * 0.9 - sizes.attention - (1 << 30)
    fits = max_batch(100e9, 0.9, sizes.attention, sizes.kv_per_token, 32768, state)
    assert fits == int(room // (sizes.kv_per_token * 32768 + state))
