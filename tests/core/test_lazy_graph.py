"""graphopt.lazy_graph: a graph whose weights are lazy runs node by node, each weight read when a
node needs it and dropped after it, to the values of the graph with its weights read in, bit for
bit; a pure graph takes its input sets in step (each weight read once for all), a graph that
updates a buffer in place takes them one after the other, as separate calls would."""

import weakref

import torch
import torch.fx as fx

from graphopt import lazy_graph, lazy_weights

aten = torch.ops.aten


class Source:
    """A lazy weight's source that counts its reads and watches the copies it hands out."""

    def __init__(self, t: torch.Tensor, alive: list) -> None:
        self.t, self.shape, self.dtype, self.alive, self.reads = t, tuple(t.shape), t.dtype, alive, 0

    def load(self) -> torch.Tensor:
        self.reads += 1
        out = self.t.clone()
        self.alive.append(weakref.ref(out))
        return out


class Mlp(torch.nn.Module):
    def __init__(self, layers: int = 4, width: int = 16, update: bool = False) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        for i in range(layers):  # parameters: the trace reads them through get_attr
            self.register_parameter(f"w{i}", torch.nn.Parameter(torch.randn(width, width, generator=gen) / width ** 0.5,
                                                                requires_grad=False))
        self.register_buffer("seen", torch.zeros(()))
        self.layers, self.update = layers, update

    def forward(self, x):
        for i in range(self.layers):
            x = torch.relu(x @ getattr(self, f"w{i}").t())  # the transpose depends on no input
        if self.update:  # a running total kept in place, as a KV cache is
            aten.add_.Tensor(self.seen, x.sum())
            x = x + self.seen
        return x


def lazy(module: Mlp):
    """``module`` traced, its weights made lazy; (graph, sources, the copies read that are alive)."""
    gm = fx.symbolic_trace(module)
    mode, alive, sources = lazy_weights.new_mode(), [], []
    for i in range(module.layers):
        source = Source(getattr(module, f"w{i}").detach(), alive)
        setattr(gm, f"w{i}", torch.nn.Parameter(lazy_weights.fake(mode, source), requires_grad=False))
        sources.append(source)
    return gm, sources, alive


def inputs(*rows: int):
    gen = torch.Generator().manual_seed(1)
    return [[torch.randn(r, 16, generator=gen)] for r in rows]


def test_a_pure_graph_reads_each_weight_once_for_all_sets_and_one_at_a_time():
    module = Mlp()
    gm, sources, alive = lazy(module)
    most = [0]
    load = Source.load

    def watched(self):
        out = load(self)
        most[0] = max(most[0], sum(r() is not None for r in alive))
        return out

    Source.load = watched
    try:
        got = lazy_graph.run(gm, inputs(2, 3, 5))
    finally:
        Source.load = load
    assert lazy_graph.in_step(gm) and [s.reads for s in sources] == [1] * 4
    assert most[0] == 1  # the previous layer's weight is gone before the next is read
    assert all(torch.equal(g, module(*x)) for g, x in zip(got, inputs(2, 3, 5)))


def test_watched_values_without_outputs_run_only_what_they_need():
    gm, sources, _ = lazy(Mlp())
    relus = [n for n in gm.graph.nodes if n.target is torch.relu]
    seen = {}
    got = lazy_graph.run(gm, inputs(2, 3), watched={relus[1]}, outputs=False,
                         on_value=lambda node, values: seen.setdefault(node, values))
    assert got == [None, None] and list(seen) == [relus[1]] and len(seen[relus[1]]) == 2
    assert [s.reads for s in sources] == [1, 1, 0, 0]  # the layers after it never ran


def test_a_graph_that_updates_in_place_takes_its_sets_one_after_the_other():
    module, reference = Mlp(update=True), Mlp(update=True)
    gm, sources, _ = lazy(module)
    assert not lazy_graph.in_step(gm)
    got = lazy_graph.run(gm, inputs(2, 3))
    want = [reference(*x) for x in inputs(2, 3)]  # the second call sees the first call's total
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert torch.equal(module.seen, reference.seen) and [s.reads for s in sources] == [2] * 4
