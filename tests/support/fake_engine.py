"""The api without workers: a fake engine and tokenizer for `create_app`, and a raw ASGI caller.

The caller drives the app the way uvicorn does (body chunks through `receive`, `http.disconnect` once
the client is gone), so tests can send chunked bodies, stall mid-body and disconnect mid-request —
none of which httpx's ASGI transport can do.
"""
from __future__ import annotations

import asyncio
import json
import threading
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from types import SimpleNamespace

from foresight.config import DEFAULT_MODEL_NAME, EngineConfig, ServerConfig
from foresight.protocol.messages import TokenLogprobs, TokenOutput
from foresight.server.app import create_app
from foresight.server.engine_client import RequestError
from foresight.server.metrics import ServerMetrics

MODEL = DEFAULT_MODEL_NAME
EOS = 256


class ByteTokenizer:
    """One token per UTF-8 byte (ids 0..255) plus EOS; records the thread each call runs in."""

    eos_token_id = EOS

    def __init__(self):
        self.calls: list[tuple[str, int]] = []  # (method, thread id)

    def __len__(self):
        return 257

    def convert_ids_to_tokens(self, ids):
        return ["<eos>" if i == EOS else chr(i) for i in ids]

    def encode(self, text, add_special_tokens=False):
        self.calls.append(("encode", threading.get_ident()))
        return list(text.encode("utf-8"))

    def decode(self, ids, skip_special_tokens=True):
        return bytes(i for i in ids if i != EOS).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        self.calls.append(("template", threading.get_ident()))
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"
        return list(text.encode("utf-8"))


