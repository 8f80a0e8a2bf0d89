"""`--api-key`: every request needs `Authorization: Bearer <key>`, except the probes (/health,
/metrics) that load balancers and Prometheus call without credentials."""

from __future__ import annotations

import hmac
import json
from typing import Any

from afdserve.server.protocol import error_body

OPEN_PATHS = ("/health", "/metrics")


class APIKeyCheck:
    """Plain ASGI middleware (nothing buffers a streaming response). The comparison takes the same
    time whatever the key sent, so that its timing does not reveal a prefix of the real one."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("path", "") in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        sent = dict(scope.get("headers") or ()).get(b"authorization", b"")
        if hmac.compare_digest(sent, self.expected):
            await self.app(scope, receive, send)
            return
        body = json.dumps(error_body(401, "missing or wrong API key (Authorization: Bearer ...)"))
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"www-authenticate", b"Bearer"),
                    # Refused before its body was read: the connection ends here, so a client
                    # without the key cannot keep it by trickling a body (connections.py).
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body.encode()})
