"""graphopt.generate's onnxruntime decoder as a benchmarks/ort_llama.py variant: the model
``decoder.OrtRunner`` exports (``inplace_cache.export_decoder``: one model whose
GroupQueryAttentions write a shared KV buffer in place, for the prompt and every step) on
the runner's own session, timed in lockstep with the other variants."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

from graphopt.backends.onnxruntime.runtime.session import create_session
from weight_traffic import onnx_decode_bytes


def in_place(variant_type, name: str, model, example, config, threads: int, folder: Path, start: float,
             profile_dir: str | None = None, path: str | None = None, unfolded: bool = False,
             spin: bool = True):
    """A ``variant_type`` (ort_llama.Variant) on the in-place decoder. Its prefill returns the
    last position's logits only. ``start``: perf_counter() when its setup began; ``path``:
    reuse that export; ``unfolded``: export with the rotary fold off; ``spin``: as OrtRunner
    runs it (workers spin between ops, torch on one thread while it decodes alone); off for
    lockstep, where its spinning workers would slow the torch variants stepped between."""
    from graphopt.backends.onnxruntime.decoder.decoder import OrtRunner
    from graphopt.backends.onnxruntime.decoder.in_place import InPlaceSession
    from graphopt.backends.onnxruntime.decoder.inplace_cache import export_decoder
    from graphopt.export.files import save_atomically

    if path is None:
        with _fold_off() if unfolded else contextlib.nullcontext():
            onnx_model, _ = export_decoder(model, example, config)
        path = str(folder / (name.replace(" ", "_").replace(".", "_").replace(",", "") + ".onnx"))
        save_atomically(onnx_model, Path(path))
    prefix = os.path.join(profile_dir, name.replace(" ", "_")) if profile_dir else None
    session = create_session(path, "cpu", threads=threads, arena=False, spin=spin, profile_prefix=prefix)
    runner = OrtRunner(None, config)
    runner.decoder = InPlaceSession(session)

    def prefill(ids):
        return runner.prefill(ids, None)[:, None], None

    def decode(token, cache):
        return runner.step(token, 0)[:, None], None

    variant = variant_type(name, prefill, decode, time.perf_counter() - start, [session])
    if spin:
        variant.decoding = runner.decoding  # torch on one thread while it decodes alone (drive enters it)
    variant.paths = (path,)
    variant.weight_bytes = onnx_decode_bytes(path)
    variant.profiled = lambda directory: in_place(variant_type, name, model, example, config, threads, folder,
                                                  time.perf_counter(), directory, path, spin=spin)
    return variant


@contextlib.contextmanager
def _fold_off():
    from graphopt.backends.onnxruntime.onnx_passes import rotary_fold

    real = rotary_fold.fold_rotary_into_attention
    rotary_fold.fold_rotary_into_attention = lambda model, positions: {"rotary": 0}
    try:
        yield
    finally:
        rotary_fold.fold_rotary_into_attention = real
