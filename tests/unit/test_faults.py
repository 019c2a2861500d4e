"""Fault handling without real workers: restart budgets, heartbeats, the supervisor's decisions, the api's
reader, draining, exit codes, and the sweep of what dead instances left behind."""
from __future__ import annotations

import asyncio
import itertools
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import zmq

from foresight.config import ConfigError, EngineConfig, ServerConfig
from foresight.protocol.leftovers import sweep_stale
from foresight.protocol.liveness import Heartbeats as WorkerHeartbeats
from foresight.protocol.messages import Heartbeat, HiddenLayout, TokenOutput, WorkerReady
from foresight.protocol.owner import owner_tag, parse_owner, pid_namespace
from foresight.server.faults import HeartbeatMonitor, RestartBudget
from foresight.server.shutdown import Drain
from foresight.server.supervisor import DOWN, FAILED, UP, Hooks, Supervisor

from support.fake_engine import DrainEngine

REPO = Path(__file__).resolve().parents[2]


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


# ------------------------------------------------------------------ restart budget and heartbeats


def test_restart_budget_refuses_past_the_limit_and_recovers_after_the_window():
    clock = FakeClock()
    budget = RestartBudget(max_restarts=2, window_s=60, clock=clock)
    assert budget.spend() and budget.spend()
    assert not budget.spend() and budget.used == 2  # a refusal is not counted
    clock.now += 59
    assert not budget.spend()
    clock.now += 1  # the first restart left the window
    assert budget.spend()


def test_zero_restarts_means_the_first_fault_is_fatal():
    assert not RestartBudget(max_restarts=0, window_s=60).spend()


def test_silence_means_hung_and_only_watched_workers_count():
    clock = FakeClock()
    beats = HeartbeatMonitor(timeout_s=5, stall_timeout_s=60, clock=clock)
    beats.beat("target")  # not watched yet (still loading): ignored
    assert beats.hung("target") is None
    beats.watch("target")
    clock.now += 4
    beats.beat("target")
    clock.now += 5
    assert beats.hung("target") is None and beats.silent_for("target") == 5
    clock.now += 0.5
    assert "no heartbeat for 5.5 s" in beats.hung("target")
    beats.forget("target")
    assert beats.hung("target") is None


def test_a_loop_stuck_in_one_step_is_hung_only_past_the_stall_timeout():
    clock = FakeClock()
    beats = HeartbeatMonitor(timeout_s=5, stall_timeout_s=60, clock=clock)
    beats.watch("target")
    beats.beat("target", stalled_s=59.0)  # a long prefill: beating, loop busy
    assert beats.hung("target") is None
    clock.now += 1.5
    assert "not turned for 60 s" in beats.hung("target")
    beats.beat("target", stalled_s=0.2)  # the step ended
    assert beats.hung("target") is None
    off = HeartbeatMonitor(timeout_s=5, stall_timeout_s=0, clock=clock)
    off.watch("target")
    off.beat("target", stalled_s=10_000)
    assert off.hung("target") is None


def test_worker_heartbeats_come_from_a_thread_and_report_the_stall():
    from foresight.protocol.addresses import WorkerAddresses
    from foresight.protocol.sockets import MessageSocket

    clock = FakeClock()
    ctx, addrs = zmq.Context(), WorkerAddresses.fresh()
    pull = MessageSocket(ctx, zmq.PULL, addrs.workers_to_api, bind=True)
    try:
        beats = WorkerHeartbeats(ctx, addrs.workers_to_api, "drafter", interval_s=0.02, clock=clock)
        clock.now += 3  # the loop is busy: no turn() for 3 s
        assert beats.beat().stalled_s == 3
        beats.turn()
        assert beats.beat().stalled_s == 0
        with beats:  # nobody calls turn() here, yet beats keep coming: they do not wait for the loop
            got = [pull.recv(timeout_ms=10_000) for _ in range(3)]
        assert all(isinstance(m, Heartbeat) and m.worker == "drafter" and m.pid == os.getpid() for m in got)
    finally:
        ctx.destroy(linger=0)
        addrs.remove()


