"""A tensor-parallel run never hangs silently: a collective that waits past ``--tp-timeout``
fails with one line naming the rank and the collective, a rank that dies makes the launcher
fail at once with a line naming it, and no rank is left running after either.

Two real 2-rank launches (gloo, a 2 s timeout); the rest reads the launcher's choice of root
cause and the CLI's option without starting processes. A launch that hangs would fail here
after ``LIMIT_S`` instead of holding the suite: the launcher runs in a watched thread.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist
from typer.testing import CliRunner

from graphopt.cli.main import app
from graphopt.distributed import launch
from graphopt.distributed.failures import RENDEZVOUS, RankFailure, describe, died, one_line
from graphopt.distributed.launch import DEFAULT_TIMEOUT_S, RankFailed, spawn
from graphopt.errors import GraphoptError

LIMIT_S = 240  # far beyond a launch on a busy 2-core machine (~15 s); only a hang gets there
TIMEOUT_S = 2.0
GLOO_TIMEOUT = "[third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 2000ms for recv operation to complete"
GLOO_PEER_LOST = "[third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:6578."


def _launch_failure(fn, *args) -> RankFailed:
    """``spawn(fn, 2, *args)`` with a 2 s timeout in a watched thread: the RankFailed it raised."""
    box: dict = {}

    def run() -> None:
        try:
            box["rows"] = spawn(fn, 2, *args, timeout=TIMEOUT_S)
        except BaseException as error:  # noqa: BLE001  handed to the test below
            box["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(LIMIT_S)
    if thread.is_alive():
        for p in multiprocessing.active_children():
            p.kill()
        pytest.fail(f"spawn still waiting after {LIMIT_S} s")
    assert not multiprocessing.active_children(), "a rank was left running"
    assert "error" in box, f"the launch succeeded: {box.get('rows')}"
    assert isinstance(box["error"], RankFailed), repr(box["error"])
    return box["error"]


def _fused_then_stall(rank: int, world: int) -> None:
    """One fused all-reduce + add + RMSNorm on both ranks; then rank 1 stalls far past the
    timeout while rank 0 enters the next one."""
    import graphopt.ops.collectives  # noqa: F401  registers graphopt::all_reduce_add_rms_norm

    x, residual = torch.full((2, 8), float(rank + 1)), torch.zeros(2, 8)
    group = dist.group.WORLD.group_name
    _, total = torch.ops.graphopt.all_reduce_add_rms_norm(x, residual, None, 1e-6, group)
    assert torch.equal(total, torch.full((2, 8), 3.0))  # 1 + 2: the group is up and reduces
    if rank == 1:
        time.sleep(10 * LIMIT_S)  # the launcher stops it; were it left, the test would see it
    torch.ops.graphopt.all_reduce_add_rms_norm(x, residual, None, 1e-6, group)


def _exit_abruptly(rank: int, world: int) -> None:
    """Rank 1 leaves without a word after the first all-reduce, as a killed process would."""
    x = torch.ones(4)
    dist.all_reduce(x)
    if rank == 1:
        os._exit(3)
    time.sleep(0.5)
    dist.all_reduce(x)


def test_a_collective_past_the_timeout_fails_in_one_line_naming_rank_and_collective():
    error = _launch_failure(_fused_then_stall)
    line = str(error)
    # "after 2 s" is the process group's own timeout, read back from the collective that failed
    assert line.startswith("rank 0: all_reduce timed out after 2 s waiting for rank 1 (raise --tp-timeout"), line
    assert "\n" not in line
    assert [f.rank for f in error.failures] == [0] and "Timed out waiting" in error.failures[0].text


def test_a_rank_that_dies_fails_the_launch_naming_it():
    line = str(_launch_failure(_exit_abruptly))
    assert line.startswith("rank 1 exited with code 3 without returning its result"), line
    assert "\n" not in line


def test_root_cause_first():
    timeout = RankFailure(0, "timeout", "RuntimeError: " + GLOO_TIMEOUT, "all_reduce", 5, 60.0)
    lost = RankFailure(1, "peer_lost", "RuntimeError: " + GLOO_PEER_LOST, "all_reduce", 5)
    own = RankFailure(1, "error", "GraphoptError: --tp 3: the model's attention heads (4) do not split")
    killed = died(1, -signal.SIGKILL)
    assert one_line([lost, own], 2, 60) == "rank 1 failed: GraphoptError: --tp 3: the model's attention heads (4) do not split"
    assert one_line([timeout, killed], 2, 60) == ("rank 1 was killed by SIGKILL (the out-of-memory killer's signal); "
                                                 "rank 0 lost it in all_reduce")
    assert one_line([timeout, lost], 2, 60).startswith("rank 0: all_reduce timed out after 60 s waiting for rank 1 (")
    assert one_line([lost], 2, 60).startswith("rank 1: all_reduce failed: another rank closed its connection")
    # on 3 ranks, one that waited in the same collective is not the one waited for
    also_waiting = RankFailure(2, "timeout", timeout.text, "all_reduce", 5, 60.0)
    assert " waiting for rank 1 (" in one_line([timeout, also_waiting], 3, 60)
    # a peer seen in another collective is named with it
    elsewhere = RankFailure(1, "peer_lost", lost.text, "barrier", 5)
    assert " waiting for rank 1 (rank 1 was in barrier) (" in one_line([timeout, elsewhere], 2, 60)


def test_gloo_errors_are_classified_by_their_text():
    assert describe(0, RuntimeError(GLOO_TIMEOUT), initialised=True).kind == "timeout"
    assert describe(0, RuntimeError(GLOO_PEER_LOST), initialised=True).kind == "peer_lost"
    # what a rank's next collective says once its timeout closed gloo's pairs (a target that
    # falls back and runs the graph again meets it)
    assert describe(0, RuntimeError("Application timeout caused pair closure"), initialised=True).kind == "timeout"
    rendezvous = describe(0, dist.DistStoreError("Timed out after 61 seconds waiting for clients. 1/2 clients joined."),
                          initialised=False)
    assert (rendezvous.kind, rendezvous.collective) == ("timeout", RENDEZVOUS)
    # a wrapper around gloo's error still counts as the collective's
    try:
        try:
            raise RuntimeError(GLOO_PEER_LOST)
        except RuntimeError as inner:
            raise GraphoptError("the compiled graph failed") from inner
    except GraphoptError as outer:
        assert describe(0, outer, initialised=True).kind == "peer_lost"
    assert describe(0, ValueError("bad shard"), initialised=True) == RankFailure(
        0, "error", "ValueError: bad shard", detail="ValueError: bad shard\n")
    assert died(1, 0).text == "exited with code 0 without returning its result"


def test_tp_timeout_reaches_the_launcher_and_the_output_names_the_backend(monkeypatch):
    seen = []

    def fake_spawn(fn, world, *args, threads=1, timeout=DEFAULT_TIMEOUT_S):
        seen.append(timeout)
        return [{"rank": r, "model": "llama-tiny", "rel_err": 0.0, "tokens_match_tp1": True} for r in range(world)]

    monkeypatch.setattr(launch, "spawn", fake_spawn)
    for extra, expected in (([], DEFAULT_TIMEOUT_S), (["--tp-timeout", "7"], 7.0)):
        for generate in ([], ["--generate", "4"]):
            result = CliRunner().invoke(app, ["run", "llama-tiny", "--tp", "2", "--json", *generate, *extra])
            assert result.exit_code == 0, result.output + repr(result.exception)
            assert json.loads(result.stdout)["backend"] == "gloo"
            assert seen.pop() == expected


def test_a_failed_rank_is_the_commands_one_line(monkeypatch):
    def failing_spawn(fn, world, *args, threads=1, timeout=DEFAULT_TIMEOUT_S):
        raise RankFailed(f"rank 1: all_reduce timed out after {timeout:g} s waiting for rank 0", [])

    monkeypatch.setattr(launch, "spawn", failing_spawn)
    result = CliRunner().invoke(app, ["run", "llama-tiny", "--tp", "2", "--tp-timeout", "7"])
    assert str(result.exception) == "rank 1: all_reduce timed out after 7 s waiting for rank 0"


def test_a_timeout_that_is_not_positive_is_refused():
    with pytest.raises(GraphoptError, match="--tp-timeout must be more than 0 seconds, got 0"):
        spawn(_exit_abruptly, 2, timeout=0)
