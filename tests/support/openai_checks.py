"""Schemathesis checks shared by the in-process and the live-server runs: what every answer of the api
must look like, whatever request produced it."""
from __future__ import annotations

import json

import schemathesis
from hypothesis import HealthCheck, settings


def bounded(max_examples: int) -> settings:
    """derandomize: CI sees the same cases every run; no deadline: a loaded CI machine is slow, not wrong."""
    return settings(max_examples=max_examples, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


def config(max_examples: int, coverage: bool = True) -> schemathesis.Config:
    """The coverage phase adds a fixed set of boundary and method cases on top of max_examples."""
    return schemathesis.Config.from_dict({
        "generation": {"max-examples": max_examples, "deterministic": True},
        "phases": {"coverage": {"enabled": coverage}}})


def openai_error_shape(ctx, response, case):
    """Every 4xx carries an OpenAI error object whose code is the status."""
    status = response.status_code
    if not 400 <= status < 500:
        return None
    body = json.loads(response.content)
    err = body.get("error") if isinstance(body, dict) else None
    assert isinstance(err, dict) and set(err) == {"message", "type", "param", "code"}, body
    assert err["code"] == status and isinstance(err["message"], str) and err["message"], body
    assert isinstance(err["type"], str) and (err["param"] is None or isinstance(err["param"], str)), body
    return None


def complete_stream(ctx, response, case):
    """A 200 event stream ends with `data: [DONE]` (a timeout or a failure still ends it that way)."""
    content_type = response.headers.get("content-type", [""])[0]
    if response.status_code == 200 and content_type.startswith("text/event-stream"):
        events = [line for line in response.content.decode().splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "data: [DONE]", events[-3:]
    return None
