"""On two GPUs: dummy weights give 1A1F (one rank per GPU, NCCL) the colocated greedy tokens,
`bench generate` runs with CUDA graphs, and a 1A1F attention rank, which holds no experts,
allocates more KV cache than a colocated engine under the same gpu_memory_utilization."""

from __future__ import annotations

import gc
import json

import pytest
import torch

from afdserve import LLM, SamplingParams
from afdserve.bench.capacity import CapacityBench, run_capacity_bench
from afdserve.cli import main
from afdserve.model.presets import write_preset_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (one rank per GPU)"),
]


def test_dummy_1a1f_matches_colocated(tmp_path):
    model = str(write_preset_config("tiny", tmp_path / "tiny"))
    prompts = [[(7 * i + j) % 500 for j in range(3 + 5 * i)] for i in range(6)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    tokens = []
    for topology, connector in (("colocated", "auto"), ("1A1F", "p2p")):
        with LLM(
            model,
            topology=topology,
            connector=connector,
            device="cuda",
            dtype="float32",
            load_format="dummy",
            seed=5,
            graph_mode="full_decode_only",
            cuda_graph_sizes=[1, 2, 4, 8],
            max_num_seqs=8,
        ) as llm:
            tokens.append([o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    assert tokens[0] == tokens[1]


def test_generate_bench_1a1f_with_graphs(tmp_path):
    out = tmp_path / "generate.json"
    assert (
        main(
            [
                "bench",
                "generate",
                "--preset",
                "tiny",
                "--load-format",
                "dummy",
                "--topology",
                "1A1F",
                "--batch-sizes",
                "4,8",
                "--input-len",
                "32",
                "--output-len",
                "16",
                "--graph-mode",
                "full_decode_only",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    results = json.loads(out.read_text())["results"]
    assert [r["output_tokens"] for r in results] == [4 * 16, 8 * 16]


def test_attention_rank_has_the_room_of_the_experts(wide_model):
    """Experts of 6.4 GB in bf16 (the wide_model fixture): the attention rank's cache gets most
    of that room. The attention rank's NCCL buffers, the processes' CUDA
    contexts and whatever this test process still holds on GPU 0 (the attention rank sees it as
    used) take a GB or two of it: the cache is emptied first, and the experts are large against
    that blur."""
    gc.collect()
    torch.cuda.empty_cache()
    spec = CapacityBench(
        model_dir=str(wide_model),
        context_len=1024,
        gpu_memory_utilization=0.3,
        load_format="dummy",
        max_num_seqs=64,
    )
    attention, colocated = run_capacity_bench(spec)
    assert (attention.topology, colocated.topology) == ("1A1F", "colocated")
    per_block = colocated.cache_bytes // colocated.num_blocks
    experts = colocated.parameter_bytes - attention.parameter_bytes
    assert experts > 6e9
    assert attention.num_blocks - colocated.num_blocks > 0.5 * experts / per_block
