"""The loop's pieces that need no model: top-p, stop conditions, streaming, the runner protocol."""

import contextlib

import pytest
import torch

import graphopt
from graphopt.generation import GenerateResult, Sampler, StopConditions, drive


def test_top_p_keeps_the_smallest_prefix_that_reaches_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    draws = {Sampler(True, 1.0, None, s, "cpu", top_p=0.75)(logits).item() for s in range(200)}
    assert draws == {0, 1}  # 0.5 + 0.3 reaches 0.75; 2 and 3 never drawn
    draws = {Sampler(True, 1.0, None, s, "cpu", top_p=1.0)(logits).item() for s in range(200)}
    assert draws == {0, 1, 2, 3}
    assert {Sampler(True, 1.0, None, s, "cpu", top_p=0.1)(logits).item() for s in range(50)} == {0}


def test_bad_top_p_is_one_line():
    with pytest.raises(graphopt.GraphoptError, match=r"top_p must be in \(0, 1\], got 1.5"):
        Sampler(True, 1.0, None, 0, "cpu", top_p=1.5)


class Scripted:
    """A runner that plays back fixed next-token choices (logits one-hot), one row per script."""

    target, pads, compiles, prefill_compiles, compile_s, cuda_graphs, reports = "scripted", True, 0, 0, 0.0, "", []

    def __init__(self, scripts: list[list[int]], vocab: int = 16) -> None:
        self.scripts, self.vocab, self.calls = scripts, vocab, []

    def _logits(self, i: int) -> torch.Tensor:
        return torch.nn.functional.one_hot(torch.tensor([s[i] for s in self.scripts]), self.vocab).float()

    def prepare(self, ids, mask):
        self.calls.append("prepare")

    def prefill(self, ids, mask):
        self.calls.append(("prefill", ids.shape[1]))
        return self._logits(0)

    def prepare_step(self, token, position):
        pass

    def step(self, token, position):
        self.calls.append(("step", position, token[:, 0].tolist()))
        return self._logits(position - 2 + 1)


def test_eos_stops_a_row_pads_it_and_the_loop_ends_when_all_rows_stopped():
    runner = Scripted([[4, 2, 9, 9, 9], [5, 6, 7, 2, 9]])
    stop = StopConditions(eos_token_ids=(2,), pad_token_id=0)
    out = drive([runner], torch.ones(2, 2, dtype=torch.long), None, 5, [Sampler()], stop)[0]
    assert out.new_tokens.tolist() == [[4, 2, 0, 0], [5, 6, 7, 2]]
    assert out.new_lengths == [2, 4] and out.token_ids(0) == [4, 2] and out.token_ids(1) == [5, 6, 7, 2]
    assert runner.calls[-1] == ("step", 4, [0, 7])  # the finished row is fed padding; no step after the last EOS
    assert len(out.ms_per_token) == 3 and out.target == "scripted"


def test_stop_strings_read_the_decoded_text():
    words = {4: "the", 5: " end", 6: " is", 7: " near", 8: "."}
    stop = StopConditions(stop_strings=("end is",), decode=lambda ids: "".join(words.get(i, "?") for i in ids))
    out = drive([Scripted([[4, 5, 6, 7, 8]])], torch.ones(1, 2, dtype=torch.long), None, 5, [Sampler()], stop)[0]
    assert out.token_ids(0) == [4, 5, 6]  # the stop string's last token is kept, as transformers does
    with pytest.raises(graphopt.GraphoptError, match="stop strings need a tokenizer"):
        StopConditions(stop_strings=("x",))


def test_tokens_stream_as_they_come_and_runners_run_in_lockstep():
    first, second = Scripted([[3, 4, 5]]), Scripted([[3, 4, 5]])
    seen = []
    results = drive([first, second], torch.ones(1, 2, dtype=torch.long), None, 3, [Sampler(), Sampler()],
                    on_token=lambda token, live: seen.append((token.item(), live.item())))
    assert seen == [(3, True), (4, True), (5, True)]  # the first runner's tokens only
    assert [r.new_tokens.tolist() for r in results] == [[[3, 4, 5]], [[3, 4, 5]]]
    assert first.calls == second.calls == ["prepare", ("prefill", 2), ("step", 2, [3]), ("step", 3, [4])]


def test_zero_tokens_and_result_helpers():
    result = GenerateResult(torch.tensor([[1, 2, 3, 4]]), 2, ms_per_token=[3.0, 1.0, 2.0], new_lengths=[1])
    assert result.token_ids(0) == [3] and result.median_ms(1, 3) == 2.0 and result.median_ms(5, 6) is None


class Threaded(Scripted):
    """A Scripted runner with a say over torch's threads while the loop runs (as OrtRunner)."""

    def __init__(self, script, log):
        super().__init__(script)
        self.log = log

    @contextlib.contextmanager
    def decoding(self):
        self.log.append(("enter", list(self.calls)))
        yield
        self.log.append("exit")


def test_runners_decoding_context_spans_the_loop_only_when_every_runner_has_one():
    log = []
    drive([Threaded([[3, 4]], log)], torch.ones(1, 2, dtype=torch.long), None, 2, [Sampler()])
    assert log == [("enter", ["prepare"]), "exit"]  # after the export (prepare), around prefill and steps
    log.clear()  # lockstep with a runner that needs torch's threads (eager): nobody's context
    drive([Threaded([[3, 4]], log), Scripted([[3, 4]])], torch.ones(1, 2, dtype=torch.long), None, 2,
          [Sampler(), Sampler()])
    assert log == []


def test_a_runner_with_its_own_threads_decodes_alone_not_in_lockstep():
    """generation.api._drive: the onnxruntime decoder's spinning workers would slow an eager
    reference stepped between its steps, so each runner then decodes on its own."""
    from graphopt.generation.api import _drive

    log, seen = [], []
    first, second = Threaded([[3, 4, 5]], log), Scripted([[3, 4, 5]])
    results = _drive([first, second], torch.ones(1, 2, dtype=torch.long), None, 3, Sampler, StopConditions(),
                     lambda token, live: seen.append(token.item()))
    assert log == [("enter", ["prepare"]), "exit"]  # its context held: it ran alone
    assert [r.new_tokens.tolist() for r in results] == [[[3, 4, 5]], [[3, 4, 5]]]
    assert seen == [3, 4, 5]  # the first runner's tokens stream, once
    assert second.calls == ["prepare", ("prefill", 2), ("step", 2, [3]), ("step", 3, [4])]
