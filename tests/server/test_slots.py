"""slots.ConnectionSlots, in-process: which connection is closed when slots run short."""

from __future__ import annotations

from afdserve.server.slots import ConnectionSlots


def test_the_address_holding_the_most_loses_its_oldest_reading_connection() -> None:
    slots = ConnectionSlots(max_connections=6, max_reading=None, max_per_client=None, grace_s=1)
    for i in range(3):
        assert slots.admit(f"a{i}", "A", now=i) == []
    assert slots.admit("b0", "B", now=3) == []
    slots.stop_reading("b0")  # B's request is in: serving
    assert slots.admit("c0", "C", now=4) == []
    assert slots.admit("b1", "B", now=5) == []
    # At the cap: A holds 3 reading, B and C one each; A's oldest goes, at any age.
    assert slots.admit("d0", "D", now=5.5) == [("a0", "connection_cap")]
    # A and D tie at 2 (d1 counted): A got there first.
    assert slots.admit("d1", "D", now=5.6) == [("a1", "connection_cap")]
    assert slots.admit("d2", "D", now=5.7) == [("d0", "connection_cap")]  # D's own, now
    assert slots.admit("e0", "E", now=5.8) == [("d1", "connection_cap")]
    assert slots.per_client == {"A": 1, "B": 2, "C": 1, "D": 1, "E": 1}


def test_the_share_spares_connections_within_their_grace() -> None:
    slots = ConnectionSlots(max_connections=None, max_reading=2, max_per_client=None, grace_s=1)
    assert slots.admit("a0", "A", now=0) == []
    assert slots.admit("a1", "A", now=0.1) == []
    assert slots.admit("a2", "A", now=0.2) == []  # over the share, but all within their grace
    assert slots.admit("b0", "B", now=1.15) == [("a0", "reading_share"), ("a1", "reading_share")]
    assert slots.reading_count == 2 and set(slots.host) == {"a2", "b0"}


def test_a_new_connection_is_closed_when_no_slot_can_be_freed() -> None:
    slots = ConnectionSlots(max_connections=2, max_reading=None, max_per_client=2, grace_s=1)
    for name in ("a0", "a1"):
        slots.admit(name, "A", now=0)
        slots.stop_reading(name)
    assert slots.admit("a2", "A", now=1) == [("a2", "per_client")]
    assert slots.admit("b0", "B", now=1) == [("b0", "connection_cap")]  # every slot serving
    slots.start_reading("a0", now=2)  # a keep-alive connection between two requests
    assert slots.admit("b1", "B", now=2.5) == [("a0", "connection_cap")]


def test_released_connections_leave_nothing_behind() -> None:
    slots = ConnectionSlots(max_connections=4, max_reading=1, max_per_client=4, grace_s=0)
    for i in range(50):
        for conn, _ in slots.admit(i, f"10.0.0.{i % 3}", now=i):
            slots.release(conn)  # what connection_lost does, again
        slots.release(i - 4)
    for i in range(50):
        slots.release(i)
    assert (slots.host, slots.per_client, slots.reading, slots.by_count) == ({}, {}, {}, {})
    assert (slots.reading_count, slots.most) == (0, 0)
