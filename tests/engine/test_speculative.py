"""Speculative decoding with n-gram drafts on one process: the lookup against its definition, the
config's refusals, the rejection sampler's distribution (statistically), and greedy tokens equal
to the same engine without speculation beside chunked prefill, preemption and prefix caching."""

from __future__ import annotations

import random

import pytest
import torch
from scipy.stats import chi2

from afdserve import LLM, SamplingParams
from afdserve.config import EngineConfig, SpeculativeConfig
from afdserve.engine.block_manager import BlockManager
from afdserve.engine.rejection import verify
from afdserve.engine.scheduler import Scheduler, SchedulerConfig
from afdserve.engine.sequence import Sequence
from afdserve.engine.speculative import Drafter, ngram_drafts
from afdserve.layout.plan import GraphTable, RankStep, plan_step
from afdserve.layout.topology import Topology
from afdserve.model.fixtures.tiny import make_tiny_model

NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_max": 3,
    "prompt_lookup_min": 1,
}


def _lookup_oracle(tokens: list[int], k: int, low: int, high: int) -> tuple[int, ...]:
    """The definition, written plainly: longest n first, earliest occurrence that a token
    follows, other than the suffix itself."""
    for n in range(high, low - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n):
            if tokens[start : start + n] == suffix:
                return tuple(tokens[start + n : start + n + k])
    return ()


def test_ngram_drafts_follow_the_definition() -> None:
    rng = random.Random(0)
    for _ in range(400):
        tokens = [rng.randrange(4) for _ in range(rng.randint(1, 30))]
        low = rng.randint(1, 3)
        high = rng.randint(low, 5)
        k = rng.randint(1, 4)
        assert ngram_drafts(tokens, k, low, high) == _lookup_oracle(tokens, k, low, high)
    assert ngram_drafts([1, 2, 3, 1, 2], 2, 1, 2) == (3, 1)
    assert ngram_drafts([1, 2, 3], 2, 1, 2) == ()


def test_config_takes_vllm_spelling_and_refuses_the_rest() -> None:
    text = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}'
    config = EngineConfig("m", speculative_config=text).speculative_config
    assert config == SpeculativeConfig("ngram", 4, prompt_lookup_max=3, prompt_lookup_min=3)
    assert SpeculativeConfig("ngram", 2).prompt_lookup_min == 5  # vLLM's defaults
    refused = [
        ({"method": "eagle", "num_speculative_tokens": 1}, "method='eagle' is not allowed"),
        ({**NGRAM, "draft_model": "x"}, "key 'draft_model' is not supported"),
        ({"method": "ngram"}, "'num_speculative_tokens' is required"),
        ({**NGRAM, "num_speculative_tokens": 0}, "num_speculative_tokens=0"),
        ({**NGRAM, "prompt_lookup_min": 4}, "prompt_lookup_min=4 .* at most prompt_lookup_max"),
        ({**NGRAM, "prompt_lookup_min": 0}, "prompt_lookup_min=0"),
        ("{not json", "not valid JSON"),
    ]
    for value, message in refused:
        with pytest.raises(ValueError, match=message):
            EngineConfig("m", speculative_config=value)


def test_cli_flag_reaches_the_config(capsys) -> None:
    from afdserve.cli import build_parser

    args = build_parser().parse_args(
        ["generate", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}']
    )
    assert args.speculative_config == SpeculativeConfig("ngram", 2)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--speculative-config", '{"method": "medusa"}'])
    assert "method='medusa' is not allowed" in capsys.readouterr().err


def _seq(params: SamplingParams) -> Sequence:
    return Sequence("s", [1, 2, 3], params, eos_token_id=None)


