"""Who holds the server's connection slots, and whom to close when they run short.

A connection is *reading* while the client owes its request (from the accept, or the end of the
previous response, until head and body are in), else *serving* (requests in progress are bounded
in the app: --limit-concurrency). Reading connections get a share of their own (`max_reading`);
all together a cap (`max_connections`: requests in progress plus that share). When reading ones
are too many, the oldest of the address holding the most is closed (max-min fair, as Envoy's
overload manager closes idle connections first and nginx's limit_conn counts per address): slow
clients, from however many addresses, take slots from each other, and a client that sends its
request at once is not closed. For the share a connection gets `grace_s` to send its head (a
burst is accepted before any head is read); at the cap, none. A new connection that finds the
cap full of serving ones, or its address at `max_per_client`, is closed itself.

Used from the event loop only."""

from __future__ import annotations

from collections.abc import Hashable

Connection = Hashable  # the protocol object of one connection


class ConnectionSlots:
    def __init__(
        self,
        max_connections: int | None,
        max_reading: int | None,
        max_per_client: int | None,
        grace_s: float,
    ) -> None:
        self.max_connections, self.max_reading = max_connections, max_reading
        self.max_per_client, self.grace_s = max_per_client, grace_s
        self.host: dict[Connection, str] = {}  # every open connection's client address
        self.per_client: dict[str, int] = {}  # open connections by address, reading or not
        # reading connections by address, oldest first (dicts keep their insertion order), and
        # the addresses by how many they hold, in the order they got to that many
        self.reading: dict[str, dict[Connection, float]] = {}
        self.by_count: dict[int, dict[str, None]] = {}
        self.most = 0  # the largest count in by_count
        self.reading_count = 0

    def admit(self, conn: Connection, host: str, now: float) -> list[tuple[Connection, str]]:
        """A new connection, reading; the connections to close now, each with why (the new
        one itself among them when it may not stay)."""
        if self.max_per_client is not None and self.per_client.get(host, 0) >= self.max_per_client:
            return [(conn, "per_client")]
        self.host[conn] = host
        self.per_client[host] = self.per_client.get(host, 0) + 1
        self.start_reading(conn, now)
        shed = []
        if self.max_connections is not None and len(self.host) > self.max_connections:
            victim = self._victim(now)
            shed.append((victim, "connection_cap"))
            self.release(victim)
        return shed + self.enforce_share(now)

    def start_reading(self, conn: Connection, now: float) -> None:
        """`conn` waits for (the rest of) a request: a new connection, or one between two."""
        host = self.host.get(conn)
        if host is None:
            return
        conns = self.reading.setdefault(host, {})
        if conn in conns:
            return
        conns[conn] = now
        self.reading_count += 1
        self._recount(host, len(conns) - 1, len(conns))

    def stop_reading(self, conn: Connection) -> None:
        """`conn`'s request is all in: the server owes the response."""
        host = self.host.get(conn)
        conns = self.reading.get(host) if host is not None else None
        if not conns or conn not in conns:
            return
        del conns[conn]
        self.reading_count -= 1
        if not conns:
            del self.reading[host]
        self._recount(host, len(conns) + 1, len(conns))

    def release(self, conn: Connection) -> None:
        """`conn` is closed (or about to be): its slot is free. Idempotent."""
        self.stop_reading(conn)
        host = self.host.pop(conn, None)
        if host is None:
            return
        left = self.per_client[host] - 1
        if left:
            self.per_client[host] = left
        else:
            del self.per_client[host]  # no entry per address ever seen

    def enforce_share(self, now: float) -> list[tuple[Connection, str]]:
        """Reading connections beyond the share that have had their grace: the ones to close."""
        shed = []
        while self.max_reading is not None and self.reading_count > self.max_reading:
            victim = self._victim(now - self.grace_s)
            if victim is None:
                break
            shed.append((victim, "reading_share"))
            self.release(victim)
        return shed

    def _victim(self, since_before: float = float("inf")) -> Connection | None:
        """The oldest reading connection of the address that holds the most (of addresses tied,
        the one that got there first), if it has been reading since before `since_before`. At the
        cap there is always one: the new connection is reading."""
        if not self.most:
            return None
        host = next(iter(self.by_count[self.most]))
        conn, since = next(iter(self.reading[host].items()))
        return conn if since <= since_before else None

    def _recount(self, host: str, old: int, new: int) -> None:
        if old:
            hosts = self.by_count[old]
            del hosts[host]
            if not hosts:
                del self.by_count[old]
        if new:
            self.by_count.setdefault(new, {})[host] = None
        self.most = max(self.most, new)
        while self.most and self.most not in self.by_count:
            self.most -= 1  # counts move by one, so this loop runs at most once
