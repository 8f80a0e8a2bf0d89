"""Sampling defaults from a model's generation_config.json, read as vLLM reads them.

One reader for both users: the offline API's `LLM(generation_config=...)` (its
`get_default_sampling_params()`, used when `generate` gets no SamplingParams) and the server's
`--generation-config` (defaults of the fields a request leaves out). Sources, as in vLLM:
"auto" reads the model directory's file if it has one, "vllm" reads none, anything else is a
directory that must hold one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from afdserve.engine.sampling_params import SamplingParams

# generation_config.json key -> SamplingParams field (which is also the request field): the keys
# vLLM takes as defaults. Anything else in the file (do_sample, eos_token_id, ...) is not one.
GENERATION_CONFIG_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
NAMED_SOURCES = ("auto", "vllm")


def generation_defaults(source: str, model_dir: str | Path) -> dict[str, Any]:
    """SamplingParams field -> default. Raises ValueError, naming the source or the file, for a
    directory without the file or a value SamplingParams refuses, so that a bad file stops the
    start rather than every request."""
    if source == "vllm":
        return {}
    path = Path(model_dir if source == "auto" else source) / "generation_config.json"
    if not path.is_file():
        if source == "auto":
            return {}
        raise ValueError(f"generation_config={source!r}: no generation_config.json there")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a JSON object")
    # transformers writes unset values as null; they are no default.
    defaults = {
        field: config[key]
        for key, field in GENERATION_CONFIG_FIELDS.items()
        if config.get(key) is not None
    }
    try:
        SamplingParams(**defaults)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    return defaults
