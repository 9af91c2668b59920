"""``graphopt export --int4 --calibration-text FILE [--calibration-tokens N] [--int4-budget F]``:
what INT4 calibrates on, turned into ``quantize_int4``'s options. A calibration text switches
the search to GPTQ (unless ``--option`` names one): the default, round-to-nearest, reads no text.

The text is read as UTF-8 and tokenized with the model's own tokenizer (graphopt/sources/tokenizers.py:
a .gguf file, or a checkpoint directory with tokenizer.json); its first N token ids become
``Int4Options.calibration``, so GPTQ feeds its errors with the activations of real text instead
of the 32 example token ids. ``--int4-budget`` is ``Int4Options.budget`` and ``--embedding-bits``
``Int4Options.embedding_bits``. All travel the same
path as ``--option pass_options=...`` (they override its ``quantize_int4`` entries), and the
export's summary repeats the pass's own line on what it calibrated on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from graphopt.config import Options
from graphopt.errors import GraphoptError, ModelLoadError

PASS_NAME = "quantize_int4"
DEFAULT_TOKENS = 2048


def read_text(path: str) -> str:
    """The file's text; GraphoptError (one line naming the fix) when it is missing, unreadable or empty."""
    file = Path(path).expanduser()
    if not file.is_file():
        what = "is a folder" if file.is_dir() else "does not exist"
        raise GraphoptError(f"--calibration-text {path} {what}: give a UTF-8 text file (any prose, e.g. a README)")
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise GraphoptError(f"--calibration-text {path} is not UTF-8 text: give a plain-text file") from None
    except OSError as exc:
        raise GraphoptError(f"--calibration-text {path} cannot be read ({exc.strerror or exc}): check its "
                            "permissions, or give another file") from None
    if not text.strip():
        raise GraphoptError(f"--calibration-text {path} is empty: give a file with some text in it "
                            "(a few thousand words calibrate well)")
    return text


def token_ids(model: str, path: str, tokens: int) -> tuple[list[int], dict[str, Any]]:
    """The first ``tokens`` token ids of the text at ``path`` by ``model``'s tokenizer, and a
    record of them for the report: ``{"text", "tokens", "text_tokens"}``."""
    if tokens < 1:
        raise GraphoptError(f"--calibration-tokens must be at least 1, got {tokens}")
    text = read_text(path)
    from graphopt.sources.tokenizers import load_tokenizer

    try:
        tokenizer = load_tokenizer(model)
    except ModelLoadError as exc:
        raise GraphoptError(f"--calibration-text needs the model's tokenizer: {exc}; or drop --calibration-text "
                            "to calibrate on the example inputs") from None
    ids = list(tokenizer(text, verbose=False)["input_ids"])
    if not ids:
        raise GraphoptError(f"--calibration-text {path}: the tokenizer of {model} made no tokens of it; "
                            "give a file with text in the model's language")
    used = ids[:tokens]
    return used, {"text": str(path), "tokens": len(used), "text_tokens": len(ids)}


def with_int4_options(config: Options, calibration: list[int] | None, budget: float | None,
                      embedding_bits: int | None = None) -> Options:
    """``config`` with ``pass_options["quantize_int4"]`` carrying ``calibration``, ``budget`` and
    ``embedding_bits`` (those given), over what ``--option pass_options=...`` set; checked by
    Int4Options itself."""
    mine: dict[str, Any] = {}
    if calibration:  # a text to calibrate on asks for the method that reads it (rtn, the default, does not)
        mine["calibration"] = list(calibration)
        mine["search"] = config.pass_options.get(PASS_NAME, {}).get("search", "gptq")
    if budget is not None:
        mine["budget"] = float(budget)
    if embedding_bits is not None:
        mine["embedding_bits"] = int(embedding_bits)
    if not mine:
        return config
    from graphopt.passes.quantize_int4 import Int4Options

    merged = {**config.pass_options.get(PASS_NAME, {}), **mine}
    try:
        Int4Options(**merged)
    except (TypeError, ValueError) as exc:
        flag = ("--int4-budget" if "budget" in str(exc) and budget is not None else
                "--embedding-bits" if "embedding_bits" in str(exc) and embedding_bits is not None else
                "quantize_int4 options")
        raise GraphoptError(f"{flag}: {exc}") from None
    return config.replace(pass_options={**config.pass_options, PASS_NAME: merged})


def calibration_lines(data: dict) -> list[str]:
    """The quantize_int4 pass's line on what it calibrated on, once per distinct line (one per
    exported graph: prefill and decode with --kv-cache)."""
    lines = [r["stats"]["calibration"] for r in data.get("passes", ())
             if r.get("name") == PASS_NAME and isinstance(r.get("stats"), dict) and r["stats"].get("calibration")]
    return list(dict.fromkeys(lines))
