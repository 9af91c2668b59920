"""Options of the graphopt backend: one dataclass, validated with one-line errors.

``torch.compile(model, backend="graphopt", options={...})`` hands its dict here.
Every option has a type, a default and a help line; options with a closed set of
values list them, so an unknown key or value names the valid ones.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass, field
from typing import Any

from graphopt.errors import BackendFailed, OptionsError
from graphopt.targets import NAMES as TARGET_NAMES

TARGETS = ("auto", *TARGET_NAMES)
FALLBACKS = ("eager", "error")
PROVIDERS = ("cpu", "cuda", "rocm", "migraphx", "tensorrt")


def _opt(default: Any, help: str, choices: tuple | None = None) -> Any:
    meta = {"help": help, "choices": choices}
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class Options:
    """Everything the backend can be told. Build with :meth:`Options.parse`."""

    target: str = _opt("auto", "where the optimized graph runs; auto picks from the hardware present", TARGETS)
    provider: str = _opt("cpu", "ONNX Runtime execution provider (target=onnxruntime)", PROVIDERS)
    lazy_recompiles: bool = _opt(True, "target=onnxruntime: a graph dynamo compiles again with static tensor shapes runs on torch at its first call and builds its session at its second (a one-shape graph, such as model.generate's first decode step, never builds)")
    inductor: bool = _opt(True, "target=triton: compile the ops around graphopt's Triton kernels with Inductor; false runs them eagerly")
    fallback: str = _opt("eager", "on a failing pass or target: 'eager' skips it with a warning, 'error' raises", FALLBACKS)
    pipeline: list = _opt([], "pass names to run instead of the default pipeline, in order")
    disable_passes: list = _opt([], "pass names to leave out of the pipeline")
    pass_options: dict = _opt({}, "per-pass options, e.g. {'fuse_rms_norm': {...}}")
    int4: bool = _opt(False, "quantize linear weights to 4 bits (pass quantize_int4; tune it through pass_options)")
    freeze_weights: bool = _opt(True, "treat parameters and unmutated buffers as constants (needed by weight-rewriting passes)")
    verify: bool = _opt(True, "lint the graph and check node metadata after every pass")
    check_numerics: bool = _opt(False, "run the graph after every pass on the compile-time inputs and record the error")
    tolerance: float = _opt(1e-4, "relative error above which check_numerics flags a pass")
    record_routing: bool = _opt(False, "record each MoE layer's expert choices per call: tokens per expert and top-k jitter in the report's routing")
    bisect_limit: int = _opt(-1, "allow only this many rewrites in total (-1: no limit); for bisecting a bad rewrite")

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def parse(cls, options: dict | Options | None) -> Options:
        """Validate a user dict; raise OptionsError with one line naming the valid choices."""
        if isinstance(options, Options):
            return options
        if options is None:
            return cls()
        if not isinstance(options, dict):
            raise OptionsError(f"graphopt options must be a dict, got {type(options).__name__}")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        values = {}
        for key, value in options.items():
            if key not in fields:
                raise OptionsError(f"unknown graphopt option {key!r}; valid options: {', '.join(fields)}")
            values[key] = _coerce(fields[key], value)
        return cls(**values)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> Options:
        return Options.parse({**self.to_dict(), **changes})


def _coerce(f: dataclasses.Field, value: Any) -> Any:
    """Check (and, for strings from the CLI, convert) one option value."""
    kind = type(f.default) if f.default is not dataclasses.MISSING else type(f.default_factory())
    if isinstance(value, str) and kind is not str:
        value = _from_text(f.name, kind, value)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if kind is list and isinstance(value, tuple):
        value = list(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise OptionsError(f"graphopt option {f.name!r} must be a {kind.__name__}, got {value!r}")
    choices = f.metadata.get("choices")
    if choices and value not in choices:
        raise OptionsError(f"graphopt option {f.name}={value!r} is not valid; choose one of: {', '.join(choices)}")
    return value


def _from_text(name: str, kind: type, text: str) -> Any:
    """Turn ``--option key=value`` text into the option's type."""
    try:
        if kind is bool:
            lowered = text.strip().lower()
            if lowered in ("1", "true", "yes", "on"):
                return True
            if lowered in ("0", "false", "no", "off"):
                return False
            raise ValueError(text)
        if kind is int:
            return int(text)
        if kind is float:
            return float(text)
        if kind is list:
            return [part.strip() for part in text.split(",") if part.strip()]
        if kind is dict:
            return json.loads(text)
    except ValueError:
        pass
    raise OptionsError(f"graphopt option {name!r} expects a {kind.__name__}, got {text!r}")


def fall_back(policy: Options | str, error: BaseException, what: str, instead: str | None, *,
              reason: str | None = None, raise_as: type[Exception] | None = BackendFailed) -> str:
    """The fallback policy, written once ("never break the user's model"): under
    ``fallback="error"`` raise ``raise_as("graphopt {what} failed: {reason}")`` from ``error``
    (``raise_as=None``: ``error`` itself); otherwise log one warning line, ``graphopt: {what}
    failed ({reason}); {instead}``, and return the reason for the report. ``instead=None``: the
    caller reports the fallback itself (a note, or a later warning), so nothing is logged here.
    ``reason`` defaults to the error's type and first line. Call it from an ``except`` block."""
    if reason is None:
        reason = f"{type(error).__name__}: {error}".splitlines()[0]
    if (policy if isinstance(policy, str) else policy.fallback) == "error":
        if raise_as is None:
            raise error
        raise raise_as(f"graphopt {what} failed: {reason}") from error
    if instead is not None:
        logging.getLogger("graphopt").warning("graphopt: %s failed (%s); %s", what, reason, instead)
    return reason


def describe_options() -> list[dict]:
    """Name, type, default, choices and help of every option (for ``--help`` and docs)."""
    rows = []
    for f in dataclasses.fields(Options):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        rows.append({
            "name": f.name,
            "type": type(default).__name__,
            "default": default,
            "choices": list(f.metadata["choices"] or []),
            "help": f.metadata["help"],
        })
    return rows
