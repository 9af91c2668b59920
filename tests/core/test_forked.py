"""run_forked: the child's result comes back, its exception as one ForkedError line, its memory
stays its own; without fork the function runs here."""

import os

import pytest

from graphopt.forked import ForkedError, fork_available, run_forked, start_forked

pytestmark = pytest.mark.skipif(not fork_available(), reason="this platform cannot fork")


def _pid_and_sum(values):
    return os.getpid(), sum(values)


def _fails():
    raise ValueError("the export broke\nwith a long trace")


def _grows(holder):
    holder.append(bytearray(32 << 20))  # in the child only
    return len(holder)


def test_result_comes_back_from_another_process():
    pid, total = run_forked(_pid_and_sum, [1, 2, 3])
    assert total == 6 and pid != os.getpid()


def test_an_exception_comes_back_as_one_line():
    with pytest.raises(ForkedError, match="^the export broke$") as raised:
        run_forked(_fails)
    assert raised.value.kind == "ValueError" and "Traceback" in raised.value.details


def test_the_childs_memory_is_not_the_parents():
    holder = []
    assert run_forked(_grows, holder) == 1
    assert holder == []


def test_without_fork_it_runs_here(monkeypatch):
    monkeypatch.setenv("GRAPHOPT_NO_FORK", "1")
    pid, total = run_forked(_pid_and_sum, [4])
    assert pid == os.getpid() and total == 4


def test_a_started_child_runs_while_this_process_works_and_answers_later():
    started = start_forked(_pid_and_sum, [4, 5])
    here = sum(range(1000))  # this process's own work meanwhile
    pid, total = started.result()
    assert (total, here) == (9, 499500) and pid != os.getpid()


def test_a_cancelled_child_is_stopped():
    import time

    started = start_forked(time.sleep, 60)
    started.cancel()
    assert not started._child.is_alive()
