"""The FastAPI app: OpenAI-compatible routes, health, metrics and error mapping."""
from __future__ import annotations

import asyncio
import logging
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..config import DEFAULT_MODEL_NAME, ConfigError, ServerConfig
from ..models.loading import load_tokenizer, resolve_target
from .engine_client import EngineClient, EngineUnavailable, KVBudgetExceeded, QueueFull
from .errors import AsciiJSONResponse, error, internal_message
from .metrics import ServerMetrics
from .middleware import ApiKeyAuth, BodyLimit
from .openai_schemas import ChatCompletionRequest, CompletionRequest, error_body
from .responses import Job, complete, stream
from .serving import BadRequest, RequestRunner
from .shutdown import Drain
from .tool_formats import tool_format

log = logging.getLogger("foresight.server")
NOT_READY = "the engine is not ready (loading, or a worker died and is being restarted)"
SHUTTING_DOWN = "the server is shutting down and admits no new requests"
SERVING = ("ok", "degraded")  # /health statuses that answer 200: degraded = serving without the drafter


def served_model_name(cfg: ServerConfig) -> str:
    if cfg.engine.model_name:
        return cfg.engine.model_name
    return DEFAULT_MODEL_NAME if cfg.engine.target is None else resolve_target(cfg.engine.target).name


def validation_error(exc: RequestValidationError):
    """400 naming the parameter. Of a union's alternatives' errors, the deepest says the most."""
    errors = exc.errors()
    err = max(errors, key=lambda e: len(e.get("loc", ()))) if errors else {}
    if err.get("type") == "json_invalid":
        return error(400, "the request body is not valid JSON")
    # Drop "body" and pydantic's names for union alternatives ("list[int]", "function-after[...]").
    loc = [str(p) for p in err.get("loc", []) if p != "body" and (isinstance(p, int) or "[" not in str(p))]
    message = err.get("msg", "invalid value")
    if err.get("type") == "extra_forbidden":
        message = "not a field this server accepts (the README lists the request fields)"
    return error(400, f"{'.'.join(loc) or 'body'}: {message}", loc[0] if loc else None)


