"""The default pipeline: one explicit, ordered list of pass names, and the PassManager
built from a config.

Order matters where one pattern feeds another; the comments say why. This module reads
the registry and the pass manager; neither of them imports it.
"""

from __future__ import annotations

from typing import Sequence

from graphopt.config import Options
from graphopt.pass_manager import Instrument, Pass, PassManager, build_pass_options, check_preconditions
from graphopt.registry import get_pass

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


def build_pipeline(names: Sequence[str] | None = None, int4: bool = False) -> list[Pass]:
    """Pass objects for ``names`` (default pipeline if None), plus the INT4 quantizer when
    asked, with preconditions checked."""
    names = list(names or DEFAULT_PIPELINE)
    if int4 and INT4_PASS not in names:
        names.insert(names.index(INT4_BEFORE) if INT4_BEFORE in names else len(names), INT4_PASS)
    passes = [get_pass(n) for n in names]
    check_preconditions(passes)
    return passes


def build_pass_manager(config: Options, instruments: Sequence[Instrument] = ()) -> PassManager:
    """The PassManager ``config`` asks for: its pipeline (with INT4 when asked), disabled
    passes, verification and fallback. Bad pass options fail here, as one OptionsError,
    rather than later as a pass failure."""
    passes = build_pipeline(config.pipeline or None, int4=config.int4)
    for name, given in config.pass_options.items():
        build_pass_options(get_pass(name), given)
    return PassManager(passes, instruments, disabled=config.disable_passes,
                       verify=config.verify, fallback=config.fallback)


def pipeline_string(passes: Sequence[Pass]) -> str:
    """``"a,b,c"``: what ``--pipeline`` takes back, for reproducers."""
    return ",".join(p.name for p in passes)