def test_fault_config_is_validated():
    for bad in (dict(heartbeat_timeout_s=0.5), dict(heartbeat_timeout_s=float("inf")), dict(drain_timeout_s=-1),
                dict(restart_window_s=0), dict(max_restarts=-1), dict(stall_timeout_s=1.0),
                dict(stall_timeout_s=float("nan"))):
        with pytest.raises(ConfigError):
            ServerConfig(**bad)


def test_serve_flags_reach_the_server_config():
    from foresight.config import server_from_args
    from foresight.cli import build_parser

    args = build_parser().parse_args(["serve", "--drain-timeout", "7", "--heartbeat-timeout", "3",
                                      "--stall-timeout", "0", "--max-restarts", "2", "--restart-window", "60"])
    cfg = server_from_args(args, EngineConfig())
    assert (cfg.drain_timeout_s, cfg.heartbeat_timeout_s, cfg.stall_timeout_s, cfg.max_restarts,
            cfg.restart_window_s) == (7, 3, 0, 2, 60)


# ------------------------------------------------------------------ the supervisor's decisions


class FakeProcess:
    _pids = itertools.count(4_000_000)  # above any real pid_max: sweeping its segments finds nothing

    def __init__(self, name):
        self.name, self.pid, self.exitcode, self.signals = name, next(self._pids), None, []

    def is_alive(self):
        return self.exitcode is None

    def terminate(self):
        self.signals.append("TERM")
        self.exitcode = -15

    def kill(self):
        self.signals.append("KILL")
        self.exitcode = -9


class Events:
    def __init__(self):
        self.log = []

    def hooks(self):
        async def target_lost(reason):
            self.log.append(("target_lost", reason))

        async def drafter_status(up, reason):
            self.log.append(("drafter_status", up))

        return Hooks(state_changed=lambda w, up: self.log.append(("up", w, up)),
                     restarted=lambda w: self.log.append(("restarted", w)),
                     target_lost=target_lost, drafter_status=drafter_status,
                     fatal=lambda reason: self.log.append(("fatal", reason)))


def fake_supervisor(events: Events, max_restarts=5) -> Supervisor:
    """A Supervisor whose spawns make fake processes that are ready at once (or fail, for the names put
    in its `fail_starts`)."""
    from foresight.protocol.addresses import WorkerAddresses

    sup = Supervisor(EngineConfig(), WorkerAddresses("ipc://a", "ipc://b", "ipc://c", "ipc://d"),
                     max_restarts=max_restarts, restart_window_s=600, heartbeat_timeout_s=5, hooks=events.hooks())
    sup.fail_starts = set()

    async def spawn(name, args):
        from foresight.server.supervisor import WorkerStartError

        handle = sup.workers[name]
        handle.process = FakeProcess(name)
        if name in sup.fail_starts:
            handle.process.exitcode = 1
            raise WorkerStartError(f"{name} worker exited during start-up")
        handle.ready = WorkerReady(worker=name, pid=handle.process.pid, layout=HiddenLayout((1,), 8), info={
            "strategies": ["ar", "sync"], "auto_strategies": ["ar", "sync"]})
        sup.heartbeats.watch(name)
        sup._set_state(name, UP)
        return handle.ready

    sup._spawn = spawn
    return sup


async def settle(sup: Supervisor) -> None:
    if sup._drafter_restart is not None:
        await sup._drafter_restart


