"""`EngineView`: everything the HTTP side needs from the engine it serves, in one place.

The routes, the server state and the request conversion read this, never the offline `LLM`:
serve.py builds one from each LLM it starts (a restart builds a new LLM, and with it a new view),
so that what the server depends on is this short list and not the LLM's attributes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from afdserve.frontend.client import EngineClient
from afdserve.server.responses import TokenText


class Tokenizer(Protocol):
    """What the server calls on a model's tokenizer (a transformers tokenizer, or
    engine/tokenizer.py's TokenIdsOnly for a directory without one)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> str: ...


@dataclass(frozen=True)
class EngineView:
    client: EngineClient  # driven by the engine thread only (engine_loop.py)
    tokenizer: Tokenizer
    served_name: str  # the name clients ask for (--served-model-name, else `root`)
    root: str  # the model's own name: the model card's "root"
    model_dir: str  # holds the tokenizer files the ranks compile grammars from
    max_model_len: int
    vocab_size: int
    # SamplingParams field -> the value a request that leaves it out gets (--generation-config)
    defaults: Mapping[str, Any] = field(default_factory=dict)
    aliases: tuple[str, ...] = ()  # --served-model-name's further names, accepted as well

    def encode(self, prompt: str | list[int]) -> list[int]:
        """A prompt's token ids, without the tokenizer's special tokens (as the offline API
        encodes them: chat templates write their own)."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        return list(prompt)

    @property
    def names(self) -> TokenText:
        return TokenText(self.tokenizer)

    def token_names(self, as_token_ids: bool | None) -> TokenText:
        """How logprobs name tokens: by text, or "token_id:N" (return_tokens_as_token_ids)."""
        return TokenText(self.tokenizer, as_token_ids=bool(as_token_ids))
