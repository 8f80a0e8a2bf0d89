"""The graph policy on CPU, observed through LLM.step_log(): the CPU graph runner executes eagerly
with the padded layout a graph would have and records each decision (capture / replay / eager)."""

from __future__ import annotations

from collections import defaultdict

from afdserve import LLM, SamplingParams

from .conftest import colocated_tokens


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


def test_full_decode_only_two_peers_one_ffn(afd_models):
    """Decode 4+4 replays; a chunked prefill 7+1 (same total) runs the FFN eagerly; 6+2 and 4+4 get
    different keys; outputs equal colocated."""
    model = afd_models["qwen3_moe"]
    decode = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    short = [[10 + i, 20 + i, 30 + i] for i in range(8)]  # equal costs: 4 per rank
    long_prompt = [(3 * i + 1) % 250 for i in range(30)]
    uneven = [[1, 2]] * 2 + [[7, 8, 9]]  # first request of each generate() picks rank 0
    uneven_params = [
        SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (30, 4, 4)
    ]
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
        got_mixed = [
            o.token_ids
            for o in llm.generate(
                [long_prompt, [5]],
                [
                    SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
                    SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                ],
            )
        ]
        got_uneven = [o.token_ids for o in llm.generate(uneven, uneven_params)]
        records = llm.step_log()
    assert got_short == colocated_tokens(model, short, decode)
    assert (
        got_mixed[0]
        == colocated_tokens(
            model, [long_prompt], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        )[0]
    )
    assert got_uneven[1:] == [
        colocated_tokens(
            model, [p], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        )[0]
        for p in uneven[1:]
    ]

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
    keys_by_layout: dict[tuple, set] = defaultdict(set)
    for roles in steps.values():
        if roles["ffn"]:
            keys_by_layout[layout(roles)].add(repr(roles["ffn"][0]["key"]))
    if ((0, 2), (1, 6)) in keys_by_layout or ((0, 6), (1, 2)) in keys_by_layout:
        six_two = keys_by_layout.get(((0, 6), (1, 2)), set()) | keys_by_layout.get(
            ((0, 2), (1, 6)), set()
        )
        assert not six_two & keys_by_layout[((0, 4), (1, 4))]


def test_uneven_peers_padded_to_equal_tiles_4a2f(afd_models):
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
            assert ffn["padded_rows"] == 2 * 16
        assert {r["padded_rows"] for r in roles["attention"]} == {16}