def test_dead_drafter_is_replaced_while_the_target_keeps_running():
    async def go():
        events = Events()
        sup = fake_supervisor(events)
        await sup._start_pair()
        target, drafter = sup.workers["target"].process, sup.workers["drafter"].process
        drafter.exitcode = -9  # killed
        await sup._check()
        assert sup.healthy and sup.degraded  # serving, without the drafter
        await settle(sup)
        assert sup.workers["target"].process is target and target.signals == []  # untouched
        assert sup.workers["drafter"].process is not drafter and sup.workers["drafter"].state == UP
        assert sup.workers["drafter"].restarts == 1 and not sup.degraded
        assert [e for e in events.log if e[0] in ("drafter_status", "restarted", "target_lost")] == [
            ("drafter_status", False), ("restarted", "drafter"), ("drafter_status", True)]
        assert "exited with code -9" in sup.workers["drafter"].last_fault
    asyncio.run(go())


def test_hung_drafter_is_killed_and_replaced():
    async def go():
        events = Events()
        sup = fake_supervisor(events)
        await sup._start_pair()
        drafter = sup.workers["drafter"].process
        sup.heartbeats._last["drafter"] = (time.monotonic() - 6, 0.0)  # silent for longer than the 5 s timeout
        await sup._check()
        assert drafter.signals == ["KILL"]  # SIGKILL: a stopped process would never act on SIGTERM
        await settle(sup)
        assert sup.workers["drafter"].state == UP and "hung" in sup.workers["drafter"].last_fault
    asyncio.run(go())


def test_target_fault_fails_requests_and_restarts_the_pair():
    async def go():
        events = Events()
        sup = fake_supervisor(events)
        await sup._start_pair()
        old = {n: sup.workers[n].process for n in ("target", "drafter")}
        old["target"].exitcode = 1
        await sup._check()
        assert ("target_lost", "the target worker exited with code 1") in events.log
        assert old["drafter"].signals == ["KILL"]
        assert all(sup.workers[n].process is not old[n] and sup.workers[n].state == UP for n in old)
        assert ("restarted", "target") in events.log
    asyncio.run(go())


def test_late_news_of_a_replaced_incarnation_is_ignored():
    async def go():
        events = Events()
        sup = fake_supervisor(events)
        await sup._start_pair()
        old_pid = sup.workers["drafter"].pid
        await sup.fault("drafter", "died (RuntimeError)", pid=old_pid)
        await settle(sup)
        await sup.fault("drafter", "died (RuntimeError)", pid=old_pid)  # e.g. its WorkerDead arrives late
        await settle(sup)
        assert sup.workers["drafter"].restarts == 1
        sup.on_heartbeat(Heartbeat(worker="drafter", pid=old_pid))  # a beat of the dead one: no effect
    asyncio.run(go())


def test_spent_budget_is_fatal():
    async def go():
        events = Events()
        sup = fake_supervisor(events, max_restarts=1)
        await sup._start_pair()
        sup.workers["drafter"].process.exitcode = -9
        await sup._check()
        await settle(sup)
        sup.workers["drafter"].process.exitcode = -9
        await sup._check()
        await settle(sup)
        assert sup.workers["drafter"].state == FAILED
        assert events.log[-1][0] == "fatal" and "drafter" in events.log[-1][1]
        assert sup.healthy  # the target still serves while the api drains
    asyncio.run(go())


def test_failed_restarts_spend_the_budget_then_give_up(monkeypatch):
    import foresight.server.supervisor as supervisor_module

    monkeypatch.setattr(supervisor_module, "RETRY_DELAY_S", 0.0)

    async def go():
        events = Events()
        sup = fake_supervisor(events, max_restarts=3)
        await sup._start_pair()
        sup.workers["drafter"].process.exitcode = -9
        sup.fail_starts.add("drafter")  # every new drafter exits during start-up
        await sup._check()
        await settle(sup)
        assert sup.workers["drafter"].restarts == 3 and sup.workers["drafter"].state == FAILED
        assert events.log[-1][0] == "fatal"
    asyncio.run(go())


def test_stop_terminates_gracefully_and_marks_workers_down():
    async def go():
        events = Events()
        sup = fake_supervisor(events)
        await sup._start_pair()
        procs = [sup.workers[n].process for n in ("target", "drafter")]
        await sup.stop()
        assert all(p.signals == ["TERM"] for p in procs)
        assert all(sup.workers[n].state == DOWN and sup.workers[n].process is None for n in sup.workers)
    asyncio.run(go())


