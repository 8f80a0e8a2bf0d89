from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from afdserve.engine.sampler import process_logits, sample
from afdserve.engine.sampling_params import SamplingParams
from afdserve.engine.sequence import Sequence

VOCAB = 32
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
        ],
    ),
]


def make_seq(name: str = "r", **params: object) -> Sequence:
    return Sequence(name, [1, 2, 3], SamplingParams(**params), eos_token_id=None)


def random_logits(rows: int, seed: int = 0, device: str = "cpu") -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, VOCAB, generator=generator) * 3).to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_greedy_is_argmax(dtype: torch.dtype, device: str) -> None:
    logits = random_logits(9, device=device).to(dtype)
    seqs = [make_seq(f"r{i}", temperature=0.0) for i in range(9)]
    result = sample(logits, seqs)
    assert result.token_ids == logits.float().argmax(dim=-1).tolist()
    assert result.logprobs == [None] * 9


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 1.0, "top_k": 1},
        {"temperature": 5.0, "top_k": 1, "top_p": 0.5},
        {"temperature": 1.0, "top_p": 1e-6},
        {"temperature": 3.0, "top_p": 1e-6, "seed": 4},
    ],
)
def test_filters_down_to_one_token_are_argmax(params: dict) -> None:
    logits = random_logits(64, seed=1)
    seqs = [make_seq(f"r{i}", **params) for i in range(64)]
    assert sample(logits, seqs).token_ids == logits.argmax(dim=-1).tolist()


def test_mixed_batch_greedy_rows_stay_argmax() -> None:
    logits = random_logits(6, seed=2)
    seqs = [make_seq(f"r{i}", temperature=0.0 if i % 2 else 1.0) for i in range(6)]
    tokens = sample(logits, seqs).token_ids
    argmax = logits.argmax(dim=-1).tolist()
    assert [tokens[i] for i in (1, 3, 5)] == [argmax[i] for i in (1, 3, 5)]


def draw_sequence(
    seq: Sequence, row_logits: torch.Tensor, steps: int, position: int, others: list[Sequence]
) -> list[int]:
    """Sample `steps` tokens for `seq`, placed at `position` among `others` in every batch."""
    tokens = []
    for step in range(steps):
        batch = list(others)
        batch.insert(position, seq)
        logits = random_logits(len(batch), seed=100 + step, device=row_logits.device.type)
        logits[position] = row_logits
        tokens.append(sample(logits, batch).token_ids[position])
    return tokens


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_sampling_is_reproducible_and_independent_of_batch(device: str) -> None:
    params = {"temperature": 1.3, "top_k": 20, "top_p": 0.95, "seed": 1234}
    row = torch.linspace(0, 1, VOCAB, device=device)  # close to uniform: every draw matters
    alone = draw_sequence(make_seq(**params), row, steps=30, position=0, others=[])
    again = draw_sequence(make_seq(**params), row, steps=30, position=0, others=[])
    assert alone == again
    assert len(set(alone)) > 5, "a uniform distribution should give varied tokens"
    others = [
        make_seq("x", temperature=0.7, seed=99),
        make_seq("y", temperature=1.0),
        make_seq("z", temperature=0.0),
        make_seq("w", temperature=2.0, top_k=3, seed=5),
    ]
    for position in (0, 2, 4):
        crowded = draw_sequence(make_seq(**params), row, steps=30, position=position, others=others)
        assert crowded == alone
    other_seed = draw_sequence(make_seq(**{**params, "seed": 4321}), row, 30, 0, [])
    assert other_seed != alone


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_sampling_independent_of_batch_size(device: str) -> None:
    params = {"temperature": 0.9, "seed": 7}
    row = random_logits(1, seed=3, device=device)[0]
    small = draw_sequence(make_seq(**params), row, steps=10, position=0, others=[])
    many = [make_seq(f"o{i}", temperature=1.0, seed=i) for i in range(40)]
    large = draw_sequence(make_seq(**params), row, steps=10, position=17, others=many)
    assert small == large


def empirical(logits_row: torch.Tensor, params: dict, draws: int = 20_000) -> torch.Tensor:
    seq = make_seq(**params, seed=11)
    tokens = sample(logits_row.expand(draws, -1).contiguous(), [seq] * draws).token_ids
    return torch.bincount(torch.tensor(tokens), minlength=logits_row.numel()).double() / draws


@pytest.mark.parametrize("device", DEVICES)
def test_frequencies_match_softmax_with_temperature(device: str) -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0, 1.5])
    for temperature in (0.7, 1.0, 2.0):
        expected = torch.softmax(logits.double() / temperature, dim=-1)
        freq = empirical(logits.to(device), {"temperature": temperature}).cpu()
        # Binomial std of a frequency is at most 0.5 / sqrt(20000) = 0.0035.
        assert (freq - expected).abs().max() < 0.015, (temperature, freq, expected)


