"""The in-place decoder of a checkpoint file (``graphopt.generation.checkpoint.Checkpoint``).

Found in the decoder cache by the file's identity and graphopt's options, it opens without
building the model at all. Otherwise it is exported in a forked child (``graphopt.forked``):
the child builds the model (lazy weights), traces and exports it and writes the decoder, its
weights read from the checkpoint one tensor at a time; everything it allocated goes when it
exits, and the session then opens on the written file in a process that holds little else.
For Qwen2.5-0.5B that is the difference between the export's leftovers (~180 MB) plus the
session and the session alone.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

from graphopt.config import Options
from graphopt.errors import GraphoptError


def checkpoint_runner(checkpoint, config: Options, max_length: int | None):
    """An OrtRunner whose decoder is ``checkpoint``'s, from the cache or exported now."""
    from graphopt.backends.onnxruntime.decoder import decoder_cache
    from graphopt.backends.onnxruntime.decoder.decoder import InPlaceSession, OrtRunner, _decoder_session
    from graphopt.forked import ForkedError, run_forked

    runner = OrtRunner(None, config, max_length)
    start = time.perf_counter()
    options = config.to_dict()  # the pipeline it implies (--int4's pass) is the child's to build
    key = decoder_cache.checkpoint_key(checkpoint.identity, options) if decoder_cache.cache_dir() else None
    kept = decoder_cache.lookup(key) if key else None
    stages: dict[str, float] = {}
    if kept is None:
        checkpoint.check_memory()  # one line now, not the OOM killer halfway through the export
        scratch = None
        if key is None:
            runner._scratch = scratch = tempfile.TemporaryDirectory(prefix="graphopt-decoder-")
        try:
            made = run_forked(_export, checkpoint, options, key, scratch.name if scratch else None)
        except ForkedError as error:
            raise GraphoptError(f"exporting the decoder of {checkpoint.name} failed ({error.kind}: {error})") from None
        kept, stages = Path(made["path"]), made["stages"]
        runner.notes += made["notes"]
        runner.reports, fallbacks = made["records"], made["fallbacks"]
    else:
        fallbacks = []
        _check_kept_fits(kept, checkpoint.name)
        runner.notes.append(f"loaded the decoder exported by an earlier run from {kept.parent}")
    opened = time.perf_counter()
    runner.decoder = InPlaceSession(_decoder_session(str(kept)))
    stages["session"] = time.perf_counter() - opened
    # Nothing of the exporter is imported here (onnx, onnxscript: 50 MB on a warm start).
    runner.compile_s, runner.compile_stages = time.perf_counter() - start, dict(stages)
    runner.compiles = runner.prefill_compiles = 1  # one model serves every step (dynamic axes)
    runner.notes += [f"export: {f['where']}: {f['reason']}" for f in fallbacks]
    return runner


def _check_kept_fits(kept: Path, name: str) -> None:
    """A kept decoder's session holds about its weights file; with the runtime's own share."""
    from graphopt.memory import RUNTIME_BYTES, check_fits

    data = kept.with_name(kept.name + ".data")
    size = data.stat().st_size if data.exists() else kept.stat().st_size
    check_fits(size + RUNTIME_BYTES, f"the decoder of {name} kept by an earlier run")


def _export(checkpoint, options: dict, key: str | None, scratch: str | None) -> dict:
    """In the child: build, export and write the decoder; what the parent needs to report it."""
    from graphopt.backends.onnxruntime import tool
    from graphopt.backends.onnxruntime.decoder import decoder_cache
    from graphopt.backends.onnxruntime.decoder.decoder import _export_prompt
    from graphopt.backends.onnxruntime.decoder.inplace_cache import export_decoder

    torch.set_num_threads(torch.get_num_threads())  # the child's own OpenMP pool, not the parent's
    timer = tool.Timer(None)
    with timer("load"):
        model = checkpoint.build()
    prompt = torch.randint(0, 100, (2, 4))
    config = Options.parse(options)
    config = tool.pipeline_options(config, config.int4)
    onnx_model, result = export_decoder(model, _export_prompt(prompt), config, timer)
    notes = list(onnx_model.notes)
    path = None
    if key:
        with timer("cache store"):
            path, note = decoder_cache.store(key, onnx_model)
        notes.append(note)
    if path is None:
        folder = Path(scratch or tempfile.mkdtemp(prefix="graphopt-decoder-"))
        path = folder / "model.onnx"
        with timer("write"):
            onnx_model.save(path, external_data=True)
    return {"path": str(path), "stages": timer.seconds, "notes": notes,
            "records": [r.to_dict() for r in result.records], "fallbacks": list(result.fallbacks)}
