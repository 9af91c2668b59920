"""The in-place decoder of a checkpoint file (``graphopt.generation.checkpoint.Checkpoint``).

Found in the decoder cache by the file's identity and graphopt's options, it opens without
building the model at all. Otherwise it is exported in a forked child (``graphopt.forked``):
the child builds the model (lazy weights), traces and exports it and writes the decoder, its
weights read from the checkpoint one tensor at a time; everything it allocated goes when it
exits, and the session then opens on the written file in a process that holds little else.
For Qwen2.5-0.5B that is the difference between the export's leftovers (~180 MB) plus the
session and the session alone.

The parent imports no torch (the child does, after the fork): the runner is
``in_place.ArrayRunner``, on numpy arrays.
"""

from __future__ import annotations

import importlib.util
import tempfile
import time
from pathlib import Path

from graphopt.config import Options
from graphopt.errors import GraphoptError, TargetUnavailable
from graphopt.memory import MemoryNeeded


# Exports begun by ``start_decoder`` (the child, when it began), and kept decoders it began to
# open (a thread's session, when it began), by cache key, until ``checkpoint_runner`` takes them up.
_STARTED: dict = {}
_OPENING: dict = {}


def start_decoder(checkpoint, config: Options) -> None:
    """Begin what ``checkpoint``'s decoder needs now: export it in a child when no kept decoder
    serves it, or open the kept one's session in a thread.

    ``graphopt generate`` calls this before it loads the file's tokenizer: on two cores the
    tokenizer's conversion (a child of its own, 5 s of Qwen2.5-0.5B's first run) and the export
    run side by side instead of one after the other, and on a warm run the session (1.2 s;
    ONNX Runtime lets go of the GIL while it loads) opens while the kept tokenizer loads (0.6 s).
    ``checkpoint_runner`` with the same options takes either up.
    """
    from graphopt.backends.onnxruntime.decoder import decoder_cache
    from graphopt.forked import fork_available, start_forked

    if config.provider != "cpu" or importlib.util.find_spec("onnxruntime") is None:
        return  # checkpoint_runner says why
    if decoder_cache.cache_dir() is None:
        return
    options = config.to_dict()
    key = decoder_cache.checkpoint_key(checkpoint.identity, options)
    if key in _STARTED or key in _OPENING:
        return
    kept = decoder_cache.lookup(key)
    if kept is not None:
        _check_kept_fits(kept, checkpoint.name)  # before the session allocates
        _OPENING[key] = (_Opening(kept), time.perf_counter())
    elif fork_available():
        _STARTED[key] = (start_forked(_export, checkpoint, options, key, None), time.perf_counter())


class _Opening:
    """A kept decoder's session opening in a daemon thread (an unused one does not hold up exit)."""

    def __init__(self, path: Path) -> None:
        import threading

        self.path = path
        self.session = self.error = self.note = None
        self.seconds = 0.0
        self._thread = threading.Thread(target=self._open, args=(path,), name="graphopt-open-decoder", daemon=True)
        self._thread.start()

    def _open(self, path: Path) -> None:
        from graphopt.backends.onnxruntime.decoder.in_place import kept_decoder_session

        start = time.perf_counter()
        try:
            self.session, self.note = kept_decoder_session(str(path))
        except BaseException as error:  # re-raised in the thread that takes the session up
            self.error = error
        self.seconds = time.perf_counter() - start

    def result(self):
        self._thread.join()
        if self.error is not None:
            raise self.error
        return self.session


