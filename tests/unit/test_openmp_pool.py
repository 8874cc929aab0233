"""runner/openmp_pool.py: a thread's OpenMP team is freed when it is done with the model, so the
next thread to compute is the only team in the process (libgomp throttles every team's barrier
spinning once teams hold more threads than there are CPUs)."""
from __future__ import annotations

import os
import threading

import pytest
import torch

from specserve.runner.openmp_pool import release_thread_team


def _num_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _parallel_work() -> None:
    torch.ones(1 << 22).mul_(2.0).sum()


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc to count threads")
def test_releasing_a_thread_team_ends_its_worker_threads() -> None:
    previous = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        counts: dict[str, int] = {}

        def compute_then_release() -> None:
            _parallel_work()
            counts["with_team"] = _num_threads()
            counts["released"] = int(release_thread_team())
            counts["after"] = _num_threads()

        worker = threading.Thread(target=compute_then_release)
        worker.start()
        worker.join()
    finally:
        torch.set_num_threads(previous)
    if not counts["released"]:
        pytest.skip("this torch build's OpenMP runtime has no omp_pause_resource_all")
    assert counts["with_team"] - counts["after"] == 2, counts   # a team of 3 = the caller + 2 workers
