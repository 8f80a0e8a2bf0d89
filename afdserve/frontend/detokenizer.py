"""Incremental detokenization and stop-string search.

Tokens do not map to text one by one: a byte-level token can hold part of a UTF-8 character, and
some tokenizers render a token differently depending on what precedes it (a leading space).
So text is produced by decoding a short window of tokens twice, with and without the newest ones,
and emitting the difference once it no longer ends in U+FFFD, the replacement character a decoder
yields for an incomplete UTF-8 sequence.

Where the tokenizer is a fast one (a `tokenizers.Tokenizer`, or a transformers tokenizer backed
by one), the `tokenizers` library's own `DecodeStream` does that window bookkeeping in Rust, with
one decode per token instead of two. Other tokenizers take the Python window below.
"""

from __future__ import annotations

from typing import Any, Protocol

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded ahead of the first output token, so that the first output token is
# rendered in context (e.g. keeps its leading space) rather than as the start of a text.
PROMPT_CONTEXT_TOKENS = 5


class Tokenizer(Protocol):
    """What both `tokenizers.Tokenizer` and Hugging Face `transformers` tokenizers provide."""

    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


def fast_backend(tokenizer: Any) -> Any | None:
    """The `tokenizers.Tokenizer` that decodes exactly as `tokenizer.decode` does, or None.
    transformers' clean-up of tokenization spaces happens after the backend's decode, so a
    tokenizer that cleans up takes the Python window."""
    try:
        from tokenizers import Tokenizer as FastTokenizer
    except ImportError:
        return None
    if isinstance(tokenizer, FastTokenizer):
        return tokenizer
    backend = (
        getattr(tokenizer, "backend_tokenizer", None)
        if getattr(tokenizer, "is_fast", False)
        else None
    )
    if isinstance(backend, FastTokenizer) and not getattr(
        tokenizer, "clean_up_tokenization_spaces", False
    ):
        return backend
    return None


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        # A prompt that ends inside a character would leave a U+FFFD in the emitted context that
        # the output can never complete; the context only serves rendering, so drop its last
        # tokens until it ends on a character boundary.
        while context and self._decode(context).endswith(REPLACEMENT_CHAR):
            context.pop()
        self._ids: list[int] = context
        # Window: `_ids[_prefix_offset:_read_offset]` is text already emitted, kept as context;
        # `_ids[_read_offset:]` is held back.
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._text = ""
        self._backend = fast_backend(tokenizer)
        self._stream = None
        if self._backend is not None:
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)

    @property
    def uses_decode_stream(self) -> bool:
        return self._stream is not None

    @property
    def text(self) -> str:
        """All output text emitted so far."""
        return self._text

    def add(self, token_id: int) -> str:
        """Append one output token; return the text that became stable with it (may be "")."""
        self._ids.append(token_id)
        if self._stream is not None:
            delta = self._stream.step(self._backend, token_id)
            if not delta:
                return ""
            # The stream keeps its own window; ours only serves flush().
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            self._text += delta
            return delta
        emitted = self._decode(self._ids[self._prefix_offset : self._read_offset])
        window = self._decode(self._ids[self._prefix_offset :])
        if len(window) <= len(emitted) or window.endswith(REPLACEMENT_CHAR):
            return ""
        delta = window[len(emitted) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._text += delta
        return delta

    def flush(self) -> str:
        """At finish: release held-back text, incomplete characters included (as U+FFFD)."""
        emitted = self._decode(self._ids[self._prefix_offset : self._read_offset])
        window = self._decode(self._ids[self._prefix_offset :])
        delta = window[len(emitted) :]
        self._prefix_offset = self._read_offset = len(self._ids)
        self._text += delta
        return delta

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)


def find_stop_string(text: str, stops: tuple[str, ...], start: int) -> int | None:
    """Index in `text` where the earliest stop string begins, or None.

    `start` is how much of `text` was already searched: a match must end after it, so the search
    begins `longest stop - 1` characters earlier. The caller truncates the output at the returned
    index (the stop string itself is not part of the output, as in OpenAI's API)."""
    if not stops:
        return None
    begin = max(0, start - max(len(stop) for stop in stops) + 1)
    found = [index for index in (text.find(stop, begin) for stop in stops) if index >= 0]
    return min(found) if found else None
