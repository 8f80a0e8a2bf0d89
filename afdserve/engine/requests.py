"""What every layer says about a request: the refusal (`RequestError`), the limits a request is
checked against (`RequestLimits`, from the attention ranks' caches) and the check itself, run by
the frontend before routing and again by the rank that takes the request, and what the engine
core says back about it each step (`TokenDelta`)."""

from __future__ import annotations

from dataclasses import dataclass

from afdserve.engine.logprobs import Logprob
from afdserve.engine.sampling_params import SamplingParams


class RequestError(ValueError):
    """A request the engine refuses; the message names the field and what is allowed."""

    def __init__(self, message: str, request_id: str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id


@dataclass(frozen=True)
class RequestLimits:
    max_model_len: int
    vocab_size: int
    num_blocks: int
    block_size: int
    # Blocks a sequence's state slot takes where the slots live in the pool's pages (0: none).
    slot_pages: int = 0


def check_request(prompt: list[int], params: SamplingParams, limits: RequestLimits) -> None:
    """Refuse what can never run, before it reaches a scheduler (so nothing else is disturbed)."""
    if len(prompt) == 0:
        raise RequestError("prompt: must not be empty")
    if len(prompt) >= limits.max_model_len:
        raise RequestError(
            f"prompt: {len(prompt)} tokens, but max_model_len={limits.max_model_len} leaves room "
            f"for at most {limits.max_model_len - 1} prompt tokens"
        )
    # The whole prompt at C speed first (a 1024-token prompt is checked on the step's path, by
    # the frontend and again by its rank); the loop only finds the position to name.
    vocab = limits.vocab_size
    plain = all(type(tok) is int for tok in prompt)  # not bool, not a float or numpy int
    if not (plain and 0 <= min(prompt) and max(prompt) < vocab):
        for i, tok in enumerate(prompt):
            if not isinstance(tok, int) or isinstance(tok, bool) or not 0 <= tok < vocab:
                raise RequestError(
                    f"prompt: token id {tok!r} at position {i} is outside the vocabulary "
                    f"[0, {vocab})"
                )
    longest = min(len(prompt) + params.max_tokens, limits.max_model_len)
    blocks = -(-longest // limits.block_size)
    if blocks + limits.slot_pages > limits.num_blocks:
        slot = f" and its state slot {limits.slot_pages} more" if limits.slot_pages else ""
        raise RequestError(
            f"prompt + max_tokens: {longest} tokens need {blocks} KV blocks{slot}, but the cache "
            f"holds {limits.num_blocks} blocks of {limits.block_size} tokens"
        )


@dataclass(frozen=True)
class TokenDelta:
    """What one step of the engine core added to one request: token ids, no text. An attention
    rank sends these as they are; the frontend's output processor (frontend/output_processor.py)
    detokenizes, applies stop strings and keeps the cumulative output, so that the rank's step
    neither decodes text nor pickles what the frontend already has."""

    request_id: str
    new_token_ids: tuple[int, ...]
    # One entry per new token when the request asked for logprobs, else empty.
    new_logprobs: tuple[dict[int, Logprob] | None, ...]
    finished: bool
    finish_reason: str | None
    num_tokens: int  # generated tokens so far, this step's included: the frontend checks its sum
    # time.monotonic() of the core's process: compare them with each other, not across hosts.
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    # Prompt tokens whose KV the first admission found in the prefix cache (None: not yet
    # admitted). OpenAI's usage.prompt_tokens_details.cached_tokens.
    num_cached_tokens: int | None = None
    # The prompt's logprob entries this step completed (SamplingParams.prompt_logprobs): all of
    # them with the request's first token, the first one None.
    new_prompt_logprobs: tuple[dict[int, Logprob] | None, ...] = ()
