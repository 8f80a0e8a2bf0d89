"""/v1/models and /v1/models/{id}: the one model this server serves, a card for each of its
names (--served-model-name a b: both)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from afdserve.server.state import ServerState


def router(state: ServerState) -> APIRouter:
    routes = APIRouter()

    @routes.get("/v1/models")
    async def models() -> Response:
        _, view = state.ready()
        cards = [state.model_card(view, name) for name in state.model_names]
        return JSONResponse({"object": "list", "data": cards})

    @routes.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Response:
        _, view = state.ready()
        state.check_model(model_id)
        return JSONResponse(state.model_card(view, model_id))

    return routes
