"""The FastAPI app: OpenAI-compatible routes, health, metrics and error mapping."""
from __future__ import annotations

import time
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..config import DEFAULT_MODEL_NAME, ServerConfig
from ..target_worker.loading import load_tokenizer, resolve_target
from .engine_client import EngineClient, EngineUnavailable, QueueFull, RequestError
from .metrics import ServerMetrics
from .openai_schemas import ChatCompletionRequest, CompletionRequest, error_body
from .serving import BadRequest, RequestRunner, sse


def served_model_name(cfg: ServerConfig) -> str:
    if cfg.engine.model_name:
        return cfg.engine.model_name
    return DEFAULT_MODEL_NAME if cfg.engine.target is None else resolve_target(cfg.engine.target).name


def error(status: int, message: str, param: str | None = None, type_: str | None = None) -> JSONResponse:
    kinds = {400: "invalid_request_error", 404: "not_found_error", 429: "rate_limit_error",
             503: "service_unavailable"}
    return JSONResponse(error_body(message, type_ or kinds.get(status, "server_error"), param, status), status)


def create_app(cfg: ServerConfig) -> FastAPI:
    model_path = resolve_target(cfg.engine.target)  # converts the embedded default once, before workers start
    tokenizer = load_tokenizer(model_path)
    model_name = served_model_name(cfg)
    metrics = ServerMetrics(model_name, max_draft_tokens=cfg.engine.gamma)
    engine = EngineClient(cfg.engine, cfg.max_running, cfg.max_waiting, cfg.startup_timeout_s,
                          cfg.max_restarts, metrics)
    state: dict = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await engine.start()
        info = engine.target_info()
        state["runner"] = RequestRunner(engine, tokenizer, model_name, info["max_model_len"], metrics)
        yield
        await engine.stop()

    app = FastAPI(title="Foresight", lifespan=lifespan)
    app.state.engine = engine
    app.state.metrics = metrics

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError):
        err = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in err.get("loc", []) if p != "body"]
        metrics.record_failure("bad_request")
        if err.get("type") == "json_invalid":
            return error(400, "the request body is not valid JSON", None)
        param = loc[0] if loc else None
        return error(400, f"{'.'.join(loc) or 'body'}: {err.get('msg', 'invalid value')}", param)

    @app.get("/health")
    async def health():
        if not engine.healthy:
            return error(503, "the engine is not ready (loading, or a worker died and is being restarted)")
        return {"status": "ok", "workers": engine.worker_pids(), "restarts": engine.supervisor.restarts}

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
        return await handle(body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request):
        return await handle(body, chat=True)

    async def handle(body, chat: bool):
        if body.model is not None and body.model != model_name:
            return error(404, f"the model '{body.model}' does not exist; this server serves '{model_name}'", "model")
        if not engine.healthy:
            return error(503, "the engine is not ready (loading, or a worker died and is being restarted)")
        if not engine.can_admit():
            metrics.record_failure("queue_full")
            return error(429, f"the server is busy: {engine.waiting} requests are already waiting")
        runner: RequestRunner = state["runner"]
        try:
            prompt_ids, param = runner.prompt_ids(body)
            request = runner.build(body, prompt_ids, param)
        except BadRequest as exc:
            metrics.record_failure("bad_request")
            return error(400, str(exc), exc.param)
        if body.stream:
            return StreamingResponse(stream(runner, body, request, chat), media_type="text/event-stream")
        return await complete(runner, body, request, chat)

    return app


def _chunk_choice(chat: bool, text: str | None, reason: str | None, first: bool) -> dict:
    if chat:
        delta = {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
        return {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}
    return {"index": 0, "text": text or "", "finish_reason": reason, "logprobs": None}


async def stream(runner: RequestRunner, body, request, chat: bool):
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    base = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": runner.model_name}
    n_completion, tally, first = 0, None, True
    try:
        async for text, reason, tally, n_completion in runner.events(request, body.stop_list()):
            if not text and reason is None and not first:
                continue
            yield sse({**base, "choices": [_chunk_choice(chat, text, reason, first)]})
            first = False
    except (RequestError, EngineUnavailable, QueueFull) as exc:
        status = getattr(exc, "status", 503 if isinstance(exc, EngineUnavailable) else 429)
        yield sse(error_body(str(exc), "server_error", None, status))
        yield sse("[DONE]")
        return
    if body.include_usage() and tally is not None:
        usage = runner.usage(len(request.prompt_ids), n_completion, tally)
        yield sse({**base, "choices": [], "usage": usage})
    yield sse("[DONE]")


async def complete(runner: RequestRunner, body, request, chat: bool):
    parts, reason, tally, n_completion = [], None, None, 0
    try:
        async for text, r, tally, n_completion in runner.events(request, body.stop_list()):
            parts.append(text)
            reason = r or reason
    except QueueFull as exc:
        return error(429, str(exc))
    except EngineUnavailable as exc:
        return error(503, str(exc))
    except RequestError as exc:
        return error(exc.status, str(exc))
    text = "".join(parts)
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason,
                  "logprobs": None}
    else:
        choice = {"index": 0, "text": text, "finish_reason": reason, "logprobs": None}
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": runner.model_name, "choices": [choice],
            "usage": runner.usage(len(request.prompt_ids), n_completion, tally)}

