"""Workers pinned to their own cores (`--target-cores`, `--drafter-cores`; placement.py): the lists
parse and are validated where the flags are read, a pinned process and the threads it starts stay on its cores,
and the api takes what is left."""
from __future__ import annotations

import multiprocessing as mp
import os

import pytest

from foresight.config import ConfigError, EngineConfig, check_cores_exist, parse_cores
from foresight.placement import api_cores, pin_worker


def test_core_lists_parse_like_taskset_takes_them():
    assert parse_cores("0-3,8", "x") == (0, 1, 2, 3, 8)
    assert parse_cores(" 2, 0 ,1-1", "x") == (0, 1, 2)
    assert parse_cores("", "x") == ()


@pytest.mark.parametrize("fields, message", [
    ({"target_cores": "0-1", "drafter_cores": "1-2"}, "overlap"),
    ({"target_cores": "a"}, "target_cores: 'a' is not a core"),
    ({"drafter_cores": "3-1"}, "drafter_cores: '3-1'"),
    ({"drafter_cores": "1-"}, "drafter_cores: '1-'"),
    ({"drafter_cores": ","}, "drafter_cores: no core"),
    ({"target_cores": "0", "target_threads": 2}, "target_threads: 2 threads on 1 core"),
])
def test_bad_core_lists_are_refused_naming_the_flag(fields, message):
    with pytest.raises(ConfigError, match=message):
        EngineConfig(**fields)


def test_cores_this_process_cannot_run_on_are_refused():
    missing = max(os.sched_getaffinity(0)) + 1
    with pytest.raises(ConfigError, match=f"drafter_cores: core\\(s\\) {missing} do not exist"):
        check_cores_exist(EngineConfig(drafter_cores=str(missing)))
    check_cores_exist(EngineConfig(target_cores=str(min(os.sched_getaffinity(0)))))


def test_the_api_takes_the_cores_the_workers_leave():
    assert api_cores(EngineConfig(), {0, 1, 2, 3}) == ()  # nothing pinned: nothing to do
    assert api_cores(EngineConfig(target_cores="0-1", drafter_cores="2"), {0, 1, 2, 3}) == (3,)
    assert api_cores(EngineConfig(target_cores="0", drafter_cores="1"), {0, 1}) == ()  # none left


def _report_cores(cfg_dict: dict, queue) -> None:
    """A spawned worker: a thread started before it pins (as the parent watcher is), the pin, then a thread started
    after; reports the masks of the process and of both threads."""
    import threading

    pinned, seen = threading.Event(), {}

    def early() -> None:
        pinned.wait()
        seen["early"] = os.sched_getaffinity(0)

    before = threading.Thread(target=early)
    before.start()
    pin_worker(EngineConfig.from_dict(cfg_dict), "target")
    pinned.set()
    before.join()
    after = threading.Thread(target=lambda: seen.update(late=os.sched_getaffinity(0)))
    after.start()
    after.join()
    queue.put((sorted(os.sched_getaffinity(0)), sorted(seen["early"]), sorted(seen["late"])))


def test_a_pinned_worker_and_its_threads_run_on_its_cores_only():
    before = os.sched_getaffinity(0)
    core = min(before)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_report_cores, args=(EngineConfig(target_cores=str(core)).to_dict(), queue))
    proc.start()
    process_cores, early_thread, late_thread = queue.get(timeout=60)
    proc.join(timeout=30)
    assert process_cores == early_thread == late_thread == [core]
    assert os.sched_getaffinity(0) == before  # the parent is untouched
