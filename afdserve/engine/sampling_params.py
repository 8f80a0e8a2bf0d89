"""Per-request sampling and stopping parameters, with vLLM's names, defaults and bounds."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, replace
from typing import Any

from afdserve.engine.structured import StructuredOutputsParams

MAX_LOGPROBS = 20
# Below this a temperature is greedy (vLLM's rule): dividing logits by 1e-45 overflows to inf and
# the softmax of the row turns into NaN.
GREEDY_TEMPERATURE = 1e-5
# A seed is a signed 64-bit integer, as in vLLM; torch's generators take no more.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
MAX_PENALTY = 2.0  # |presence_penalty|, |frequency_penalty| (OpenAI's range)
MAX_LOGIT_BIAS = 100.0  # |logit_bias[token]| (OpenAI's range)


class RequestOutputKind(enum.Enum):
    """vLLM's output kinds. The offline API returns each request once, finished (FINAL_ONLY),
    whatever the kind, as vLLM's LLM does; the server streams deltas by its own rule."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


def _is_int(value: object) -> bool:
    # bool is a subclass of int; `max_tokens=True` is a caller bug, not the number 1.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _finite_in(value: object, low: float, high: float) -> bool:
    return _is_number(value) and math.isfinite(value) and low <= value <= high


@dataclass(frozen=True)
class SamplingParams:
    """Processing order for each step: the grammar, `allowed_token_ids` and `bad_words` mask
    what may never be sampled, `min_tokens` masks the stop tokens, `logit_bias` is added,
    then repetition, frequency and presence penalties; greedy takes the argmax of that; sampling
    divides by `temperature`, then applies `min_p`, `top_k`, `top_p`. Logprobs are always those of
    the model's unmodified distribution."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    # Output tokens of this request: logit -= frequency * count + presence * (count > 0).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # Prompt and output tokens: a positive logit is divided by it, a negative one multiplied.
    repetition_penalty: float = 1.0
    # Token id -> value added to its logit. Not part of the hash (a dict is not hashable).
    logit_bias: dict[int, float] | None = field(default=None, hash=False)
    # Choices per prompt (`n`), drawn from `best_of` candidates ranked by cumulative logprob.
    n: int = 1
    best_of: int | None = None
    # Constrains the output to a JSON schema, regex, choice or grammar (needs llguidance).
    structured_outputs: StructuredOutputsParams | None = None
    # Detokenization: drop special tokens (EOS, chat markers) from the text; keep the stop
    # string that ended the output.
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # vLLM's bad_words: each word's tokens (with and without a leading space) may never be
    # generated in a row; the frontend tokenizes them into `bad_words_token_ids`
    # (`with_bad_words_token_ids`), which the sampler reads.
    bad_words: tuple[str, ...] = ()
    bad_words_token_ids: tuple[tuple[int, ...], ...] | None = None
    # Only these tokens may be sampled (vLLM's allowed_token_ids).
    allowed_token_ids: tuple[int, ...] | None = None
    # The top `prompt_logprobs` tokens (plus the prompt's own) at every prompt position but the
    # first, from the same forward as the prefill.
    prompt_logprobs: int | None = None
    # Keep the prompt's last N tokens (-1: as many as max_model_len), as vLLM's field.
    truncate_prompt_tokens: int | None = None
    # False: outputs carry token ids and no text (vLLM's detokenize).
    detokenize: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        # The checks run in this order, so a request with several bad fields is told the first.
        self._check_sampling()
        self._check_output_fields()
        self._check_penalties_and_choices()
        self._check_structured_outputs()
        self._normalise_stops()
        self._normalise_token_lists()
        self._normalise_logit_bias()

    def _bad(self, name: str, allowed: str) -> ValueError:
        return ValueError(f"SamplingParams.{name}={getattr(self, name)!r}: {allowed}")

    def _check_sampling(self) -> None:
        """The length and the distribution: max_tokens, temperature, top_k/top_p/min_p, seed."""
        bad = self._bad
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise bad("max_tokens", "must be an integer >= 1")
        if not _finite_in(self.temperature, 0.0, math.inf):
            raise bad("temperature", "must be a finite number >= 0 (below 1e-5 means greedy)")
        if not _is_int(self.top_k) or not (self.top_k in (-1, 0) or self.top_k >= 1):
            raise bad("top_k", "must be -1 or 0 (disabled) or an integer >= 1")
        if not _is_number(self.top_p) or not (0 < self.top_p <= 1):
            raise bad("top_p", "must be a number in (0, 1]")
        if not _finite_in(self.min_p, 0.0, 1.0):
            raise bad("min_p", "must be a number in [0, 1]")
        if self.seed is not None and not (_is_int(self.seed) and SEED_MIN <= self.seed <= SEED_MAX):
            raise bad("seed", f"must be None or an integer in [{SEED_MIN}, {SEED_MAX}]")

    def _check_output_fields(self) -> None:
        """What comes back: the bool flags, min_tokens, logprobs, prompt truncation, kind."""
        bad = self._bad
        for name in (
            "ignore_eos",
            "skip_special_tokens",
            "include_stop_str_in_output",
            "detokenize",
        ):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "must be a bool")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise bad("min_tokens", f"must be an integer in [0, max_tokens={self.max_tokens}]")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise bad(name, f"must be None or an integer in [0, {MAX_LOGPROBS}]")
        keep = self.truncate_prompt_tokens
        if keep is not None and not (_is_int(keep) and (keep == -1 or keep >= 1)):
            raise bad(
                "truncate_prompt_tokens", "must be None, -1 (max_model_len) or an integer >= 1"
            )
        if not isinstance(self.output_kind, RequestOutputKind):
            raise bad("output_kind", "must be a RequestOutputKind (CUMULATIVE, DELTA, FINAL_ONLY)")

    def _check_penalties_and_choices(self) -> None:
        """The three penalties, then `n` and `best_of`."""
        bad = self._bad
        for name in ("presence_penalty", "frequency_penalty"):
            if not _finite_in(getattr(self, name), -MAX_PENALTY, MAX_PENALTY):
                raise bad(name, f"must be a number in [-{MAX_PENALTY}, {MAX_PENALTY}]")
        if not _finite_in(self.repetition_penalty, 0.0, math.inf) or self.repetition_penalty == 0:
            raise bad("repetition_penalty", "must be a finite number > 0 (1 means none)")
        if not _is_int(self.n) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        if self.best_of is not None and not (_is_int(self.best_of) and self.best_of >= self.n):
            raise bad("best_of", f"must be None or an integer >= n={self.n}")

    def _check_structured_outputs(self) -> None:
        if self.structured_outputs is None:
            return
        # These two name no value: the constraint holds server-side fields (tokenizer_dir,
        # a path) that an HTTP client, who sees this message, must not.
        if not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(
                "SamplingParams.structured_outputs: must be None or a StructuredOutputsParams"
            )
        # The grammar ends the output with EOS: it must be allowed to stop it, at once.
        if self.ignore_eos or self.min_tokens:
            raise ValueError(
                "SamplingParams.structured_outputs: cannot be combined with "
                "ignore_eos or min_tokens"
            )

    # The _normalise_* checks also store the field back: the dataclass is frozen, and the stored
    # value must be a hashable tuple whatever the caller passed (str, list or tuple).

    def _normalise_stops(self) -> None:
        bad = self._bad
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            raise bad("stop", "must be a non-empty string or a list/tuple of non-empty strings")
        object.__setattr__(self, "stop", tuple(stop))
        if self.stop and not self.detokenize:
            raise bad("detokenize", "must be True when stop strings are given (they need text)")

        ids = self.stop_token_ids
        if not isinstance(ids, (list, tuple)) or not all(_is_int(t) and t >= 0 for t in ids):
            raise bad("stop_token_ids", "must be a list/tuple of integers >= 0")
        object.__setattr__(self, "stop_token_ids", tuple(ids))

    def _normalise_token_lists(self) -> None:
        """bad_words, their token ids, allowed_token_ids."""
        bad = self._bad
        words = (self.bad_words,) if isinstance(self.bad_words, str) else self.bad_words
        if not isinstance(words, (list, tuple)) or not all(
            isinstance(w, str) and w.strip() for w in words
        ):
            raise bad("bad_words", "must be a list/tuple of words (non-blank strings)")
        object.__setattr__(self, "bad_words", tuple(words))
        if self.bad_words_token_ids is not None:
            seqs = self.bad_words_token_ids
            if not isinstance(seqs, (list, tuple)) or not all(
                isinstance(s, (list, tuple)) and s and all(_is_int(t) and t >= 0 for t in s)
                for s in seqs
            ):
                raise bad("bad_words_token_ids", "must be a list of non-empty token id lists")
            object.__setattr__(self, "bad_words_token_ids", tuple(tuple(s) for s in seqs))
        if self.allowed_token_ids is not None:
            allowed = self.allowed_token_ids
            if (
                not isinstance(allowed, (list, tuple))
                or not allowed
                or not all(_is_int(t) and t >= 0 for t in allowed)
            ):
                raise bad("allowed_token_ids", "must be None or a non-empty list of token ids >= 0")
            object.__setattr__(self, "allowed_token_ids", tuple(allowed))

    def _normalise_logit_bias(self) -> None:
        if self.logit_bias is None:
            return
        bias = self.logit_bias
        ok = isinstance(bias, dict) and all(
            _is_int(t) and t >= 0 and _finite_in(v, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
            for t, v in bias.items()
        )
        if not ok:
            allowed = f"must map token ids >= 0 to numbers in [-{MAX_LOGIT_BIAS:g}, "
            raise self._bad("logit_bias", allowed + f"{MAX_LOGIT_BIAS:g}]")
        # A copy: the caller's dict may change after the request was made.
        object.__setattr__(self, "logit_bias", {t: float(v) for t, v in bias.items()} or None)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def candidates(self) -> int:
        """Sequences to generate per prompt: `best_of` when given, else `n`."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def penalized(self) -> bool:
        return (
            self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1
        )

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids the request names must exist; raises ValueError naming the field."""
        for name, ids in (
            ("stop_token_ids", self.stop_token_ids),
            ("logit_bias", tuple(self.logit_bias or ())),
            ("allowed_token_ids", self.allowed_token_ids or ()),
            ("bad_words", tuple(t for s in self.bad_words_token_ids or () for t in s)),
        ):
            outside = [t for t in ids if t >= vocab_size]
            if outside:
                raise ValueError(
                    f"{name}: token id {outside[0]} is outside the vocabulary [0, {vocab_size})"
                )


def with_bad_words_token_ids(params: SamplingParams, tokenizer: Any) -> SamplingParams:
    """`params` with its bad words' token ids, as vLLM tokenizes them: each word as given
    (leading space stripped) and, where the tokenizer makes it a different first token of the
    same length, with one leading space, so that the word is banned at the start of the text and
    after a space. Unchanged when it has no bad words or its ids are already there."""
    if not params.bad_words or params.bad_words_token_ids is not None:
        return params
    ids: list[list[int]] = []
    for word in params.bad_words:
        try:
            plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        except Exception as e:  # a model without a tokenizer: bad words need text
            raise ValueError(f"bad_words: cannot be tokenized here ({e})") from None
        ids.append(plain)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            ids.append(spaced)
    return replace(params, bad_words_token_ids=tuple(tuple(s) for s in ids if s))


def candidate_params(params: SamplingParams) -> list[SamplingParams]:
    """One SamplingParams per engine sequence of a prompt: `n`, or `best_of` candidates. With a
    seed, candidate i gets seed + i (wrapped into int64), so that candidates differ yet the set
    is reproducible. best_of ranks by cumulative logprob, so its candidates are generated with
    the sampled token's logprob."""
    count = params.candidates
    one = replace(params, n=1, best_of=None)
    if count > params.n and one.logprobs is None:
        one = replace(one, logprobs=0)
    if one.seed is None or count == 1:
        return [one] * count
    span = SEED_MAX - SEED_MIN + 1
    return [replace(one, seed=(one.seed + i - SEED_MIN) % span + SEED_MIN) for i in range(count)]