class AdmittedStream(StreamingResponse):
    """A stream of an admitted request: `on_close` runs however the response ends, also when its body never
    started (a client gone at once), so the request's admission is always given back."""

    def __init__(self, content, on_close, **kwargs):
        super().__init__(content, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def create_app(cfg: ServerConfig, engine=None, tokenizer=None) -> FastAPI:
    """`engine` and `tokenizer` are built from `cfg` unless given (the unit tests pass fakes)."""
    if tokenizer is None:
        tokenizer = load_tokenizer(resolve_target(cfg.engine.target))  # converts the embedded default once
    model_name = served_model_name(cfg)
    try:
        calls_format = tool_format(tokenizer, cfg.tool_call_parser)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if engine is None:
        engine = EngineClient(cfg.engine, cfg.max_num_seqs, cfg.max_waiting, cfg.startup_timeout_s,
                              cfg.max_restarts, ServerMetrics(model_name, max_draft_tokens=cfg.engine.gamma),
                              restart_window_s=cfg.restart_window_s, heartbeat_timeout_s=cfg.heartbeat_timeout_s,
                              stall_timeout_s=cfg.stall_timeout_s, max_kv_tokens=cfg.max_kv_tokens)
    metrics: ServerMetrics = engine.metrics
    drain = Drain(engine, cfg.drain_timeout_s)
    # The engine gave up (a worker's restart budget is spent): drain what still runs, then exit non-zero
    # so that compose or Kubernetes restarts the whole server.
    engine.on_fatal = lambda reason: drain.begin(exit_code=1, why=reason)
    state: dict = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        try:
            started = await drain.starting(engine.start())
        except BaseException:
            await engine.stop()  # no worker, socket folder or segment outlives a failed start
            raise
        if not started:  # a stop signal came during start-up: the server exits without serving
            await engine.stop()
            yield
            return
        info = engine.target_info()
        state["runner"] = RequestRunner(engine, tokenizer, model_name, info["max_model_len"], metrics,
                                        special_tokens_in_content=cfg.allow_special_tokens_in_content,
                                        tool_format=calls_format)
        yield
        state["runner"].close()
        await engine.stop()

    app = FastAPI(title="Foresight", lifespan=lifespan)
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.drain = drain
    app.add_middleware(BodyLimit, max_bytes=cfg.max_request_bytes, metrics=metrics, timeout_s=cfg.body_timeout_s)
    if cfg.api_key:
        app.add_middleware(ApiKeyAuth, api_key=cfg.api_key)  # added last: runs first, before any body is read

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError):
        metrics.record_failure("bad_request")
        return validation_error(exc)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException):
        # Routing and body-parsing errors Starlette raises itself (404, 405, an undecodable body):
        # OpenAI-shaped like every other error.
        return error(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def on_internal_error(request: Request, exc: Exception):
        rid = f"http-{uuid.uuid4().hex}"
        log.error("request %s (%s %s) failed", rid, request.method, request.url.path, exc_info=exc)
        return error(500, internal_message(rid))

    @app.get("/health")
    async def health():
        """200 while requests are served (status ok, or degraded: without the drafter); 503 while
        loading, while the target is down, or while draining — with the same JSON body either way."""
        body = engine.health()
        if body["status"] not in SERVING:
            return AsciiJSONResponse({**body, "error": error_body(
                SHUTTING_DOWN if body["status"] == "draining" else NOT_READY, "service_unavailable", None,
                503)["error"]}, 503)
        return body

    @app.get("/metrics")
    async def metrics_route():
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                             "owned_by": "foresight", "max_model_len": engine.target_info().get("max_model_len")}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request):
        return await handle(body, raw, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request):
        return await handle(body, raw, chat=True)

    async def handle(body, raw: Request, chat: bool):
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        timeout_s = cfg.request_timeout_s
        deadline = asyncio.get_running_loop().time() + timeout_s if timeout_s > 0 else None
        if body.model is not None and body.model != model_name:
            return error(404, f"the model '{body.model}' does not exist; this server serves '{model_name}'", "model")
        if drain.draining:
            return error(503, SHUTTING_DOWN)
        if not engine.healthy:
            return error(503, NOT_READY)
        if not engine.can_admit():
            metrics.record_failure("queue_full")
            return error(429, f"the server is busy: {engine.waiting} requests are already waiting")
        runner: RequestRunner = state["runner"]
        try:
            structure = runner.structure(body)
            prompt_ids, param = await runner.tokenize(body)
            requests = runner.build_choices(body, prompt_ids, param, rid, structure)
        except BadRequest as exc:
            metrics.record_failure("bad_request")
            return error(400, str(exc), exc.param)
        except Exception:
            log.exception("request %s: preparing the prompt failed", rid)
            return error(500, internal_message(rid))
        # Admission is decided here, before any stream starts: 400 for a request larger than the whole KV
        # budget, 429 when the wait queue is full. The request then waits for its turn inside generate().
        # The n choices are admitted together or not at all.
        try:
            for request in requests:
                engine.admit(request)
        except (KVBudgetExceeded, QueueFull, EngineUnavailable) as exc:
            discard_all(requests)
            return refused(exc)
        job = Job(runner, body, requests, chat, rid, deadline, timeout_s, cfg.idle_timeout_s or None, structure)
        if body.stream:
            return AdmittedStream(stream(job), lambda: discard_all(requests), media_type="text/event-stream")
        try:
            return await complete(job, raw.is_disconnected)
        finally:
            discard_all(requests)  # the admission of requests whose engine work never started

    def discard_all(requests) -> None:
        for request in requests:
            engine.discard(request.req_id)

    def refused(exc: Exception):
        if isinstance(exc, KVBudgetExceeded):
            metrics.record_failure("bad_request")
            return error(400, str(exc), exc.param)
        if isinstance(exc, QueueFull):
            metrics.record_failure("queue_full")
            return error(429, f"the server is busy: {engine.waiting} requests are already waiting")
        return error(503, SHUTTING_DOWN if drain.draining else NOT_READY)

    return app
