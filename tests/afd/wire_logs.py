"""Reading what every rank of a world really posted and received (LLM(log_data_plane=DIR))."""

from __future__ import annotations

import json
from pathlib import Path

from afdserve.afd.dataplane.wire import mirror_errors, read_wire_log
from afdserve.layout.plan import GraphTable, warmup_reports
from afdserve.layout.topology import Topology


def warmup_steps(graph_mode: str, sizes: list[int]) -> int:
    """The steps of the lockstep warm-up (`full` captures two kinds of graph of every size);
    graph mode none has no capture sizes (GraphConfig.capture_sizes)."""
    sizes = tuple(sizes) if graph_mode != "none" else ()
    return len(warmup_reports(GraphTable(graph_mode, sizes), Topology(1, 0)))


def received(log_dir: Path) -> list[dict]:
    """Every FFN-side receive record: step, layer, ubatch, peer, header, real_rows."""
    out = []
    for path in sorted(log_dir.glob("rank*.jsonl")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if "header" in record:
                out.append(record)
    return out


def assert_data_plane_matches_plan(log_dir: Path, step_log: list[dict], warmup_steps: int) -> int:
    """The batches mirror pairwise, and every tile an FFN half ran carries the header of its step,
    layer and ubatch and exactly the real rows its peer's plan gave that ubatch (warm-up steps
    plan real rows but run pad rows only: they are checked for headers). Returns the number of
    tiles checked."""
    batches = read_wire_log(str(p) for p in log_dir.glob("rank*.jsonl"))
    assert mirror_errors(batches) == []
    plans = {(r["step"], r["rank"]): r for r in step_log if r["role"] == "attention"}
    tiles = received(log_dir)
    for tile in tiles:
        plan = plans[(tile["step"], tile["peer"])]
        u = tile["ubatch"]
        assert tile["header"] == [tile["step"], tile["layer"], u, plan["tile_rows"][u]], tile
        real = plan["ubatch_real_rows"][u] if tile["step"] >= warmup_steps else 0
        assert tile["real_rows"] == real, (tile, plan)
    # Every peer with a non-empty tile in a working step was received, in every layer.
    expected = {
        (r["step"], r["rank"], u)
        for r in step_log
        if r["role"] == "attention" and r["mode"] != "idle"
        for u, t in enumerate(r["tile_rows"])
        if t
    }
    assert {(t["step"], t["peer"], t["ubatch"]) for t in tiles} == expected
    return len(tiles)


def collectives(log_dir: Path) -> dict[int, list[dict]]:
    """Every collective each FFN rank of an expert-parallel group ran, in order, by rank."""
    out: dict[int, list[dict]] = {}
    for path in sorted(log_dir.glob("rank*.jsonl")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if "collective" in record:
                out.setdefault(record["rank"], []).append(record)
    return out
