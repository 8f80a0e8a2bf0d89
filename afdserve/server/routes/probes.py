"""What load balancers, supervisors and Prometheus poll: /health, /version and /metrics."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

import afdserve
from afdserve.server.metrics import CONTENT_TYPE
from afdserve.server.state import ServerState


def router(state: ServerState) -> APIRouter:
    routes = APIRouter()

    @routes.get("/health")
    async def health() -> Response:
        state.check_serving()  # 503 while loading, draining, restarting or failed
        return JSONResponse({"status": "ok"})

    @routes.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @routes.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": afdserve.__version__})

    return routes