# ------------------------------------------------------------------ the api side: reader, health, drain, exit


def test_reader_survives_a_bad_message_and_is_restarted_if_it_dies(caplog):
    from foresight.protocol.sockets import MessageSocket
    from foresight.server.engine_client import EngineClient

    async def go():
        engine = EngineClient(EngineConfig())
        engine.supervisor.workers["target"].state = UP
        seen = []

        def on_tokens(msg):
            if msg.req_id == "bad":
                raise RuntimeError("handler bug")
            seen.append(msg.req_id)

        engine.handlers[TokenOutput] = on_tokens
        push = MessageSocket(zmq.Context.instance(), zmq.PUSH, engine.addrs.workers_to_api, bind=False)
        try:
            engine._start_reader()
            for rid in ("bad", "good"):
                push.send(TokenOutput(req_id=rid, token_ids=[1]))
            await wait_until(lambda: seen == ["good"])
            assert engine.healthy
            # The reader itself dies (here: its socket fails): unhealthy, logged, then running again.
            real_recv = engine.recv_from_workers.recv

            async def broken(*a, **k):
                engine.recv_from_workers.recv = real_recv
                raise zmq.ZMQError(zmq.ETERM)

            engine.recv_from_workers.recv = broken
            push.send(TokenOutput(req_id="wake", token_ids=[1]))
            await wait_until(lambda: not engine.reading)
            assert not engine.healthy and engine.health()["status"] == "unavailable"
            await wait_until(lambda: engine.reading)
            push.send(TokenOutput(req_id="after", token_ids=[1]))
            await wait_until(lambda: "after" in seen)
        finally:
            push.close()
            engine._reader.cancel()
            engine.ctx.destroy(linger=0)
            engine.addrs.remove()
        assert "could not be handled" in caplog.text and "reader of worker messages died" in caplog.text

    asyncio.run(go())


async def wait_until(cond, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition never became true"
        await asyncio.sleep(0.01)


def test_health_is_200_degraded_without_the_drafter_and_503_without_the_target():
    from support.fake_engine import ByteTokenizer, call

    from foresight.server.app import create_app
    from foresight.server.engine_client import EngineClient
    from foresight.server.metrics import ServerMetrics

    async def go():
        engine = EngineClient(EngineConfig(), metrics=ServerMetrics("m"))
        engine.start = engine.stop = _noop
        engine.target_info = lambda: {"max_model_len": 64}
        engine._reader = asyncio.ensure_future(asyncio.Event().wait())
        app = create_app(ServerConfig(), engine=engine, tokenizer=ByteTokenizer())
        workers = engine.supervisor.workers
        try:
            async with app.router.lifespan_context(app):
                workers["target"].state, workers["drafter"].state = UP, "restarting"
                reply = await call(app, "GET", "/health")
                assert reply.status == 200 and reply.json()["status"] == "degraded"
                assert reply.json()["worker_state"]["drafter"]["state"] == "restarting"
                workers["drafter"].state = UP
                assert (await call(app, "GET", "/health")).json()["status"] == "ok"
                workers["target"].state = DOWN
                reply = await call(app, "GET", "/health")
                assert reply.status == 503 and reply.json()["status"] == "unavailable"
        finally:
            engine._reader.cancel()
            engine.ctx.destroy(linger=0)
            engine.addrs.remove()

    asyncio.run(go())


async def _noop():
    pass


def test_drain_waits_for_in_flight_requests_then_finishes():
    async def go():
        engine, done = DrainEngine(2), asyncio.Event()
        drain = Drain(engine, timeout_s=30)
        drain.on_done = done.set
        drain.begin()
        assert drain.draining and not engine.admitting
        await asyncio.sleep(0.3)
        assert not done.is_set()
        engine.in_flight = 0
        await asyncio.wait_for(done.wait(), 5)
        assert engine.aborted is None and drain.exit_code == 0
    asyncio.run(go())


def test_drain_aborts_what_is_left_after_its_timeout():
    async def go():
        engine, done = DrainEngine(1), asyncio.Event()
        drain = Drain(engine, timeout_s=0.2)
        drain.on_done = done.set
        drain.begin()
        await asyncio.wait_for(done.wait(), 5)
        assert "drain timeout" in engine.aborted
    asyncio.run(go())


def test_engine_giving_up_drains_and_exits_non_zero():
    from support.fake_engine import FakeEngine, running_app

    async def go():
        engine = FakeEngine()
        async with running_app(engine) as app:
            engine.on_fatal("the drafter worker failed more than 5 times within 600 s")
            await asyncio.wait_for(app.state.drain.task, 5)
            assert app.state.drain.exit_code == 1
            app.state.drain.begin(exit_code=0)  # a later SIGTERM does not turn it into a success
            assert app.state.drain.exit_code == 1
    asyncio.run(go())


def test_draining_server_answers_new_requests_503():
    from support.fake_engine import call, running_app

    async def go():
        async with running_app() as app:
            app.state.drain.begin()
            reply = await call(app, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2})
            assert reply.status == 503 and "shutting down" in reply.json()["error"]["message"]
    asyncio.run(go())


