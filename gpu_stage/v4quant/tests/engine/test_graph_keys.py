"""A graph runner asked to replay a key it never captured raises (both roles use this check),
instead of capturing behind a step log that says replay."""

from __future__ import annotations

import pytest

from afdserve.engine.cuda_graphs import GraphKeyError, check_replayable


def test_replay_of_an_uncaptured_key_raises():
    graphs = {("ffn", 2, ((4,),), (4,)): object()}
    check_replayable(2, "replay", ("ffn", 2, ((4,),), (4,)), graphs)
    check_replayable(2, "capture", ("ffn", 2, ((8,),), (8,)), graphs)
    with pytest.raises(GraphKeyError, match=r"rank 2: the plan replays .*never captured"):
        check_replayable(2, "replay", ("ffn", 2, ((8,),), (8,)), graphs)
