from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from afdserve.frontend.detokenizer import IncrementalDetokenizer, find_stop_string

TEXT = "héllo wörld ✓ 你好 🙂"
TEXTS = [
    TEXT,
    "🙂🙂🙂 mixed: naïve café — “quotes” ∑ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢!",
    "plain ascii, the quick brown fox jumps over the lazy dog",
    "日本語のテキストと English と emoji 👩‍💻 joined",
]
EOS = "<eos>"


def build_tokenizer() -> Tokenizer:
    """A small byte-level BPE trained on ASCII only, so every non-ASCII character is split into
    byte tokens and most multi-byte characters straddle token boundaries."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[EOS],
        show_progress=False,
    )
    corpus = ["hello world, the quick brown fox jumps over the lazy dog. plain ascii text"] * 20
    tok.train_from_iterator(corpus, trainer)
    return tok


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return build_tokenizer()


@pytest.fixture(scope="module")
def hf_tokenizer(tokenizer: Tokenizer) -> object:
    transformers = pytest.importorskip("transformers")
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS)


class SlowTokenizer:
    """Only `decode`, like a pure-Python tokenizer: takes the Python window, not DecodeStream."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def stream(tok: object, prompt: list[int], ids: list[int], **kwargs: bool) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt, **kwargs)
    deltas = [detok.add(token) for token in ids]
    deltas.append(detok.flush())
    assert detok.text == "".join(deltas)
    return deltas


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("which", ["tokenizers", "transformers", "slow"])
def test_deltas_concatenate_to_full_decode(
    tokenizer: Tokenizer, hf_tokenizer: object, text: str, which: str
) -> None:
    """Multi-byte characters split across tokens: the stream's deltas add up to the full decode,
    through tokenizers' DecodeStream (fast tokenizers) and through the Python window (slow)."""
    tok = {"tokenizers": tokenizer, "transformers": hf_tokenizer}.get(
        which, SlowTokenizer(tokenizer)
    )
    assert IncrementalDetokenizer(tok, []).uses_decode_stream == (which != "slow")
    ids = tokenizer.encode(text).ids
    if not text.isascii():
        assert any(tokenizer.decode([i]).endswith("\ufffd") for i in ids), "no split character"
    mid_char = tokenizer.encode("prompt ends inside 🙂").ids[:-1]
    for prompt in ([], tokenizer.encode("prompt: ").ids, mid_char):
        deltas = stream(tok, prompt, ids)
        assert "".join(deltas) == tokenizer.decode(ids) == text
        assert not any("\ufffd" in delta for delta in deltas), deltas
        assert deltas[-1] == "", "nothing should be left to flush after complete characters"


def test_prompt_ending_inside_a_character(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("x🙂").ids
    prompt, output = ids[:-2], ids[-2:]  # the emoji's last two bytes are the output
    deltas = stream(tokenizer, prompt, output + tokenizer.encode(" ok").ids)
    # The orphan continuation bytes can never form a character; they decode as U+FFFD like a
    # full decode of the output would, and the text after them is intact.
    assert "".join(deltas).endswith(" ok")


@pytest.mark.parametrize("slow", [False, True])
def test_held_back_bytes_are_released_by_flush(tokenizer: Tokenizer, slow: bool) -> None:
    ids = tokenizer.encode("ab🙂").ids
    detok = IncrementalDetokenizer(SlowTokenizer(tokenizer) if slow else tokenizer, [])
    partial = ids[:-1]  # the emoji without its last byte
    out = "".join(detok.add(token) for token in partial)
    assert out == "ab"
    assert detok.text == "ab"
    rest = detok.flush()
    assert rest and set(rest) == {"\ufffd"}
    assert detok.text == tokenizer.decode(partial)


def test_special_tokens_skipped_or_kept(tokenizer: Tokenizer) -> None:
    eos = tokenizer.token_to_id(EOS)
    ids = tokenizer.encode("hi ✓").ids + [eos]
    assert "".join(stream(tokenizer, [], ids)) == "hi ✓"
    kept = stream(tokenizer, [], ids, skip_special_tokens=False)
    assert "".join(kept) == "hi ✓" + EOS


@pytest.mark.parametrize("slow", [False, True])
def test_random_token_streams_never_emit_partial_characters(
    tokenizer: Tokenizer, slow: bool
) -> None:
    rng = random.Random(0)
    pieces = ["a", "é", "✓", "你", "🙂", " ", "fox", "ö"]
    tok = SlowTokenizer(tokenizer) if slow else tokenizer
    for _ in range(50):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 20)))
        ids = tokenizer.encode(text).ids
        deltas = stream(tok, tokenizer.encode("ctx ").ids, ids)
        assert "".join(deltas) == text
        assert not any("\ufffd" in delta for delta in deltas)