def _chi_square_ok(counts: torch.Tensor, probs: torch.Tensor, alpha: float) -> bool:
    """Pearson's test over the cells with mass; cells without mass must stay empty."""
    assert counts[probs == 0].sum() == 0
    cells = probs > 0
    expected = probs[cells] * counts.sum()
    statistic = float(((counts[cells] - expected) ** 2 / expected).sum())
    return statistic < chi2.ppf(1 - alpha, int(cells.sum()) - 1)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, seed=11),
        SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=12),
    ],
    ids=["plain", "top-k-top-p"],
)
def test_rejection_sampling_keeps_the_target_distribution(params) -> None:
    """Drafts (a likely token, then one outside top-k) over a vocabulary of 8: the first token
    must be distributed as the target row 0, the second, given the first draft accepted, as row
    1. Each chi-square test fails by chance with probability 1e-4 (fixed seeds: the run is
    deterministic, this is the rate at which a correct sampler would fail for other seeds)."""
    vocab, trials, alpha = 8, 4000, 1e-4
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0)) * 1.5
    seq = _seq(params)
    draft = (int(logits[0].argmax()), int(logits[1].argmin()))
    first = torch.zeros(vocab)
    second = torch.zeros(vocab)
    for _ in range(trials):
        tokens = verify(logits, [seq], [draft])[0]
        first[tokens[0]] += 1
        if tokens[0] == draft[0]:
            second[tokens[1]] += 1
    target = [_reference_probs(logits[row], params) for row in range(2)]
    assert _chi_square_ok(first, target[0], alpha)
    assert _chi_square_ok(second, target[1], alpha)
    assert 0 < first[draft[0]] < trials  # both outcomes of the acceptance test happened


