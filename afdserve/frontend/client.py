"""EngineClient: the frontend, the one interface the offline API and the HTTP server drive,
whatever the topology. It holds an engine core client (token deltas in), the output processor
(detokenizing, stop strings, the cumulative output) and the tokenizer.

Not thread-safe: one thread owns a client (the server funnels requests through its engine thread).
"""

from __future__ import annotations

from typing import Any

from afdserve.engine.requests import RequestError, RequestLimits
from afdserve.engine.sampling_params import SamplingParams, with_bad_words_token_ids
from afdserve.engine.tokenizer import TokenIdsOnly
from afdserve.frontend.core_client import EngineCoreClient, EngineStats
from afdserve.frontend.output_processor import OutputProcessor, Progress
from afdserve.frontend.outputs import SequenceOutput

__all__ = ["EngineClient", "EngineStats"]


class EngineClient:
    def __init__(self, core_client: EngineCoreClient, tokenizer: Any) -> None:
        self.core_client, self.tokenizer = core_client, tokenizer
        self.processor = OutputProcessor(tokenizer)
        self.max_model_len = core_client.max_model_len
        self.vocab_size = core_client.vocab_size

    @property
    def limits(self) -> RequestLimits:
        return self.core_client.limits

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        """Raises RequestError for a request the engine refuses; others are unaffected."""
        if params.stop and isinstance(self.tokenizer, TokenIdsOnly):
            raise RequestError(
                f"stop: {list(params.stop)} needs text, but the model directory "
                f"{self.tokenizer.model_dir} has no tokenizer; use stop_token_ids"
            )
        if params.bad_words:  # tokenized here, the one place with the tokenizer
            try:
                params = with_bad_words_token_ids(params, self.tokenizer)
                params.check_vocab(self.vocab_size)
            except ValueError as e:
                raise RequestError(str(e).removeprefix("SamplingParams.")) from None
        self.core_client.add_request(request_id, prompt_token_ids, params)
        self.processor.add_request(request_id, prompt_token_ids, params)

    def take_progress(self, request_id: str) -> Progress | None:
        """A request's output so far, removed from this client (whose engine failed)."""
        return self.processor.take(request_id)

    def resume_request(self, request_id: str, params: SamplingParams, progress: Progress) -> None:
        """Go on with a request another client's engine failed under: the core recomputes its
        prompt and generated tokens and samples what follows; its text continues from
        `progress`. Raises RequestError like add_request."""
        generated = tuple(progress.token_ids)
        self.core_client.add_request(request_id, progress.prompt_token_ids, params, generated)
        self.processor.adopt(request_id, progress)

    def abort(self, request_id: str) -> None:
        self.processor.abort(request_id)
        self.core_client.abort(request_id)

    def wake(self) -> None:
        """Any thread: work was queued for the stepping thread (EngineCoreClient.wake)."""
        self.core_client.wake()

    def step(self) -> list[SequenceOutput]:
        """Advance the engine; returns the outputs that changed. Returns [] promptly when idle."""
        try:
            deltas = self.core_client.step()
        except RequestError as e:  # a rank refused a request: it will send nothing more for it
            if e.request_id is not None:
                self.processor.abort(e.request_id)
            raise
        processed = self.processor.process(deltas)
        for request_id in processed.stopped:
            self.core_client.abort(request_id)  # a stop string ended it: free its KV blocks
        return processed.outputs

    @property
    def has_unfinished(self) -> bool:
        return self.core_client.has_unfinished

    def stats(self) -> EngineStats:
        return self.core_client.stats()

    def step_log(self) -> list[dict]:
        return self.core_client.step_log()

    def shutdown(self) -> None:
        self.core_client.shutdown()
