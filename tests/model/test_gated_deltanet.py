"""The delta-rule hybrids (Qwen3-Next, Qwen3.5-MoE image-text and text-only, Kimi-Linear)
against transformers: the delta rule's chunked and recurrent forms equal its torch references
(a decay per head, and Kimi's per key channel), split anywhere; greedy tokens equal the full
forward's argmax teacher-forced (CPU, float32); the image-text checkpoint loads text-only with
its vision tower skipped by name; config fields are honoured or refused by name; the presets
parse."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3_5MoeForConditionalGeneration
from transformers.models.kimi_linear import modeling_kimi_linear as hf_kimi
from transformers.models.qwen3_next import modeling_qwen3_next as hf_next

from afdserve import LLM, SamplingParams
from afdserve.engine.cuda_graphs import UbatchBuffers
from afdserve.kernels import ops
from afdserve.kernels.metadata import AttentionMetadata, Segment, batch_segments
from afdserve.kernels.reference import delta_chunked
from afdserve.model.checkpoint.loader import load_model
from afdserve.model.families import cache_layout, load_model_config, parse_model_config
from afdserve.model.families.gated_deltanet import config as gdn_config
from afdserve.model.families.gated_deltanet import tiny as gdn_tiny
from afdserve.model.families.gated_deltanet.cache import DeltaNetState
from afdserve.model.families.gated_deltanet.deltanet import DeltaRuleLayer
from afdserve.model.families.gated_deltanet.spans import DeltaSpans
from afdserve.model.fixtures import byte_tokenizer
from afdserve.model.fixtures.tiny import make_tiny_model
from afdserve.model.parts import ModelParts
from afdserve.model.presets import preset_config, preset_hf_config

MODEL_TYPES = ("qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text", "kimi_linear")
NEW_TOKENS = 12
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (1, 3, 7, 13, 70)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gdn")
    return {t: make_tiny_model(root / t, t, seed=1) for t in MODEL_TYPES}


def test_chunked_and_recurrent_forms_equal_transformers_reference() -> None:
    gen = torch.Generator().manual_seed(0)
    n, hk, hv, dk, dv = 150, 2, 4, 8, 6
    q, k = torch.randn(n, hk, dk, generator=gen), torch.randn(n, hk, dk, generator=gen)
    v = torch.randn(n, hv, dv, generator=gen)
    g, beta = -torch.rand(n, hv, generator=gen), torch.rand(n, hv, generator=gen)
    ref, ref_state = hf_next.torch_chunk_gated_delta_rule(
        q[None], k[None], v[None], g[None], beta[None], output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    out, state = delta_chunked.chunked(q, k, v, g, beta, None)
    torch.testing.assert_close(out, ref[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(state, ref_state[0], atol=1e-5, rtol=0)
    # The same tokens as two chunked pieces (odd chunk sizes) and one recurrent step.
    o1, s1 = delta_chunked.chunked(q[:70], k[:70], v[:70], g[:70], beta[:70], None, chunk=16)
    part = slice(70, n - 1)
    o2, s2 = delta_chunked.chunked(q[part], k[part], v[part], g[part], beta[part], s1, chunk=7)
    last = slice(n - 1, n)
    o3, s3 = ops.recurrent_step(q[last], k[last], v[last], g[last], beta[last], s2[None])
    torch.testing.assert_close(torch.cat([o1, o2, o3]), ref[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(s3[0], ref_state[0], atol=1e-5, rtol=0)


def test_per_channel_decay_equals_kimi_reference() -> None:
    gen = torch.Generator().manual_seed(1)
    n, h, d = 150, 3, 8
    q, k, v = (torch.randn(n, h, d, generator=gen) for _ in range(3))
    g, beta = -0.5 * torch.rand(n, h, d, generator=gen), torch.rand(n, h, generator=gen)
    ref, ref_state = hf_kimi.chunk_kimi_delta_attention(
        q[None], k[None], v[None], g=g[None], beta=beta[None], output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    o1, s1 = delta_chunked.chunked(q[:70], k[:70], v[:70], g[:70], beta[:70], None, chunk=16)
    part = slice(70, n - 1)
    o2, s2 = delta_chunked.chunked(q[part], k[part], v[part], g[part], beta[part], s1, chunk=7)
    last = slice(n - 1, n)
    o3, s3 = ops.recurrent_step(q[last], k[last], v[last], g[last], beta[last], s2[None])
    torch.testing.assert_close(torch.cat([o1, o2, o3]), ref[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(s3[0], ref_state[0], atol=1e-5, rtol=0)


def _oracle(model_type: str, path: Path) -> torch.nn.Module:
    cls = (
        Qwen3_5MoeForConditionalGeneration if model_type == "qwen3_5_moe" else AutoModelForCausalLM
    )
    return cls.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.mark.parametrize("model_type", MODEL_TYPES)
@torch.inference_mode()
def test_greedy_tokens_are_the_full_forward_argmax(tiny, model_type: str) -> None:
    path = tiny[model_type]
    with LLM(str(path), dtype="float32", block_size=4) as llm:
        outs = [o.token_ids for o in llm.generate(prompts(), GREEDY)]
    hf = _oracle(model_type, path)
    for prompt, got in zip(prompts(), outs, strict=True):
        assert len(got) == NEW_TOKENS
        seq = torch.tensor(prompt + got)
        logits = hf(input_ids=seq[None, :-1], use_cache=False).logits[0]
        assert float(logits.std()) > 0.5  # spread logits: ties do not decide the argmax
        assert got == logits[len(prompt) - 1 :].argmax(dim=-1).tolist()


def test_image_text_checkpoint_loads_text_only(tiny) -> None:
    """Its `model.language_model.` read as `model.`, `model.visual.` skipped by name, never
    reported unexpected; the text weights equal the text-only checkpoint's."""
    model, report = load_model(tiny["qwen3_5_moe"], ModelParts.colocated(), "float32")
    assert report.unexpected == []
    names = json.loads((tiny["qwen3_5_moe"] / "config.json").read_text())
    assert "vision_config" in names and report.skipped_by_name > 0
    text, _ = load_model(tiny["qwen3_5_moe_text"], ModelParts.colocated(), "float32")
    for (name, a), (_, b) in zip(model.state_dict().items(), text.state_dict().items()):
        assert torch.equal(a, b), name