def outputs_for(text: str, pieces: int = 2, reason: str = "length") -> list[TokenOutput]:
    ids = list(text.encode("utf-8"))
    step = max(1, -(-len(ids) // pieces))
    chunks = [ids[i:i + step] for i in range(0, len(ids), step)]
    return [TokenOutput(req_id="", token_ids=c, finished=i == len(chunks) - 1,
                        finish_reason=reason if i == len(chunks) - 1 else None) for i, c in enumerate(chunks)]


def fake_logprobs(token_ids: list[int], top: int) -> TokenLogprobs:
    """Made-up logprobs a test can recognise: token t gets -t/100, its alternatives t+1.. lower ones; token 0
    gets -inf (what a rule that forbids a token gives)."""
    return TokenLogprobs(values=[-t / 100 if t else float("-inf") for t in token_ids],
                         top_ids=[[(t + j) % 256 for j in range(top)] for t in token_ids],
                         top_values=[[-(t + j) / 100 - 0.5 for j in range(top)] for t in token_ids])


def with_logprobs(out: TokenOutput, request, first: bool) -> None:
    """Attach what the target worker would: the output's logprobs and, on the first output, the prompt's."""
    sampling = request.sampling
    if sampling.logprobs is not None and out.logprobs is None:
        out.logprobs = fake_logprobs(out.token_ids, sampling.logprobs)
    if sampling.prompt_logprobs is not None and first and out.prompt_logprobs is None:
        out.prompt_logprobs = fake_logprobs(request.prompt_ids[1:], sampling.prompt_logprobs)


@dataclass
class FakeEngine:
    """What the app uses of EngineClient. `script(request)` gives the outputs; `hang` keeps a request
    running after them (until aborted); `fail` raises it inside generate."""

    max_model_len: int = 64
    script: object = lambda request: outputs_for("hello world")
    hang: bool = False
    fail: BaseException | None = None
    cfg: EngineConfig = field(default_factory=EngineConfig)
    metrics: ServerMetrics = field(default_factory=lambda: ServerMetrics(MODEL))
    healthy: bool = True
    waiting: int = 0
    requests: list = field(default_factory=list)
    aborted: list = field(default_factory=list)
    supervisor: object = field(default_factory=lambda: SimpleNamespace(restarts=0))

    async def start(self):
        pass

    async def stop(self):
        pass

    def target_info(self):
        return {"max_model_len": self.max_model_len}

    def worker_pids(self):
        return {"target": 1, "drafter": 2}

    def can_admit(self):
        return True

    def admit(self, request):
        pass

    def discard(self, req_id):
        pass

    @property
    def in_flight(self):
        return 0

    def close_admission(self):
        self.healthy = False

    def health(self):
        return {"status": "ok" if self.healthy else "unavailable", "workers": self.worker_pids(),
                "restarts": self.supervisor.restarts}

    async def generate(self, request):
        self.requests.append(request)
        finished = False
        try:
            if self.fail is not None:
                finished = True
                raise self.fail
            for i, out in enumerate(self.script(request)):
                await asyncio.sleep(0)
                with_logprobs(out, request, first=i == 0)
                finished = out.finished
                yield out
            if not finished and self.hang:
                await asyncio.Event().wait()  # a request that would run for minutes
        finally:
            if not finished:
                await self.abort(request.req_id)

    async def abort(self, req_id):
        self.aborted.append(req_id)


class DrainEngine:
    """What `Drain` uses of an engine: `in_flight` requests, admission, `abort_all`."""

    def __init__(self, in_flight: int):
        self.in_flight, self.admitting, self.aborted = in_flight, True, None

    def close_admission(self) -> None:
        self.admitting = False

    async def abort_all(self, reason: str) -> None:
        self.aborted = reason
        self.in_flight = 0


def worker_error(message: str, status: int = 500) -> RequestError:
    return RequestError(message, status)


@dataclass
class Reply:
    status: int
    headers: dict
    body: bytes

    def json(self):
        return json.loads(self.body)

    def events(self) -> list[str]:
        return [line[len("data: "):] for line in self.body.decode().splitlines() if line.startswith("data: ")]


@asynccontextmanager
async def running_app(engine: FakeEngine | None = None, tokenizer=None, **server):
    """The app over a fake engine, its lifespan entered."""
    engine = engine or FakeEngine()
    app = create_app(ServerConfig(**server), engine=engine, tokenizer=tokenizer or ByteTokenizer())
    async with app.router.lifespan_context(app):
        yield app


async def call(app, method: str, path: str, body=None, headers: dict | None = None, chunks=None,
               gone: asyncio.Event | None = None) -> Reply:
    """One request. `body`: a dict (sent as JSON), bytes or str; `chunks`: an async iterator of byte
    chunks sent without Content-Length; `gone`: once set, the client has disconnected."""
    if isinstance(body, dict):
        body = json.dumps(body).encode()
    elif isinstance(body, str):
        body = body.encode()
    hdrs = {"content-type": "application/json", **(headers or {})}
    if body is not None:
        hdrs["content-length"] = str(len(body))
    done = asyncio.Event()
    gone = gone or done
    parts = chunks if chunks is not None else _one(body or b"")

    async def receive():
        try:
            chunk = await anext(parts)
            return {"type": "http.request", "body": chunk, "more_body": True}
        except StopAsyncIteration:
            pass
        if not receive.ended:
            receive.ended = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    receive.ended = False
    reply = Reply(0, {}, b"")

    async def send(message):
        if message["type"] == "http.response.start":
            reply.status = message["status"]
            reply.headers = {k.decode(): v.decode() for k, v in message.get("headers", [])}
        elif message["type"] == "http.response.body":
            reply.body += message.get("body", b"")
            if not message.get("more_body", False):
                done.set()

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": method, "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "headers": [(k.lower().encode(), v.encode()) for k, v in hdrs.items()],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000)}
    await app(scope, receive, send)
    return reply


async def _one(body: bytes):
    if body:
        yield body


class RecordingSocket:
    """Stands for the api's socket to the target: records what the api sends."""

    def __init__(self):
        self.sent = []

    async def send(self, msg):
        self.sent.append(msg)

    def reset(self):
        pass
