"""Pipeline policy, all of it: the default pipeline (one explicit, ordered list of pass
names), where INT4 goes, and the named stages the compile front half runs
(``graphopt.compiler.front_half``), each built into PassManagers from a config.

Order matters where one pattern feeds another; the comments say why. This module reads
the registry and the pass manager; neither of them imports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from graphopt.config import Options
from graphopt.errors import OptionsError
from graphopt.pass_manager import Instrument, Pass, PassManager, build_pass_options, check_preconditions
from graphopt.registry import all_passes, get_pass

DEFAULT_PIPELINE: tuple[str, ...] = (
    "canonicalize",  # drops identity ops (x*1, same-dtype casts) that would split patterns
    "fuse_rms_norm",
    "fuse_add_rms_norm",  # composes on graphopt.rms_norm, so after fuse_rms_norm
    "fuse_softmax_rms_norm",  # likewise
    "fuse_all_reduce_add_rms_norm",  # composes on graphopt.add_rms_norm (tensor-parallel graphs only)
    "fuse_layer_norm",  # after fuse_rms_norm: it also folds rms_norm(x - mean(x)) back into LayerNorm
    "fuse_gated_mlp",  # before fuse_bias_gelu, which would turn GeGLU's gelu into bias_gelu
    "fuse_moe",  # after fuse_gated_mlp: reads the experts' activation as graphopt.swiglu
    "fuse_bias_gelu",
    "merge_qkv",
    "fuse_rope",
    "fuse_attention",  # after fuse_rope: it reads through the layout copies rope leaves
    # after the fusions that concatenate weights (merge_qkv, fuse_gated_mlp): rows of a file's
    # quantized weights concatenate into one quantized weight. A no-op unless weights are lazy.
    "keep_checkpoint_quantization",
    "cuda_graphs",  # last: marks the final graph's ops for capture (on the CPU it only says why not)
)


# Where options={"int4": True} puts the quantizer: after every pass that concatenates or
# fuses full-precision weights (gated MLP, QKV merge), before the final capture pass.
INT4_PASS, INT4_BEFORE = "quantize_int4", "cuda_graphs"

# The static-cache step's last passes (graphopt.generation.static), run apart from the rest:
# static_kv_cache changes the graph's inputs (so numeric checks cannot replay the traced ones)
# and no later pass may move a cache read across its kv_cache_update; it makes the cache
# writes that fuse_rope_kv_cache_update folds rope into; cuda_graphs marks the final ops for
# capture, so it comes last.
STATIC_STEP_LAST = ("static_kv_cache", "fuse_rope_kv_cache_update", "cuda_graphs")
STATIC_STEP_REQUIRED = ("static_kv_cache",)  # never disabled: without it there is no step to decode with

# The stages the front half runs, by name: "default" is the configured pipeline (torch.compile,
# graphopt export, the ONNX Runtime decoders); "static_step" is the same less the static step's
# last passes, then those.
STAGES = ("default", "static_step")


def build_pipeline(names: Sequence[str] | None = None, int4: bool = False) -> list[Pass]:
    """Pass objects for ``names`` (default pipeline if None), plus the INT4 quantizer when
    asked, with preconditions checked."""
    names = list(names or DEFAULT_PIPELINE)
    if int4 and INT4_PASS not in names:
        names.insert(names.index(INT4_BEFORE) if INT4_BEFORE in names else len(names), INT4_PASS)
    passes = [get_pass(n) for n in names]
    check_preconditions(passes)
    return passes


def with_int4(config: Options, int4: bool) -> Options:
    """``config``, asking for the INT4 quantizer too when ``int4`` (``build_pipeline`` places it);
    OptionsError now, before any model is loaded, when no such pass is registered."""
    if not int4:
        return config
    if INT4_PASS not in all_passes():
        raise OptionsError(f"--int4 needs the {INT4_PASS} pass, which this graphopt version does not have yet")
    return config.replace(int4=True)


def build_pass_manager(config: Options, instruments: Sequence[Instrument] = ()) -> PassManager:
    """The PassManager ``config`` asks for: its pipeline (with INT4 when asked), disabled
    passes, verification and fallback. Bad pass options fail here, as one OptionsError,
    rather than later as a pass failure."""
    passes = build_pipeline(config.pipeline or None, int4=config.int4)
    for name, given in config.pass_options.items():
        build_pass_options(get_pass(name), given)
    return PassManager(passes, instruments, disabled=config.disable_passes,
                       verify=config.verify, fallback=config.fallback)


@dataclass(frozen=True)
class Phase:
    """One PassManager run of a stage; ``replays_inputs``: numeric checks (and the caller's
    instruments) may run the graph on the traced inputs, false once a pass changes them."""

    manager: PassManager
    replays_inputs: bool = True


def build_stage(config: Options, stage: str = "default", instruments: Sequence[Instrument] = ()) -> list[Phase]:
    """The PassManagers of the named ``stage`` (see STAGES), in the order they run."""
    if stage == "default":
        return [Phase(build_pass_manager(config, instruments))]
    if stage == "static_step":
        fusion = [p.name for p in build_pipeline(config.pipeline or None, int4=config.int4)
                  if p.name not in STATIC_STEP_LAST]
        # An empty pipeline option would mean the default one: no fusion phase then.
        phases = [Phase(build_pass_manager(config.replace(pipeline=fusion), instruments))] if fusion else []
        disabled = [n for n in config.disable_passes if n in STATIC_STEP_LAST and n not in STATIC_STEP_REQUIRED]
        last = PassManager([get_pass(n) for n in STATIC_STEP_LAST], verify=config.verify, fallback=config.fallback,
                           disabled=disabled)
        return phases + [Phase(last, replays_inputs=False)]
    raise OptionsError(f"unknown pipeline stage {stage!r}; the stages are {', '.join(STAGES)}")


def pipeline_string(passes: Sequence[Pass]) -> str:
    """``"a,b,c"``: what ``--pipeline`` takes back, for reproducers."""
    return ",".join(p.name for p in passes)
