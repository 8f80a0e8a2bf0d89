"""MTP drafts (DeepSeek-V3's next-token-prediction layer) on one process: the layer's logits
against an independent reference of the formula (transformers' DeepSeek-V3 decoder layer fed
h' computed in plain torch from the same safetensors), every draft the engine proposes equal to
that reference's argmax, greedy tokens equal to the engine without speculation beside chunked
prefill, preemption and prefix caching, and the refusals by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV3ForCausalLM

from afdserve import LLM, SamplingParams
from afdserve.config import EngineConfig, SpeculativeConfig
from afdserve.kernels.metadata import AttentionMetadata, Segment
from afdserve.llm import check_mtp_connector
from afdserve.model.checkpoint.draft import load_draft
from afdserve.model.checkpoint.loader import load_model
from afdserve.model.fixtures.tiny import make_tiny_model
from afdserve.model.parts import ModelParts

N = 4  # the tiny model's num_hidden_layers: its MTP layer is model.layers.4
PROMPTS = [
    "abcabcabcabcabc",
    "the cat sat on the mat, the cat sat on the",
    "1 2 3 1 2 3 1 2",
    "def f(x): return x\ndef g(x): return x\n",
]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("mtp") / "v3"
    return str(make_tiny_model(path, "deepseek_v3", seed=4, mtp_layers=1))


@pytest.fixture(scope="module")
def reference(mtp_model, tmp_path_factory):
    """tokens [L] -> MTP logits [L - 1, vocab] at positions 0..L-2, by the formula: the main
    model is transformers' own; the MTP decoder layer is a one-layer transformers DeepSeek-V3
    whose final norm and head are shared_head's, fed h' computed here in plain torch."""
    main = DeepseekV3ForCausalLM.from_pretrained(mtp_model, dtype=torch.float32).eval()
    weights = load_file(Path(mtp_model) / "model.safetensors")
    layer = {k: v for k, v in weights.items() if k.startswith(f"model.layers.{N}.")}
    one = {
        k.replace(f"model.layers.{N}.", "model.layers.0."): v
        for k, v in layer.items()
        if k.split(".")[3] not in ("enorm", "hnorm", "eh_proj", "shared_head", "embed_tokens")
    }
    one["model.norm.weight"] = layer[f"model.layers.{N}.shared_head.norm.weight"]
    one["lm_head.weight"] = layer[f"model.layers.{N}.shared_head.head.weight"]
    one["model.embed_tokens.weight"] = layer[f"model.layers.{N}.embed_tokens.weight"]
    raw = json.loads((Path(mtp_model) / "config.json").read_text())
    raw.update(num_hidden_layers=1, first_k_dense_replace=0, mlp_layer_types=["moe"])
    raw.update(num_nextn_predict_layers=0)
    folder = tmp_path_factory.mktemp("mtp_ref")
    (folder / "config.json").write_text(json.dumps(raw))
    save_file(one, folder / "model.safetensors", metadata={"format": "pt"})
    block = DeepseekV3ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    eps = raw["rms_norm_eps"]

    def rms(x: torch.Tensor, name: str) -> torch.Tensor:
        w = layer[f"model.layers.{N}.{name}.weight"]
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    def h_in(next_ids: torch.Tensor, h: torch.Tensor, first: int) -> torch.Tensor:
        """h' of rows at positions first, first + 1, ...: the embedding's half zero at 0."""
        embed = layer[f"model.layers.{N}.embed_tokens.weight"][next_ids].clone()
        if first == 0:
            embed[0] = 0.0
        both = torch.cat([rms(embed, "enorm"), rms(h, "hnorm")], dim=-1)
        return both @ layer[f"model.layers.{N}.eh_proj.weight"].T

    outputs = []  # the decoder layer's output g (before shared_head.norm), of the last call
    block.model.layers[0].register_forward_hook(lambda m, i, out: outputs.append(out))

    @torch.no_grad()
    def logits(tokens: list[int], draft: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits at positions 0..L-2, and the main hidden rows; with `draft`, one more row:
        the chained draft at position L-1 (input `draft` and g at L-2)."""
        ids = torch.tensor(tokens)
        h = main.model(input_ids=ids[None]).last_hidden_state[0, :-1]  # after the final norm
        rows = h_in(ids[1:], h, 0)
        if draft is not None:
            outputs.clear()
            block(inputs_embeds=rows[None], position_ids=torch.arange(len(rows))[None])
            g = outputs[-1][0, -1:]
            rows = torch.cat([rows, h_in(torch.tensor([draft]), g, len(rows))])
        out = block(inputs_embeds=rows[None], position_ids=torch.arange(len(rows))[None])
        return out.logits[0], h

    return logits


