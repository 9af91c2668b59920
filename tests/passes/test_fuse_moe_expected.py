"""fuse_moe, Before/Expected: the whole graph the pass leaves, node for node
(tests/passes/_before_expected.py): the router, the sort by expert, the two grouped GEMMs
with SwiGLU between them, the weighting and the unsorted sum over k become one graphopt.moe.

The block is written as transformers' grouped_mm experts implementation writes it, in
bfloat16 (aten._grouped_mm traces in bfloat16 only), with the activation already
graphopt.swiglu (fuse_gated_mlp runs first)."""

import torch
import torch.nn.functional as F
from torch import nn

from tests.helpers import aten_graph
from tests.passes._before_expected import Expected, assert_pass_result

PASS = "fuse_moe"
g = torch.ops.graphopt
EXPERTS, K, HIDDEN, INTER = 4, 2, 8, 16


class GroupedMmMoe(nn.Module):
    def __init__(self, normalize=False):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.router = nn.Parameter(torch.randn(EXPERTS, HIDDEN, generator=gen).bfloat16())
        self.gate_up = nn.Parameter(torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen).bfloat16())
        self.down = nn.Parameter(torch.randn(EXPERTS, HIDDEN, INTER, generator=gen).bfloat16())
        self.normalize = normalize

    def forward(self, x):
        probs = torch.softmax(F.linear(x, self.router).float(), dim=-1)
        top_w, top_i = torch.topk(probs, K, dim=-1)
        if self.normalize:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        ids, perm = torch.sort(top_i.reshape(-1))
        xs, ws = x[perm // K], top_w.reshape(-1)[perm]
        offsets = torch.cumsum(torch.histc(ids.float(), bins=EXPERTS, min=0, max=EXPERTS - 1), dim=0,
                               dtype=torch.int32)
        h = g.swiglu(torch._grouped_mm(xs, self.gate_up.transpose(-2, -1), offs=offsets))
        y = torch._grouped_mm(h, self.down.transpose(-2, -1), offs=offsets) * ws.unsqueeze(-1)
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(perm.size(0), device=x.device)
        return y[inv].view(-1, K, HIDDEN).sum(dim=1).to(x.dtype)


def test_the_routed_block_becomes_one_moe_op():
    for normalize in (False, True):
        module = GroupedMmMoe(normalize)
        before = aten_graph(module, torch.randn(6, HIDDEN).bfloat16())
        b = Expected()
        x = b.input((6, HIDDEN), torch.bfloat16)
        router, gate_up, down = (b.const(name, getattr(module, name)) for name in ("router", "gate_up", "down"))
        moe = b.new(g.moe.default, x, router, gate_up, down, K, normalize, by=PASS)
        assert_pass_result(PASS, before, b.output(moe))
