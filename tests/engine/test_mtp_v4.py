"""DeepSeek-V4's MTP drafts on one process: the layer's logits against a teacher-forced reference
of its public definition (transformers' V4 decoder layer as the block, fed u computed here in
plain torch from the safetensors, the layer's head collapse and norm written out), greedy tokens
equal to the engine without speculation for k = 1 and 2 (drafts rejected by a random layer,
beside chunked prefill, preemption and prefix caching), and a constructed checkpoint whose
drafts are all accepted."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV4ForCausalLM

from afdserve import LLM, SamplingParams
from afdserve.kernels.metadata import AttentionMetadata, Segment, batch_segments
from afdserve.model.checkpoint.draft import load_draft
from afdserve.model.checkpoint.loader import load_model
from afdserve.model.fixtures.tiny import make_tiny_model
from afdserve.model.parts import ModelParts
from tests.model.test_deepseek_v4_batched import forward, v4_cache

N = 4  # the tiny V4's num_hidden_layers: its MTP layer is layer 4 (`mtp.0.*`)
PROMPTS = [
    "abcabcabcabcabc",
    "the cat sat on the mat, the cat sat on the",
    "1 2 3 1 2 3 1 2",
    "def f(x): return x\ndef g(x): return x\n",
]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def v4_mtp(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("v4mtp") / "v4"
    return str(make_tiny_model(path, "deepseek_v4", seed=2, mtp_layers=1))


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return (x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def _reference(model: str, tmp: Path, ids: torch.Tensor) -> torch.Tensor:
    """ids [L + 1] -> the MTP logits [L, vocab] at positions 0..L-1 (t_{p+1} = ids[p + 1]),
    from the definition: transformers' model with one more layer (the MTP's block at N) runs the
    main layers; a hook swaps N's input, the main streams h, for u = e_proj(enorm(embed(t_{p+1})))
    + h_proj(hnorm(h)) and keeps its output g; logits = head(norm(hc_head(g)))."""
    weights = load_file(Path(model) / "model.safetensors")
    own = {k.removeprefix("mtp.0."): v for k, v in weights.items() if k.startswith("mtp.0.")}
    wide = {k: v for k, v in weights.items() if not k.startswith("mtp.")}
    block = ("e_proj.", "h_proj.", "enorm.", "hnorm.", "norm.", "hc_head_")
    wide.update({f"model.layers.{N}.{k}": v for k, v in own.items() if not k.startswith(block)})
    raw = json.loads((Path(model) / "config.json").read_text())
    raw.update(num_hidden_layers=N + 1, num_nextn_predict_layers=0)
    raw["layer_types"] = [*raw["layer_types"][:N], "sliding_attention"]
    raw["mlp_layer_types"] = [*raw["mlp_layer_types"][:N], "moe"]
    shutil.copytree(model, tmp)
    save_file(wide, tmp / "model.safetensors", metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(raw))
    hf = DeepseekV4ForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
    eps, c = hf.config.rms_norm_eps, hf.config
    kept = {}

    def swap(module, args, kwargs):
        h = args[0]  # [1, L, hc, hidden]: the main model's streams
        e = _rms(hf.model.embed_tokens(ids[1:])[None], own["enorm.weight"], eps)
        u = (e @ own["e_proj.weight"].T)[:, :, None] + _rms(h, own["hnorm.weight"], eps) @ (
            own["h_proj.weight"].T
        )
        return (u, *args[1:]), kwargs

    layer = hf.model.layers[N]
    hooks = [
        layer.register_forward_pre_hook(swap, with_kwargs=True),
        layer.register_forward_hook(lambda m, a, out: kept.__setitem__("g", out)),
    ]
    with torch.no_grad():
        hf(ids[None, :-1])
    for hook in hooks:
        hook.remove()
    g = kept["g"][0].float()  # [L, hc, hidden]
    flat = g.flatten(-2)
    mix = (flat @ own["hc_head_fn"].float().T) * torch.rsqrt(flat.square().mean(-1, True) + eps)
    pre = torch.sigmoid(mix * own["hc_head_scale"].float() + own["hc_head_base"].float())
    collapsed = ((pre + c.hc_eps)[..., None] * g).sum(dim=-2)
    return (_rms(collapsed, own["norm.weight"], eps) @ weights["head.weight"].float().T).float()


def test_draft_logits_match_the_reference(v4_mtp, tmp_path) -> None:
    """Teacher-forced over a prompt long enough to close CSA and HCA windows of the main model
    and pass the MTP layer's sliding window: the engine's layer loop gives the main streams,
    the draft's calls (first_input, attention_half over its own pages, MoE, logits) the rest."""
    ids = torch.tensor([(7 * i + 3) % 250 for i in range(14)])
    want = _reference(v4_mtp, tmp_path / "wide", ids)
    main, _ = load_model(v4_mtp, ModelParts.colocated(), "float32")
    draft = load_draft(v4_mtp, main, "auto", 0, "cpu")
    n = ids.shape[0] - 1
    table = torch.arange(4)
    segments = (Segment(0, n, table, n, 0),)
    batched = batch_segments(segments, torch.device("cpu"))
    meta = AttentionMetadata(torch.arange(n), torch.zeros(n, dtype=torch.int64), segments, batched)
    cache = v4_cache(main, 4, 4)
    with torch.inference_mode():
        hidden = _streams(main, cache, ids[:-1], meta)
        u = draft.first_input(hidden, ids[1:], meta.positions)
        pages = draft.cache_layout().allocate(4, 4, torch.float32, "cpu").layers[0]
        x, state = draft.attention_half(u, meta, pages, None)
        g = draft.add_ffn_output(state, draft.ffn_half(N, x, ids[1:]))
        got = draft.logits(g)
    torch.testing.assert_close(got, want, atol=2e-4 * float(want.abs().max()), rtol=0.0)
    assert got.argmax(-1).tolist() == want.argmax(-1).tolist()


