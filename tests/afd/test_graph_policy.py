"""The graph policy on CPU, observed through LLM.step_log(): the CPU graph runner executes eagerly
with the padded layout a graph would have and records each decision (capture / replay / eager)."""

from __future__ import annotations

from collections import defaultdict

from afdserve import LLM, SamplingParams

from .conftest import colocated_tokens
from .wire_logs import assert_data_plane_matches_plan, received


def _steps(records: list[dict]) -> dict[int, dict[str, list[dict]]]:
    steps: dict[int, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        steps[r["step"]][r["role"]].append(r)
    return steps


def _assert_paired_replay(records: list[dict]) -> None:
    for roles in _steps(records).values():
        for ffn in roles["ffn"]:
            peers = [r for r in roles["attention"] if r["rank"] in ffn["peers"]]
            if ffn["mode"] == "replay":
                assert all(p["mode"] == "replay" for p in peers), (ffn, peers)
            if any(p["mode"] == "eager" for p in peers):
                assert ffn["mode"] == "eager", (ffn, peers)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def test_full_decode_only_two_peers_one_ffn(afd_models):
    """Decode 4+4 replays; a chunked prefill 7+1 (same total) runs the FFN eagerly; 6+2 and 4+4 get
    different keys; outputs equal colocated."""
    model = afd_models["qwen3_moe"]
    decode = greedy(5)
    short = [[10 + i, 20 + i, 30 + i] for i in range(8)]  # equal costs: 4 per rank
    long_prompt = [(3 * i + 1) % 250 for i in range(30)]
    uneven = [[1, 2]] * 2 + [[7, 8, 9]]  # first request of each generate() picks rank 0
    uneven_params = [greedy(m) for m in (30, 4, 4)]
    # Six decodes beside two: requests go to the rank with the fewest outstanding tokens
    # (prompt + max_tokens, ties to rank 0), so costs 8, 44, 8, 8, 8, 8, 8, 8 put the first and
    # the third to seventh on rank 0, the second and the eighth on rank 1.
    six_two = [[1 + i, 2 + i] for i in range(8)]
    six_two_params = [greedy(42 if i == 1 else 6) for i in range(8)]
    with LLM(
        str(model),
        topology="2A1F",
        dtype="float32",
        graph_mode="full_decode_only",
        cuda_graph_sizes=[1, 2, 4, 8],
        max_num_batched_tokens=7,
        log_step_plan=True,
    ) as llm:
        got_short = [o.token_ids for o in llm.generate(short, decode)]
        got_mixed = [o.token_ids for o in llm.generate([long_prompt, [5]], [greedy(3), greedy(12)])]
        got_uneven = [o.token_ids for o in llm.generate(uneven, uneven_params)]
        got_six_two = [o.token_ids for o in llm.generate(six_two, six_two_params)]
    records = llm.step_log()
    assert got_short == colocated_tokens(model, short, decode)
    assert got_mixed[0] == colocated_tokens(model, [long_prompt], greedy(3))[0]
    assert got_uneven[1:] == [colocated_tokens(model, [p], greedy(4))[0] for p in uneven[1:]]
    assert got_six_two == [
        colocated_tokens(model, [p], sp)[0] for p, sp in zip(six_two, six_two_params)
    ]
    check_graph_decisions(records)


def check_graph_decisions(records: list[dict]) -> None:
    """What the steps of the test above captured, replayed or ran eagerly, and under which keys."""
    steps = _steps(records)
    # Warm-up captured every size on both roles together.
    captures = [r for r in records if r["mode"] == "capture"]
    assert {(r["role"], r["padded_rows"]) for r in captures if r["role"] == "attention"} == {
        ("attention", s) for s in (1, 2, 4, 8)
    }
    assert {tuple(r["tile_rows"]) for r in captures if r["role"] == "ffn"} == {
        (1,),
        (2,),
        (4,),
        (8,),
    }
    _assert_paired_replay(records)

    def layout(roles):
        return tuple(sorted((r["rank"], r["real_rows"]) for r in roles["attention"]))

    four_four = [
        s
        for s, roles in steps.items()
        if layout(roles) == ((0, 4), (1, 4)) and roles["ffn"][0]["mode"] == "replay"
    ]
    assert four_four, "decode 4+4 should replay"
    seven_one = [roles for roles in steps.values() if layout(roles) == ((0, 7), (1, 1))]
    assert seven_one, "the chunked prefill 7+1 step did not happen"
    for roles in seven_one:
        assert roles["ffn"][0]["mode"] == "eager"
        assert {r["mode"] for r in roles["attention"]} == {"eager"}
    key_44 = steps[four_four[0]]["ffn"][0]["key"]
    assert all(roles["ffn"][0]["key"] != key_44 for roles in seven_one)
    # 6+2 and 4+4 decode the same total, but pad to different graphs: their keys differ, and
    # the FFN rank replays the 6+2 graph only in steps where both peers replay it.
    six_two_steps = [roles for roles in steps.values() if layout(roles) == ((0, 6), (1, 2))]
    assert six_two_steps, "no step decoded six requests on rank 0 beside two on rank 1"
    for roles in six_two_steps:
        assert roles["ffn"][0]["key"] != key_44
        assert roles["ffn"][0]["tile_rows"] == [8]
    assert any(roles["ffn"][0]["mode"] == "replay" for roles in six_two_steps)


def test_uneven_peers_padded_to_equal_tiles_4a2f(afd_models, tmp_path):
    """4A2F decode loads 16/16/16/1: every member of a group computes and sends the same tile; the
    FFN receives peers x tile and validates each payload; outputs equal colocated."""
    model = afd_models["deepseek_v3"]
    small = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    big = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    prompts = [[1 + (i % 200), 2 + (i % 100)] for i in range(49)]
    params = [small] * 3 + [big] + [small] * 45  # rank 3 takes the big one and nothing else
    with LLM(
        str(model),
        topology="4A2F",
        dtype="float32",
        graph_mode="full_decode_only",
        cuda_graph_sizes=[4, 8, 16],
        max_num_seqs=16,
        log_step_plan=True,
        log_data_plane=str(tmp_path),
    ) as llm:
        got = [o.token_ids for o in llm.generate(prompts, params)]
    records = llm.step_log()
    want = [colocated_tokens(model, [p], sp)[0] for p, sp in zip(prompts[:5], params[:5])]
    assert got[:5] == want
    _assert_paired_replay(records)
    uneven = [
        roles
        for roles in _steps(records).values()
        if sorted(r["real_rows"] for r in roles["attention"]) == [1, 16, 16, 16]
    ]
    assert uneven, "no 16/16/16/1 decode step"
    for roles in uneven:
        for ffn in roles["ffn"]:
            assert ffn["mode"] == "replay" and ffn["tile_rows"] == [16]
        assert {r["padded_rows"] for r in roles["attention"]} == {16}
    # What the FFN ranks received: in those steps the lone request's rank sent a 16-row tile
    # holding 1 real row, and every other peer 16 real rows (checked against each peer's plan).
    assert assert_data_plane_matches_plan(tmp_path, records, warmup_steps=3) > 0
    tiles = received(tmp_path)
    for step in {r["step"] for roles in uneven for r in roles["attention"]}:
        rows = sorted(t["real_rows"] for t in tiles if t["step"] == step and t["layer"] == 0)
        assert rows == [1, 16, 16, 16], (step, rows)
