"""Request building in the api: defaults from the server config, context checks before model work."""
from types import SimpleNamespace

import pytest

from foresight.config import EngineConfig
from foresight.server.openai_schemas import ChatCompletionRequest, CompletionRequest
from foresight.server.serving import BadRequest, RequestRunner
from support.fake_engine import RecordingSocket


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


def test_tiny_temperatures_are_greedy():
    r = runner()
    for t, expected in ((1e-40, 0.0), (0.0, 0.0), (0.7, 0.7)):
        assert r.build(CompletionRequest(prompt=[1], temperature=t), [1], "prompt").sampling.temperature == expected


# ------------------------------------------------------------------ the real EngineClient, no workers



def engine_client(max_num_seqs=1, **kwargs):
    import asyncio
    import shutil
    from pathlib import Path

    from foresight.server.engine_client import EngineClient

    engine = EngineClient(EngineConfig(), max_num_seqs=max_num_seqs, **{"max_waiting": 4, **kwargs})
    engine.send_to_target.socket.close(linger=0)
    engine.send_to_target = RecordingSocket()
    engine.supervisor.workers["target"].state = "up"
    engine._reader = asyncio.ensure_future(asyncio.Event().wait())  # stands for the reader of worker messages

    def close():
        engine._reader.cancel()
        engine.ctx.destroy(linger=0)
        shutil.rmtree(Path(engine.addrs.api_to_target.removeprefix("ipc://")).parent, ignore_errors=True)
    return engine, close


def gen_request(req_id="r1"):
    from foresight.protocol.messages import GenerateRequest, SamplingParams

    return GenerateRequest(req_id=req_id, prompt_ids=[1, 2], max_tokens=4, sampling=SamplingParams())


async def first_output(engine, output):
    """Start request r1 on `engine`, deliver `output` as the worker would; (the generator, its first item)."""
    import asyncio

    gen = engine.generate(gen_request())
    first = asyncio.ensure_future(anext(gen))
    while "r1" not in engine.queues:
        await asyncio.sleep(0)
    engine.queues["r1"].put_nowait(output)
    return gen, await first


def test_slot_is_freed_when_the_worker_finishes_not_when_the_client_reads():
    import asyncio

    from foresight.protocol.messages import AbortRequest, TokenOutput

    async def go():
        engine, close = engine_client()
        try:
            gen, first = await first_output(engine, TokenOutput(req_id="r1", token_ids=[5], finished=True,
                                                                finish_reason="length"))
            assert first.finished
            # The consumer has not come back for more (a slow client): the slot is free already.
            assert engine.running == 0 and engine.kv_reserved == 0 and "r1" not in engine.queues
            await gen.aclose()
            assert engine.running == 0 and engine.kv_reserved == 0 and engine.in_flight == 0
            assert not any(isinstance(m, AbortRequest) for m in engine.send_to_target.sent)
        finally:
            close()
    asyncio.run(go())


def test_leaving_an_unfinished_request_aborts_it_and_frees_the_slot():
    import asyncio

    from foresight.protocol.messages import AbortRequest, TokenOutput

    async def go():
        engine, close = engine_client()
        try:
            gen, _ = await first_output(engine, TokenOutput(req_id="r1", token_ids=[5]))
            second = asyncio.ensure_future(anext(gen))
            await asyncio.sleep(0)
            second.cancel()  # what the api does when the client leaves or the time is up
            await asyncio.wait({second})
            assert engine.running == 0 and engine.kv_reserved == 0 and engine.in_flight == 0
            assert [m.req_id for m in engine.send_to_target.sent if isinstance(m, AbortRequest)] == ["r1"]
        finally:
            close()
    asyncio.run(go())
