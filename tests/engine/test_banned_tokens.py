"""allowed_token_ids and bad_words in the sampler, against transformers' own logits processors
(PrefixConstrainedLogitsProcessor for an allowed set, NoBadWordsLogitsProcessor for bad words
over the output so far), and bad words tokenized as vLLM does, on the bundled tokenizer."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer
from transformers.generation.logits_process import (
    NoBadWordsLogitsProcessor,
    PrefixConstrainedLogitsProcessor,
)

from afdserve.engine.sampler import process_logits, sample
from afdserve.engine.sampling_params import SamplingParams, with_bad_words_token_ids
from afdserve.engine.sequence import Sequence
from afdserve.model.fixtures.bundled import bundled_model_dir

VOCAB = 32
tokens = st.lists(st.integers(0, VOCAB - 1), max_size=8)
words = st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=3), max_size=4)


def seq_with(output: list[int], **params: object) -> Sequence:
    seq = Sequence("r", [1, 2, 3], SamplingParams(max_tokens=64, **params), eos_token_id=None)
    seq.token_ids.extend(output)
    return seq


@settings(max_examples=80, deadline=None)
@given(
    output=tokens,
    bad=words,
    allowed=st.none() | st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6),
    seed=st.integers(0, 99),
)
def test_masks_match_transformers_processors(
    output: list[int], bad: list[list[int]], allowed: list[int] | None, seed: int
) -> None:
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed)) * 3
    params: dict = {"temperature": 0.0, "allowed_token_ids": allowed}
    if bad:
        params |= {"bad_words": ["w"] * len(bad), "bad_words_token_ids": bad}
    got = process_logits(logits[None], [seq_with(output, **params)])[0]

    # vLLM's bad words look at the output only: transformers' processor is given just that.
    ids = torch.tensor([output], dtype=torch.long).reshape(1, len(output))
    want = logits[None].clone()
    if allowed is not None:
        want = PrefixConstrainedLogitsProcessor(lambda _b, _ids: allowed, 1)(ids, want)
    if bad:
        want = NoBadWordsLogitsProcessor(bad, eos_token_id=None)(ids, want)
    want = want[0]
    if not torch.isfinite(want).any():  # all masked: the model's own logits (documented)
        want = logits
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    torch.testing.assert_close(got[torch.isfinite(got)], want[torch.isfinite(want)])


def test_sampling_never_draws_a_masked_token() -> None:
    """Greedy and random rows alike, over many seeds: only allowed, unbanned tokens."""
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(3))
    for seed in range(50):
        allowed_seq = seq_with([], allowed_token_ids=[4, 9, 17], temperature=1.0, seed=seed)
        banned_seq = seq_with(
            [5], bad_words=["x", "y"], bad_words_token_ids=[[7], [5, 8]], temperature=2.0, seed=seed
        )
        drawn = sample(logits.repeat(2, 1), [allowed_seq, banned_seq]).token_ids
        assert drawn[0] in (4, 9, 17) and drawn[1] not in (7, 8)


def test_bad_words_tokenized_as_vllm() -> None:
    """Each word as given and with a leading space when that is a different first token of
    the same length; both variants' last tokens are banned after their prefixes."""
    tokenizer = AutoTokenizer.from_pretrained(bundled_model_dir())
    params = with_bad_words_token_ids(SamplingParams(bad_words=["ab", " c"]), tokenizer)
    encode = lambda text: tuple(tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
    # The byte tokenizer: " ab" is 3 tokens against "ab"'s 2, so only "ab"; " c" gives "c"
    # and " c" (2 tokens against 1: not added either).
    assert params.bad_words_token_ids == (encode("ab"), encode("c"))
    assert with_bad_words_token_ids(params, None) is params  # already tokenized
    seq = Sequence("r", [1], params, eos_token_id=None)
    seq.token_ids.extend(encode("xa"))
    masked = process_logits(torch.zeros(1, 300), [seq])[0]
    assert masked[encode("b")[0]] == -torch.inf and masked[encode("c")[0]] == -torch.inf
    assert torch.isfinite(masked).sum() == 298


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
        ({"bad_words": [" "]}, "bad_words"),
        ({"bad_words": [3]}, "bad_words"),
        ({"bad_words_token_ids": [[]]}, "bad_words_token_ids"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"detokenize": 1}, "detokenize"),
        ({"output_kind": "delta"}, "output_kind"),
    ],
)
def test_new_fields_are_checked_by_name(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=f"SamplingParams.{name}="):
        SamplingParams(**kwargs)


def test_ids_outside_the_vocabulary_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="allowed_token_ids: token id 40"):
        SamplingParams(allowed_token_ids=[1, 40]).check_vocab(VOCAB)
    with pytest.raises(ValueError, match="bad_words: token id 99"):
        SamplingParams(bad_words=["z"], bad_words_token_ids=[[99]]).check_vocab(VOCAB)
