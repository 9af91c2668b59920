"""Session-wide test settings."""

import os
from collections import Counter

# Tests never read or write the user's decoder cache (~/.cache/graphopt); the cache's own
# tests point GRAPHOPT_CACHE_DIR at a temporary folder.
os.environ["GRAPHOPT_CACHE_DIR"] = "off"

# The files that keep a pytest-xdist worker longest (scripts/test.sh: -n 2 --dist loadfile),
# longest first: wall seconds on the 2-core CI machine under load, from --durations. xdist
# hands out whole files in collection order (scripts/test.sh turns off its own reordering,
# which puts the files with the most tests first and left the 2-test fuzz budget, 3 minutes,
# to run alone at the end while the other worker idled). Longest first, the short files
# fill in at the end. Other files follow in xdist's order; a stale list only costs time.
LONGEST_FILES = (
    "tests/backends/onnxruntime/test_hf_kv_cache.py",  # 400 s
    "tests/backends/onnxruntime/test_dynamic_shapes.py",  # 247
    "tests/generate/test_runner_cache.py",  # 223
    "tests/fuzz/test_ci_budget.py",  # 212
    "tests/sources/test_safetensors_lazy.py",  # 199
    "tests/core/test_repeated_layers.py",  # 172
    "tests/generate/test_smollm2.py",  # 167
    "tests/backends/onnxruntime/decoder/test_decoder_cache.py",  # 150
    "tests/backends/onnxruntime/lower/test_direct_export.py",  # 142
    "tests/passes/test_merge_qkv.py",  # 129
    "tests/backends/onnxruntime/test_export_tool.py",  # 127
    "tests/generate/test_checkpoint_generate.py",  # 126
    "tests/generate/test_hf_breadth.py",  # 124
    "tests/distributed/test_generate_tp.py",  # 124
)


def pytest_collection_modifyitems(config, items):
    """Whole files, longest first (LONGEST_FILES), then the rest by number of tests as xdist
    would; each file's tests keep their order. Every worker sorts the same collection alike."""
    rank = {path: i for i, path in enumerate(LONGEST_FILES)}
    files = [item.nodeid.split("::")[0] for item in items]
    count, first = Counter(files), {}
    for i, f in enumerate(files):
        first.setdefault(f, i)
    order = sorted(range(len(items)), key=lambda i: (rank.get(files[i], len(rank)), -count[files[i]],
                                                     first[files[i]], i))
    items[:] = [items[i] for i in order]