def test_abort_all_fails_admitted_and_queued_requests_with_the_reason():
    from foresight.protocol.messages import GenerateRequest, SamplingParams
    from foresight.server.engine_client import EngineClient, RequestError

    class Sink:
        def __init__(self):
            self.sent = []

        async def send(self, msg):
            self.sent.append(msg)

    async def go():
        engine = EngineClient(EngineConfig(), max_num_seqs=1)
        engine.send_to_target.socket.close(linger=0)
        engine.send_to_target = Sink()
        engine.supervisor.workers["target"].state = UP
        engine._reader = asyncio.ensure_future(asyncio.Event().wait())

        async def run(rid):
            req = GenerateRequest(req_id=rid, prompt_ids=[1], max_tokens=4, sampling=SamplingParams())
            async for _ in engine.generate(req):
                pass

        try:
            tasks = [asyncio.ensure_future(run(r)) for r in ("a", "b")]  # "b" waits for the only slot
            await wait_until(lambda: engine.running == 1 and engine.waiting == 1)
            await engine.abort_all("stopped by the drain")
            for task in tasks:
                with pytest.raises(RequestError) as err:
                    await task
                assert err.value.status == 503 and err.value.public and "drain" in str(err.value)
            assert engine.in_flight == 0
            assert [m.req_id for m in engine.send_to_target.sent if type(m).__name__ == "AbortRequest"] == ["a"]
        finally:
            engine._reader.cancel()
            engine.ctx.destroy(linger=0)
            engine.addrs.remove()
    asyncio.run(go())


# ------------------------------------------------------------------ leftovers of dead instances


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_sweep_removes_only_leftovers_of_dead_owners_in_our_namespace(tmp_path):
    tmp, shm = tmp_path / "tmp", tmp_path / "shm"
    tmp.mkdir()
    shm.mkdir()
    dead, live, ns = dead_pid(), os.getppid(), pid_namespace()
    names = {
        "dead": f"{dead}x{ns}", "live": f"{live}x{ns}", "mine": owner_tag(),
        "other_ns": f"{dead}x{ns + 1}",  # another container's /dev/shm view: its pids are not ours to judge
    }
    for key, tag in names.items():
        (tmp / f"foresight-zmq-{tag}-abc123").mkdir()
        (tmp / f"foresight-zmq-{tag}-abc123" / "api_to_target").touch()
        (shm / f"foresight_{tag}_0_deadbeef").touch()
    (tmp / "foresight-zmq-legacy9").mkdir()  # the old naming: no owner to check, left alone
    (shm / "foresight_123_4_cafe").touch()
    (shm / "sem.mp-abc").touch()

    swept = sweep_stale(tmp, shm)

    assert (swept.folders, swept.segments) == (1, 1)
    assert not (tmp / f"foresight-zmq-{names['dead']}-abc123").exists()
    assert not (shm / f"foresight_{names['dead']}_0_deadbeef").exists()
    for key in ("live", "mine", "other_ns"):
        assert (tmp / f"foresight-zmq-{names[key]}-abc123").exists(), key
        assert (shm / f"foresight_{names[key]}_0_deadbeef").exists(), key
    assert (tmp / "foresight-zmq-legacy9").exists() and (shm / "foresight_123_4_cafe").exists()