def checkpoint_runner(checkpoint, config: Options, max_length: int | None):
    """An ArrayRunner on ``checkpoint``'s decoder, from the cache, from the export
    ``start_decoder`` began (or the session it began to open), or exported now."""
    from graphopt.backends.onnxruntime.decoder import decoder_cache
    from graphopt.backends.onnxruntime.decoder.in_place import ArrayRunner, decoder_session, kept_decoder_session
    from graphopt.forked import ForkedError, run_forked

    if importlib.util.find_spec("onnxruntime") is None:
        raise TargetUnavailable("target onnxruntime needs onnxruntime: pip install onnxruntime")
    if config.provider != "cpu":
        raise TargetUnavailable(f"the in-place decoder runs on the CPU provider only, not {config.provider}")
    notes: list[str] = []
    scratch = None
    start = time.perf_counter()
    options = config.to_dict()  # the pipeline it implies (--int4's pass) is the child's to build
    key = decoder_cache.checkpoint_key(checkpoint.identity, options) if decoder_cache.cache_dir() else None
    started, began = _STARTED.pop(key, (None, None)) if key else (None, None)
    opening, opened_at = _OPENING.pop(key, (None, None)) if key else (None, None)
    for other, _ in _STARTED.values():  # begun for other options: nobody reads it
        other.cancel()
    _STARTED.clear()
    _OPENING.clear()
    start = began or opened_at or start  # compile time counts from the export's or the opening's start
    kept = opening.path if opening else decoder_cache.lookup(key) if key and started is None else None
    stages: dict[str, float] = {}
    reports: list = []
    if kept is None:
        if key is None:
            scratch = tempfile.TemporaryDirectory(prefix="graphopt-decoder-")
        packer = _start_prepack(checkpoint, key)
        try:
            made = started.result() if started else run_forked(_export, checkpoint, options, key,
                                                                scratch.name if scratch else None)
        except ForkedError as error:
            if error.kind == MemoryNeeded.__name__:  # the child checked before building: its line is the user's
                raise MemoryNeeded(str(error)) from None
            raise GraphoptError(f"exporting the decoder of {checkpoint.name} failed ({error.kind}: {error})") from None
        finally:
            _stop_prepack(packer, key)
        kept, stages = Path(made["path"]), made["stages"]
        notes += made["notes"] + [f"export: {f['where']}: {f['reason']}" for f in made["fallbacks"]]
        reports = made["records"]
    else:
        if opening is None:
            _check_kept_fits(kept, checkpoint.name)  # start_decoder checked before it began to open
        notes.append(f"loaded the decoder exported by an earlier run from {kept.parent}")
    # Nothing of the exporter is imported here (onnx, onnxscript: 50 MB on a warm start), nor torch.
    if opening is not None:  # opened beside the tokenizer's load (compile_s counts from its start)
        session, packing_note = opening.result(), opening.note
        stages["session"] = opening.seconds
    else:
        opened = time.perf_counter()
        # a kept decoder through its packed copy (saved by this first session on this machine)
        session, packing_note = kept_decoder_session(str(kept)) if key else (decoder_session(str(kept)), None)
        stages["session"] = time.perf_counter() - opened
    notes += [packing_note] if packing_note else []  # what the packed copy did (none without a cache)
    runner = ArrayRunner(session, max_length)
    runner.compile_s, runner.compile_stages = time.perf_counter() - start, dict(stages)
    runner.notes, runner.reports = notes, reports
    runner._scratch = scratch  # the written decoder's folder lives as long as the runner
    return runner


def _prepack_dir(key: str) -> Path:
    from graphopt.cache_root import cache_root

    return cache_root() / "prepack" / key


def _start_prepack(checkpoint, key: str | None):
    """The checkpoint's prepack (sources/gguf_prepack.py) in a child of its own, beside the
    export: started here, after the tokenizer's child is done, so that it takes the core the
    export leaves idle rather than one of the two it shares with the tokenizer."""
    from graphopt.forked import fork_available, start_forked

    if key is None or checkpoint.prepack is None or not fork_available():
        return None
    return start_forked(checkpoint.prepack.run, str(_prepack_dir(key)))


def _stop_prepack(packer, key: str | None) -> None:
    """The export has written its weights: the prepacked fields served it, or came too late."""
    if packer is None:
        return
    import shutil

    packer.cancel()
    shutil.rmtree(_prepack_dir(key), ignore_errors=True)


def _check_kept_fits(kept: Path, name: str) -> None:
    """A kept decoder's session holds about its weights file; with the runtime's own share."""
    from graphopt.memory import RUNTIME_BYTES, check_fits

    data = kept.with_name(kept.name + ".data")
    size = data.stat().st_size if data.exists() else kept.stat().st_size
    check_fits(size + RUNTIME_BYTES, f"the decoder of {name} kept by an earlier run")


def _export(checkpoint, options: dict, key: str | None, scratch: str | None) -> dict:
    """In the child: build, export and write the decoder; what the parent needs to report it."""
    checkpoint.check_memory()  # one line now, not the OOM killer halfway through the export
    import torch

    from graphopt.backends.onnxruntime.decoder import decoder_cache
    from graphopt.backends.onnxruntime.decoder.decoder import _export_prompt
    from graphopt.backends.onnxruntime.decoder.inplace_cache import export_decoder
    from graphopt.export.files import Timer

    torch.set_num_threads(torch.get_num_threads())  # the child's own OpenMP pool, not the parent's
    if key and checkpoint.prepack is not None:  # the weights the prepack child re-lays out meanwhile
        checkpoint.prepack.use(_prepack_dir(key))
    timer = Timer(None)
    with timer("load"):
        model = checkpoint.build()
    prompt = torch.randint(0, 100, (2, 4))
    config = Options.parse(options)
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
