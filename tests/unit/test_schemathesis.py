"""Schemathesis against the api's own OpenAPI schema, the engine faked: no answer is a 5xx, and every
4xx is an OpenAI-shaped error `{"error": {"message", "type", "param", "code"}}`.

Schemathesis generates requests from the schema FastAPI derives from the pydantic request models (valid
bodies, bodies that break one constraint, boundary values, undeclared methods, malformed payloads) and
sends them to the app in-process, so the run takes seconds and needs no model.

`FORESIGHT_SCHEMATHESIS_REPORT=path.json` writes how many cases each operation answered with each status.
"""
from __future__ import annotations

import asyncio
import json
import os
from collections import Counter

import pytest
import schemathesis
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import negative_data_rejection, response_schema_conformance

from foresight.config import ServerConfig
from foresight.server.app import create_app
from support.fake_engine import ByteTokenizer, FakeEngine, call, outputs_for, running_app
from support.openai_checks import bounded, complete_stream, config, openai_error_shape

MAX_EXAMPLES = 50
# Multi-byte characters, cut wherever max_tokens ends, exercise the incremental detokenizer.
REPLY = "héllo wörld ✓ " * 4


def reply_script(request):
    """At most max_tokens byte tokens of REPLY, in three pieces, like a model that ran out of length."""
    text = REPLY.encode()[:request.max_tokens].decode("utf-8", errors="ignore")
    return outputs_for(text or "x", pieces=3)


def build_app():
    # A context of 512 byte tokens lets most generated prompts through to the (fake) engine.
    engine = FakeEngine(max_model_len=512, script=reply_script)
    return create_app(ServerConfig(), engine=engine, tokenizer=ByteTokenizer())


schema = schemathesis.openapi.from_asgi("/openapi.json", build_app(), config=config(MAX_EXAMPLES))
TALLY: Counter = Counter()


@pytest.fixture(scope="module", autouse=True)
def write_tally():
    yield
    path = os.environ.get("FORESIGHT_SCHEMATHESIS_REPORT")
    if path:
        rows = [{"operation": op, "status": status, "cases": n} for (op, status), n in sorted(TALLY.items())]
        server_errors = sum(n for (_, status), n in TALLY.items() if status >= 500)
        with open(path, "w") as f:
            json.dump({"cases": sum(TALLY.values()), "server_errors": server_errors, "by_status": rows}, f, indent=1)


@schema.parametrize()
@bounded(MAX_EXAMPLES)
def test_api_answers_every_generated_request(case):
    response = case.call()
    TALLY[(f"{case.method} {case.path}", response.status_code)] += 1
    # Not status_code_conformance: FastAPI documents 422 for validation errors, the api answers 400 as
    # OpenAI does. Not positive_data_acceptance: the schema cannot say "one prompt per request" or
    # "prompt + max_tokens within the context", which the api refuses with 400.
    case.validate_response(response, checks=[not_a_server_error, response_schema_conformance,
                                             openai_error_shape, complete_stream])


@schema.include(method="POST").parametrize()
@bounded(MAX_EXAMPLES)
def test_schema_violating_bodies_are_refused(case):
    case.call_and_validate(checks=[negative_data_rejection])


@pytest.mark.parametrize("method,path,body,status", [
    ("PUT", "/v1/completions", b"{}", 405),
    ("GET", "/v1/nothing-here", None, 404),
    ("POST", "/v1/completions", b"\x80", 400),
])
def test_starlette_errors_are_openai_shaped(method, path, body, status):
    async def go():
        async with running_app() as app:
            return await call(app, method, path, body)

    reply = asyncio.run(go())
    assert reply.status == status
    err = reply.json().get("error")
    assert isinstance(err, dict) and err["code"] == status and err["message"]