def test_owner_tags_parse_and_new_addresses_carry_ours():
    from foresight.protocol.addresses import WorkerAddresses

    assert parse_owner("12x34_0_ab") == (12, 34) and parse_owner("12x34-abc") == (12, 34)
    assert parse_owner("123_4_cafe") is None and parse_owner("12x34y") is None
    addrs = WorkerAddresses.fresh()
    try:
        assert addrs.directory.name.startswith(f"foresight-zmq-{owner_tag()}-")
    finally:
        addrs.remove()
    assert not addrs.directory.exists()


# ------------------------------------------------------------------ a worker process's signals


def test_worker_process_exits_cleanly_on_sigterm_and_ignores_sigint():
    code = textwrap.dedent("""
        import time
        from foresight.protocol.liveness import prepare_worker_process
        prepare_worker_process()
        print("ready", flush=True)
        try:
            while True:
                time.sleep(0.05)
        finally:
            print("cleanup ran", flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGINT)
        time.sleep(0.3)
        assert proc.poll() is None, "SIGINT stopped a worker; only the api decides that"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert "cleanup ran" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()


# ------------------------------------------------------------------ CUDA IPC flag segments (no GPU needed)


def cpu_ring(slots=4):
    """A CUDA IPC ring with only its CPU half: the shared flag segment (what must never leak)."""
    from foresight.protocol.cuda_ipc import _Ring
    from foresight.protocol.transport import SHM_PREFIX, _open_shm

    ring = object.__new__(_Ring)
    ring.name = f"{SHM_PREFIX}{owner_tag()}_cuda_test{os.urandom(2).hex()}"
    ring.flags = _open_shm(ring.name, slots, create=True)
    ring.bufs = [None] * slots
    return ring


def test_lost_receiver_frees_every_slot_and_close_unlinks_the_flags():
    from foresight.protocol.cuda_ipc import CudaIpcSender
    from foresight.protocol.transport import TensorTransport, shm_segments

    ring = cpu_ring()
    sender = CudaIpcSender(4, 1024, 1.0)
    sender.rings[0] = ring
    transport = TensorTransport()
    transport._cuda_tx = sender
    ring.flags.buf[1] = ring.flags.buf[3] = 1  # held by a receiver that then died
    transport.peer_lost()
    assert bytes(ring.flags.buf[:4]) == b"\0\0\0\0"
    assert ring.name in shm_segments(os.getpid())
    transport.close()
    assert ring.name not in shm_segments(os.getpid())


def test_worker_lifetime_closes_the_transport_whatever_ends_the_worker():
    from foresight.protocol.addresses import WorkerAddresses
    from foresight.protocol.cuda_ipc import CudaIpcSender
    from foresight.protocol.liveness import worker_lifetime
    from foresight.protocol.transport import default_transport, shm_segments

    transport = default_transport()
    for ending in (SystemExit(0), RuntimeError("loop bug")):
        ring = cpu_ring()
        transport._cuda_tx = CudaIpcSender(4, 1024, 1.0)
        transport._cuda_tx.rings[0] = ring
        addrs = WorkerAddresses.fresh()
        try:
            with pytest.raises(type(ending)):
                with worker_lifetime(zmq.Context(), addrs, "drafter"):
                    raise ending
        finally:
            addrs.remove()
        assert ring.name not in shm_segments(os.getpid()) and transport._cuda_tx is None
