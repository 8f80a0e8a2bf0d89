"""The planner's arithmetic against hand-computed cases: the curves go through their points and
reproduce the (bi)linear costs that made them, each deployment's step follows predict.py's rules,
the memory fit counts the tiny model's weights as a hand count does, and the enumeration is every
xAyF that can run."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from afdserve.bench.calibrate import CalibrateBench
from afdserve.cli import main
from afdserve.model.presets import preset_config
from afdserve.planner.deployments import Deployment, enumerate_deployments
from afdserve.planner.kernels import dispatch_note, running_expert_kernels
from afdserve.planner.memory import RESERVE_BYTES, max_batch, model_bytes
from afdserve.planner.plan import PlanSpec, check_rows, format_check, plan
from afdserve.planner.predict import predict_step
from afdserve.planner.profile import (
    Costs,
    ExpertKernels,
    FFNPoint,
    FixedPoint,
    Handover,
    ModelShape,
    Profile,
    StepPoint,
    ValidationPoint,
    interpolate,
    touched,
)

A = (0.02, 0.001, 2e-7)  # attention per layer: a0 + a1 b + a2 b c (ms)
F = (0.05, 0.002)  # FFN per layer: f0 + f1 tokens
G = (0.3, 0.002)  # per step: g0 + g1 b
SHAPE = ModelShape("qwen3-30b-a3b", 48, 128, 8, "bfloat16")
H200 = {"device": "NVIDIA H200", "memory_bytes": 150e9}


def _attn(b, c):
    return A[0] + A[1] * b + A[2] * b * c


def _ffn(n, held=128):
    return (F[0] + F[1] * n) * held / 128


def _fixed(b):
    return G[0] + G[1] * b


def synthetic_profile(**extra) -> Profile:
    L = SHAPE.num_layers
    attention = tuple(
        StepPoint(b, c, _fixed(b) + L * _attn(b, c)) for b in (1, 4, 16, 64) for c in (1024, 8192)
    )
    return Profile(
        date="2026-12-02",
        hardware=H200,
        versions={"torch": "x"},
        model=SHAPE,
        attention=attention,
        ffn=tuple(FFNPoint(n, L * _ffn(n)) for n in (1, 8, 64, 512)),
        fixed=tuple(FixedPoint(b, _fixed(b)) for b in (1, 64)),
        handover={"ipc": Handover(25.0, "test"), "inprocess": Handover(2.0, "test")},
        **extra,
    )


def test_the_curves_reproduce_the_linear_costs_that_made_their_points():
    costs = Costs.fit(synthetic_profile())
    for b, c in ((1, 1024), (16, 8192), (7, 3000), (100, 1024), (300, 16384)):  # in and beyond
        assert costs.attention_ms(b, c) == pytest.approx(_attn(b, c))
    for n in (1, 5, 64, 200, 2000):
        assert costs.ffn_ms(n) == pytest.approx(_ffn(n))
        assert costs.ffn_ms(n, held=32) == pytest.approx(_ffn(n) / 4)  # a quarter of the experts
    assert costs.fixed_ms(128) == pytest.approx(_fixed(128))
    assert costs.colocated_step_ms(32, 4096) == pytest.approx(
        _fixed(32) + 48 * (_attn(32, 4096) + _ffn(32))
    )


def test_a_curve_is_piecewise_linear_through_noisy_points():
    assert interpolate((1.0, 2.0, 4.0), (1.0, 3.0, 4.0), 3.0) == pytest.approx(3.5)
    assert interpolate((1.0, 2.0, 4.0), (1.0, 3.0, 4.0), 8.0) == pytest.approx(6.0)  # last slope
    assert interpolate((1.0, 2.0, 4.0), (1.0, 3.0, 4.0), 0.0) == pytest.approx(-1.0)
    assert interpolate((5.0,), (2.0,), 100.0) == 2.0


def test_touched_experts_is_the_expected_count_under_uniform_routing():
    assert touched(1, 128, 8, 128) == pytest.approx(8)  # one token: its top-k
    assert touched(2, 128, 8, 128) == pytest.approx(128 * (1 - (120 / 128) ** 2))
    assert touched(10_000, 16, 8, 128) == pytest.approx(16)  # a shard saturates at its experts


def test_each_deployments_step_follows_the_rules_by_hand():
    costs = Costs.fit(synthetic_profile())
    L, b, c, h = 48, 64, 8192, 0.025
    # 1A1F, one ubatch: the chain of every layer, one after the other.
    got = predict_step(costs, Deployment(1, 1, ubatches=1), b, c)
    assert got.step_ms == pytest.approx(_fixed(b) + L * (_attn(b, c) + _ffn(b) + h))
    # 2 ubatches: the busier GPU's two ubatches, or one ubatch's chain, whichever is longer.
    ta, tf = _attn(32, c), _ffn(32)
    layer = max(2 * (ta + h), 2 * (tf + h), ta + tf + h)
    got = predict_step(costs, Deployment(1, 1, ubatches=2), b, c)
    assert got.step_ms == pytest.approx(_fixed(b) + L * layer)
    assert got.busier == ("ffn" if tf > ta else "attention")
    # 3A1F: the FFN rank serves all three attention ranks' rows.
    got = predict_step(costs, Deployment(3, 1), b, c)
    assert got.step_ms == pytest.approx(_fixed(b) + L * (_attn(b, c) + _ffn(3 * b) + h))
    # 3A2F: the busier FFN rank is home to two attention ranks.
    got = predict_step(costs, Deployment(3, 2), b, c)
    assert got.step_ms == pytest.approx(_fixed(b) + L * (_attn(b, c) + _ffn(2 * b) + h))
    # 2A2F EP: each FFN rank runs its 64 experts' share over both ranks' gathered rows, plus one
    # more hand-over for the group's collectives.
    ep = _ffn(2 * b, held=64) + h
    got = predict_step(costs, Deployment(2, 2, expert_parallel=True), b, c)
    assert got.step_ms == pytest.approx(_fixed(b) + L * (_attn(b, c) + ep + h))
    # In-process 1A1F: one GPU, nothing overlaps.
    got = predict_step(costs, Deployment(1, 1, ubatches=2, transport="inprocess"), b, c)
    assert got.step_ms == pytest.approx(_fixed(b) + L * 2 * (ta + tf + 0.002))


def test_the_enumeration_is_every_xAyF_that_can_run():
    names = [d.name for d in enumerate_deployments(2)]
    assert names == ["colocated"] + [f"1A1F u{u}" for u in (1, 2, 3, 4)]
    worlds = {(d.attention, d.ffn, d.expert_parallel) for d in enumerate_deployments(4)}
    assert worlds == {
        (1, 0, False),
        (1, 1, False),
        (2, 1, False),
        (3, 1, False),
        (2, 2, False),
        (1, 2, True),
        (1, 3, True),
        (2, 2, True),
    }
    with pytest.raises(ValueError, match="gpus=0"):
        enumerate_deployments(0)


def test_the_memory_fit_counts_the_tiny_model_by_hand():
    c = preset_config("tiny")  # hidden 64, 4 q and 2 kv heads of 16, 8 experts of 32, vocab 512
    assert (c.hidden_size, c.num_layers, c.num_experts, c.vocab_size) == (64, 2, 8, 512)
    attention_layer = 64 * 64 + 2 * (64 * 32) + 64 * 64 + 16 + 16 + 64 + 64  # q k v o, norms
    experts_layer = 8 * 3 * 64 * 32
    ffn_layer = 8 * 64 + experts_layer  # router + experts
    attention = 2 * 512 * 64 + 64 + 2 * attention_layer  # embedding, lm_head, final norm
    got = model_bytes(c, "bfloat16")
    rotary = got.attention - 2 * attention  # the rotary's inv_freq buffer, if kept
    assert 0 <= rotary <= 4 * 16
    assert got.ffn == 2 * 2 * ffn_layer
    assert got.routed_experts == 2 * 2 * experts_layer
    assert got.colocated == got.attention + got.ffn
    assert got.kv_per_token == 2 * 2 * 2 * 16 * 2  # layers x (k, v) x heads x dim x bytes
    assert model_bytes(c, "bfloat16", "float8_e4m3fn").kv_per_token == got.kv_per_token // 2
    assert got.ffn_shard(2) == got.ffn - got.routed_experts / 2
    room = 10e9 * 0.5 - 1e6 - RESERVE_BYTES
    assert max_batch(10e9, 0.5, 1e6, 256, 1000) == int(room // (256 * 1000))
    assert max_batch(1e9, 0.5, 1e9, 256, 1000) == 0


def test_a_plan_of_four_gpus_ranks_what_fits(tmp_path):
    profile = synthetic_profile()
    path = tmp_path / "p.json"
    profile.save(path)
    spec = PlanSpec(
        gpus=4, context_len=8192, output_len=256, preset="qwen3-30b-a3b", profile=str(path)
    )
    rows = plan(spec).rows
    by = {r.deployment: r for r in rows}
    sizes = model_bytes(preset_config("qwen3-30b-a3b"))
    # Colocated: what the KV memory beside every weight allows, at prompt + output tokens.
    assert by["colocated"].max_batch == max_batch(
        150e9, 0.9, sizes.colocated, sizes.kv_per_token, 8192 + 256
    )
    assert by["colocated"].worlds == 4
    # 1A1F: the attention rank holds only its half, so more sequences; two worlds on four GPUs.
    one = by["1A1F u1"]
    assert one.max_batch == max_batch(150e9, 0.9, sizes.attention, sizes.kv_per_token, 8448)
    assert one.batch == min(one.max_batch, 256) and one.worlds == 2
    step = predict_step(Costs.fit(profile), Deployment(1, 1), one.batch, 8192 + 128).step_ms
    assert one.step_ms == pytest.approx(step)
    assert one.tokens_per_s_per_gpu == pytest.approx(2 * one.batch / (step / 1e3) / 4)
    # 3A1F: one world on four GPUs, the fourth idle, counted in the per-GPU figure.
    three = by["3A1F u1"]
    step = predict_step(Costs.fit(profile), Deployment(3, 1), three.batch, 8320).step_ms
    assert three.worlds == 1
    assert three.tokens_per_s_per_gpu == pytest.approx(3 * three.batch / (step / 1e3) / 4)
    assert [r.tokens_per_s_per_gpu for r in rows] == sorted(
        (r.tokens_per_s_per_gpu for r in rows), reverse=True
    )
    # A TPOT target: the largest batch whose step is within it.
    tpot = replace(spec, tpot_ms=30.0)
    for r in plan(tpot).rows:
        d = Deployment(r.attention, r.ffn, r.expert_parallel, r.ubatches)
        assert predict_step(Costs.fit(profile), d, r.batch, 8320).step_ms <= 30.0
        if r.batch < min(r.max_batch, 256):
            assert predict_step(Costs.fit(profile), d, r.batch + 1, 8320).step_ms > 30.0


def test_check_sets_each_measured_step_against_its_prediction():
    costs = Costs.fit(synthetic_profile())
    measured = (
        ValidationPoint("colocated", 8, 1024, 10.0),
        ValidationPoint("1A1F", 64, 8192, 30.0, 2, "ipc"),
    )
    pairs = check_rows(synthetic_profile(validation=measured), [])
    assert [p for _, p in pairs] == pytest.approx(
        [
            costs.colocated_step_ms(8, 1024),
            predict_step(costs, Deployment(1, 1, ubatches=2), 64, 8192).step_ms,
        ]
    )


def test_a_profile_round_trips_and_bad_ones_are_refused(tmp_path):
    profile = synthetic_profile()
    path = tmp_path / "p.json"
    profile.save(path)
    assert Profile.load(path) == profile
    raw = json.loads(path.read_text())
    raw["version"] = 7
    path.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="profile version 7"):
        Profile.load(path)
    del raw["ffn"]
    path.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="'ffn'"):
        Profile.load(path)
    profile.save(path)
    spec = PlanSpec(
        gpus=2, context_len=1024, output_len=64, preset="mixtral-8x7b", profile=str(path)
    )
    with pytest.raises(ValueError, match="measured on qwen3-30b-a3b"):
        plan(spec)


def test_calibrate_then_plan_on_the_cpu(tmp_path, capsys):
    """The real path end to end on the tiny preset: calibrate measures (CPU timings, noise on
    a shared box, so only the shape is asserted), plan and check read what it wrote."""
    out = tmp_path / "tiny.json"
    calibrate = """
        bench calibrate --preset tiny --random-weights --device cpu --graph-mode none
        --dtype float32 --fit-batches 1,2,4 --check-batches 3 --contexts 16,32
        --check-contexts 16,32 --ffn-tokens 1,4,16 --steps 2
    """.split()
    assert main([*calibrate, "--out", str(out)]) == 0
    profile = Profile.load(out)
    assert {(p.batch, p.context) for p in profile.attention} == {
        (b, c) for b in (1, 2, 4) for c in (16, 32)
    }
    assert [p.tokens for p in profile.ffn] == [1, 4, 16]
    kinds = {(v.deployment, v.batch, v.context, v.ubatches) for v in profile.validation}
    assert kinds == {("colocated", 3, c, 1) for c in (16, 32)} | {
        ("1A1F", 3, c, u) for c in (16, 32) for u in (1, 2)
    }
    assert {"inprocess", "ipc", "nccl"} <= set(profile.handover)
    # tiny: hidden 64, expert intermediate 32, float32; the CPU runs no decode kernels.
    assert profile.model.expert_bytes == 3 * 64 * 32 * 4 and profile.expert_kernels is None
    assert all(p.step_ms > 0 for p in profile.attention)
    rows_json = tmp_path / "rows.json"
    plan_argv = "plan --preset tiny --gpus 3 --context-len 16 --output-len 8".split()
    plan_argv += ["--profile", str(out)]
    assert main([*plan_argv, "--json", str(rows_json)]) == 0
    rows = json.loads(rows_json.read_text())
    assert {r["deployment"] for r in rows} >= {"colocated", "1A1F u1", "2A1F u1", "1A2F EP u1"}
    assert main([*plan_argv, "--check"]) == 0
    text = capsys.readouterr().out
    assert f"over {len(profile.validation)} measured steps" in text
    assert math.isfinite(float(text.rsplit("largest error ", 1)[1].split("%")[0]))


def test_the_shipped_h200_profile_is_the_default_and_other_models_need_their_own():
    """The profile measured on the H200 ships with the package: a plan of its model needs no
    --profile; a model it was not measured on is refused with the command that measures one."""
    result = plan(PlanSpec(gpus=2, context_len=1024, output_len=128, preset="qwen3-30b-a3b"))
    rows, profile = result.rows, result.profile
    assert profile.hardware["device"] == "NVIDIA H200"
    assert profile.model.name == "qwen3-30b-a3b" and len(profile.attention) >= 10
    assert {r.deployment for r in rows} >= {"colocated", "1A1F u1"}
    with pytest.raises(ValueError, match="afdserve bench calibrate"):
        plan(PlanSpec(gpus=2, context_len=1024, output_len=128, preset="mixtral-8x7b"))


REPO = Path(__file__).resolve().parents[2]
KERNELS_OF_2026_11_30 = REPO / "docs/plan/h200-qwen3-30b-a3b-kernels-of-2026-11-30.json"
TWO_GPU_STEPS = REPO / "docs/plan/h200x2-2026-11-30.json"
SHIPPED = REPO / "afdserve/planner/profiles/h200-qwen3-30b-a3b.json"


def _kernel_profile(ffn_per_layer: dict[int, float], **extra) -> Profile:
    """1e6 bytes per expert at 1000 GB/s: reading one expert takes 0.001 ms."""
    return replace(
        synthetic_profile(**extra),
        model=replace(SHAPE, expert_bytes=1_000_000),
        hardware={**H200, "copy_gbps": 1000.0},
        ffn=tuple(FFNPoint(n, 48 * ms) for n, ms in ffn_per_layer.items()),
        expert_kernels=ExpertKernels(1024, "triton_grouped_moe"),
    )


def test_the_ffn_curve_follows_the_experts_kernels_by_hand():
    k = ExpertKernels(1024, "triton_grouped_moe")
    # top-8: the decode kernels' pair list padded to a power of two, at least 64; past 1024 pairs
    # (128 rows) the grouped GEMM.
    assert [k.bucket(8 * n) for n in (1, 8, 9, 64, 65, 81, 128)] == [
        64,
        64,
        128,
        512,
        1024,
        1024,
        1024,
    ]
    assert k.bucket(8 * 129) is None and k.bucket(8 * 21.33) == 256
    ms = {8: 0.10, 64: 0.30, 128: 0.42, 256: 0.55, 512: 0.64, 1024: 0.84}
    costs = Costs.fit(_kernel_profile(ms))
    assert costs.expert_read_ms == pytest.approx(0.001)

    def experts_touched(n):  # of 128, each row picking 8 at random
        return 128 * (1 - (120 / 128) ** n)

    for n, ms_n in ms.items():  # through every point
        assert costs.ffn_ms(n) == pytest.approx(ms_n)
    # 81 rows: the 128-row bucket's measured time, less the experts 81 rows leave unread.
    assert costs.ffn_ms(81) == pytest.approx(
        0.42 - 0.001 * (experts_touched(128) - experts_touched(81))
    )
    assert costs.ffn_ms(4) == pytest.approx(
        0.10 - 0.001 * (experts_touched(8) - experts_touched(4))
    )
    # 162 rows run the grouped GEMM: its own points' line (256 -> 512), not one from 128.
    assert costs.ffn_ms(162) == pytest.approx(0.55 + (0.64 - 0.55) * (162 - 256) / 256)
    assert costs.ffn_ms(2048) == pytest.approx(0.84 + (0.84 - 0.64) * 1024 / 512)
    assert costs.ffn_ms(81, held=32) == pytest.approx(costs.ffn_ms(81) / 4)
    # A bucket with no measured count above: the decode kernels' points' line (8 -> 64 and on).
    gap = Costs.fit(_kernel_profile({8: 0.10, 64: 0.30, 256: 0.55, 512: 0.64}))
    assert gap.ffn_ms(81) == pytest.approx(0.30 + (0.30 - 0.10) * (81 - 64) / 56)
    # Without the kernels named: one straight line through every point, as before.
    plain = Costs.fit(replace(_kernel_profile(ms), expert_kernels=None))
    assert plain.ffn_ms(81) == pytest.approx(0.30 + (0.42 - 0.30) * 17 / 64)
    assert plain.ffn_ms(162) == pytest.approx(0.42 + (0.55 - 0.42) * 34 / 128)


def test_a_profile_with_expert_kernels_round_trips_and_needs_the_expert_bytes(tmp_path):
    profile = _kernel_profile({8: 0.1, 64: 0.3})
    path = tmp_path / "p.json"
    profile.save(path)
    assert Profile.load(path) == profile
    with pytest.raises(ValueError, match="expert_bytes"):
        replace(profile, model=SHAPE)
    with pytest.raises(ValueError, match="copy_gbps"):
        replace(profile, hardware=H200)


def test_the_bucket_rule_predicts_the_measured_ffn_points_it_is_not_given():
    """Within the 64-pair bucket (1-8 rows) the H200 profiles' 1, 2 and 4-row FFN halves,
    predicted from their 8-row point and the experts those rows leave unread."""
    for path in (KERNELS_OF_2026_11_30, SHIPPED):
        profile = Profile.load(path)
        measured = {p.tokens: p.step_ms for p in profile.ffn}
        costs = Costs.fit(
            replace(profile, ffn=tuple(p for p in profile.ffn if p.tokens not in (1, 2, 4)))
        )
        for n in (1, 2, 4):
            assert 48 * costs.ffn_ms(n) == pytest.approx(measured[n], rel=0.05), (path.name, n)


def test_the_two_gpu_host_steps_are_predicted_within_ten_percent_on_their_own_kernels():
    """The 11 two-GPU 1A1F steps of 2026-11-30 and the colocated step at 91 sequences of 8192
    (its capacity) against the profile of their experts' kernels; against the shipped profile
    (later grouped kernels) each is marked as run on other kernels."""
    measured = [ValidationPoint(**p) for p in json.loads(TWO_GPU_STEPS.read_text())]
    profile = Profile.load(KERNELS_OF_2026_11_30)
    pairs = check_rows(profile, measured)[len(profile.validation) :]
    assert len(pairs) == 12
    for v, predicted in pairs:
        assert predicted == pytest.approx(v.step_ms, rel=0.10), v
    shipped = Profile.load(SHIPPED)
    text = format_check(check_rows(shipped, measured), shipped.expert_kernels.name)
    assert text.count("[other kernels]") == 12 + 1  # each step, and the summary line


def test_check_marks_misses_and_steps_of_other_kernels():
    pairs = [
        (ValidationPoint("colocated", 8, 1024, 10.0), 10.5),
        (ValidationPoint("colocated", 64, 1024, 20.0, expert_kernels="old"), 23.0),
    ]
    lines = format_check(pairs, "new").splitlines()
    assert lines[1].endswith("+5.0%")
    assert lines[2].endswith("+15.0%  MISS (> 10%)  [other kernels]")
    assert lines[3] == "largest error 15.0% over 2 measured steps; 1 of 2 within 10%"
    assert lines[4].startswith("[other kernels]: 1 steps ran old, not the profile's new")
    assert "[other kernels]" not in format_check(pairs, "")  # a profile naming no kernels


def test_a_plan_says_when_its_profile_ran_other_experts_kernels_than_the_code(capsys):
    profile = _kernel_profile({8: 0.1, 64: 0.3})  # decode kernels up to 1024 pairs
    newer = ExpertKernels(512, "triton_grouped_moe")
    note = dispatch_note(profile, newer)
    assert note == (
        "note: the profile's FFN points ran decode kernels up to 1024 pairs, then "
        "triton_grouped_moe; this afdserve runs decode kernels up to 512 pairs, then "
        "triton_grouped_moe: FFN halves of 65-128 rows are predicted for the profile's kernels "
        "(re-run `afdserve bench calibrate` for this code's)"
    )
    older = replace(profile, expert_kernels=ExpertKernels(1024, "moe_gpu"))
    assert "FFN halves of 65 rows and more" in dispatch_note(older, newer)
    assert dispatch_note(profile, ExpertKernels(1024, "triton_grouped_moe", source="x")) is None
    assert dispatch_note(profile, None) is None  # the code's dispatch unknown here
    assert "does not say" in dispatch_note(synthetic_profile(), newer)
    # This code's dispatch, as ops.moe_experts reads it; the CLI prints the note when it differs.
    pytest.importorskip("triton")
    from afdserve.kernels.moe import decode as triton_moe

    running = running_expert_kernels("bfloat16")
    assert (running.decode_max_pairs, running.grouped) == (
        triton_moe.MAX_PAIRS,
        "triton_grouped_moe",
    )
    assert running_expert_kernels("float32") is None
    assert (
        main(
            [
                "plan",
                "--preset",
                "qwen3-30b-a3b",
                "--gpus",
                "2",
                "--context-len",
                "1024",
                "--output-len",
                "64",
                "--top",
                "1",
            ]
        )
        == 0
    )
    shipped = Profile.load(SHIPPED).expert_kernels
    assert ("note: the profile's FFN points ran" in capsys.readouterr().out) == (
        shipped.decode_max_pairs != triton_moe.MAX_PAIRS
    )


def test_a_profile_of_the_first_layers_plans_the_whole_model(tmp_path, capsys):
    """`bench calibrate --preset deepseek-v4-flash:4` measures what one GPU holds; `plan --preset
    deepseek-v4-flash` predicts every deployment at its 43 layers from those per-layer costs,
    and says what each role holds at full depth (neither the whole model nor an FFN rank with
    every expert fits one H200, so expert-parallel FFN groups are what fit)."""
    first = replace(SHAPE, name="deepseek-v4-flash:4", num_layers=4, num_experts=256, top_k=6)
    L = first.num_layers
    profile = replace(
        synthetic_profile(),
        model=first,
        attention=tuple(
            StepPoint(b, c, _fixed(b) + L * _attn(b, c))
            for b in (1, 4, 16, 64)
            for c in (1024, 8192)
        ),
        ffn=tuple(FFNPoint(n, L * _ffn(n)) for n in (1, 8, 64, 512)),
    )
    path = tmp_path / "flash4.json"
    profile.save(path)
    spec = PlanSpec(
        gpus=8, context_len=8192, output_len=1024, preset="deepseek-v4-flash", profile=str(path)
    )
    result = plan(spec)
    assert result.layers == 43 and result.rows
    deep = Costs.fit(profile).at_depth(43)
    assert deep.attention_ms(16, 8192) == pytest.approx(_attn(16, 8192))  # per layer, as measured
    for r in result.rows:
        d = Deployment(r.attention, r.ffn, r.expert_parallel, r.ubatches, "ipc")
        step = predict_step(deep, d, r.batch, 8192 + 512).step_ms
        assert r.step_ms == pytest.approx(step)
        assert step > 43 * (_attn(r.batch / r.ubatches, 8704)) * 0.99  # every layer counted
    # Neither colocated nor a whole FFN rank fits one GPU: only expert-parallel FFN groups.
    assert {r.deployment for r in result.rows} and all(r.expert_parallel for r in result.rows)
    main_args = ["plan", "--preset", "deepseek-v4-flash", "--gpus", "8", "--profile", str(path)]
    assert main([*main_args, "--context-len", "8192", "--output-len", "1024"]) == 0
    text = capsys.readouterr().out
    assert "does not fit one GPU whole: colocated, FFN (weights alone)" in text
    assert "per-layer costs measured on deepseek-v4-flash:4 (4 of 43 layers)" in text
    assert f"attention rank {result.sizes.attention / 2**30:.1f} GiB" in text
    # Another model's first layers, or a profile deeper than the model: refused by name.
    other = replace(spec, preset="glm-5")
    with pytest.raises(ValueError, match="measured on deepseek-v4-flash:4"):
        plan(other)
    replace(profile, model=replace(first, num_layers=44)).save(path)
    with pytest.raises(ValueError, match="44 layers"):
        plan(spec)


def test_the_shipped_v4_profile_plans_the_whole_model_on_2_4_and_8_gpus():
    """The profile `bench calibrate --preset deepseek-v4-flash:4` measured on one H100 ships with
    the package: its own 21 steps are predicted within 5%, and `plan --preset deepseek-v4-flash`
    (43 layers) needs no --profile. On 2 GPUs nothing fits (the FFN rank alone holds 138 GiB of
    experts), on 4 and 8 only expert-parallel FFN groups do."""
    path = REPO / "afdserve/planner/profiles/h100-deepseek-v4-flash.json"
    profile = Profile.load(path)
    assert profile.model.name == "deepseek-v4-flash:4"
    assert profile.hardware["device"] == "NVIDIA H100 80GB HBM3"
    pairs = check_rows(profile, [])
    assert len(pairs) == len(profile.validation) == 21
    for v, predicted in pairs:
        assert predicted == pytest.approx(v.step_ms, rel=0.05), v
    rows = {}
    for gpus in (2, 4, 8):
        spec = PlanSpec(gpus=gpus, context_len=8192, output_len=1024, preset="deepseek-v4-flash")
        result = plan(spec)
        assert result.profile == profile and result.layers == 43
        assert result.sizes.ffn > 128 * 2**30 > 8 * 2**30 > result.sizes.attention
        rows[gpus] = result.rows
    assert not rows[2]
    assert rows[4] and rows[8] and all(r.expert_parallel for r in rows[4] + rows[8])
    assert max(r.tokens_per_s for r in rows[8]) > max(r.tokens_per_s for r in rows[4])


def test_calibrate_takes_a_preset_of_its_first_layers():
    assert CalibrateBench(
        "p.json", preset="deepseek-v4-flash:4", random_weights=True
    ).preset.endswith(":4")
    with pytest.raises(ValueError, match="must be an integer in \\[1, 43\\]"):
        CalibrateBench("p.json", preset="deepseek-v4-flash:44", random_weights=True)


def test_one_routed_experts_bytes_are_counted_as_stored():
    """What `calibrate` records as model.expert_bytes: bf16 experts at 2 bytes a weight, V4's
    FP4 ones at half a byte plus a ue8m0 scale per 32, V3.2's FP8 ones at a byte plus a float32
    scale per 128 x 128 block."""
    qwen = preset_config("qwen3-30b-a3b")
    assert model_bytes(qwen).expert_bytes == 3 * qwen.hidden_size * qwen.moe_intermediate_size * 2
    v4 = preset_config("deepseek-v4-flash:4")
    weights = 3 * v4.hidden_size * v4.moe_intermediate_size
    assert model_bytes(v4).expert_bytes == weights // 2 + weights // 32
    v32 = preset_config("deepseek-v3.2:8")
    h, i = v32.hidden_size, v32.moe_intermediate_size
    blocks = 2 * (-(-i // 128)) * (-(-h // 128)) + (-(-h // 128)) * (-(-i // 128))
    assert model_bytes(v32).expert_bytes == 3 * h * i + 4 * blocks
