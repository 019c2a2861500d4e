"""The edges a load balancer meets: stop signals during start-up and mid-drain, slow clients.

The protocol tests run a real uvicorn server (the h11 protocol the product uses) on a loopback port and talk
to it over raw sockets, so what is tested is what a slow client meets."""
from __future__ import annotations

import asyncio
import json
import signal
import socket
import tempfile
import threading
import time

import pytest
import uvicorn

from foresight.config import ConfigError, ServerConfig
from foresight.protocol.addresses import WorkerAddresses
from foresight.protocol.leftovers import remove_own_folders
from foresight.protocol.owner import owner_tag
from foresight.server.connections import header_timeout_protocol
from foresight.server.middleware import BodyLimit
from foresight.server.shutdown import STOPPED_NOW, Drain, DrainingServer

from support.fake_engine import DrainEngine


def test_a_stop_during_start_up_cancels_it_and_says_so():
    async def go():
        drain, done = Drain(DrainEngine(0), timeout_s=30), asyncio.Event()
        drain.on_done = done.set
        cancelled = asyncio.Event()

        async def slow_start():
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                cancelled.set()
                raise

        starting = asyncio.create_task(drain.starting(slow_start()))
        await asyncio.sleep(0.05)
        drain.begin(0, "SIGTERM")
        assert await asyncio.wait_for(starting, 5) is False
        assert cancelled.is_set()
        await asyncio.wait_for(done.wait(), 5)
        assert drain.exit_code == 0
    asyncio.run(go())


def test_a_finished_start_up_is_true_and_a_start_cancelled_from_outside_raises():
    async def go():
        drain = Drain(DrainEngine(0), timeout_s=30)
        assert await drain.starting(asyncio.sleep(0)) is True
        outer = asyncio.create_task(Drain(DrainEngine(0), timeout_s=30).starting(asyncio.sleep(60)))
        await asyncio.sleep(0.05)
        outer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await outer
    asyncio.run(go())


def test_a_second_interrupt_aborts_the_drain_at_once():
    async def go():
        engine, done = DrainEngine(2), asyncio.Event()
        drain = Drain(engine, timeout_s=600)
        drain.on_done = done.set
        drain.abort_now()  # not draining: nothing to abort
        assert engine.aborted is None and not drain.aborting
        drain.begin()
        await asyncio.sleep(0.2)
        assert not done.is_set()
        drain.abort_now()
        await asyncio.wait_for(done.wait(), 5)
        assert engine.aborted == STOPPED_NOW and drain.exit_code == 0
    asyncio.run(go())


def test_signals_route_first_to_the_drain_then_to_the_abort_then_to_a_forced_exit():
    async def go():
        drain = Drain(DrainEngine(1), timeout_s=600)
        server = DrainingServer(uvicorn.Config(app=None), drain)
        server._loop = asyncio.get_running_loop()
        server.handle_exit(signal.SIGINT, None)
        await asyncio.sleep(0.05)
        assert drain.draining and not drain.aborting and not server.should_exit
        server.handle_exit(signal.SIGINT, None)
        await asyncio.sleep(0.05)
        assert drain.aborting and not server.force_exit
        server.handle_exit(signal.SIGINT, None)
        assert server.force_exit and server.should_exit
    asyncio.run(go())


def test_a_second_sigterm_does_not_abort_the_drain():
    async def go():
        drain = Drain(DrainEngine(1), timeout_s=600)
        server = DrainingServer(uvicorn.Config(app=None), drain)
        server._loop = asyncio.get_running_loop()
        for _ in range(2):
            server.handle_exit(signal.SIGTERM, None)
            await asyncio.sleep(0.05)
        assert drain.draining and not drain.aborting and not server.force_exit
        drain.task.cancel()
    asyncio.run(go())


def test_own_socket_folders_are_removed_and_no_one_elses(tmp_path):
    mine = WorkerAddresses.fresh(tempfile.mkdtemp(prefix="foresight-zmq-x-", dir=tmp_path))  # no owner tag
    own = tmp_path / f"foresight-zmq-{owner_tag()}-abc"
    own.mkdir()
    other = tmp_path / "foresight-zmq-1x1-abc"
    other.mkdir()
    assert remove_own_folders(tmp_path) == 1
    assert not own.exists() and other.exists() and mine.directory.exists()


def test_slow_client_settings_are_validated():
    with pytest.raises(ConfigError, match="header_timeout"):
        ServerConfig(header_timeout_s=0)
    with pytest.raises(ConfigError, match="body_timeout"):
        ServerConfig(body_timeout_s=float("inf"))
    with pytest.raises(ConfigError, match="max_connections"):
        ServerConfig(max_connections=0)


# ---------------------------------------------------------------- slow clients, on a real uvicorn server

async def echo_app(scope, receive, send):
    """Answers every request with the length of its body."""
    if scope["type"] != "http":
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    payload = json.dumps({"bytes": len(body)}).encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})


SLOW_S = 2.0  # the header and body timeouts of the test server


@pytest.fixture
def slow_server():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(BodyLimit(echo_app, max_bytes=1 << 20, timeout_s=SLOW_S), log_level="warning",
                            http=header_timeout_protocol(SLOW_S), lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    yield port
    server.should_exit = True
    thread.join(timeout=10)


def read_all(conn: socket.socket, timeout_s: float = 10.0) -> bytes:
    """What the server sends until it closes the connection."""
    conn.settimeout(timeout_s)
    data = b""
    while chunk := conn.recv(65536):
        data += chunk
    return data


def test_headers_that_never_finish_get_408_and_the_connection_closes(slow_server):
    with socket.create_connection(("127.0.0.1", slow_server)) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        cut_off = False
        for _ in range(20):  # a header line every SLOW_S / 4 for 5 x SLOW_S, as a slow client trickles them
            time.sleep(SLOW_S / 4)
            try:
                conn.sendall(b"X-Slow: 1\r\n")
            except OSError:  # the server closed the connection: the bytes bought no time
                cut_off = True
                break
        assert cut_off, "a connection that kept sending header bytes was never closed"
        reply = read_all(conn)
    assert reply.startswith(b"HTTP/1.1 408"), reply
    assert b"--header-timeout" in reply


def test_a_body_that_never_finishes_gets_408(slow_server):
    with socket.create_connection(("127.0.0.1", slow_server)) as conn:
        conn.sendall(b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n" + b"a" * 10)
        reply = read_all(conn)
    assert reply.startswith(b"HTTP/1.1 408"), reply
    assert b"--body-timeout" in reply


def test_prompt_clients_are_served_and_kept_alive_past_the_header_timeout(slow_server):
    request = b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello"
    with socket.create_connection(("127.0.0.1", slow_server)) as conn:
        conn.settimeout(10)
        for _ in range(4):  # four requests over 3.2 s on one connection: each has its own SLOW_S
            conn.sendall(request)
            reply = b""
            while not reply.endswith(b'{"bytes": 5}'):  # the body may come in a segment of its own
                chunk = conn.recv(65536)
                assert chunk, f"the connection was closed after {reply!r}"
                reply += chunk
            assert reply.startswith(b"HTTP/1.1 200"), reply
            time.sleep(0.4 * SLOW_S)


def test_an_idle_connection_is_closed_without_a_408(slow_server):
    """A connection that sends nothing is closed at the header deadline without a response: a 408 on an
    idle kept-alive connection could be taken for the answer to the client's next request."""
    with socket.create_connection(("127.0.0.1", slow_server)) as conn:
        assert read_all(conn) == b""
