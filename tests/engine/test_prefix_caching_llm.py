"""Prefix caching through the offline API on one process: what it changes (cached tokens, the
counters) and what it must not (tokens, under n > 1, seeds, stop strings, structured output,
preemption), with caching off as the oracle; DeepSeek-V4 refuses it by name at block sizes that
end inside its compressor windows (tests/engine/test_deepseek_v4_prefix_caching.py runs it)."""

from __future__ import annotations

import logging

import pytest

from afdserve import LLM, SamplingParams, StructuredOutputsParams
from afdserve.config import EngineConfig
from afdserve.engine.factory import prefix_caching_for
from afdserve.model.families import load_model_config

SYSTEM = "You are a helpful assistant. Answer briefly and politely. "
QUESTIONS = ["What is a cat?", "Name a colour.", "Count to three.", "Say hello."]


def run(enable: bool, **params: object) -> list:
    # A cache of 24 blocks of 4 tokens, chunks of 16: requests are preempted and prefixes evicted.
    with LLM(
        enable_prefix_caching=enable, block_size=4, kv_cache_blocks=24, max_num_batched_tokens=16
    ) as llm:
        assert llm.prefix_caching is enable
        sampling = SamplingParams(**{"max_tokens": 12, **params})
        prompts = [SYSTEM + q for q in QUESTIONS]
        outs = llm.generate(prompts, sampling, use_tqdm=False)
        outs += llm.generate(prompts, sampling, use_tqdm=False)  # meets its own prefixes
        stats = llm.engine.stats()
        assert llm.engine.core_client.core.scheduler.num_preemptions > 0  # the cache is tiny
    return [[(c.text, c.token_ids, c.finish_reason) for c in o.outputs] for o in outs], outs, stats


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 0.0, "ignore_eos": True},
        {"temperature": 1.0, "seed": 7, "n": 2, "stop": ["e"]},
        {"temperature": 1.0, "seed": 3, "n": 3, "best_of": 4, "logprobs": 2},
    ],
    ids=["greedy", "n2-seed-stop", "best_of"],
)
def test_caching_changes_no_token(params) -> None:
    want, plain, plain_stats = run(False, **params)
    got, cached, stats = run(True, **params)
    assert got == want
    assert all(o.num_cached_tokens == 0 for o in plain)
    assert sum(plain_stats.prefix_cache_queries.values()) == 0
    # The second round finds at least the system prompt's full blocks.
    prompt_len = len(cached[0].prompt_token_ids)
    assert all(o.num_cached_tokens >= 4 for o in cached[len(QUESTIONS) :]), prompt_len
    assert 0 < stats.prefix_cache_hits[0] <= stats.prefix_cache_queries[0]


def test_structured_output_with_caching() -> None:
    pytest.importorskip("llguidance")
    structured = StructuredOutputsParams(choice=["yes", "no", "maybe"])
    want, _, _ = run(False, temperature=1.0, seed=1, n=2, structured_outputs=structured)
    got, _, _ = run(True, temperature=1.0, seed=1, n=2, structured_outputs=structured)
    assert got == want
    assert all(text in ("yes", "no", "maybe") for row in got for text, _, _ in row)


def test_deepseek_v4_refuses_the_flag_and_defaults_off(tmp_path, caplog) -> None:
    """At a block size that is not a multiple of its compress rates (the tiny V4's: 2 and 4)."""
    from afdserve.model.fixtures.deepseek_v4 import make_tiny_v4

    model = str(make_tiny_v4(tmp_path / "v4"))
    with pytest.raises(
        ValueError,
        match="enable_prefix_caching=True is not supported for deepseek_v4: block_size=6 is "
        r"not a multiple of every compress rate \(CSA 2, HCA 4\)",
    ):
        LLM(model, enable_prefix_caching=True, block_size=6)
    config = load_model_config(model)
    with caplog.at_level(logging.INFO, logger="afdserve.engine.factory"):
        assert prefix_caching_for(EngineConfig(model=model, block_size=6), config) is False
    assert "prefix caching is off for deepseek_v4" in caplog.text
    off = EngineConfig(model=model, enable_prefix_caching=False)
    assert prefix_caching_for(off, config) is False
    with LLM(model, dtype="float32", block_size=6) as llm:  # the default: runs, without caching
        assert llm.prefix_caching is False
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        outs = llm.generate([[5, 6, 7, 8] * 6] * 2, params, use_tqdm=False)
    assert [(len(o.token_ids), o.num_cached_tokens) for o in outs] == [(2, 0), (2, 0)]


def test_auto_block_size_turns_deepseek_v4_caching_on(tmp_path, caplog) -> None:
    """block_size "auto": the default 16 where it lets blocks be reused (every family but V4 at
    rates above 16), else the smallest multiple of 16 that does (V4-Flash: its HCA rate 128);
    16 with caching turned off or where no size can (a recurrent state); a size given stays."""
    from afdserve.engine.factory import block_size_for
    from afdserve.model.fixtures.deepseek_v4 import make_tiny_v4
    from afdserve.model.presets import write_preset_config

    flash = str(write_preset_config("deepseek-v4-flash:4", tmp_path / "flash"))
    config = load_model_config(flash)
    assert block_size_for(EngineConfig(model=flash), config) == 128
    assert prefix_caching_for(EngineConfig(model=flash), config) is True
    off = EngineConfig(model=flash, enable_prefix_caching=False)
    assert block_size_for(off, config) == 16
    given = EngineConfig(model=flash, block_size=16)
    assert block_size_for(given, config) == 16
    with caplog.at_level(logging.INFO, logger="afdserve.engine.factory"):
        assert prefix_caching_for(given, config) is False
    assert "use a block_size that is a multiple of 128" in caplog.text
    rates = {"compressed_sparse_attention": 2, "heavily_compressed_attention": 24}
    model = str(make_tiny_v4(tmp_path / "v4", compress_rates=rates))
    with LLM(model, dtype="float32", kv_cache_blocks=16) as llm:
        assert llm.prefix_caching is True
        assert llm.engine_config.block_size == 48
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        outs = llm.generate([[5, 6, 7, 8] * 13] * 2, params, use_tqdm=False)
        outs += llm.generate([[5, 6, 7, 8] * 13], params, use_tqdm=False)
    assert [o.num_cached_tokens for o in outs] == [0, 0, 48]  # the first two in one step
    assert outs[0].token_ids == outs[2].token_ids


def test_flags_reach_the_configs() -> None:
    from afdserve.cli import build_parser, llm_kwargs
    from afdserve.config import engine_configs

    def configs(*flags: str):
        kwargs = llm_kwargs(build_parser().parse_args(["serve", *flags]))
        kwargs = {
            k: v for k, v in kwargs.items() if k not in ("frontend_address", "generation_config")
        }
        return engine_configs({**kwargs, "model": "unchecked"})

    default = configs()
    assert default.engine.enable_prefix_caching is None  # on, where the model allows
    assert default.afd.routing_policy == "prefix"
    off = configs("--no-enable-prefix-caching", "--routing-policy", "least-tokens")
    assert off.engine.enable_prefix_caching is False and off.afd.routing_policy == "least-tokens"
    assert configs("--enable-prefix-caching").engine.enable_prefix_caching is True
    with pytest.raises(ValueError, match="routing_policy='random'"):
        engine_configs({"model": "m", "routing_policy": "random"})