def test_frequencies_match_top_k_and_top_p() -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0, 1.5])
    probs = torch.softmax(logits.double(), dim=-1)
    order = probs.argsort(descending=True)

    top3 = torch.zeros_like(probs)
    top3[order[:3]] = probs[order[:3]]
    freq = empirical(logits, {"temperature": 1.0, "top_k": 3})
    assert (freq - top3 / top3.sum()).abs().max() < 0.015
    assert freq[order[3:]].sum() == 0

    # top_p: the smallest prefix of the sorted distribution whose mass reaches top_p.
    top_p = 0.8
    cumulative = probs[order].cumsum(0)
    kept = order[: int((cumulative < top_p).sum()) + 1]
    nucleus = torch.zeros_like(probs)
    nucleus[kept] = probs[kept]
    freq = empirical(logits, {"temperature": 1.0, "top_p": top_p})
    assert (freq - nucleus / nucleus.sum()).abs().max() < 0.015
    assert freq[order[len(kept) :]].sum() == 0

    # top-k first, then top-p on the renormalised top-k distribution.
    renorm = probs[order[:3]] / probs[order[:3]].sum()
    kept = order[: int((renorm.cumsum(0) < 0.6).sum()) + 1]
    freq = empirical(logits, {"temperature": 1.0, "top_k": 3, "top_p": 0.6})
    assert set(torch.nonzero(freq).flatten().tolist()) == set(kept.tolist())


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_are_unmodified_log_softmax(device: str) -> None:
    logits = random_logits(4, seed=5, device=device).to(torch.bfloat16)
    seqs = [
        make_seq("a", temperature=0.0, logprobs=3),
        make_seq("b", temperature=0.5, top_k=2, logprobs=0, seed=1),
        make_seq("c", temperature=1.0),
        make_seq("d", temperature=2.0, top_p=0.3, logprobs=20, seed=2),
    ]
    result = sample(logits, seqs)
    reference = torch.log_softmax(logits.float(), dim=-1)
    assert result.logprobs[2] is None
    for row, k in ((0, 3), (1, 0), (3, 20)):
        entry = result.logprobs[row]
        token = result.token_ids[row]
        top = reference[row].topk(k).indices.tolist() if k else []
        assert set(entry) == {token, *top}
        for tok, value in entry.items():
            assert value == pytest.approx(reference[row, tok].item(), abs=1e-6)
    assert result.token_ids[0] == int(reference[0].argmax())


def test_shape_mismatch_is_rejected() -> None:
    with pytest.raises(ValueError, match="expected \\[2, vocab\\]"):
        sample(torch.zeros(3, VOCAB), [make_seq(), make_seq()])


@pytest.mark.parametrize(
    ("kwargs", "field_name"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_k": -2}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"seed": 1.5}, "seed"),
        ({"stop": ""}, "stop"),
        ({"stop": ["ok", 3]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"seed": 2**63}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"temperature": float("inf")}, "temperature"),
        ({"min_p": 1.5}, "min_p"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_tokens": 17}, "min_tokens"),
        ({"logit_bias": {3: 101}}, "logit_bias"),
        ({"logit_bias": {-1: 1}}, "logit_bias"),
        ({"n": 0}, "n"),
        ({"n": 3, "best_of": 2}, "best_of"),
    ],
)
def test_sampling_params_validation(kwargs: dict, field_name: str) -> None:
    with pytest.raises(ValueError, match=f"SamplingParams.{field_name}="):
        SamplingParams(**kwargs)


def test_sampling_params_normalisation() -> None:
    assert SamplingParams(stop="END").stop == ("END",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)
    assert SamplingParams(temperature=0).greedy and not SamplingParams().greedy
    assert SamplingParams(top_k=0).top_k == 0
    hash(SamplingParams(stop=["x"], stop_token_ids=[1]))  # frozen and hashable after normalising


# ----- logits processing: transformers' processors and OpenAI's penalty formula as oracles -----

EOS = 0


def with_history(prompt: list[int], output: list[int], **params: object) -> Sequence:
    seq = Sequence("h", prompt, SamplingParams(max_tokens=64, **params), eos_token_id=EOS)
    seq.token_ids.extend(output)
    return seq


