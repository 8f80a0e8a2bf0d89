"""An attention rank's output sender (afd/ranks/sender.py): each step's Outputs reaches the
frontend in step order, all of them before close() returns; a connection that fails is raised
in the stepping thread by its next send."""

from __future__ import annotations

import socket

import pytest

from afdserve.afd.ranks.channel import Channel
from afdserve.afd.ranks.messages import Outputs, RankStats
from afdserve.afd.ranks.sender import OutputSender
from afdserve.engine.requests import TokenDelta


def step_outputs(step: int) -> Outputs:
    deltas = tuple(
        TokenDelta(f"r{i}", (step, i), (), False, None, 2 * (step + 1), 1.0, 1.0, 1.0, 0, ())
        for i in range(3)
    )
    return Outputs(0, deltas, RankStats(running=3, step_tokens=(3,), scheduled_tokens=3 * step))


def test_outputs_arrive_in_step_order_before_close_returns() -> None:
    rank_end, frontend_end = socket.socketpair()
    rank, frontend = Channel(rank_end, "frontend"), Channel(frontend_end, "rank 0")
    sent = [step_outputs(step) for step in range(40)]
    # A queue of one: the stepping thread waits for the sender rather than run ahead of it.
    sender = OutputSender(rank, max_queued=1)
    for message in sent:
        sender.send(message)
    sender.close()
    sender.check()
    assert [frontend.recv(timeout=10) for _ in sent] == sent
    assert not frontend.poll()


def test_a_failed_connection_is_raised_by_the_next_send() -> None:
    rank_end, frontend_end = socket.socketpair()
    frontend_end.close()
    sender = OutputSender(Channel(rank_end, "frontend"))
    sender.send(step_outputs(0))  # fails in the sender's thread
    sender.close()
    with pytest.raises(OSError):
        sender.send(step_outputs(1))
    with pytest.raises(OSError):
        sender.check()
