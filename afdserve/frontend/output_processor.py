"""The frontend's output processor (vLLM's name): turns the engine core's per-step token deltas
into each sequence's cumulative output, once, in the frontend process.

Per request it keeps the prompt ids, an incremental detokenizer, the stop strings and the tokens,
text and logprobs so far. Stop strings are found here, not on the ranks: a request a stop string
ends is reported finished at once, and its id is returned so that the caller aborts it at the core
(which frees its KV blocks). Deltas the core sends for it meanwhile are dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from afdserve.engine.logprobs import Logprob
from afdserve.engine.requests import TokenDelta
from afdserve.engine.sampling_params import SamplingParams
from afdserve.engine.tokenizer import TokenIdsOnly
from afdserve.frontend.detokenizer import IncrementalDetokenizer, find_stop_string
from afdserve.frontend.outputs import SequenceOutput


class DeltaMismatch(RuntimeError):
    """The core's count of a request's tokens disagrees with the deltas received: a lost or
    repeated delta, which would otherwise corrupt the output silently."""


@dataclass
class Progress:
    """One request's output so far. It outlives a failed engine: a resumed request hands it to
    the new engine's processor, so that its text goes on exactly where the client's stream is."""

    prompt_token_ids: list[int]
    detok: IncrementalDetokenizer
    stops: tuple[str, ...]
    min_tokens: int
    include_stop: bool
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float] | None] = field(default_factory=list)
    prompt_logprobs: list[dict[int, float] | None] = field(default_factory=list)
    decode: bool = True  # fill the logprob entries' decoded_token
    stop_token_ids: tuple[int, ...] = ()
    stop_string: str | None = None  # the stop string that ended the text, once found
    emitted_text: int = 0  # how much of the text the caller has been given
    text_limit: int | None = None  # truncation point once a stop string is found


@dataclass(frozen=True)
class Processed:
    outputs: list[SequenceOutput]
    stopped: list[str]  # finished here by a stop string: abort them at the core


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._requests: dict[str, Progress] = {}

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        # detokenize=False: token ids only, the text stays empty (vLLM's field).
        tokenizer = self.tokenizer if params.detokenize else TokenIdsOnly("")
        detok = IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens)
        self._requests[request_id] = Progress(
            list(prompt_token_ids),
            detok,
            tuple(params.stop),
            params.min_tokens,
            params.include_stop_str_in_output,
            decode=params.detokenize,
            stop_token_ids=tuple(params.stop_token_ids),
        )

    def abort(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def take(self, request_id: str) -> Progress | None:
        """Remove a request and return its progress (to resume it on another engine)."""
        return self._requests.pop(request_id, None)

    def adopt(self, request_id: str, progress: Progress) -> None:
        """Go on with a request another processor had: the next delta continues its tokens."""
        self._requests[request_id] = progress

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def process(self, deltas: list[TokenDelta]) -> Processed:
        outputs, stopped = [], []
        for delta in deltas:
            request = self._requests.get(delta.request_id)
            if request is None:
                continue  # aborted, or already finished here by a stop string
            out, stop = self._advance(request, delta)
            outputs.append(out)
            if stop:
                stopped.append(delta.request_id)
            if out.finished:
                del self._requests[delta.request_id]
        return Processed(outputs, stopped)

    def _advance(self, r: Progress, delta: TokenDelta) -> tuple[SequenceOutput, bool]:
        first = len(r.token_ids)
        r.token_ids += delta.new_token_ids
        r.logprobs += [self._named(e, r.decode) for e in delta.new_logprobs]
        r.prompt_logprobs += [self._named(e, r.decode) for e in delta.new_prompt_logprobs]
        if len(r.token_ids) != delta.num_tokens:
            raise DeltaMismatch(
                f"request {delta.request_id!r}: the engine core counts "
                f"{delta.num_tokens} tokens, its deltas add up to "
                f"{len(r.token_ids)}"
            )
        finished, reason = delta.finished, delta.finish_reason
        stopped = self._add_tokens(r, delta)
        if stopped and not finished:
            finished, reason = True, "stop"
        elif stopped and reason == "length":
            # The stop string completed on the last allowed token: the text was cut at the
            # stop string, so that is why it ended.
            reason = "stop"
        text = r.detok.text if r.text_limit is None else r.detok.text[: r.text_limit]
        if not finished and r.stops:
            # Hold back a tail that could still grow into a stop string.
            longest = max(len(s) for s in r.stops)
            text = text[: max(r.emitted_text, len(text) - longest + 1)]
        new_text = text[r.emitted_text :]
        r.emitted_text = len(text)
        out = SequenceOutput(
            request_id=delta.request_id,
            prompt_token_ids=r.prompt_token_ids,
            token_ids=list(r.token_ids),
            text=text,
            new_token_ids=r.token_ids[first:],
            new_text=new_text,
            finished=finished,
            finish_reason=reason,
            logprobs=list(r.logprobs),
            prompt_logprobs=list(r.prompt_logprobs),
            arrival_time=delta.arrival_time,
            first_scheduled_time=delta.first_scheduled_time,
            first_token_time=delta.first_token_time,
            num_cached_tokens=delta.num_cached_tokens,
            stop_reason=self._stop_reason(r, finished, reason),
        )
        return out, stopped and not delta.finished

    @staticmethod
    def _stop_reason(r: Progress, finished: bool, reason: str | None) -> int | str | None:
        """vLLM's stop_reason: the stop string, or the stop token id, that ended the request;
        None for EOS, length and abort."""
        if not finished or reason != "stop":
            return None
        if r.stop_string is not None:
            return r.stop_string
        last = r.token_ids[-1] if r.token_ids else None
        return last if last in r.stop_token_ids else None

    def _named(self, entry: dict | None, decode: bool) -> dict | None:
        """The entry with each token's text as its decoded_token (vLLM's Logprob field)."""
        if entry is None or not decode:
            return entry
        return {
            t: Logprob(v, getattr(v, "rank", None), self.tokenizer.decode([t]))
            for t, v in entry.items()
        }

    def _add_tokens(self, r: Progress, delta: TokenDelta) -> bool:
        """Detokenizes the delta's tokens one at a time (speculative decoding sends several a
        step): a stop string one of them completes ends the output at that token, with its
        logprobs, as when tokens came one a step. Returns whether a stop string completed."""
        new = delta.new_token_ids
        first = len(r.token_ids) - len(new)
        for i, token in enumerate(new):
            r.detok.add(token)
            if i < len(new) - 1 and self._find_stop(r, first + i + 1):
                del r.token_ids[first + i + 1 :]
                del r.logprobs[first + i + 1 :]
                return True
        if delta.finished:
            r.detok.flush()
        return self._find_stop(r, len(r.token_ids))

    @staticmethod
    def _find_stop(r: Progress, num_tokens: int) -> bool:
        """Whether a stop string completed with the output's first `num_tokens` tokens; sets
        the text's truncation point. Stop strings count once min_tokens are out (vLLM's rule),
        like stop tokens do."""
        if not r.stops or r.text_limit is not None or num_tokens < r.min_tokens:
            return False
        text = r.detok.text
        hit = find_stop_string(text, r.stops, r.emitted_text)
        if hit is None:
            return False
        r.text_limit = hit
        r.stop_string = next(stop for stop in r.stops if text.startswith(stop, hit))
        if r.include_stop:
            r.text_limit += len(r.stop_string)
        return True
