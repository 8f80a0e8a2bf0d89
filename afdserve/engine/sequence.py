"""One request as the engine sees it: its tokens, how many of them have KV in the cache, and
the blocks that hold that KV."""

from __future__ import annotations

import enum

import torch

from afdserve.engine.requests import RequestError
from afdserve.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


class Sequence:
    """`token_ids` holds the prompt followed by every generated token. Positions
    `[0, num_computed_tokens)` have KV in the cache; the rest still has to run through the model.
    Preemption by recompute only resets `num_computed_tokens`: generated tokens are kept and are
    simply recomputed like prompt tokens."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        eos_token_id: int | None,
        output_token_ids: list[int] | tuple[int, ...] = (),
    ) -> None:
        """`output_token_ids`: tokens generated before, elsewhere (a request resumed after its
        engine failed). They are recomputed like prompt tokens, and the seeded generator is moved
        past their draws, so that the sequence goes on exactly as if it had never moved."""
        if not prompt_token_ids:
            raise ValueError(f"Sequence {request_id!r}: prompt_token_ids must not be empty")
        self.request_id = request_id
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        # The windowed layers' table (engine/block_manager.py): same indices, its own pool; the
        # entries before `window_first` are released behind the window (the null block).
        self.window_table: list[int] = []
        self.window_first = 0
        # The slot of the cache's per-sequence state while it runs (engine/block_manager.py);
        # None without one.
        self.state_slot: int | None = None
        # Prefix caching (engine/block_manager.py): the chained hashes of the full blocks of
        # `token_ids` known so far, how many blocks of `block_table` are registered under theirs,
        # and the prompt tokens the first admission found cached (None until admitted).
        self.block_hashes: list[bytes] = []
        self.num_registered_blocks = 0
        self.num_cached_tokens: int | None = None
        self.params = params
        self.eos_token_id = eos_token_id
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        # A private CPU generator per seeded request makes its draws depend only on its own
        # history, never on which other requests share the batch.
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator(device="cpu")
            self.generator.manual_seed(params.seed)
        self.token_ids.extend(output_token_ids)
        if self.generator is not None and not params.greedy:
            skip_draws(self.generator, len(output_token_ids))
        self.output_logprobs: list[dict[int, float] | None] = []
        # Prompt logprobs: None for the first prompt token (nothing predicts it), then one entry
        # per prompt token as the prefill reaches the position before it; never recomputed
        # after a preemption (`prompt_logprobs_done`).
        self.prompt_logprobs: list[dict[int, float] | None] = (
            [None] if params.prompt_logprobs is not None else []
        )
        self.grammar = None  # a structured.GrammarState for a constrained sequence
        self.draft_lookup = None  # speculative.TokenArray: token_ids for the n-gram lookup
        # MTP (engine/mtp.py): (the position they follow, the drafts) proposed after a step.
        self.mtp_drafts: tuple[int, tuple[int, ...]] | None = None
        if params.structured_outputs is not None:
            self.grammar = _grammar_state(request_id, params)

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, status={self.status.name}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
            f"blocks={len(self.block_table)})"
        )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def prompt_logprobs_done(self) -> int:
        """Prompt positions whose prediction of the next prompt token is in prompt_logprobs."""
        return max(len(self.prompt_logprobs) - 1, 0)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED


def skip_draws(generator: torch.Generator, count: int) -> None:
    """Advance a seeded sequence's generator past `count` tokens. The sampler draws exactly one
    float64 uniform per sampled token of a non-greedy sequence (sampler._draw), so the k-th output
    token's randomness is the k-th draw of the stream `seed` starts: a function of the seed and
    the position alone, which a resumed sequence reproduces by skipping the draws it made."""
    for _ in range(count):
        torch.rand((), generator=generator, dtype=torch.float64)


def _grammar_state(request_id: str, params: SamplingParams):
    """Built with the sequence, so that a grammar this rank cannot run (llguidance missing, no
    tokenizer at the path) refuses this one request instead of failing a step of all of them."""
    from afdserve.engine.structured import GrammarState

    try:
        return GrammarState(params.structured_outputs)
    except Exception as e:
        message = f"structured_outputs: this rank cannot run the grammar: {type(e).__name__}: {e}"
        raise RequestError(message, request_id) from None
