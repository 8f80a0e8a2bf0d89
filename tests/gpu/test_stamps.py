"""Device timestamps (kernels/triton/stamp.py) read the GPU's global timer when the stream
reaches them, also inside a replayed CUDA graph."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_stamps_time_the_work_between_them_in_a_graph():
    from afdserve.kernels.triton.stamp import Stamps

    stamps = Stamps(torch.device("cuda"))

    def body() -> None:
        stamps.mark()
        torch.cuda._sleep(2_000_000)  # about 1 ms at the H200's ~2 GHz
        stamps.mark()

    body()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    stamps.reset()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    graph.replay()
    end.record()
    end.synchronize()
    marks = stamps.read()
    assert len(marks) == 4  # two replays, two stamps each: the slot comes from the device
    assert marks == sorted(marks)
    spans_ms = [(marks[1] - marks[0]) / 1e6, (marks[3] - marks[2]) / 1e6]
    total_ms = start.elapsed_time(end)
    for span in spans_ms:
        assert 0.2 < span <= total_ms  # the sleep ran between the stamps, within the replays
