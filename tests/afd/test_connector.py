"""The receiver rejects payloads that differ from the plan; each role holds only its half."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue

import pytest
import torch
from safetensors import safe_open

from afdserve import LLM
from afdserve.afd.dataplane.ffn import check_payload
from afdserve.afd.dataplane.payload import LayoutError
from afdserve.frontend.process import free_port
from afdserve.layout.plan import GraphTable, RankStep, plan_step
from afdserve.layout.topology import Topology


def _ids(step, layer, ubatch, rows, tokens):
    return torch.tensor([step, layer, ubatch, rows, *tokens], dtype=torch.int32)


def _check(hidden_rows=4, ids=None, tile=4):
    check_payload(
        rank=2,
        peer=1,
        step=7,
        layer=3,
        ubatch=1,
        tile_rows=tile,
        hidden=torch.zeros(hidden_rows, 8),
        ids=ids if ids is not None else _ids(7, 3, 1, 4, [1, 2, -1, -1]),
        vocab_size=100,
    )


def test_valid_payload_passes():
    _check()


def test_rows_differ_from_plan():
    with pytest.raises(
        LayoutError,
        match=r"FFN rank 2 from attention rank 1, layer 3, ubatch 1: "
        r"expected 4 hidden rows, got 3",
    ):
        _check(hidden_rows=3)


def test_header_from_another_step_or_layout():
    with pytest.raises(
        LayoutError,
        match=r"expected \(step, layer, ubatch, rows\) = \(7, 3, 1, 4\), "
        r"the peer wrote \(7, 2, 1, 4\)",
    ):
        _check(ids=_ids(7, 2, 1, 4, [1, 2, 3, 4]))


def test_token_id_out_of_range():
    with pytest.raises(LayoutError, match=r"token id 100 at row 2 is outside \[-1, 100\)"):
        _check(ids=_ids(7, 3, 1, 4, [1, 2, 100, -1]))


def _rank(rank: int, port: int, model_dir: str, errors) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank)
    )
    import torch.distributed as dist

    from afdserve.afd.dataplane.connector import AttentionConnector
    from afdserve.afd.dataplane.ffn import FFNExchange
    from afdserve.afd.dataplane.wire import Wire
    from afdserve.engine.factory import half_parts
    from afdserve.model.checkpoint.loader import load_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    plan = plan_step([RankStep(3, 3, True)], Topology(1, 1), GraphTable(), 1)
    cpu = torch.device("cpu")
    try:
        if rank == 0:
            model, _ = load_model(model_dir, half_parts("attention", False), "float32")
            connector = AttentionConnector(model.config, torch.float32, cpu, False, Wire(0))
            connector.begin_step(plan.attention[0], step=5)  # this peer believes it is step 5
            connector.post(
                0, 0, torch.randn(3, model.config.hidden_size), torch.tensor([1, 2, 3]), None
            ).wait()
        else:
            model, _ = load_model(model_dir, half_parts("ffn", False), "float32")
            exchange = FFNExchange(model, 1, False, cpu, Wire(1))
            exchange.step.set(0)
            exchange.run(plan.ffn[0], step=0)
    except LayoutError as e:
        errors.put(str(e))


def test_receiver_rejects_desynchronised_peer_over_gloo(afd_models):
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank, args=(r, port, str(afd_models["qwen3_moe"]), errors))
        for r in range(2)
    ]
    for p in procs:
        p.start()
    try:
        message = errors.get(timeout=120)
    except queue.Empty:
        pytest.fail("the FFN rank accepted a payload from another step")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
                p.join()
    assert message == (
        "FFN rank 1 from attention rank 0, layer 0, ubatch 0: expected "
        "(step, layer, ubatch, rows) = (0, 0, 0, 3), the peer wrote (5, 0, 0, 3)"
    )


def test_memory_split_matches_checkpoint_halves(afd_models):
    """Attention ranks hold no expert weights; FFN ranks no KV cache, embedding or LM head; byte
    counts equal the checkpoint's tensors of each half."""
    model = afd_models["deepseek_v2"]
    with safe_open(str(model / "model.safetensors"), "pt") as f:
        sizes = {name: f.get_slice(name).get_shape() for name in f.keys()}
    nbytes = {name: 4 * int(torch.Size(shape).numel()) for name, shape in sizes.items()}
    attention_bytes = sum(b for n, b in nbytes.items() if ".mlp." not in n)
    ffn_bytes = sum(b for n, b in nbytes.items() if ".mlp." in n and not n.endswith("tid2eid"))
    ffn_bytes += sum(
        2 * 4 * int(torch.Size(sizes[n]).numel()) for n in sizes if n.endswith("tid2eid")
    )
    with LLM(str(model), topology="2A1F", dtype="float32") as llm:
        reports = {m.rank: m for m in llm.memory_reports}
        names = llm.rank_tensor_names
    for rank in (0, 1):
        assert reports[rank].role == "attention"
        assert reports[rank].cache_bytes > 0
        assert reports[rank].parameter_bytes == attention_bytes
        assert not [n for n in names[rank] if ".mlp." in n]
        assert "model.embed_tokens.weight" in names[rank] and "lm_head.weight" in names[rank]
    ffn = reports[2]
    assert ffn.role == "ffn" and ffn.cache_bytes == 0
    assert ffn.parameter_bytes == ffn_bytes
    assert all(".mlp." in n for n in names[2])
    assert any("experts.gate_up_proj" in n for n in names[2])
