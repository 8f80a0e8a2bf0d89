"""load_format="dummy" reaches every rank: colocated and multi-process AFD runs of the same model
and seed hold the same weights, so they produce the same greedy tokens; and a model directory with
config.json alone (no weights, no tokenizer) runs on token ids, saying plainly what it cannot do."""

from __future__ import annotations

import pytest

from afdserve import LLM, SamplingParams
from afdserve.engine.requests import RequestError
from afdserve.model.presets import write_preset_config

from .conftest import GREEDY, mixed_prompts


def _tokens(model, prompts, **kwargs) -> list[list[int]]:
    with LLM(str(model), dtype="float32", load_format="dummy", **kwargs) as llm:
        return [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize(("topology", "expert_parallel"), [("1A1F", False), ("1A2F", True)])
def test_dummy_weights_match_across_topologies(afd_models, topology, expert_parallel):
    """deepseek_v3: shared experts, a dense first layer, a correction bias, a hash layer; the
    1A2F world shards the routed experts over two FFN ranks."""
    model, prompts = afd_models["deepseek_v3"], mixed_prompts()
    want = _tokens(model, prompts, seed=11)
    got = _tokens(
        model,
        prompts,
        seed=11,
        topology=topology,
        connector="p2p",
        ffn_expert_parallel=expert_parallel,
        max_num_batched_tokens=16,
    )
    assert got == want
    assert _tokens(model, prompts, seed=12) != want  # the seed reaches the weights
    with LLM(str(model), dtype="float32") as llm:  # ... and dummy is not the checkpoint
        assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] != want


def test_config_only_dir_runs_on_token_ids(tmp_path):
    model = write_preset_config("tiny", tmp_path / "tiny")
    prompts = [[1, 2, 3, 4], [500, 7], [9] * 20]
    want = _tokens(model, prompts, seed=3)
    assert all(len(tokens) == GREEDY.max_tokens for tokens in want)
    assert _tokens(model, prompts, seed=3, topology="1A1F", connector="p2p") == want
    with LLM(str(model), dtype="float32", load_format="dummy", seed=3) as llm:
        out = llm.generate({"prompt_token_ids": prompts[0]}, GREEDY, use_tqdm=False)[0]
        assert out.token_ids == want[0] and out.text == ""
        with pytest.raises(ValueError, match="prompt: the model directory .* has no tokenizer"):
            llm.generate("Hello", GREEDY)
        with pytest.raises(ValueError, match="chat: the model directory .* has no tokenizer"):
            llm.chat([{"role": "user", "content": "Hi"}], GREEDY)
        with pytest.raises(RequestError, match="stop: \\['x'\\] needs text.*stop_token_ids"):
            llm.generate(prompts[0], SamplingParams(max_tokens=4, stop=["x"]))
        stop = want[0][2]
        stopped = llm.generate(
            prompts[0],
            SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=[stop]),
            use_tqdm=False,
        )[0]
        assert stopped.token_ids == want[0][: want[0].index(stop) + 1]
    with pytest.raises(Exception, match="safetensors"):  # load_format="auto" needs weights
        LLM(str(model), dtype="float32")
