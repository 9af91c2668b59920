"""Random models through the whole fusion pipeline on the triton target, checked against eager.

Here, not in tests/fuzz/: the kernels run only under TRITON_INTERPRET=1, which this
folder's conftest sets for its own pytest process (scripts/test.sh), so this case runs in
CI instead of skipping. Each graph is compiled once and called at two shapes.
"""

from graphopt.backends.triton import ops
from graphopt.fuzz.generate import Settings
from graphopt.fuzz.runner import resolve_targets, run_fuzz
from tests.fuzz.test_ci_budget import LARGER, failures


def test_random_graphs_match_eager_on_triton(tmp_path):
    usable, skipped = resolve_targets(["triton"])
    assert usable == ["triton"], skipped  # conftest's TRITON_INTERPRET=1 makes it available on the CPU
    # triton 3.9's interpreter rounds float32 -> bfloat16 by truncation (a GPU rounds to nearest),
    # so bfloat16 kernels run there are up to one ulp off: fp32 and fp16 test the kernels fairly
    settings: Settings = LARGER.replace(dtypes=("float32", "float16"))
    before = ops.calls.copy()
    summary = run_fuzz(8, seed=11, targets=["triton"], out_dir=tmp_path, settings=settings, shrink_budget=10)
    ran = ops.calls - before
    assert summary.mismatches == 0 and summary.crashes == 0, failures(summary)
    stats = summary.targets["triton"]
    assert stats.fell_back == 0, summary.to_dict()["fallbacks"]
    assert stats.recompiled == 0, "a second shape of sizes >= 2 must reuse the first compile"
    assert summary.multi_shape == 8, summary.single_shape_examples  # every graph of this seed has a second length
    assert sum(n for (_, kind), n in ran.items() if kind == "kernel") > 0, f"no Triton kernel ran: {dict(ran)}"
