"""Schemathesis against a real `foresight serve` (the session's live_server): generated requests reach the
real tokenizer, chat template and workers, which the in-process run (tests/unit/test_schemathesis.py)
fakes. A handful of valid and invalid cases per operation, every body's max_tokens forced to 2, so that
it stays within seconds on a CPU.

The schema is loaded inside the test (schemathesis' `pytest.from_fixture` fails under pytest 9.2: it
reads `request.node._nodeid`, which pytest no longer has), so hypothesis runs per operation here.
"""
from __future__ import annotations

import pytest
import schemathesis
from hypothesis import given, strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from support.openai_checks import bounded, complete_stream, config, openai_error_shape

pytestmark = pytest.mark.integration
MAX_EXAMPLES = 25
MAX_TOKENS = 2
OPERATIONS = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
              ("GET", "/health")]


@pytest.fixture(scope="module")
def live_schema(live_server):
    return schemathesis.openapi.from_url(f"{live_server}/openapi.json", config=config(MAX_EXAMPLES))


@pytest.mark.parametrize("method,path", OPERATIONS)
def test_real_server_answers_generated_requests(live_schema, method, path):
    operation = live_schema[path][method]

    @given(case=st.one_of(*(operation.as_strategy(mode) for mode in GenerationMode)))
    @bounded(MAX_EXAMPLES)
    def answer(case):
        if isinstance(case.body, dict):
            # Generated bodies may ask for the whole context; two tokens exercise the same paths.
            case.body["max_tokens"] = MAX_TOKENS
        response = case.call(timeout=120)
        case.validate_response(response, checks=[not_a_server_error, openai_error_shape, complete_stream])

    answer()
