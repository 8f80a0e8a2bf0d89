"""generation_config.json as vLLM applies it offline: `LLM(generation_config="auto")` takes
temperature, top_p, top_k, min_p, repetition_penalty and max_new_tokens from the model directory
as the SamplingParams `generate` uses when given none; "vllm" ignores the file; a directory
replaces the model's. The oracle is the same request with those SamplingParams spelled out."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from afdserve import LLM, SamplingParams
from afdserve.frontend.generation_config import generation_defaults
from afdserve.model.fixtures.bundled import resolve_model

PROMPTS = ["Hello, world", [5, 6, 7]]
FILE = {
    "temperature": 0.0,
    "top_k": 5,
    "max_new_tokens": 3,
    "do_sample": False,
    "top_p": None,
    "eos_token_id": 1,
}
FROM_FILE = SamplingParams(temperature=0.0, top_k=5, max_tokens=3)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("generation") / "model"
    shutil.copytree(resolve_model(None), path)
    (path / "generation_config.json").write_text(json.dumps(FILE))
    return path


def generated(llm: LLM, params: SamplingParams | None) -> list[list[int]]:
    return [out.token_ids for out in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_auto_applies_the_models_file_when_no_params_are_given(model_dir: Path) -> None:
    with LLM(str(model_dir)) as llm:
        assert llm.get_default_sampling_params() == FROM_FILE
        assert generated(llm, None) == generated(llm, FROM_FILE)
        assert all(len(ids) <= 3 for ids in generated(llm, None))
        # Given SamplingParams are used as they are, as in vLLM.
        explicit = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        assert [len(ids) for ids in generated(llm, explicit)] == [6, 6]
        chat = llm.chat([{"role": "user", "content": "hi"}], use_tqdm=False)[0]
        assert len(chat.token_ids) <= 3


def test_vllm_ignores_the_file_and_a_directory_replaces_it(model_dir: Path) -> None:
    with LLM(str(model_dir), generation_config="vllm") as llm:
        assert llm.get_default_sampling_params() == SamplingParams()
    with LLM(generation_config=str(model_dir)) as llm:  # the bundled model, this file
        assert llm.get_default_sampling_params() == FROM_FILE
        assert generated(llm, None) == generated(llm, FROM_FILE)
    with LLM() as llm:  # the bundled model's own file sets none of the fields
        assert llm.get_default_sampling_params() == SamplingParams()


def test_a_bad_source_is_named_before_anything_starts(tmp_path: Path, model_dir: Path) -> None:
    with pytest.raises(ValueError, match="generation_config='nowhere': no generation_config"):
        LLM(generation_config="nowhere")
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 0}))
    with pytest.raises(ValueError, match=r"generation_config\.json: SamplingParams\.top_p=0"):
        LLM(generation_config=str(tmp_path))
    assert generation_defaults("auto", tmp_path / "empty") == {}
    assert generation_defaults("auto", model_dir) == {
        "temperature": 0.0,
        "top_k": 5,
        "max_tokens": 3,
    }
