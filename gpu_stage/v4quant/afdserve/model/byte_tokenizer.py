"""A byte-level tokenizer for tiny test checkpoints.

Token id ``b`` (0..255) is the raw byte ``b``, so any UTF-8 string encodes to its bytes and decodes
back exactly, and a test can predict token ids without running the tokenizer. A handful of special
tokens follow the bytes. The files written here load with ``transformers.AutoTokenizer``.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

NUM_BYTE_TOKENS = 256
BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
PAD_TOKEN = "<|pad|>"
TURN_START_TOKEN = "<|im_start|>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, TURN_START_TOKEN)

BOS_ID = NUM_BYTE_TOKENS + SPECIAL_TOKENS.index(BOS_TOKEN)
EOS_ID = NUM_BYTE_TOKENS + SPECIAL_TOKENS.index(EOS_TOKEN)
PAD_ID = NUM_BYTE_TOKENS + SPECIAL_TOKENS.index(PAD_TOKEN)
TURN_START_ID = NUM_BYTE_TOKENS + SPECIAL_TOKENS.index(TURN_START_TOKEN)
VOCAB_SIZE = NUM_BYTE_TOKENS + len(SPECIAL_TOKENS)

# One turn is "<|im_start|>{role}\n{content}<|eos|>\n". Ending a turn with the eos token keeps a
# single stop id for the engine; the generation prompt opens an assistant turn.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def byte_symbols() -> list[str]:
    """The printable stand-in the ByteLevel pre-tokenizer uses for each byte, indexed by byte.

    Bytes that are already visible, non-space characters stand for themselves; every other byte
    borrows the next unused code point from 256 upwards, in byte order.
    """
    visible = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    visible_set = set(visible)
    symbols: list[str] = []
    borrowed = 0
    for byte in range(NUM_BYTE_TOKENS):
        if byte in visible_set:
            symbols.append(chr(byte))
        else:
            symbols.append(chr(NUM_BYTE_TOKENS + borrowed))
            borrowed += 1
    return symbols


def build_tokenizer() -> Tokenizer:
    """The in-memory `tokenizers.Tokenizer`: one token per byte plus the special tokens."""
    vocab = {symbol: byte for byte, symbol in enumerate(byte_symbols())}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # No prefix space and no regex split: the text maps byte for byte onto tokens.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(token, special=True) for token in SPECIAL_TOKENS])
    if tokenizer.get_vocab_size(with_added_tokens=True) != VOCAB_SIZE:
        raise RuntimeError(
            f"byte tokenizer has {tokenizer.get_vocab_size(with_added_tokens=True)} tokens, "
            f"expected {VOCAB_SIZE}"
        )
    return tokenizer


def build_byte_tokenizer(out_dir: str | Path) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into `out_dir`.

    The chat template lives in tokenizer_config.json (`chat_template`), where both transformers
    and simple loaders find it.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    build_tokenizer().save(str(out_dir / "tokenizer.json"))
    added_tokens = {
        str(NUM_BYTE_TOKENS + offset): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for offset, token in enumerate(SPECIAL_TOKENS)
    }
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added_tokens,
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "additional_special_tokens": [TURN_START_TOKEN],
        "add_bos_token": False,
        "add_eos_token": False,
        # Byte round-trips must be exact: no space clean-up on decode.
        "clean_up_tokenization_spaces": False,
        "model_max_length": 512,
        "chat_template": CHAT_TEMPLATE,
    }
    special_tokens_map = {
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "additional_special_tokens": [TURN_START_TOKEN],
    }
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config)
    _write_json(out_dir / "special_tokens_map.json", special_tokens_map)


def _write_json(path: Path, payload: dict[str, object]) -> None:
    path.write_text(json.dumps(payload, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
