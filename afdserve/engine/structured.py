"""Structured output through llguidance (optional: `pip install 'afdserve[structured]'`).

The frontend turns a request's JSON schema, regex or choice into an llguidance grammar and checks
that it compiles. On the attention rank, each constrained sequence owns a matcher that consumes
the tokens it sampled; before every draw the matcher's bitmask removes the tokens the grammar
forbids. When the grammar is complete only EOS is left, so the request stops by EOS.

The rank builds llguidance's view of the tokenizer from `tokenizer_dir` (the model directory,
which every rank reads anyway), once per process.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where it is used: SamplingParams imports this module
    import torch


INSTALL_HINT = "structured output needs llguidance: pip install 'afdserve[structured]'"


def available() -> bool:
    try:
        import llguidance  # noqa: F401
        import llguidance.torch  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of: a JSON schema (`json`, a dict or its JSON text), any JSON object
    (`json_object`), a regular expression, a choice among strings, or a Lark grammar."""

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    # Where the rank finds the tokenizer; the offline API and the server fill it in.
    tokenizer_dir: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.json, dict):
            object.__setattr__(self, "json", json.dumps(self.json))
        if self.choice is not None:
            if not self.choice or not all(isinstance(c, str) for c in self.choice):
                raise ValueError("StructuredOutputsParams.choice: must be a non-empty list of str")
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [
            self.json is not None,
            self.json_object,
            self.regex is not None,
            self.choice is not None,
            self.grammar is not None,
        ]
        if sum(given) != 1:
            raise ValueError(
                "StructuredOutputsParams: give exactly one of json, json_object, regex, choice, "
                "grammar"
            )

    def llguidance_grammar(self) -> str:
        from llguidance import LLMatcher

        # Compact JSON: a small model is not tempted into endless whitespace.
        compact = {"whitespace_flexible": False}
        if self.json is not None:
            return LLMatcher.grammar_from_json_schema(json.loads(self.json), defaults=compact)
        if self.json_object:
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=compact)
        if self.regex is not None:
            return LLMatcher.grammar_from_regex(self.regex)
        if self.choice is not None:
            return LLMatcher.grammar_from_regex("|".join(re.escape(c) for c in self.choice))
        return LLMatcher.grammar_from_lark(self.grammar or "")

    def check(self) -> None:
        """Raises ValueError when llguidance is missing or the grammar does not compile."""
        if not available():
            raise ValueError(INSTALL_HINT)
        from llguidance import LLMatcher

        try:
            error = LLMatcher.validate_grammar(self.llguidance_grammar())
        except Exception as e:  # a schema that is not JSON, a regex llguidance cannot parse
            error = str(e)
        if error:
            raise ValueError(f"the grammar does not compile: {error}")


@functools.lru_cache(maxsize=4)
def _llg_tokenizer(tokenizer_dir: str) -> Any:
    import llguidance.hf
    from transformers import AutoTokenizer

    return llguidance.hf.from_tokenizer(AutoTokenizer.from_pretrained(tokenizer_dir))


class GrammarState:
    """One sequence's matcher, and how many of its output tokens it has consumed (a preempted
    sequence keeps its tokens, so the count stays right across recomputes)."""

    def __init__(self, params: StructuredOutputsParams) -> None:
        import llguidance

        if params.tokenizer_dir is None:
            raise ValueError("StructuredOutputsParams.tokenizer_dir: not set by the frontend")
        self.tokenizer = _llg_tokenizer(params.tokenizer_dir)
        self.matcher = llguidance.LLMatcher(self.tokenizer, params.llguidance_grammar())
        self.consumed = 0

    def allowed(
        self, output_token_ids: list[int], vocab: int, device: torch.device
    ) -> torch.Tensor:
        """[vocab] bool: the tokens the grammar allows next."""
        import llguidance.torch as llg_torch
        import torch

        for token in output_token_ids[self.consumed :]:
            self.matcher.consume_token(token)
        self.consumed = len(output_token_ids)
        bitmask = llg_torch.allocate_token_bitmask(1, self.tokenizer.vocab_size)
        llg_torch.fill_next_token_bitmask(self.matcher, bitmask, 0)
        bits = torch.arange(32, dtype=torch.int32)
        allowed = ((bitmask[0][:, None] >> bits) & 1).bool().flatten()  # [32 * words]
        row = torch.zeros(vocab, dtype=torch.bool)
        n = min(vocab, allowed.numel())
        row[:n] = allowed[:n]
        return row.to(device)
