"""`python silent_flood.py HOST PORT COUNT [--renew]`: COUNT peers that connect to a rank listener
and never say a word, held open until stdin closes. Prints "held COUNT" once all are open. With
--renew, each connection the listener drops (its handshake deadline) is replaced at once, so the
flood stays COUNT strong, until the listener stops listening. Loopback only, bounded: COUNT
connections at a time, and none once a connection is refused."""

from __future__ import annotations

import selectors
import socket
import sys
import time

CONNECT_DEADLINE_S = 30.0


def open_peer(address: tuple[str, int], selector: selectors.BaseSelector) -> None:
    sock = socket.create_connection(address, timeout=CONNECT_DEADLINE_S)
    sock.setblocking(False)
    selector.register(sock, selectors.EVENT_READ)


def main() -> None:
    host, port, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    renew = "--renew" in sys.argv[4:]
    address = (host, port)
    selector = selectors.DefaultSelector()
    deadline = time.monotonic() + CONNECT_DEADLINE_S
    opened = 0
    while opened < count:
        try:
            open_peer(address, selector)
            opened += 1
        except ConnectionRefusedError:  # not listening yet
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    print(f"held {count}", flush=True)
    selector.register(sys.stdin, selectors.EVENT_READ)
    while True:
        for key, _ in selector.select():
            if key.fileobj is sys.stdin:
                return  # the test closed stdin (or wrote to it): stop
            sock = key.fileobj
            assert isinstance(sock, socket.socket)
            try:
                data = sock.recv(4096)  # the challenge: read and ignored
            except OSError:
                data = b""
            if data:
                continue
            selector.unregister(sock)
            sock.close()
            if renew:
                try:
                    open_peer(address, selector)
                except OSError:
                    renew = False  # the listener has closed: the world is complete


if __name__ == "__main__":
    main()