def test_stop_string_found_across_delta_boundaries(tokenizer: Tokenizer) -> None:
    stops = ("wörld", "你好 🙂", "never")
    ids = tokenizer.encode(TEXT).ids
    detok = IncrementalDetokenizer(tokenizer, [])
    searched, hit, crossing = 0, None, False
    for token in ids:
        delta = detok.add(token)
        if not delta:
            continue
        hit = find_stop_string(detok.text, stops, searched)
        if hit is not None:
            # The match ends inside the newest delta, so it started in text searched earlier
            # or spans several deltas.
            crossing = hit < searched or len(delta) < len("wörld")
            break
        searched = len(detok.text)
    assert hit == TEXT.index("wörld")
    assert crossing
    assert detok.text[:hit] == "héllo "


@pytest.mark.parametrize(
    ("text", "stops", "start", "expected"),
    [
        ("hello world", ("world",), 0, 6),
        ("hello world", ("world",), 8, 6),  # began before `start`, ends after it
        ("hello world", ("lo", "hell"), 0, 0),  # earliest start wins, not first listed
        ("hello world", ("o",), 5, 7),  # an "o" before the window was already seen
        ("hello world", ("xyz",), 0, None),
        ("hello world", (), 0, None),
        ("ab", ("abc",), 0, None),
        ("", ("a",), 0, None),
    ],
)
def test_find_stop_string(
    text: str, stops: tuple[str, ...], start: int, expected: int | None
) -> None:
    assert find_stop_string(text, stops, start) == expected


def test_find_stop_string_incremental_equals_full_search() -> None:
    rng = random.Random(1)
    for _ in range(200):
        text = "".join(rng.choice("abcab ") for _ in range(rng.randint(0, 40)))
        stops = tuple("".join(rng.choices("abc", k=rng.randint(1, 4))) for _ in range(3))
        truth = min((i for i in (text.find(s) for s in stops) if i >= 0), default=None)
        searched, found = 0, None
        while searched < len(text) and found is None:
            end = min(len(text), searched + rng.randint(1, 5))
            found = find_stop_string(text[:end], stops, searched)
            searched = end
        assert found == truth, (text, stops)


def test_bundled_tokenizer_streams_through_decode_stream() -> None:
    """The engine's own tokenizer (byte-level, one token per byte) takes the fast path, and a
    random byte stream (what random weights produce) decodes as a full decode does."""
    from afdserve.engine.factory import load_tokenizer
    from afdserve.model.fixtures.bundled import resolve_model

    tok = load_tokenizer(resolve_model(None))
    rng = random.Random(1)
    prompt = tok.encode("naïve ✓ ", add_special_tokens=False)
    for _ in range(20):
        ids = [rng.randrange(256) for _ in range(rng.randint(1, 30))]
        detok = IncrementalDetokenizer(tok, prompt)
        assert detok.uses_decode_stream
        text = "".join(detok.add(t) for t in ids) + detok.flush()
        assert text == tok.decode(ids, skip_special_tokens=True)
