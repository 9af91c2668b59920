"""The onnxruntime backend's legalisation (backends/onnxruntime/lower/lowering.py, schemas.py).

- every graphopt op can reach ONNX Runtime: a translation, or a decomposition that leaves
  no graphopt op and computes what the op computes;
- the cached-attention rewrite (GroupQueryAttention with past/present) says why it refused
  each attention over a cache concatenation, and the report carries those near misses;
- the ORT ops a translation may emit are listed once.

All on the CPU. Numerics: fp32, seeded random non-zero inputs, rtol = atol = 1e-5.
"""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import graphopt
from graphopt.backends.onnxruntime.lower import lowering, onnx_model, schemas
from graphopt.backends.onnxruntime.target import onnxruntime
from graphopt.backends.onnxruntime.lower.translations import translation_table
from graphopt.compiler import compile_graph
from graphopt.config import Options
from graphopt.ops import op_name, reference_of
from graphopt.ops.decompose import decompose_graphopt_ops
from tests.backends.onnxruntime._helpers import rel_err  # noqa: F401  (skips without onnxruntime)
from tests.op_cases import OP_CASES, nonzero_random

go = torch.ops.graphopt
ORT = Options.parse({"target": "onnxruntime", "provider": "cpu", "fallback": "error", "pipeline": []})
TOL = {"rtol": 1e-5, "atol": 1e-5}


# --- every graphopt op has a way onto ONNX Runtime ---------------------------------------

def _graphopt_ops() -> list[torch._ops.OpOverload]:
    """Every op graphopt itself registers in the ``graphopt`` torch.library namespace (ops
    that tests register there for their own use are left out)."""
    ops = []
    for qualified in sorted(torch._C._dispatch_get_all_op_names()):
        namespace, _, name = qualified.partition("::")
        if namespace != "graphopt":
            continue
        packet = getattr(go, name.split(".")[0])
        overload = getattr(packet, name.split(".")[1]) if "." in name else packet.default
        module = getattr(reference_of(overload), "__module__", "")
        if not module.startswith("tests."):
            ops.append(overload)
    return ops


def _decomposes(op: torch._ops.OpOverload) -> str | None:
    """None when OP_CASES' call of ``op`` decomposes to ATen ops that compute the same; else why not."""
    cases = [case for case in OP_CASES.values() if case[0] == op_name(op)]
    if not cases:
        return "no OP_CASES entry to decompose it on (tests/op_cases.py)"
    for _, fn, tensors in cases:
        gm = decompose_graphopt_ops(make_fx(fn, tracing_mode="fake")(*[t.clone() for t in tensors]))
        left = [n.name for n in gm.graph.nodes if n.op == "call_function" and op_name(n.target)]
        if left:
            return f"graphopt ops left after decomposing: {left}"
        torch.testing.assert_close(gm(*[t.clone() for t in tensors]), fn(*[t.clone() for t in tensors]), **TOL)
    return None


# A collective cannot run inside ONNX Runtime: the op decomposes to its functional
# all_reduce, which the partitioner keeps on eager (tests/distributed checks that run), and
# its reference needs a process group, so OP_CASES has no call of it.
NEEDS_A_PROCESS_GROUP = {"graphopt.all_reduce_add_rms_norm"}


def test_every_graphopt_op_has_an_ort_translation_or_a_decomposition():
    table = translation_table()
    ops = [o for o in _graphopt_ops() if op_name(o) not in NEEDS_A_PROCESS_GROUP]
    assert {op_name(o) for o in ops} >= {"graphopt.rms_norm", "graphopt.attention", "graphopt.kv_cache_update"}
    missing = {op_name(o): why for o in ops if o not in table and (why := _decomposes(o))}
    assert missing == {}, "add a translation under backends/onnxruntime/lower/translations/ or fix the decomposition"


@pytest.mark.parametrize("op", [o for o in _graphopt_ops() if o not in translation_table()], ids=op_name)
def test_an_op_without_translation_is_decomposed_on_the_target(op):
    # Today kv_cache_update: its reference's in-place write runs eagerly (ONNX has no in-place
    # op), everything else of the graph on ORT, and the report says so.
    for _, fn, tensors in [case for case in OP_CASES.values() if case[0] == op_name(op)]:
        compiled = onnxruntime.compile(make_fx(fn, tracing_mode="fake")(*tensors), [t.clone() for t in tensors], ORT)
        assert (op_name(op), "decomposed") in {(r["op"], r["how"]) for r in compiled.off_target_ops}
        assert op_name(op) not in {r["op"] for r in compiled.off_target_ops if r["how"] == "eager"}
        assert "onnxruntime" in {p["where"] for p in compiled.partitions}
        torch.testing.assert_close(compiled(*[t.clone() for t in tensors]), fn(*[t.clone() for t in tensors]), **TOL)


# --- cached attention: GroupQueryAttention with past/present, or a near miss saying why -----

B, HQ, HKV, D = 2, 4, 2, 16


