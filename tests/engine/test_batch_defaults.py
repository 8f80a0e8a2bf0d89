"""What max_num_seqs and max_num_batched_tokens "auto" become, by device and usage, against
vLLM's table (EngineArgs.get_batch_defaults), and the capture ladder that follows them."""

from __future__ import annotations

import pytest

from afdserve.config import EngineConfig, batch_defaults, default_capture_sizes
from afdserve.llm import LLM

GIB = 1 << 30


@pytest.mark.parametrize(
    ("device", "gpu_bytes", "name", "server", "offline"),
    [
        ("cpu", 0, "", (64, 2048), (64, 2048)),  # the CPU keeps small steps
        ("cuda", 141 * GIB, "NVIDIA H200", (1024, 8192), (1024, 16384)),
        ("cuda:1", 80 * GIB, "NVIDIA H100 80GB HBM3", (1024, 8192), (1024, 16384)),
        ("cuda", 80 * GIB, "NVIDIA A100-SXM4-80GB", (256, 2048), (256, 8192)),
        ("cuda", 24 * GIB, "NVIDIA L4", (256, 2048), (256, 8192)),
    ],
)
def test_batch_defaults_follow_the_device(device, gpu_bytes, name, server, offline) -> None:
    assert batch_defaults(device, "server", gpu_bytes, name) == server
    assert batch_defaults(device, "llm", gpu_bytes, name) == offline


def test_given_limits_stay_and_a_defaulted_budget_fits_the_sequences() -> None:
    given = EngineConfig("m", max_num_seqs=8, max_num_batched_tokens=100)
    assert given.with_batch_defaults("server", "cuda", 141 * GIB, "H200") == given
    half = EngineConfig("m", max_num_seqs=8).with_batch_defaults("llm", "cuda", 141 * GIB, "H200")
    assert (half.max_num_seqs, half.max_num_batched_tokens) == (8, 16384)
    # No more tokens than max_num_seqs sequences of max_model_len could use, as in vLLM.
    short = EngineConfig("m", max_model_len=4).with_batch_defaults("llm", "cpu")
    assert (short.max_num_seqs, short.max_num_batched_tokens) == (64, 256)
    with pytest.raises(ValueError, match="usage='batch': one of \\('llm', 'server'\\)"):
        EngineConfig("m").with_batch_defaults("batch", "cpu")


def test_the_offline_engine_on_cpu_resolves_auto_to_the_small_limits() -> None:
    with LLM(device="cpu", dtype="float32") as llm:
        assert llm.engine_config.max_num_seqs == 64
        assert llm.engine_config.max_num_batched_tokens == 2048
    with LLM(device="cpu", dtype="float32", max_num_seqs=3, usage_context="server") as llm:
        assert llm.engine_config.max_num_seqs == 3
        assert llm.engine_config.max_num_batched_tokens == 2048
        assert llm.engine.core_client.limits is not None


def test_capture_ladder_stops_at_512_and_steps_by_16_past_256() -> None:
    assert default_capture_sizes(64) == (1, 2, 4, *range(8, 65, 8))
    big = default_capture_sizes(1024)
    assert big[-1] == 512 and big[:3] == (1, 2, 4)
    assert [s for s in big if s > 256] == list(range(272, 513, 16))
    assert [s for s in big if 8 <= s <= 256] == list(range(8, 257, 8))
    assert default_capture_sizes(300) == (*default_capture_sizes(256), 272, 288, 300)
