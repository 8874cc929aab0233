"""runner/openmp_pool.py: a thread's OpenMP team is freed when it is done with the model, so the
next thread to compute is the only team in the process (libgomp throttles every team's barrier
spinning once teams hold more threads than there are CPUs)."""
from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from specserve.runner.openmp_pool import release_thread_team


def _thread_ids() -> set[str]:
    return set(os.listdir("/proc/self/task"))


def _threads_once_ended(team: set[str], timeout_s: float = 5.0) -> set[str]:
    """The process's threads once the team's have ended, or at the timeout: the runtime's workers
    exit on their own after the release returns (one was still listed in a run on a busy VM)."""
    deadline = time.monotonic() + timeout_s
    while True:
        threads = _thread_ids()
        if not team & threads or time.monotonic() > deadline:
            return threads
        time.sleep(0.01)


def _parallel_work() -> None:
    torch.ones(1 << 22).mul_(2.0).sum()


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc to count threads")
def test_releasing_a_thread_team_ends_its_worker_threads() -> None:
    previous = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        seen: dict[str, set[str] | int] = {}
        before = _thread_ids()

        def compute_then_release() -> None:
            own = str(threading.get_native_id())
            _parallel_work()
            seen["team"] = _thread_ids() - before - {own}      # the team's workers (and any stray thread)
            seen["released"] = int(release_thread_team())
            seen["after"] = _threads_once_ended(seen["team"])

        worker = threading.Thread(target=compute_then_release)
        worker.start()
        worker.join()
    finally:
        torch.set_num_threads(previous)
    if not seen["released"]:
        pytest.skip("this torch build's OpenMP runtime has no omp_pause_resource_all")
    # a team of 3 = the caller + 2 workers, both ended; thread ids, not counts, so threads that
    # other tests left behind starting or ending meanwhile do not count
    assert len(seen["team"]) >= 2 and len(seen["team"] - seen["after"]) >= 2, seen