def reference_processing(
    logits: torch.Tensor, prompt: list[int], output: list[int], params: SamplingParams
) -> torch.Tensor:
    """The documented order: min_tokens, logit_bias, repetition, frequency and presence."""
    ids = torch.tensor([prompt + output])
    scores = logits[None].clone()
    stops = [*params.stop_token_ids, *([] if params.ignore_eos else [EOS])]
    if stops:
        scores = MinNewTokensLengthLogitsProcessor(len(prompt), params.min_tokens, stops)(
            ids, scores
        )
    if params.logit_bias:
        bias = [[[t], v] for t, v in params.logit_bias.items()]
        scores = SequenceBiasLogitsProcessor(bias)(ids, scores)
    scores = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(ids, scores)
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=VOCAB).float()
    scores = scores[0] - params.frequency_penalty * counts
    return scores - params.presence_penalty * (counts > 0).float()


tokens = st.lists(st.integers(0, VOCAB - 1), max_size=12)
processing = st.fixed_dictionaries(
    {},
    optional={
        "repetition_penalty": st.floats(0.1, 3.0),
        "presence_penalty": st.floats(-2.0, 2.0),
        "frequency_penalty": st.floats(-2.0, 2.0),
        "min_tokens": st.integers(0, 8),
        "stop_token_ids": st.lists(st.integers(1, VOCAB - 1), max_size=3),
        "ignore_eos": st.booleans(),
        "logit_bias": st.dictionaries(st.integers(0, VOCAB - 1), st.floats(-100, 100), max_size=4),
    },
)


@settings(max_examples=60, deadline=None)
@given(prompt=tokens.filter(bool), output=tokens, params=processing, seed=st.integers(0, 99))
def test_processing_matches_transformers_processors(
    prompt: list[int], output: list[int], params: dict, seed: int
) -> None:
    logits = random_logits(1, seed=seed)[0]
    seq = with_history(prompt, output, temperature=0.0, **params)
    want = reference_processing(logits, prompt, output, seq.params)
    if not torch.isfinite(want).any():  # everything masked: the model's own logits are used
        want = logits
    got = process_logits(logits[None], [seq])[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    # Greedy picks the argmax of the processed logits, whatever else shares the batch.
    batch = [make_seq("x", temperature=1.0, seed=1), seq, make_seq("y", temperature=0.0)]
    row = torch.stack([random_logits(1, seed=7)[0], logits, logits])
    assert sample(row, batch).token_ids[1] == int(got.argmax())


def test_min_tokens_only_while_output_is_short() -> None:
    logits = torch.zeros(VOCAB)
    logits[EOS], logits[5] = 10.0, 9.0
    for produced, want in ((0, 5), (2, 5), (3, EOS)):
        seq = with_history([1, 2], [7] * produced, temperature=0.0, min_tokens=3)
        assert sample(logits[None], [seq]).token_ids == [want]
    stop = with_history([1], [], temperature=0.0, min_tokens=1, stop_token_ids=[5])
    logits[EOS] = -10.0
    assert sample(logits[None], [stop]).token_ids != [5]


def test_min_p_frequencies_match_transformers() -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0, 1.5])
    for temperature, min_p in ((1.0, 0.3), (0.7, 0.1)):
        scaled = logits[None] / temperature
        kept = MinPLogitsWarper(min_p)(torch.zeros(1, 1, dtype=torch.long), scaled)[0]
        expected = torch.softmax(kept.double(), dim=-1)
        freq = empirical(logits, {"temperature": temperature, "min_p": min_p})
        assert (freq - expected).abs().max() < 0.015, (min_p, freq, expected)
        assert freq[expected == 0].sum() == 0


@pytest.mark.parametrize("temperature", [1e-45, 1e-30, 9.99e-6])
def test_tiny_temperatures_are_greedy(temperature: float) -> None:
    """vLLM's rule; 1e-45 used to overflow to inf logits, NaN probabilities and index -1."""
    assert SamplingParams(temperature=temperature).greedy
    logits = random_logits(8, seed=9)
    seqs = [make_seq(f"t{i}", temperature=temperature, seed=i) for i in range(8)]
    assert sample(logits, seqs).token_ids == logits.argmax(dim=-1).tolist()
    assert not SamplingParams(temperature=1e-5).greedy


def test_extreme_values_never_break_a_draw() -> None:
    logits = random_logits(5, seed=4)
    logits[3] = torch.nan  # a broken row must not take its batch down with it
    seqs = [
        make_seq("huge-k", temperature=1.0, top_k=10**30, seed=1),
        make_seq("hot", temperature=1e30, seed=2),
        make_seq("cool", temperature=1e-5, seed=3),
        make_seq("nan", temperature=1.0, seed=4),
        make_seq("edge", temperature=1.0, top_p=1e-300, min_p=1.0, seed=2**63 - 1),
    ]
    tokens = sample(logits, seqs).token_ids
    assert all(0 <= t < VOCAB for t in tokens)
    assert tokens[2] == int(logits[2].argmax()) and tokens[4] == int(logits[4].argmax())
