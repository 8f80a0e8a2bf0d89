from __future__ import annotations

from pathlib import Path

import pytest

from afdserve import LLM, SamplingParams
from afdserve.model.fixtures.tiny import make_tiny_model

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="session")
def afd_models(tmp_path_factory) -> dict[str, Path]:
    """One tiny checkpoint per family, each with a hash-routed layer."""
    root = tmp_path_factory.mktemp("afd-models")
    return {
        family: make_tiny_model(root / family, family, hash_layers=1, seed=3)
        for family in ("qwen3_moe", "deepseek_v2", "deepseek_v3", "mixtral")
    }


def mixed_prompts() -> list[list[int]]:
    """Uneven loads: a long prompt (chunked prefill under a small budget) beside short ones."""
    long = [(7 * i + 3) % 250 for i in range(70)]
    return [long, [5, 6, 7], [42] * 9, [100, 3, 4, 200], [9], [17, 18, 19, 20, 21, 22]]


_REFERENCE: dict[tuple, list[list[int]]] = {}


def colocated_tokens(model: Path, prompts, params=GREEDY, **kwargs) -> list[list[int]]:
    key = (str(model), repr(prompts), repr(params), repr(sorted(kwargs.items())))
    if key not in _REFERENCE:
        with LLM(str(model), dtype="float32", **kwargs) as llm:
            _REFERENCE[key] = [o.token_ids for o in llm.generate(prompts, params)]
    return _REFERENCE[key]
