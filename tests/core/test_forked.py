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


def test_an_unanswered_child_is_stopped_at_the_timeout():
    import time

    started = start_forked(time.sleep, 60)
    with pytest.raises(ForkedError, match="did not answer in 0.5 s") as raised:
        started.result(timeout=0.5)
    assert raised.value.kind == "TimeoutError" and not started._child.is_alive()


def _parallel_work(a):
    import torch

    return (a @ a).sum().item(), torch.exp(a.repeat(16, 1)).sum().item(), torch.get_num_threads()


@pytest.fixture
def pool_started():
    """A matrix, and this process's OpenMP pool started on it by a matmul (MKL) and an
    elementwise op (ATen) on at least two threads (one thread starts no pool)."""
    torch = pytest.importorskip("torch")
    threads = torch.get_num_threads()
    torch.set_num_threads(max(threads, 2))
    a = torch.randn(512, 512, generator=torch.Generator().manual_seed(0))
    yield a, _parallel_work(a)
    torch.set_num_threads(threads)


def test_a_child_computes_on_all_threads_after_this_process_did(pool_started):
    """This process's OpenMP pool (libgomp: torch's and MKL's threads) is not the child's: a
    child whose first parallel region waited at the pool's barrier for threads it does not
    have hung exports in test workers. It runs as wide as this process, and answers."""
    a, here = pool_started
    there = start_forked(_parallel_work, a).result(timeout=60)
    assert there[2] == here[2] >= 2 and there[:2] == pytest.approx(here[:2], rel=1e-5)
    assert _parallel_work(a)[:2] == pytest.approx(here[:2], rel=1e-5)  # this process's new pool


def test_where_the_pool_cannot_be_released_the_child_computes_on_one_thread(pool_started, monkeypatch):
    """A libgomp older than OpenMP 5.0 has no omp_pause_resource_all: the child then keeps
    clear of the parent's pool by computing on one thread."""
    import graphopt.forked as forked

    a, here = pool_started
    monkeypatch.setattr(forked, "_release_openmp_pools", lambda: False)
    there = start_forked(_parallel_work, a).result(timeout=60)
    assert there[2] == 1 and there[:2] == pytest.approx(here[:2], rel=1e-5)


def _collect():
    import gc

    return gc.collect() >= 0


def test_a_child_does_not_destroy_what_this_process_left_to_collect():
    """An ONNX Runtime session left in a reference cycle here: collected in the child, its
    destructor waited in pthread_cond_destroy for its thread pool's threads, which the child
    does not have. The child collects only what it made."""
    import gc

    np = pytest.importorskip("numpy")
    ort = pytest.importorskip("onnxruntime")
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [64, 64])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [64, 64])
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "x"], ["y"])], "g", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2  # a pool of threads, waiting on their condition variables
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    session.run(None, {"x": np.ones((64, 64), np.float32)})
    gc.disable()  # the cycle must still be there when the child starts
    try:
        cycle = {"session": session}
        cycle["itself"] = cycle
        del cycle, session
        assert start_forked(_collect).result(timeout=60)
    finally:
        gc.enable()
        gc.collect()