def test_mtp_logits_match_the_reference(mtp_model, reference) -> None:
    """The draft module over one sequence's rows from position 0 (its own KV cache, pages of
    4), given the same main hidden states: the reference's logits (whose row at position 0
    pairs no embedding, as vLLM's DeepSeek MTP layer masks it)."""
    main, _ = load_model(mtp_model, ModelParts.colocated(), "float32")
    draft = load_draft(mtp_model, main, "auto", 0, "cpu")
    tokens = [5, 17, 99, 3, 42, 42, 7, 250, 1, 64, 9]
    want, hidden = reference(tokens)
    rows = len(tokens) - 1
    cache = draft.cache_layout().allocate(4, 4, torch.float32, "cpu").layers[0]
    positions = torch.arange(rows)
    meta = AttentionMetadata(
        positions, positions.clone(), (Segment(0, rows, torch.arange(4), rows),)
    )
    ids = torch.tensor(tokens[1:])
    with torch.inference_mode():
        h = draft.chain_input(hidden, ids, positions)
        x, h = draft.attention_half(h, meta, cache, main.cos_sin(positions))
        g = draft.add_ffn_output(h, draft.ffn_half(N, x, ids))
        got = draft.logits(g)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)


def _run(model: str, speculative: dict | None, log: list | None = None, **kwargs):
    """Every prompt's greedy tokens, the drafts proposed (request, position, drafts) and the
    speculation counters; `log`, when given, gets the step log's records and the draft passes'
    runner."""
    if log is not None:
        kwargs["log_step_plan"] = True
    with LLM(model, dtype="float32", speculative_config=speculative, **kwargs) as llm:
        scheduler = llm.engine.core_client.core.scheduler
        schedule, drafts = scheduler.schedule, []

        def noted():  # the real scheduler runs; this only keeps a note of the drafts
            out = schedule()
            drafts.extend(
                (e.seq.request_id, e.seq.num_computed_tokens, e.draft_ids)
                for e in out.scheduled
                if e.draft_ids
            )
            return out

        scheduler.schedule = noted
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        stats = llm.engine.stats().spec_decode.get(0)
        if log is not None:
            log += [llm.engine.core_client.core.mtp.passes, *llm.step_log()]
    tokens = {o.request_id: list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs}
    return [o.outputs[0].token_ids for o in outs], tokens, drafts, stats


