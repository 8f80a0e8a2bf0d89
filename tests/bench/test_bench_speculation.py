"""CPU runs of the speculative-decoding benches with the tiny preset (random weights): `bench
generate` on the repetitive workload with n-gram drafts (accepted drafts, the greedy tokens of no
speculation), and `bench decode --num-speculative-tokens 1` (a verification step's rows decode
what plain steps decode, both step times reported; on a checkpoint with an MTP layer the step
runs its draft passes too)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from afdserve.bench.decode import DecodeBench, run_verify_bench
from afdserve.bench.decode_steps import DecodeSteps, build_drafts, build_halves
from afdserve.bench.speculation import VerifyResult, expected_tokens
from afdserve.bench.workloads import EDIT_PROBABILITY, workload_prompts
from afdserve.cli import main
from afdserve.model.config import read_hf_config
from afdserve.model.fixtures.tiny import make_tiny_model
from afdserve.model.presets import preset_hf_config

CPU = ["--device", "cpu", "--dtype", "float32"]
NGRAM = json.dumps(
    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
)


def test_repetitive_prompts_repeat_their_snippet_with_few_edits():
    warm, timed = workload_prompts("repetitive", 1000, 4, 90, seed=0)
    assert (warm, timed) == workload_prompts("repetitive", 1000, 4, 90, seed=0)
    assert warm != timed and warm != workload_prompts("repetitive", 1000, 4, 90, seed=1)[0]
    edits = []
    for prompt in timed:
        assert len(prompt) == 90
        snippet, copies = prompt[:30], (prompt[30:60], prompt[60:])
        edits.append(sum(a != b for copy in copies for a, b in zip(snippet, copy, strict=True)))
    assert max(edits) <= 4 * 60 * EDIT_PROBABILITY and sum(edits) > 0  # a few edits, not none


def test_generate_bench_ngram_accepts_drafts_and_keeps_the_greedy_tokens(tmp_path, capsys):
    out = tmp_path / "generate.json"
    argv = ["bench", "generate", "--preset", "tiny", "--load-format", "dummy", *CPU]
    argv += ["--batch-sizes", "3", "--input-len", "48", "--output-len", "24"]
    argv += ["--workload", "repetitive", "--speculative-config", NGRAM]
    assert main([*argv, "--compare-no-speculation", "--json", str(out)]) == 0
    speculating, baseline = json.loads(out.read_text())["results"]
    spec = speculating["spec"]
    assert spec["num_accepted_tokens"] > 0  # the tiny model's greedy text repeats itself
    assert spec["num_accepted_tokens"] <= spec["num_draft_tokens"] <= 3 * spec["num_drafts"]
    assert spec["acceptance_rate"] == spec["num_accepted_tokens"] / spec["num_draft_tokens"]
    per_pos = spec["accepted_per_pos"]  # a draft's i-th token is accepted after its earlier ones
    assert len(per_pos) == 3 and sum(per_pos) == spec["num_accepted_tokens"]
    assert spec["num_drafts"] >= per_pos[0] >= per_pos[1] >= per_pos[2]
    assert speculating["greedy_equal_requests"] == 3  # lossless: the tokens of no speculation
    assert baseline["spec"] is None and baseline["speculation"].startswith("no speculation")
    assert speculating["speedup"] == pytest.approx(
        speculating["output_tokens_per_s"] / baseline["output_tokens_per_s"]
    )
    printed = capsys.readouterr().out
    assert "ngram k=3: acceptance" in printed and "greedy tokens the same in 3 of 3" in printed
    # Comparing needs something to compare.
    assert main([*argv[:-2], "--compare-no-speculation"]) == 2
    assert "compare_no_speculation" in capsys.readouterr().err


def test_expected_tokens_sum_the_accepted_prefixes():
    for a in (0.0, 0.6, 0.8, 1.0):
        for k in (1, 3):
            assert expected_tokens(a, k) == pytest.approx(sum(a**i for i in range(k + 1)))
    r = VerifyResult(batch=8, k=1, plain_ms=10.0, verify_ms=12.5, num_layers=4)
    assert r.speedup(0.8) == pytest.approx(1.8 / 1.25)
    assert r.speedup(0.8, r.mtp_cost) == pytest.approx(1.8 / 1.5)


def spec(**overrides) -> DecodeBench:
    fields = dict(
        model_dir=None,
        preset="tiny",
        random_weights=True,
        batch_sizes=(1, 3),
        context_len=10,
        steps=3,
        dtype="float32",
        device="cpu",
    )
    fields.update(overrides)
    return DecodeBench(**fields)


@pytest.mark.parametrize("topology,ubatches", [("colocated", 1), ("in-process", 2)])
def test_a_verification_step_decodes_what_plain_steps_decode(topology, ubatches):
    """Rows i*2 and i*2 + 1 of a 2-row verification step are sequence i's tokens at positions c
    and c + 1, so their greedy picks are those of two plain steps fed the same tokens, over the
    same random cache (drawn alike: both caches have the same shape)."""
    s = spec(topology=topology, ubatches=ubatches, context_len=8)  # caches of one block each
    attn, ffn = build_halves(s, preset_hf_config("tiny"))
    batch = 3
    plain = DecodeSteps(attn, ffn, s, batch)
    verify = DecodeSteps(attn, ffn, s, batch, query_len=2)
    assert plain.kv.tensors()[0].shape == verify.kv.tensors()[0].shape
    fed = torch.randint(0, attn.config.vocab_size, (batch, 2), generator=torch.Generator())
    picks = []
    for column in range(2):
        plain.input_ids.copy_(fed[:, column])
        picks.append(plain.step()[0])
    verify.input_ids.copy_(fed.flatten())
    assert torch.equal(verify.step()[0], torch.stack(picks, dim=1).flatten())


def test_decode_bench_reports_verification_and_plain_step_times(capsys):
    # tiny's first layer only: an MTP layer is still 1/2 of a step of the whole (2-layer) model.
    plain, verify = run_verify_bench(spec(preset="tiny:1", num_speculative_tokens=1))
    assert [r.batch for r in plain] == [r.batch for r in verify] == [1, 3]
    for step, r in zip(plain, verify, strict=True):
        assert r.k == 1 and r.plain_ms == step.step_ms > 0 and r.verify_ms > 0
        assert r.num_layers == 2
    argv = ["bench", "decode", "--preset", "tiny", "--random-weights", *CPU]
    argv += ["--batch-sizes", "2", "--context-len", "10", "--steps", "2"]
    assert main([*argv, "--num-speculative-tokens", "1"]) == 0
    printed = capsys.readouterr().out
    assert "verification steps of 2 rows a sequence" in printed and "x@a=0.8" in printed
    assert main([*argv, "--num-speculative-tokens", "1", "--topology", "1A1F"]) == 2
    assert "num_speculative_tokens" in capsys.readouterr().err


def test_verification_steps_run_the_mtp_draft_passes(tmp_path, capsys):
    """A DeepSeek-V3 checkpoint with its MTP layer: each verification step (k = 2) runs the
    plan's two draft passes, writing the layer's KV at each sequence's positions p and p + 1
    only; in-process 1A1F (the layer's MoE behind the connector) drafts colocated's tokens, and
    the bench reports the passes as timed in the step."""
    model = str(make_tiny_model(tmp_path / "v3", "deepseek_v3", seed=4, mtp_layers=1))
    runs = {}
    for topology in ("colocated", "in-process"):
        s = spec(model_dir=model, preset=None, random_weights=False, topology=topology)
        raw = read_hf_config(model)
        attn, ffn = build_halves(s, raw)
        steps = DecodeSteps(attn, ffn, s, 3, query_len=3, drafts=build_drafts(s, raw, attn, ffn))
        cache = steps.drafts.passes.cache.layers[0][0]  # [blocks, block size, 1, latent + rope]
        before = cache.clone()
        runs[topology] = [steps.step()[0].clone(), steps.drafts.last.clone()]
        changed = (cache != before).flatten(2).any(-1).nonzero().tolist()  # (block, offset)
        bs, width = steps.block_size, steps.width
        want = [[i * width + p // bs, p % bs] for i in range(3) for p in (10, 11)]
        assert sorted(changed) == sorted(want)
        records = [r for r in steps.driver.recorder.records if r["role"] == "attention"]
        # Pass 0 bounded by the step's 9 rows, pass 1 by its 3 requests (colocated: no tiles).
        tiles = [[0], [0]] if topology == "colocated" else [[9], [3]]
        assert [(r["draft_tiles"], r["draft_modes"]) for r in records] == [(tiles, ["eager"] * 2)]
    assert all(torch.equal(a, b) for a, b in zip(*runs.values(), strict=True))
    assert runs["colocated"][1].shape == (3, 2)
    argv = ["bench", "decode", "--model", model, *CPU, "--batch-sizes", "2", "--context-len"]
    assert main([*argv, "10", "--steps", "2", "--num-speculative-tokens", "1"]) == 0
    printed = capsys.readouterr().out
    assert "verify_ms includes the model's k MTP draft passes" in printed
    assert "alone_ms  alone/plain" in printed  # the step again with no draft pass run
    s = spec(model_dir=model, preset=None, random_weights=False, batch_sizes=(2,), steps=2)
    _, (r,) = run_verify_bench(dataclasses.replace(s, context_len=10, num_speculative_tokens=1))
    assert r.mtp_timed and r.alone_ms > 0 and r.alone_cost == r.alone_ms / r.plain_ms
