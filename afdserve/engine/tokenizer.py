"""The tokenizer of a model directory, or the plain statement that it has none.

A directory without tokenizer files (a config.json written for random-weight benchmarks, see
`afdserve make-config`) gets `TokenIdsOnly`: prompts must be token ids, outputs carry token ids
and empty text, and anything that needs text (a string prompt, a chat, stop strings) is refused
with a message saying why. Falling back to some other tokenizer (the bundled byte-level one) would
turn ids it does not know into wrong or silently dropped text.
"""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger(__name__)

# Any of these makes a directory's tokenizer loadable by transformers' AutoTokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class TokenIdsOnly:
    """Stands in for the tokenizer of a model directory that has none."""

    is_fast = False
    eos_token_id = None

    def __init__(self, model_dir: str) -> None:
        self.model_dir = model_dir

    def _refuse(self, what: str) -> ValueError:
        return ValueError(
            f"{what}: the model directory {self.model_dir} has no tokenizer files (any of "
            f"{', '.join(TOKENIZER_FILES)}); pass prompts as token ids "
            f"(a list of ints, or {{'prompt_token_ids': [...]}}) and no stop strings"
        )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise self._refuse("prompt")

    def apply_chat_template(self, *args, **kwargs) -> str:
        raise self._refuse("chat")

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return ""  # outputs carry token ids only


def has_tokenizer_files(model_dir: str | Path) -> bool:
    return any((Path(model_dir) / name).is_file() for name in TOKENIZER_FILES)


def load_tokenizer(model_dir: str, trust_remote_code: bool = False):
    """`trust_remote_code`: transformers' own flag, for a tokenizer with Python code of its own
    (EngineConfig.trust_remote_code)."""
    if not has_tokenizer_files(model_dir):
        log.warning(
            "%s has no tokenizer files: prompts must be token ids, and outputs carry "
            "token ids with empty text",
            model_dir,
        )
        return TokenIdsOnly(model_dir)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