@pytest.mark.parametrize("k", [1, 2])
def test_greedy_tokens_unchanged_and_drafts_are_the_layers(mtp_model, reference, k) -> None:
    """Chunked prefill (a budget of 16), preemption (24 blocks of 4) and prefix caching: the
    same tokens; every first draft is the reference's argmax at the position before it, and
    (a sample of) the second drafts its chained prediction."""
    common = dict(max_num_batched_tokens=16, block_size=4, kv_cache_blocks=24, max_num_seqs=4)
    want, _, _, _ = _run(mtp_model, None, **common)
    spec = {"method": "mtp" if k == 1 else "deepseek_mtp", "num_speculative_tokens": k}
    got, tokens, drafts, stats = _run(mtp_model, spec, **common)
    assert got == want
    assert stats.num_drafts == len(drafts) > 0
    assert stats.num_draft_tokens == sum(len(d) for _, _, d in drafts)
    chained = [d for d in drafts if len(d[2]) == 2]
    assert bool(chained) == (k == 2)
    argmax = {rid: reference(t)[0].argmax(dim=-1).tolist() for rid, t in tokens.items()}
    for rid, position, proposed in drafts:
        assert proposed[0] == argmax[rid][position - 1], (rid, position, proposed)
    for rid, position, proposed in chained[:: max(1, len(chained) // 8)]:  # a sample
        row = reference(tokens[rid][: position + 1], proposed[0])[0][-1]
        assert proposed[1] == int(row.argmax()), (rid, position, proposed)


def test_prefix_caching_keeps_tokens(mtp_model) -> None:
    """Each prompt again, continued by its output: its cached blocks' MTP rows are reused."""
    common = dict(block_size=4, kv_cache_blocks=64, enable_prefix_caching=True)
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    with LLM(mtp_model, dtype="float32", **common) as plain:
        first = plain.generate(PROMPTS, GREEDY, use_tqdm=False)
        again = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in first]
        want = [o.outputs[0].token_ids for o in plain.generate(again, GREEDY, use_tqdm=False)]
    with LLM(mtp_model, dtype="float32", speculative_config=spec, **common) as llm:
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        got = [o.outputs[0].token_ids for o in llm.generate(again, GREEDY, use_tqdm=False)]
        hits = sum(llm.engine.stats().prefix_cache_hits.values())
    assert got == want and hits > 0


def test_cli_writes_the_layer(tmp_path) -> None:
    from afdserve.cli import main

    assert (
        main(
            ["make-tiny-model", str(tmp_path / "m"), "--family", "deepseek_v3", "--mtp-layers", "1"]
        )
        == 0
    )
    raw = json.loads((tmp_path / "m" / "config.json").read_text())
    names = load_file(tmp_path / "m" / "model.safetensors")
    assert raw["num_nextn_predict_layers"] == 1 and f"model.layers.{N}.eh_proj.weight" in names


def test_config_takes_both_spellings() -> None:
    for method in ("mtp", "deepseek_mtp"):
        config = EngineConfig(
            "m", speculative_config={"method": method, "num_speculative_tokens": 2}
        )
        assert config.speculative_config == SpeculativeConfig(method, 2)
        assert config.speculative_config.is_mtp


def test_refusals_by_name(tmp_path, mtp_model) -> None:
    spec = {"method": "mtp", "num_speculative_tokens": 1}
    plain = str(make_tiny_model(tmp_path / "v3", "deepseek_v3"))
    with pytest.raises(ValueError, match="no next-token-prediction layers .*num_nextn_predict"):
        LLM(plain, speculative_config=spec)
    qwen = str(make_tiny_model(tmp_path / "qwen", "qwen3_moe"))
    with pytest.raises(ValueError, match="no next-token-prediction layers"):
        LLM(qwen, speculative_config=spec)
    with pytest.raises(ValueError, match="connector='ipc' does not carry the MTP layer"):
        # CUDA only, so called where LLM calls it once the connector is resolved
        check_mtp_connector(SpeculativeConfig("mtp", 1), "ipc")
    with pytest.raises(ValueError, match="mtp_layers=1 with family='qwen3_moe': allowed 0"):
        make_tiny_model(tmp_path / "q2", "qwen3_moe", mtp_layers=1)


def test_deepseek_v4_without_mtp_layers_refuses_mtp_by_name(tmp_path) -> None:
    """V4 builds its MTP layer (tests/engine/test_mtp_v4.py); a checkpoint without one is
    refused by name."""
    from afdserve.model.fixtures.deepseek_v4 import make_tiny_v4

    model = str(make_tiny_v4(tmp_path / "v4"))
    spec = {"method": "mtp", "num_speculative_tokens": 1}
    with pytest.raises(ValueError, match="no next-token-prediction layers"):
        LLM(model, speculative_config=spec)


def _predictable(mtp_model: str, folder: Path) -> str:
    """The MTP checkpoint made so that its drafts provably equal the main model's tokens: every
    attention and FFN output projection zero, so the main model's logits at a token are
    lm_head(norm(embed(t))) =: f(t) and it emits t, f(t), f(f(t)), ...; the MTP layer's output
    is then h' = eh_proj([enorm(embed(t')) ; .]) with eh_proj = [I 0] and enorm's weight 1,
    and shared_head = (the final norm, lm_head), so its logits are f(t')'s times a positive
    factor (RMSNorm of an RMS-normed row): the same argmax, the draft the main model emits."""
    import shutil

    shutil.copytree(mtp_model, folder)
    weights = load_file(folder / "model.safetensors")
    for name, t in weights.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = torch.zeros_like(t)
    hidden, dtype = weights["model.norm.weight"].shape[0], weights["model.norm.weight"].dtype
    layer = f"model.layers.{N}."
    eh = torch.zeros(hidden, 2 * hidden, dtype=dtype)
    eh[:, :hidden] = torch.eye(hidden, dtype=dtype)
    weights[layer + "eh_proj.weight"] = eh
    weights[layer + "enorm.weight"] = torch.ones(hidden, dtype=dtype)
    weights[layer + "shared_head.norm.weight"] = weights["model.norm.weight"].clone()
    weights[layer + "shared_head.head.weight"] = weights["lm_head.weight"].clone()
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return str(folder)


@pytest.mark.parametrize("k", [1, 2])
def test_constructed_drafts_are_all_accepted(mtp_model, tmp_path, k) -> None:
    model = _predictable(mtp_model, tmp_path / "predictable")
    common = dict(block_size=4, kv_cache_blocks=64)
    want, _, _, _ = _run(model, None, **common)
    spec = {"method": "mtp", "num_speculative_tokens": k}
    got, _, drafts, stats = _run(model, spec, **common)
    assert got == want
    assert stats.num_draft_tokens > len(PROMPTS) * GREEDY.max_tokens // (k + 1) // 2
    assert stats.num_accepted_tokens == stats.num_draft_tokens


def test_fp8_checkpoint_drafts_losslessly(tmp_path) -> None:
    """The public FP8 layout: the MTP decoder layer's linear weights block-scaled FP8, eh_proj
    and shared_head in the model dtype; the layer loads and the tokens stay the same."""
    model = str(make_tiny_model(tmp_path / "fp8", "deepseek_v3", quantization="fp8", mtp_layers=1))
    common = dict(block_size=4, kv_cache_blocks=64)
    want, _, _, _ = _run(model, None, **common)
    got, _, drafts, stats = _run(model, {"method": "mtp", "num_speculative_tokens": 1}, **common)
    assert got == want and stats.num_draft_tokens == len(drafts) > 0


@pytest.mark.slow
def test_data_parallel_replicas_draft_alone(mtp_model) -> None:
    """2A0F: two colocated replicas in their own processes, each with its MTP layer and KV."""
    common = dict(block_size=4, kv_cache_blocks=64)
    want, _, _, _ = _run(mtp_model, None, **common)
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    with LLM(
        mtp_model, dtype="float32", data_parallel_size=2, speculative_config=spec, **common
    ) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        stats = llm.engine.stats().spec_decode
    assert got == want
    assert sorted(stats) == [0, 1] and all(s.num_drafts > 0 for s in stats.values())


@pytest.mark.parametrize("topology", ["colocated", "1A1F"])
def test_graphed_draft_passes_are_token_exact(mtp_model, topology) -> None:
    """full_decode_only on CPU: the plan gives the draft passes graph keys of their own, which
    capture and then replay (on CPU: from the same static buffers, eagerly), and every token,
    draft and acceptance count equals the eager passes'."""
    common = dict(block_size=4, kv_cache_blocks=64, max_num_seqs=4, topology=topology)
    if topology == "1A1F":
        common["connector"] = "inprocess"
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    want = _run(mtp_model, spec, **common)
    graphs = dict(graph_mode="full_decode_only", cuda_graph_sizes=[2, 4, 8, 16])
    log: list = []
    got = _run(mtp_model, spec, log, **common, **graphs)
    passes, records = log[0], log[1:]
    assert passes.settings is not None and not passes.graphs  # static buffers, no CUDA graph
    assert got[0] == want[0] and got[2] == want[2]
    assert (got[3].num_draft_tokens, got[3].num_accepted_tokens) == (
        want[3].num_draft_tokens,
        want[3].num_accepted_tokens,
    )
    modes = [r.get("draft_modes", []) for r in records if r["role"] != "ffn"]
    assert {"capture", "replay"} <= {mode for step in modes for mode in step}, modes