def _streams(main, cache, ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """The main streams after the last layer (what the engine's layer loop hands MTP)."""
    captured = {}
    logits = main.logits

    def keep(h):
        captured["h"] = h
        return logits(h)

    main.logits = keep
    try:
        forward(main, cache, ids, meta)
    finally:
        del main.logits
    return captured["h"]


def _run(model: str, speculative: dict | None, **kwargs):
    with LLM(model, dtype="float32", speculative_config=speculative, **kwargs) as llm:
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        tokens = [o.outputs[0].token_ids for o in outs]
        again = [list(o.prompt_token_ids) + list(t) for o, t in zip(outs, tokens, strict=True)]
        tokens += [o.outputs[0].token_ids for o in llm.generate(again, GREEDY, use_tqdm=False)]
        stats = llm.engine.stats()
        preemptions = llm.engine.core_client.core.scheduler.num_preemptions
    return tokens, stats, preemptions


@pytest.mark.parametrize(("k", "kv"), [(1, "auto"), (2, "auto"), (2, "fp8")])
def test_greedy_tokens_unchanged(v4_mtp, k, kv) -> None:
    """Random MTP weights: its drafts are rejected, rolled back through every compressed
    layer; chunked prefill (a budget of 16), preemption (block 4) and prefix caching beside.
    The FP8 cache (the MTP layer's window rows too): its own tokens without speculation."""
    common = dict(
        max_num_batched_tokens=16,
        block_size=4,
        kv_cache_blocks=40,
        enable_prefix_caching=True,
        kv_cache_dtype=kv,
    )
    want, _, _ = _run(v4_mtp, None, **common)
    spec = {"method": "mtp", "num_speculative_tokens": k}
    got, stats, preemptions = _run(v4_mtp, spec, **common)
    assert got == want
    spec = stats.spec_decode[0]
    assert spec.num_accepted_tokens < spec.num_draft_tokens  # rejected drafts rolled back
    assert preemptions > 0 and sum(stats.prefix_cache_hits.values()) > 0


def test_draft_passes_from_graph_buffers_keep_the_tokens(v4_mtp, tmp_path) -> None:
    """Under a graph mode the draft passes run from the static buffers a CUDA graph replays
    (eagerly on CPU): they hold a row of the main model's mHC streams, [hc_mult, hidden]. The
    constructed checkpoint's drafts are all accepted there too."""
    model = _predictable(v4_mtp, tmp_path / "predictable")
    common = dict(block_size=4, kv_cache_blocks=64)
    want, _, _ = _run(model, None, **common)
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    graphs = dict(graph_mode="full_decode_only", cuda_graph_sizes=[1, 2, 4, 8, 16])
    with LLM(model, dtype="float32", speculative_config=spec, log_step_plan=True, **graphs) as llm:
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        modes = {mode for r in llm.step_log() for mode in r.get("draft_modes") or ()}
        stats = llm.engine.stats().spec_decode[0]
    assert [o.outputs[0].token_ids for o in outs] == want[: len(PROMPTS)]
    assert {"capture", "replay"} <= modes, modes
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == stats.num_draft_tokens


def _predictable(model: str, folder: Path) -> str:
    """The checkpoint made so that the drafts provably equal the main model's tokens: every
    attention output (wo_b) and expert down projection (w2) zero, so each block adds nothing
    and mixes equal streams into c * embed(t) (c > 0): the main logits at t are
    head(norm(embed(t))) =: f(t). The MTP's u is then enorm(embed(t')) on every stream with
    e_proj = I, h_proj = 0 and enorm's weight 1, and its norm the main one: its logits are
    f(t')'s (an RMS norm of a positive multiple of an RMS-normed row)."""
    shutil.copytree(model, folder)
    weights = load_file(folder / "model.safetensors")
    for name, t in weights.items():
        if name.endswith(("attn.wo_b.weight", ".w2.weight")):
            weights[name] = torch.zeros_like(t)
    hidden = weights["model.norm.weight"].shape[0]
    dtype = weights["model.norm.weight"].dtype
    weights["mtp.0.e_proj.weight"] = torch.eye(hidden, dtype=dtype)
    weights["mtp.0.h_proj.weight"] = torch.zeros(hidden, hidden, dtype=dtype)
    weights["mtp.0.enorm.weight"] = torch.ones(hidden, dtype=dtype)
    weights["mtp.0.norm.weight"] = weights["model.norm.weight"].clone()
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return str(folder)


@pytest.mark.parametrize("k", [1, 2])
def test_constructed_drafts_are_all_accepted(v4_mtp, tmp_path, k) -> None:
    model = _predictable(v4_mtp, tmp_path / "predictable")
    common = dict(block_size=4, kv_cache_blocks=64)
    want, _, _ = _run(model, None, **common)
    got, stats, _ = _run(model, {"method": "mtp", "num_speculative_tokens": k}, **common)
    assert got == want
    spec = stats.spec_decode[0]
    assert spec.num_draft_tokens > 2 * len(PROMPTS) * GREEDY.max_tokens // (k + 1) // 2
    assert spec.num_accepted_tokens == spec.num_draft_tokens


def test_refusals_by_name(tmp_path) -> None:
    """An MTP layer of a compressed type (a compress_ratios entry N other than 0), and a
    quantized tiny V4 with the layer (not written yet)."""
    from afdserve.model.families.deepseek_v4.mtp import mtp_attention_type

    flash_like = {"num_hidden_layers": 2, "compress_ratios": [0, 4, 0]}
    assert mtp_attention_type(flash_like) == "sliding_attention"
    # A preset's first layers: the list stays whole, the MTP layer's entry last.
    assert mtp_attention_type({**flash_like, "num_hidden_layers": 1}) == "sliding_attention"
    with pytest.raises(ValueError, match="MTP layer of attention type 'compressed_sparse"):
        mtp_attention_type({**flash_like, "compress_ratios": [0, 0, 4]})
    with pytest.raises(ValueError, match="mtp_layers=1 with a quantized deepseek_v4"):
        make_tiny_model(tmp_path / "q", "deepseek_v4", quantization="fp8", mtp_layers=1)