def test_tiny_vocabulary_is_the_byte_tokenizers() -> None:
    assert (gdn_tiny.VOCAB_SIZE, gdn_tiny.BOS_ID, gdn_tiny.EOS_ID, gdn_tiny.PAD_ID) == (
        byte_tokenizer.VOCAB_SIZE,
        byte_tokenizer.BOS_ID,
        byte_tokenizer.EOS_ID,
        byte_tokenizer.PAD_ID,
    )


@pytest.mark.parametrize(
    "change, match",
    [
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_type='yarn'"),
        ({"attn_output_gate": False}, "attn_output_gate"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"layer_types": ["linear_attention", "sliding_attention"] * 2}, "sliding_attention"),
        ({"linear_num_value_heads": 3}, "linear_num_value_heads"),
        ({"quantization_config": {"quant_method": "fp8"}}, "quantization"),
        ({"mamba_ssm_dtype": "bfloat16"}, "mamba_ssm_dtype"),
        ({"linear_gate_mode": "sigmoid"}, r"\['linear_gate_mode'\] not supported"),
    ],
)
def test_config_fields_refused_by_name(tiny, change: dict, match: str) -> None:
    raw = json.loads((tiny["qwen3_next"] / "config.json").read_text())
    raw.update(change)
    with pytest.raises(ValueError, match=match):
        parse_model_config(raw)


def test_config_fields_honoured(tiny) -> None:
    config = load_model_config(tiny["qwen3_next"])
    gdn = config.family_config
    assert gdn.attention_types == tuple(gdn_tiny.TEXT["layer_types"])
    assert gdn.rotary_dim == 8 and len(config.rope_inv_freq) == 4  # partial_rotary_factor 0.5
    assert config.layer_types == ("moe", "moe", "moe", "dense")  # mlp_only_layers [3]
    nested = load_model_config(tiny["qwen3_5_moe"])
    assert nested.family_config.checkpoint_prefix == "model.language_model."
    assert nested.hidden_size == 32 and nested.norm_topk_prob