def _decode(masked=False, causal=False):
    """One step over a KV cache: attention over cat(past, new) and the new cache (a mask
    is the sixth input when ``masked``)."""
    def step(q, past_k, past_v, k, v, *mask):
        keys, values = torch.cat([past_k, k], 2), torch.cat([past_v, v], 2)
        return go.attention(q, keys, values, mask[0] if masked else None, None, causal), keys, values

    return step


def _inputs(batch: int, queries: int, past: int = 7) -> list[torch.Tensor]:
    return [nonzero_random(batch, HQ, queries, D), nonzero_random(batch, HKV, past, D),
            nonzero_random(batch, HKV, past, D), nonzero_random(batch, HKV, queries, D),
            nonzero_random(batch, HKV, queries, D)]


def _near_misses(fn, inputs):
    gm = make_fx(fn, tracing_mode="fake")(*inputs)
    misses = lowering.cached_attention_near_misses(gm)
    _, fused = lowering.prepare(gm, translation_table())
    return misses, fused


def test_decode_step_fuses_with_no_near_miss():
    misses, fused = _near_misses(_decode(), _inputs(B, 1))
    assert (misses, fused) == ([], 1)


@pytest.mark.parametrize("case, reason", [
    ("chunk of a batch", "ORT's GQA needs batch 1 when several queries read a past cache"),
    ("non-causal chunk", "a non-causal chunk of several queries against the cache is not what GQA computes"),
    ("mask", "the attention has a mask; GroupQueryAttention with a cache takes none"),
])
def test_skips_cached_attention_with_the_reason(case, reason):
    inputs = _inputs(1 if case == "non-causal chunk" else B, 1 if case == "mask" else 3)
    if case == "mask":
        inputs.append(nonzero_random(B, 1, 1, 8) > 0)
    fn = _decode(masked=case == "mask", causal=case == "chunk of a batch")
    misses, fused = _near_misses(fn, inputs)
    assert fused == 0
    (miss,) = misses
    assert (miss.pass_name, miss.reason) == ("ort:gqa_with_past", reason)
    assert miss.anchor.startswith("attention")


def test_skips_attention_that_reads_no_cache_without_a_near_miss():
    # A prompt's attention has no concatenation to fold: not a candidate, so no near miss.
    q, k, v = nonzero_random(B, HQ, 5, D), nonzero_random(B, HKV, 5, D), nonzero_random(B, HKV, 5, D)
    gm = make_fx(lambda q, k, v: go.attention(q, k, v, None, None, True))(q, k, v)
    assert lowering.cached_attention_near_misses(gm) == []


def test_the_report_carries_the_cached_attention_near_misses():
    inputs = _inputs(B, 3)
    fn = _decode(causal=True)
    graphopt.reset()
    compiled = compile_graph(make_fx(fn, tracing_mode="fake")(*inputs), inputs, ORT, "export")
    torch.testing.assert_close(compiled(*inputs), fn(*inputs), **TOL)
    (report,) = graphopt.reports()
    assert report.target == "onnxruntime"
    misses = [m for m in report.to_dict()["near_misses"] if m["pass_name"] == "ort:gqa_with_past"]
    assert [m["reason"] for m in misses] == ["ORT's GQA needs batch 1 when several queries read a past cache"]
    direct = onnxruntime.compile(make_fx(fn, tracing_mode="fake")(*inputs), inputs, ORT)
    assert [m.reason for m in direct.near_misses] == [m["reason"] for m in misses]


# --- the ORT ops, listed once --------------------------------------------------------------

def test_fused_op_counts_read_the_one_list_of_ort_ops():
    assert onnx_model.ORT_FUSED_OPS is schemas.FUSED_OP_NAMES
    for domain, name in schemas.ORT_OPS:
        assert (f"{domain}::{name}" if domain else name) in schemas.FUSED_OP_NAMES


def test_every_contrib_op_a_translation_calls_is_in_the_list():
    folder = pathlib.Path(schemas.__file__).parent / "translations"
    called = set()
    for path in folder.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "ms":
                called.add(node.attr)
    listed = {name for domain, name in schemas.ORT_OPS if domain == schemas.MS_DOMAIN}
    assert called and called <= listed, f"add {sorted(called - listed)} to schemas.ORT_OPS"


def test_a_collective_is_refused_with_the_target_that_runs_it():
    from graphopt.backends.onnxruntime.errors import UnsupportedOp
    from graphopt.backends.onnxruntime.lower.lowering import check_translations
    from graphopt.ops import collectives  # noqa: F401  (registers the op; not in graphopt.ops.OPS)

    def step(x, residual, weight):
        return torch.ops.graphopt.all_reduce_add_rms_norm(x, residual, weight, 1e-6, "0")[0]

    gm = make_fx(step, tracing_mode="fake")(torch.ones(2, 8), torch.ones(2, 8), torch.ones(8))
    with pytest.raises(UnsupportedOp, match="ONNX Runtime runs no collectives; use target='eager'"):
        check_translations(gm, translation_table())
