"""The FastAPI app: the three dialects' routers, the shared endpoints
(health, metrics, models), the API-key check and error handlers. The
pieces the dialects share live in ``app.py``; this module imports both, so
imports run one way (dialects -> app, routes -> dialects)."""

import hmac
import logging
import time

from fastapi import Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse

from . import anthropic, openai, responses
from .app import APIError, Server, error_response
from .metrics import Metrics

log = logging.getLogger("mlx_dflash.server")


ENDPOINTS = {
    "/health",
    "/metrics",
    "/v1/models",
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/v1/messages",
    "/v1/messages/count_tokens",
}


class CountRequests:
    """Counts responses by endpoint and status (plain ASGI: streams and disconnects pass untouched)."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = [500]

        async def send_(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_)
        finally:
            path = scope.get("path", "")
            self.metrics.record_request(path if path in ENDPOINTS else "other", status[0])


def create_app(server: Server) -> FastAPI:
    app = FastAPI(title="mlx-dflash", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server

    async def require_key(request: Request) -> None:
        key = server.settings.api_key
        if key is None:
            return
        given = [request.headers.get("x-api-key")]
        auth = request.headers.get("authorization", "")
        if auth[:7].lower() == "bearer ":
            given.append(auth[7:].strip())
        # Either header may carry the key (SDKs send both, one of them a placeholder).
        # Constant-time comparison, on bytes so any header text is comparable.
        if not any([hmac.compare_digest(g.encode(), key.encode()) for g in given if g is not None]):
            raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer KEY' or 'x-api-key: KEY')")

    def shape(request: Request) -> str:
        """The path whose API's error shape answers: the request's, except that
        /v1/models (both APIs list models there) answers the Anthropic SDK,
        which sends anthropic-version, in Anthropic's shape."""
        path = request.url.path
        if path.startswith("/v1/models") and "anthropic-version" in request.headers:
            return "/v1/messages"
        return path

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return error_response(shape(request), e.status, e.message, param=e.param, code=e.code)

    @app.exception_handler(404)
    async def _not_found(request: Request, e):
        return error_response(shape(request), 404, f"no route {request.method} {request.url.path}")

    @app.exception_handler(405)
    async def _bad_method(request: Request, e):
        r = error_response(shape(request), 405, f"method {request.method} not allowed on {request.url.path}")
        r.headers.update(getattr(e, "headers", None) or {})  # Allow: the methods the path takes (RFC 9110)
        return r

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception):
        log.exception("unhandled error")
        return error_response(shape(request), 500, f"internal error: {type(e).__name__}")

    if server.settings.allowed_origins:  # browser clients: preflights answered, responses marked
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(server.settings.allowed_origins),
            allow_methods=["*"],
            allow_headers=["*"],
        )
    app.add_middleware(CountRequests, metrics=server.metrics)

    @app.get("/health")
    async def health():
        ok = server.worker.alive
        return JSONResponse(
            {
                "status": "ok" if ok else "error",
                "model": server.settings.model_id,
                "queue_length": server.worker.queue_length,
            },
            status_code=200 if ok else 503,
        )

    deps = [Depends(require_key)]

    @app.get("/metrics", dependencies=deps)
    async def metrics():
        return PlainTextResponse(server.metrics.render(), media_type="text/plain; version=0.0.4")

    def model_entry() -> dict:
        # One entry both SDKs accept: OpenAI's fields and Anthropic's side by side.
        mid = server.settings.model_id
        return {
            "id": mid,
            "object": "model",
            "type": "model",
            "display_name": mid,
            "created": server.created,
            "owned_by": "mlx-dflash",
            "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(server.created)),
        }

    @app.get("/v1/models", dependencies=deps)
    async def models():
        mid = server.settings.model_id
        return {"object": "list", "data": [model_entry()], "has_more": False, "first_id": mid, "last_id": mid}

    @app.get("/v1/models/{model_id:path}", dependencies=deps)
    async def model(model_id: str):
        server.check_model(model_id)  # another id: 404 model_not_found
        return model_entry()

    app.include_router(openai.router, dependencies=deps)
    app.include_router(responses.router, dependencies=deps)
    app.include_router(anthropic.router, dependencies=deps)
    return app