def test_cache_layout_refuses_what_the_state_cannot_do(tiny) -> None:
    layout = cache_layout(load_model_config(tiny["qwen3_next"]))
    assert "recurrent state" in layout.prefix_reuse_refusal(16)
    assert layout.fp8_refusal and layout.batched_segments
    # Every step runs from the device spans (spans.py), so both graph modes capture it.
    assert layout.graph_refusal("full") is None and layout.graph_refusal("full_decode_only") is None
    with pytest.raises(ValueError, match="enable_prefix_caching=True is not supported"):
        LLM(str(tiny["qwen3_next"]), dtype="float32", enable_prefix_caching=True)


def test_kimi_config_reads_both_spellings_and_the_cache_holds_its_latent(tiny) -> None:
    raw = json.loads((tiny["kimi_linear"] / "config.json").read_text())
    assert "num_experts_per_token" in raw  # transformers writes the public spelling
    config = parse_model_config(raw)
    assert (config.top_k, config.num_experts, config.n_group) == (2, 4, 2)
    assert config.layer_types == ("dense", "moe", "moe", "moe")
    public = {k: v for k, v in raw.items() if k not in ("layer_types", "linear_head_dim")}
    public["linear_attn_config"] = {"full_attn_layers": [2], "kda_layers": [1, 3, 4], "head_dim": 8}
    assert parse_model_config(public).family_config == config.family_config
    kinds = {s.kind: s for s in cache_layout(config).specs}
    assert kinds["KV"].heads == 1 and kinds["KV"].dim == 16 + 8  # kv_lora_rank + rope
    assert kinds["KDA"].bytes_per_slot(torch.float32) == 4 * (3 * 16 * 3 + 2 * 8 * 8)
    with pytest.raises(ValueError, match="mlp_layer_types"):
        parse_model_config({**raw, "mlp_layer_types": ["dense", "moe", "sparse", "sparse"]})
    refused = [
        ({"mla_use_nope": False}, "mla_use_nope"),
        ({"moe_router_activation_func": "softmax"}, "moe_router_activation_func"),
        ({"kda_gate_rank": 4}, r"\['kda_gate_rank'\] not supported"),
        ({"linear_attn_config": {"full_attn_layers": [2], "kda_layers": [1, 3]}}, "exactly one"),
    ]
    for change, match in refused:
        with pytest.raises(ValueError, match=match):
            parse_model_config({**public, **change})
    # Without grouped top-k the router picks over all experts, whatever num_expert_group says.
    assert parse_model_config({**raw, "use_grouped_topk": False}).n_group == 1


@pytest.mark.parametrize(
    "name",
    ["qwen3-next-80b-a3b", "qwen3.5-35b-a3b", "qwen3.5-35b-a3b:6", "kimi-linear-48b-a3b:8"],
)
def test_presets_parse(name: str) -> None:
    config = preset_config(name)
    layers = preset_hf_config(name)["num_hidden_layers"]
    kinds = config.family_config.attention_types
    assert len(kinds) == layers and kinds.count("full_attention") in (
        layers // 4,
        (layers - 1) // 4,
    )
    if config.family != "kimi_linear":
        assert config.family_config.rotary_dim == 64  # 0.25 of head_dim 256


@torch.inference_mode()
def test_one_token_prompts_start_the_batched_step_from_an_empty_state(tiny) -> None:
    """Every first step of one-token prompts is all one-row segments at position 0: the batched
    step (a decode graph's) must ignore what the slots held before."""
    path, singles = tiny["qwen3_next"], [[5], [77], [200], [5]]
    hf = _oracle("qwen3_next", path)
    with LLM(str(path), dtype="float32", block_size=4, max_num_seqs=2) as llm:
        for _ in range(2):  # the second round reuses slots the first one left dirty
            outs = [o.token_ids for o in llm.generate(singles, GREEDY)]
            for prompt, got in zip(singles, outs, strict=True):
                logits = hf(input_ids=torch.tensor([prompt + got[:-1]])).logits[0]
                assert got == logits.argmax(dim=-1).tolist()


