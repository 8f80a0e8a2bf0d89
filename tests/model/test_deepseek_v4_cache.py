"""DeepSeek-V4 with a per-sequence cache (`SequenceCache`: window, compressed entries, compressor
and indexer state): prefill in any chunks and decode one token at a time give transformers' full
forward logits at every position, and the cache stays as small as docs/design.md says."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import DeepseekV4ForCausalLM

from afdserve.model.checkpoint.loader import load_model
from afdserve.model.families.deepseek_v4.model import V4CausalLM
from afdserve.model.fixtures.deepseek_v4 import make_tiny_v4
from afdserve.model.fixtures.tiny import make_tiny_model
from afdserve.model.parts import ModelParts
from tests.model.deepseek_v4_helpers import boundary_ties

SPLITS = ([29], [3, 5, 1, 4, 16], [1] * 29, [2] * 14 + [1], [4, 4, 4, 17], [7, 22])


@pytest.fixture(scope="module")
def v4_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(
        tmp_path_factory.mktemp("v4c") / "tiny", "deepseek_v4", hash_layers=1, seed=2
    )


@pytest.fixture(scope="module")
def hf(v4_dir: Path) -> DeepseekV4ForCausalLM:
    return DeepseekV4ForCausalLM.from_pretrained(
        v4_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()


@pytest.fixture(scope="module")
def ours(v4_dir: Path) -> V4CausalLM:
    return load_model(v4_dir, ModelParts.colocated(), "float32")[0]


def close(got: torch.Tensor, want: torch.Tensor, tol: float = 1e-5) -> None:
    torch.testing.assert_close(got, want, atol=tol * float(want.abs().max()), rtol=0.0)


def tokens(length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("split", SPLITS, ids=lambda s: "+".join(map(str, s)))
@torch.inference_mode()
def test_chunked_prefill_equals_transformers_full_forward(
    hf: DeepseekV4ForCausalLM, ours: V4CausalLM, split: list[int]
) -> None:
    ids = tokens(sum(split), seed=len(split))
    assert boundary_ties(ours, ids) == []
    want = hf(ids[None], use_cache=False).logits[0]
    cache, got, start = ours.new_cache(), [], 0
    for size in split:
        got.append(ours.forward_chunk(ids[start : start + size], cache))
        start += size
    close(torch.cat(got), want)
    assert cache.length == ids.shape[0]


@pytest.mark.parametrize("prompt_len", [1, 3, 6])
@torch.inference_mode()
def test_cached_greedy_decode_equals_full_forward_greedy(
    hf: DeepseekV4ForCausalLM, ours: V4CausalLM, prompt_len: int
) -> None:
    """Decode 20 tokens one at a time with the cache; transformers re-runs its full forward for
    every token. Logits close at each step, tokens equal."""
    seq = tokens(prompt_len, seed=50 + prompt_len)
    cache = ours.new_cache()
    logits = ours.forward_chunk(seq, cache)[-1]
    for _ in range(20):
        want = hf(seq[None], use_cache=False).logits[0, -1]
        close(logits, want)
        nxt = want.argmax()
        assert int(logits.argmax()) == int(nxt)
        seq = torch.cat((seq, nxt[None]))
        logits = ours.forward_chunk(nxt[None], cache)[-1]
    assert boundary_ties(ours, seq) == []


@torch.inference_mode()
def test_cache_holds_what_the_design_says(ours: V4CausalLM) -> None:
    v4 = ours.config.family_config
    cache = ours.new_cache()
    ours.forward_chunk(tokens(23, seed=3), cache)
    for layer, state in enumerate(cache.layers):
        assert state.window_kv.shape == (v4.sliding_window - 1, ours.config.head_dim)
        assert state.window_pos.tolist() == list(range(23 - v4.sliding_window + 1, 23))
        rate = v4.compress_rate(layer)
        if rate == 0:
            assert state.compressor is None
            continue
        comp = state.compressor
        assert comp.entries.shape == (23 // rate, ours.config.head_dim)
        assert comp.pending_kv.shape[0] == 23 % rate
        csa = v4.attention_types[layer] == "compressed_sparse_attention"
        assert (comp.prev_kv is not None) == csa
        if csa:
            assert comp.prev_kv.shape == (rate, ours.config.head_dim)
            assert state.indexer.entries.shape == (23 // rate, v4.index_head_dim)
        else:
            assert state.indexer is None


@torch.inference_mode()
def test_transformers_cached_decode_agrees_with_its_full_forward_without_ties(
    hf: DeepseekV4ForCausalLM, ours: V4CausalLM
) -> None:
    """The oracle's two paths agree where the model is defined: its cache is right, and where
    they part it is over indexer ties (next test)."""
    seq = tokens(3, seed=8)
    out = hf.generate(
        seq[None],
        max_new_tokens=16,
        do_sample=False,
        eos_token_id=None,
        output_logits=True,
        return_dict_in_generate=True,
    )
    full = hf(out.sequences, use_cache=False).logits[0]
    assert boundary_ties(ours, out.sequences[0]) == []
    for step, logits in enumerate(out.logits):
        close(logits[0], full[2 + step])


@torch.inference_mode()
def test_indexer_ties_are_broken_the_same_way_in_every_chunking(tmp_path: Path) -> None:
    """Two index heads: relu often zeroes both, and entries tie at score 0.0. afdserve keeps the
    earliest of tied entries, so its decode equals its full forward there too (transformers'
    torch.topk choice changes with the tensor's shape, so its generate and full forward part)."""
    path = make_tiny_v4(tmp_path / "ties", seed=0, index_n_heads=2)
    model = load_model(path, ModelParts.colocated(), "float32")[0]
    ids = tokens(29, seed=0)
    assert len(boundary_ties(model, ids)) >= 3
    want = model.forward_full(ids)
    for split in SPLITS:
        cache, got, start = model.new_cache(), [], 0
        for size in split:
            got.append(model.forward_chunk(ids[start : start + size], cache))
            start += size
        close(torch.cat(got), want, 1e-6)
