"""Request building in the api: defaults from the server config, context checks before model work."""
from types import SimpleNamespace

import pytest

from foresight.config import EngineConfig
from foresight.server.openai_schemas import ChatCompletionRequest, CompletionRequest
from foresight.server.serving import BadRequest, RequestRunner


def runner(**cfg):
    engine = SimpleNamespace(cfg=EngineConfig(**cfg))
    return RequestRunner(engine, tokenizer=None, model_name="m", max_model_len=100)


def test_server_verification_is_the_default_and_requests_override_it():
    r = runner(verification="nucleus", nucleus_threshold=0.8)
    req = r.build(CompletionRequest(prompt=[1, 2, 3]), [1, 2, 3], "prompt")
    assert (req.sampling.verification, req.sampling.nucleus_threshold) == ("nucleus", 0.8)
    body = CompletionRequest(prompt=[1], verification="exact", nucleus_threshold=0.5, max_tokens=3)
    req = r.build(body, [1], "prompt")
    assert (req.sampling.verification, req.sampling.nucleus_threshold, req.max_tokens) == ("exact", 0.5, 3)


def test_context_limits_name_the_parameter():
    r = runner()
    with pytest.raises(BadRequest) as info:
        r.build(CompletionRequest(prompt=[1]), list(range(100)), "prompt")
    assert info.value.param == "prompt"
    with pytest.raises(BadRequest) as info:
        r.build(CompletionRequest(prompt=[1], max_tokens=60), list(range(50)), "prompt")
    assert info.value.param == "max_tokens"
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}])
    assert r.build(chat, list(range(30)), "messages").max_tokens == 70  # unset: the rest of the context


@pytest.mark.parametrize("field,value", [("nucleus_threshold", 0.0), ("nucleus_threshold", 1.5),
                                         ("verification", "loose"), ("top_p", 0.0), ("temperature", -1)])
def test_schema_rejects_out_of_range(field, value):
    from pydantic import ValidationError

    with pytest.raises(ValidationError) as info:
        CompletionRequest(prompt="x", **{field: value})
    assert info.value.errors()[0]["loc"][0] == field