def _reference_probs(row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The target distribution written directly: temperature, top-k (renormalised), then top-p
    (the smallest most-likely set whose mass reaches top_p)."""
    probs = torch.softmax(row.double() / params.temperature, dim=-1)
    order = torch.argsort(probs, descending=True).tolist()
    if params.top_k > 0:
        order = order[: params.top_k]
    total = float(probs[order].sum())
    kept, mass = torch.zeros_like(probs), 0.0
    for token in order:
        if mass >= params.top_p:
            break
        kept[token] = probs[token]
        mass += float(probs[token]) / total
    return (kept / kept.sum()).float()


def test_greedy_verification_is_the_argmax_chain() -> None:
    logits = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    best = logits.argmax(dim=-1).tolist()
    greedy = SamplingParams(temperature=0.0)
    assert verify(logits, [_seq(greedy)], [tuple(best[:3])]) == [best]
    wrong = (best[0], (best[1] + 1) % 8, best[2])
    assert verify(logits, [_seq(greedy)], [wrong]) == [best[:2]]


# Prompts that repeat themselves, so that drafts are found; the long one is chunked beside them.
REPEATING = [
    "abcabcabcabcabc",
    "the cat sat on the mat, the cat sat on the",
    "1 2 3 1 2 3 1 2",
    "def f(x): return x\ndef g(x): return x\ndef h(x): return x\n",
]


def _run(model: str, speculative: dict | None, params, rounds: int = 2, **kwargs):
    """Tokens of every prompt, then of each prompt continued by its own output (which meets the
    blocks the first round registered in the prefix cache)."""
    with LLM(model, dtype="float32", speculative_config=speculative, **kwargs) as llm:
        steps = _record_steps(llm)
        outs = llm.generate(REPEATING, params, use_tqdm=False)
        tokens = [o.outputs[0].token_ids for o in outs]
        for out in outs:  # one logprob entry per token, also where a stop cut the drafts
            logprobs = out.outputs[0].logprobs
            assert logprobs is None or len(logprobs) == len(out.outputs[0].token_ids)
        if rounds > 1:
            again = [list(o.prompt_token_ids) + list(t) for o, t in zip(outs, tokens, strict=True)]
            tokens += [o.outputs[0].token_ids for o in llm.generate(again, params, use_tqdm=False)]
        stats = llm.engine.stats()
        preemptions = llm.engine.core_client.core.scheduler.num_preemptions
    return tokens, stats, preemptions, steps


def _record_steps(llm: LLM) -> list[tuple[int, int]]:
    """(prefill chunks, sequences with drafts) of every scheduled step, as the scheduler gave
    them (the real scheduler runs; this only keeps a note)."""
    scheduler = llm.engine.core_client.core.scheduler
    schedule, steps = scheduler.schedule, []

    def noted():
        out = schedule()
        chunks = sum(e.seq.num_uncomputed_tokens > 1 and not e.draft_ids for e in out.scheduled)
        if out.scheduled:
            steps.append((chunks, sum(bool(e.draft_ids) for e in out.scheduled)))
        return out

    scheduler.schedule = noted
    return steps


GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


def test_greedy_tokens_unchanged_bundled_model() -> None:
    """Chunked prefill (a budget of 24), preemption (32 blocks of 4) and prefix caching at once."""
    common = dict(
        max_num_batched_tokens=24, block_size=4, kv_cache_blocks=32, enable_prefix_caching=True
    )
    want, _, _, _ = _run("tiny", None, GREEDY, **common)
    got, stats, preemptions, steps = _run("tiny", NGRAM, GREEDY, **common)
    assert got == want
    spec = stats.spec_decode[0]
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens  # accepted and rejected drafts
    assert spec.num_drafts <= spec.num_draft_tokens <= 3 * spec.num_drafts
    assert sum(spec.accepted_per_pos) == spec.num_accepted_tokens
    assert spec.accepted_per_pos == sorted(spec.accepted_per_pos, reverse=True)
    assert preemptions > 0
    assert sum(stats.prefix_cache_hits.values()) > 0
    assert any(chunks and drafted for chunks, drafted in steps)  # a prefill beside verification


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("spec") / "v3", "deepseek_v3", seed=4))


def test_greedy_tokens_unchanged_moe_two_ubatches(moe_model) -> None:
    """MLA and routed experts, two ubatches, a stop token per prompt (logprobs asked for too):
    the same tokens."""
    want, _, _, _ = _run(moe_model, None, GREEDY, rounds=1)
    params = [
        SamplingParams(
            max_tokens=17, temperature=0.0, stop_token_ids=[t[8]] if i % 2 else [], logprobs=1
        )
        for i, t in enumerate(want)
    ]
    want, _, _, _ = _run(moe_model, None, params, rounds=1, ubatches=2)
    got, stats, _, _ = _run(moe_model, NGRAM, params, rounds=1, ubatches=2)
    assert got == want
    assert any(len(t) < 17 for t in want)
    assert stats.spec_decode[0].num_accepted_tokens > 0


def _scheduler(max_model_len: int = 64) -> Scheduler:
    blocks = BlockManager(32, 2, prefix_caching=True)
    return Scheduler(
        SchedulerConfig(max_model_len=max_model_len), blocks, Drafter(SpeculativeConfig(**NGRAM))
    )


def _decoding(scheduler: Scheduler, params: SamplingParams) -> Sequence:
    """A sequence [1, 2, 3, 1, 2, 3] past its prefill: its drafts are (1, 2, 3)."""
    seq = Sequence(str(len(scheduler.running)), [1, 2, 3, 1, 2], params, eos_token_id=None)
    scheduler.add(seq)
    scheduler.update(scheduler.schedule(), [3])
    return seq


def test_update_rolls_back_rejected_drafts() -> None:
    scheduler = _scheduler()
    seq = _decoding(scheduler, SamplingParams(max_tokens=10))
    out = scheduler.schedule()
    assert [(e.draft_ids, e.num_new_tokens) for e in out.scheduled] == [((1, 2, 3), 4)]
    assert out.uniform_decode  # a decode and its drafts: a decode step for the graphs
    scheduler.update(out, [[1, 5]])  # the first draft accepted, then 5 instead of 2
    assert seq.token_ids == [1, 2, 3, 1, 2, 3, 1, 5]
    assert seq.num_computed_tokens == 7  # the rejected drafts' positions 7 and 8 are not
    # Blocks of positions [0, 6) are registered; the one holding 6 and rejected 7 is not.
    assert scheduler.block_manager.num_cached_blocks == 3


def test_update_stops_inside_accepted_drafts_and_limits_drafts() -> None:
    scheduler = _scheduler()
    seq = _decoding(scheduler, SamplingParams(max_tokens=10, stop_token_ids=[2], logprobs=0))
    out = scheduler.schedule()
    entries = [{token: -1.0} for token in (3, 1, 2, 3, 7)]  # what the engine found, per token
    seq.output_logprobs = list(entries)
    assert scheduler.update(out, [[1, 2, 3, 7]]) == [seq]  # every draft accepted, 2 stops
    assert (seq.output_token_ids, seq.finish_reason) == ([3, 1, 2], "stop")
    assert seq.output_logprobs == entries[:3]  # the entries of the tokens cut off are dropped
    # max_tokens=3 leaves room for one draft after the verification's own token; so does
    # max_model_len 8 for a sequence of 6 tokens.
    for scheduler, params in (
        (_scheduler(), SamplingParams(max_tokens=3)),
        (_scheduler(max_model_len=8), SamplingParams(max_tokens=10)),
    ):
        _decoding(scheduler, params)
        assert [e.draft_ids for e in scheduler.schedule().scheduled] == [(1,)]


def test_requests_that_cannot_speculate_decode_one_token_a_step() -> None:
    """Penalties depend on the tokens before each position: such a request takes no drafts,
    and its tokens are those without speculation."""
    params = SamplingParams(max_tokens=8, temperature=0.0, repetition_penalty=1.3)
    with LLM("tiny", dtype="float32", speculative_config=NGRAM) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(REPEATING[:2], params)]
        assert llm.engine.stats().spec_decode[0].num_drafts == 0
    with LLM("tiny", dtype="float32") as llm:
        assert got == [o.outputs[0].token_ids for o in llm.generate(REPEATING[:2], params)]


def test_logprobs_of_emitted_tokens_come_from_their_own_rows() -> None:
    """Greedy with logprobs: the tokens and each token's entry (its own and the top 2) are those
    of one-token steps."""
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=2, ignore_eos=True)
    runs = []
    for speculative in (None, NGRAM):
        with LLM("tiny", dtype="float32", speculative_config=speculative) as llm:
            runs.append([o.outputs[0] for o in llm.generate(REPEATING[:3], params)])
            drafts = llm.engine.stats().spec_decode
    assert drafts[0].num_accepted_tokens > 0
    for want, got in zip(*runs, strict=True):
        assert got.token_ids == want.token_ids
        assert len(got.logprobs) == len(want.logprobs) == len(want.token_ids)
        for mine, theirs in zip(got.logprobs, want.logprobs, strict=True):
            assert mine.keys() == theirs.keys()
            for token, value in theirs.items():
                assert abs(mine[token] - value) < 1e-4 and mine[token].rank == value.rank


def test_seeded_sampling_repeats_itself() -> None:
    """One uniform per emitted token from the request's own generator: a seeded request gives
    the same tokens twice, whatever shares its batch."""
    params = SamplingParams(max_tokens=16, temperature=0.8, seed=5)
    with LLM("tiny", dtype="float32", speculative_config=NGRAM) as llm:
        alone = llm.generate(REPEATING[:1], params, use_tqdm=False)[0].outputs[0].token_ids
        crowd = llm.generate(REPEATING, params, use_tqdm=False)[0].outputs[0].token_ids
        assert llm.engine.stats().spec_decode[0].num_drafts > 0
    assert alone == crowd


@pytest.mark.parametrize("graph_mode", ["full_decode_only", "full"])
def test_graph_policy_of_verification_steps(graph_mode) -> None:
    """The plan's graph decision for verification steps (CPU runs captures and replays eagerly
    in the graph's padded layout, and records them): a step of decodes and their drafts is a
    decode step, replayed under full_decode_only too; one with a prefill chunk beside them runs
    eagerly there and replays under full."""
    with LLM(
        "tiny",
        dtype="float32",
        speculative_config=NGRAM,
        graph_mode=graph_mode,
        cuda_graph_sizes=[1, 2, 4, 8, 16, 32],
        max_num_batched_tokens=24,
        log_step_plan=True,
    ) as llm:
        steps = _record_steps(llm)
        got = [o.outputs[0].token_ids for o in llm.generate(REPEATING, GREEDY, use_tqdm=False)]
        records = llm.step_log()[-len(steps) :]  # after the warm-up's captures
    want, _, _, _ = _run("tiny", None, GREEDY, rounds=1, max_num_batched_tokens=24)
    assert got == want
    modes = zip(records, steps, strict=True)
    verifying = {r["mode"] for r, (chunks, drafted) in modes if drafted and not chunks}
    assert verifying == {"replay"}
    beside = {r["mode"] for r, (chunks, drafted) in zip(records, steps) if drafted and chunks}
    assert beside == ({"eager"} if graph_mode == "full_decode_only" else {"replay"})


def test_a_decode_step_with_drafts_plans_a_graph() -> None:
    """Two requests with 3 and 0 drafts: 5 rows, a decode step, padded to the capture size 8."""
    plan = plan_step([RankStep(5, 2, True)], Topology(1, 0), GraphTable("full_decode_only", (4, 8)))
    (mine,) = plan.attention
    assert (mine.mode, mine.padded_rows) == ("capture", 8)


@pytest.mark.parametrize(("block_size", "kv"), [(4, "auto"), (6, "auto"), (4, "fp8")])
def test_deepseek_v4_compressed_layers_take_rejected_drafts(tmp_path, block_size, kv) -> None:
    """Every attention type (compress rates 2 and 4, window 4): n-gram drafts of 3 close
    compressor windows and are accepted and rejected, beside chunked prefill and preemption;
    the greedy tokens are those without speculation. Block 4 resumes prefixes (CSA's first
    series at block ends in the pages, prefix caching on); block 6 keeps every first series
    in the slot's ring. The FP8 cache: its own tokens without speculation."""
    from afdserve.model.fixtures.deepseek_v4 import make_tiny_v4

    model = str(make_tiny_v4(tmp_path / "v4"))
    blocks = 192 // block_size
    common = dict(
        max_num_batched_tokens=24, block_size=block_size, kv_cache_blocks=blocks, kv_cache_dtype=kv
    )
    want, _, _, _ = _run(model, None, GREEDY, **common)
    got, stats, preemptions, _ = _run(model, NGRAM, GREEDY, **common)
    assert got == want
    spec = stats.spec_decode[0]
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens
    assert preemptions > 0
    assert (sum(stats.prefix_cache_hits.values()) > 0) == (block_size == 4)


def test_deepseek_v4_refuses_more_drafts_than_its_rings_hold(tmp_path) -> None:
    from afdserve.model.families.deepseek_v4.geometry import MAX_DRAFT_ROWS
    from afdserve.model.fixtures.deepseek_v4 import make_tiny_v4

    model = str(make_tiny_v4(tmp_path / "v4"))
    many = {**NGRAM, "num_speculative_tokens": MAX_DRAFT_ROWS + 1}
    with pytest.raises(ValueError, match=f"num_speculative_tokens={MAX_DRAFT_ROWS + 1} > 16"):
        LLM(model, speculative_config=many)


def test_config_file_mapping_reaches_the_flag(tmp_path) -> None:
    """vLLM's --config YAML may spell the speculative config as a nested mapping."""
    from afdserve.cli import build_parser
    from afdserve.config_args import parse_with_config

    path = tmp_path / "serve.yaml"
    path.write_text("speculative-config:\n  method: ngram\n  num_speculative_tokens: 2\n")
    args = parse_with_config(build_parser(), ["serve", "--config", str(path)])
    assert args.speculative_config == SpeculativeConfig("ngram", 2)


def test_stop_strings_end_the_output_at_the_same_token() -> None:
    """Several tokens reach the frontend per step: a stop string one of them completes ends
    text, token ids and logprobs there, as when tokens came one a step."""
    with LLM("tiny", dtype="float32") as llm:
        texts = [o.outputs[0].text for o in llm.generate(REPEATING, GREEDY, use_tqdm=False)]
    params = [
        SamplingParams(max_tokens=20, temperature=0.0, stop=[text[4:6]], logprobs=0)
        for text in texts
    ]
    results = []
    for speculative in (None, NGRAM):
        with LLM("tiny", dtype="float32", speculative_config=speculative) as llm:
            outs = [o.outputs[0] for o in llm.generate(REPEATING, params, use_tqdm=False)]
        results.append([(o.text, o.token_ids, len(o.logprobs), o.finish_reason) for o in outs])
    assert results[0] == results[1]
    assert all(reason == "stop" for *_, reason in results[0])


def test_linear_attention_refuses_speculation_by_name(tmp_path) -> None:
    """A recurrent state folds in every row: rejected drafts cannot be taken back out."""
    from afdserve.model.fixtures.tiny import make_tiny_model

    model = str(make_tiny_model(tmp_path / "next", "qwen3_next"))
    with pytest.raises(ValueError, match="recurrent state folds in every row"):
        LLM(model, speculative_config=NGRAM)


def test_deepseek_v4_sliding_layers_take_rejected_drafts(tmp_path) -> None:
    """The window's rows sit at their own positions in the window pool (every row written), so a
    V4 of sliding layers alone speculates: n-gram drafts, accepted and rejected, beside chunked
    prefill, preemption and prefix caching, leave the greedy tokens unchanged."""
    from afdserve.model.fixtures.deepseek_v4 import make_tiny_v4

    sliding = ["sliding_attention"] * 4
    model = str(make_tiny_v4(tmp_path / "v4", layer_types=sliding))
    common = dict(
        max_num_batched_tokens=24, block_size=4, kv_cache_blocks=32, enable_prefix_caching=True
    )
    want, _, _, _ = _run(model, None, GREEDY, **common)
    got, stats, preemptions, _ = _run(model, NGRAM, GREEDY, **common)
    assert got == want
    spec = stats.spec_decode[0]
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens
    assert preemptions > 0
