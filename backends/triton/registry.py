"""The Triton kernels graphopt ships: the op each implements, its launcher, its AOT specs.

Importing this module does not import triton: kernel modules load on first use of
``entry.launcher`` or ``entry.aot_specs``, so the backend can list what it lowers on a
machine without triton and say why it falls back.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field, replace
from typing import Any, Callable

_KERNELS_PACKAGE = __package__ + ".kernels"


@dataclass(frozen=True)
class AotSpec:
    """One ``triton.compile(ASTSource(fn, signature, constexprs, attrs))`` instantiation.

    ``signature`` maps each runtime argument to a Triton type string ("*fp16", "i32",
    "fp32"); ``constexprs`` gives every ``tl.constexpr`` argument a value, and may pin
    an integer argument the way the JIT does when it sees 1 (a unit stride).
    ``divisible`` names the integer arguments that are multiples of 16 in the case
    the spec represents; with every pointer they get ``tt.divisibility = 16``, as the
    JIT gives 16-byte-aligned torch tensors and such integers. Without these hints the
    compiler cannot vectorise, and registers and spills would describe code that
    never runs.
    """

    fn: Any
    signature: dict[str, str]
    constexprs: dict[str, Any]
    num_warps: int = 4
    num_stages: int = 1
    divisible: tuple[str, ...] = ()
    label: str = ""  # which variant this is, e.g. the autotune config it stands for

    @property
    def name(self) -> str:
        return self.fn.__name__

    def full_signature(self) -> dict[str, str]:
        """All arguments in order, constexprs typed "constexpr", as ASTSource wants them.

        Fails on an argument the spec forgot, so a new kernel parameter cannot slip past AOT.
        """
        missing = [a for a in self.fn.arg_names if a not in self.signature and a not in self.constexprs]
        if missing:
            raise ValueError(f"AOT spec for {self.name} leaves {missing} untyped")
        return {a: "constexpr" if a in self.constexprs else self.signature[a] for a in self.fn.arg_names}

    def attrs(self) -> dict[tuple[int, ...], list]:
        """ASTSource attributes: 16-divisibility of every pointer and of ``divisible``."""
        names = list(self.fn.arg_names)
        hinted = [a for a, ty in self.signature.items() if a not in self.constexprs
                  and (ty.startswith("*") or a in self.divisible)]
        unknown = [a for a in self.divisible if a not in self.signature]
        if unknown:
            raise ValueError(f"AOT spec for {self.name} hints unknown arguments {unknown}")
        return {(names.index(a),): [["tt.divisibility", 16]] for a in hinted}


@dataclass(frozen=True)
class KernelEntry:
    """A kernel, the graphopt op it implements and where its code lives."""

    name: str                # registry key, e.g. "rms_norm"
    op: str                  # the op it lowers, e.g. "graphopt.rms_norm"
    module: str              # module under kernels/, e.g. "rms_norm"
    launcher_name: str       # Python launcher in that module
    notes: str = field(default="", compare=False)

    def load(self):
        """The kernel module (imports triton)."""
        return importlib.import_module(f"{_KERNELS_PACKAGE}.{self.module}")

    @property
    def launcher(self) -> Callable:
        return getattr(self.load(), self.launcher_name)

    def aot_specs(self, warp_size: int) -> list[AotSpec]:
        """Representative fp16 instantiations with warp counts sized for a ``warp_size``-wide target."""
        return [AotSpec(**spec) for spec in self.load().aot_specs(self.name, warp_size)]

    def tuning_specs(self, warp_size: int) -> list[AotSpec]:
        """The tuned (first) spec once per GPU autotune config that vendor's autotuner could pick.

        Builds of these show every config compiles, fits and does not spill, which
        the interpreter (one config) never exercises.
        """
        mod = self.load()
        specs = self.aot_specs(warp_size)
        # A module whose launchers tune several config lists names the spec each is built on
        # (int4_gemm: the MMA tiles on its prefill spec, the GEMV tiles on its GEMV spec).
        groups = (mod.tuning_groups(hip=warp_size == 64) if hasattr(mod, "tuning_groups")
                  else [(specs[0].label, mod.gpu_configs(hip=warp_size == 64))])
        built = []
        for label, configs in groups:
            base = next(s for s in specs if s.label == label)
            if prune := getattr(mod, "prune_configs", None):
                configs = prune(configs, dict(base.constexprs), warp=warp_size)
            built += [replace(base, constexprs={**base.constexprs, **c.kwargs}, num_warps=c.num_warps,
                              num_stages=c.num_stages,
                              label=" ".join([*(f"{k}={v}" for k, v in c.kwargs.items()), f"w{c.num_warps}",
                                              f"s{c.num_stages}"]))
                      for c in configs]
        return built


_ENTRIES = [
    KernelEntry("rms_norm", "graphopt.rms_norm", "rms_norm", "rms_norm"),
    KernelEntry("add_rms_norm", "graphopt.add_rms_norm", "rms_norm", "add_rms_norm"),
    KernelEntry("softmax_rms_norm", "graphopt.softmax_rms_norm", "rms_norm", "softmax_rms_norm"),
    KernelEntry("layer_norm", "graphopt.layer_norm", "layer_norm", "layer_norm"),
    KernelEntry("add_layer_norm", "graphopt.add_layer_norm", "layer_norm", "add_layer_norm"),
    KernelEntry("swiglu", "graphopt.swiglu", "activations", "swiglu"),
    KernelEntry("geglu", "graphopt.geglu", "activations", "geglu"),
    KernelEntry("bias_gelu", "graphopt.bias_gelu", "activations", "bias_gelu"),
    KernelEntry("rope", "graphopt.rope", "rope", "rope"),
    KernelEntry("flash_attention", "graphopt.attention", "flash_attention", "flash_attention",
                notes="prefill: any Sq"),
    KernelEntry("flash_decoding", "graphopt.attention", "flash_decoding", "flash_decoding",
                notes="decode: Sq == 1; split kernel + reduction kernel"),
    KernelEntry("cache_attention", "graphopt.cache_attention", "flash_decoding", "cache_attention",
                notes="decode over a static cache: split-K bounded by per-row lengths, paged and int8 read in place"),
    KernelEntry("kv_cache_update", "graphopt.kv_cache_update", "kv_cache", "kv_cache_update",
                notes="in place; bhsd, bshd and paged layouts, int8 with per-token scales"),
    KernelEntry("rope_kv_cache_update", "graphopt.rope_kv_cache_update", "rope_cache", "rope_kv_cache_update",
                notes="a decode layer's rope(q), rope(k) and both cache writes in one launch; bhsd and bshd"),
    KernelEntry("int4_gemm", "graphopt.int4_linear", "int4_gemm", "int4_linear",
                notes="INT4 weight-only; split-K GEMV for M <= 16 rows, MMA tiles above"),
    KernelEntry("moe", "graphopt.moe", "moe", "moe", notes="tokens sorted by expert; gate/up + SwiGLU, then down"),
]

KERNELS: dict[str, KernelEntry] = {e.name: e for e in _ENTRIES}

# One launcher per op for the backend to call; attention picks prefill or decode by Sq.
_LOWERINGS: dict[str, tuple[str, str]] = {e.op: (e.module, e.launcher_name) for e in _ENTRIES}
_LOWERINGS["graphopt.attention"] = ("attention", "attention")


def lowered_ops() -> list[str]:
    """The graphopt ops this backend has a Triton kernel for."""
    return sorted(_LOWERINGS)


def lowering(op: str) -> Callable | None:
    """The launcher for ``op`` ("graphopt.rms_norm"), or None if no kernel implements it."""
    if op not in _LOWERINGS:
        return None
    module, name = _LOWERINGS[op]
    return getattr(importlib.import_module(f"{_KERNELS_PACKAGE}.{module}"), name)