# (row_start, row_end, context, slot): a chunk resuming its state, a decode row, a chunk and a
# one-row prompt from position 0; row 7 a pad row. Slot 4 is no segment's.
MIXED = ((0, 3, 5, 2), (3, 4, 9, 0), (4, 6, 2, 3), (6, 7, 1, 1))


def _delta_layer(model) -> tuple[DeltaRuleLayer, DeltaNetState]:
    spec = next(s for s in cache_layout(model.config).specs if isinstance(s, DeltaNetState))
    block = model.model.layers[spec.layers[0]]
    return getattr(block, "linear_attn", None) or block.self_attn, spec


@pytest.mark.parametrize("model_type", ["qwen3_next", "kimi_linear"])
@torch.inference_mode()
def test_graph_buffers_run_a_mixed_step_as_its_segments_alone(tiny, model_type: str) -> None:
    """A mixed step as a full graph reads it (UbatchBuffers on CPU: no host segments, as many
    segments as rows, the ones past the step's of slot -1, after a larger step's were loaded)
    through the layout's per-ubatch spans: each segment's output and state are what it gets
    run alone from its host segment; the pad row gives zero, no other slot changes."""
    model, _ = load_model(tiny[model_type], ModelParts.colocated(), "float32")
    layer, spec = _delta_layer(model)
    gen = torch.Generator().manual_seed(0)
    state = spec.allocate_slots(5, torch.float32, "cpu")[0]
    state.conv.normal_(generator=gen), state.delta_all.normal_(generator=gen)
    x = torch.randn(8, model.config.hidden_size, generator=gen)
    table = torch.zeros(2, dtype=torch.int32)
    positions = torch.zeros(8, dtype=torch.int64)
    alone, padded = copy.deepcopy(state), copy.deepcopy(state)
    want = torch.zeros(8, model.config.hidden_size)
    segments = []
    for r0, r1, context, slot in MIXED:
        positions[r0:r1] = torch.arange(context - (r1 - r0), context)
        segments.append(Segment(r0, r1, table, context, slot))
        alone_seg = Segment(0, r1 - r0, table, context, slot)
        one = AttentionMetadata(positions[r0:r1], positions[r0:r1], (alone_seg,))
        want[r0:r1] = DeltaRuleLayer.forward(layer, x[r0:r1], one, alone)
    buffers = UbatchBuffers(8, 2, torch.device("cpu"))
    larger = tuple(Segment(i, i + 1, table, 3, i % 5) for i in range(8))
    buffers.load(batch_segments(larger, torch.device("cpu")), 8, 8)
    buffers.load(batch_segments(tuple(segments), torch.device("cpu")), 8, 7)
    graph = AttentionMetadata(positions, positions, (), buffers.batched(8, 8, 8))
    graph = cache_layout(model.config).with_step_metadata(graph)
    assert any(isinstance(s, DeltaSpans) for s in graph.step)
    got = DeltaRuleLayer.forward(layer, x, graph, padded)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert not got[7].any()
    torch.testing.assert_close(padded.conv, alone.conv, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(padded.delta, alone.delta, atol=1e-5, rtol=1e-5)
    assert torch.equal(padded.delta[4], state.delta[4])
    assert torch.equal(padded.conv[4], state.conv[4])


def test_training_only_and_vision_fields_change_nothing(tiny) -> None:
    raw = json.loads((tiny["qwen3_5_moe"] / "config.json").read_text())
    base = parse_model_config(raw)
    noisy = json.loads(json.dumps(raw))
    noisy["text_config"].update({key: 7 for key in gdn_config.TRAINING_ONLY})
    noisy.update({key: 7 for key in gdn_config.VISION_ONLY if key != "vision_config"})
    noisy.pop("vision_config")
    assert parse_model_config(noisy) == base
