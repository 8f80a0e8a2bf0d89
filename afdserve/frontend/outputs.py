"""The engine's outputs: a `SequenceOutput` per engine sequence (what the frontend's output
processor builds from the core's token deltas, step by step), and the offline API's results in
vLLM's shape: a `RequestOutput` per prompt holding one `CompletionOutput` per choice
(`out.outputs[0].text`). `n` choices and `best_of` candidates are several engine sequences
gathered here.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SequenceOutput:
    """One engine sequence so far, as the frontend's output processor sees it after a step."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # every generated token so far
    text: str  # every generated character so far (stop string excluded)
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    logprobs: list[dict[int, float] | None] = field(default_factory=list)
    # SamplingParams.prompt_logprobs: None for the first prompt token, then an entry each.
    prompt_logprobs: list[dict[int, float] | None] = field(default_factory=list)
    # time.monotonic() of the engine core's process: compare them with each other, not across
    # hosts.
    arrival_time: float = 0.0  # the engine accepted the request
    first_scheduled_time: float | None = None  # the first step that computes any of its tokens
    first_token_time: float | None = None
    # Prompt tokens the engine found in its prefix cache (None until the core admitted it).
    num_cached_tokens: int | None = None
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    @property
    def queue_time(self) -> float | None:
        """Seconds in the scheduler's waiting queue before its first step (vLLM's queue time)."""
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, float]] | None  # per token: {token id: logprob}; None if not asked
    finish_reason: str | None  # "stop", "length" or "abort"
    # vLLM's: the stop string or stop token id that ended the choice; None for EOS and length.
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class RequestMetrics:
    """vLLM's RequestOutput.metrics: the engine core's times (time.monotonic() of the rank that
    ran the prompt; compare them with each other), of the earliest candidate."""

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    num_generation_tokens: int  # every candidate's

    @property
    def time_in_queue(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    # The engine's clock (time.monotonic() of the rank that ran the prompt), earliest candidate.
    arrival_time: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    # Prompt tokens found in the prefix cache, as vLLM's RequestOutput has them: the first
    # candidate's, whose prompt `prompt_token_ids` is.
    num_cached_tokens: int | None = None
    candidates: list[SequenceOutput] = field(default_factory=list, repr=False)
    # None unless SamplingParams.prompt_logprobs: per prompt token {token id: Logprob}, the
    # first None (vLLM's shape).
    prompt_logprobs: list[dict[int, float] | None] | None = None

    # The first choice's fields, as the flat output of afdserve 0.1 had them.
    @property
    def metrics(self) -> RequestMetrics:
        return RequestMetrics(
            self.arrival_time,
            self.first_scheduled_time,
            self.first_token_time,
            sum(len(c.token_ids) for c in self.candidates),
        )

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> list[dict[int, float]] | None:
        return self.outputs[0].logprobs


def cumulative_logprob(out: SequenceOutput) -> float | None:
    """Sum of the sampled tokens' logprobs (under the model's unmodified distribution), or None
    when the sequence was generated without logprobs."""
    if len(out.logprobs) != len(out.token_ids) or any(e is None for e in out.logprobs):
        return None
    return sum(entry[token] for token, entry in zip(out.token_ids, out.logprobs))  # type: ignore[index]


def best(candidates: list[SequenceOutput], n: int) -> list[int]:
    """Indices of the `n` candidates with the highest cumulative logprob, best first; ties (and
    candidates without logprobs) keep their order."""
    scores = [cumulative_logprob(c) for c in candidates]
    order = sorted(
        range(len(candidates)),
        key=lambda i: -scores[i] if scores[i] is not None else float("inf"),
    )
    return order[:n]


def gather(
    request_id: str,
    prompt: str | None,
    candidates: list[SequenceOutput],
    n: int,
    keep_logprobs: bool,
) -> RequestOutput:
    """One prompt's RequestOutput from its finished candidate sequences (n of best_of)."""
    chosen = best(candidates, n) if len(candidates) > n else list(range(n))
    outputs = [
        CompletionOutput(
            index=i,
            text=candidates[c].text,
            token_ids=candidates[c].token_ids,
            cumulative_logprob=cumulative_logprob(candidates[c]),
            logprobs=list(candidates[c].logprobs) if keep_logprobs else None,  # type: ignore[arg-type]
            finish_reason=candidates[c].finish_reason,
            stop_reason=candidates[c].stop_reason,
        )
        for i, c in enumerate(chosen)
    ]

    def earliest(times: list[float | None]) -> float | None:
        known = [t for t in times if t is not None]
        return min(known) if known else None

    return RequestOutput(
        request_id=request_id,
        prompt=prompt,
        prompt_token_ids=candidates[0].prompt_token_ids,
        outputs=outputs,
        finished=all(c.finished for c in candidates),
        arrival_time=min(c.arrival_time for c in candidates),
        first_scheduled_time=earliest([c.first_scheduled_time for c in candidates]),
        first_token_time=earliest([c.first_token_time for c in candidates]),
        num_cached_tokens=candidates[0].num_cached_tokens,
        candidates=candidates,
        prompt_logprobs=candidates[0].prompt_logprobs or None,
    )
