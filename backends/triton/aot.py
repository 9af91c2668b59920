"""Ahead-of-time builds of the registered kernels for NVIDIA and AMD, on a machine with no GPU.

``build("rms_norm", "sm_90")`` runs ``triton.compile(ASTSource(...), target=GPUTarget(...))``
on each of the kernel's AOT specs (registry.py) and returns a :class:`BuildResult`;
``prove(result)`` re-reads the artifacts and lists anything that fails to show a real
build (``built`` is only True when that list is empty). ``tuning=True`` also builds
the tuned function once per autotune config of the target's vendor.

Where the numbers come from (None where unknown):

- NVIDIA: ``CompiledKernel.n_regs`` / ``n_spills`` are only filled when a driver loads
  the cubin onto a device, so this module re-runs the ptxas triton used (its bundled
  binary, same ``--gpu-name`` and register-allocation flag) with ``-v`` on the PTX:
  ``registers`` is "Used N registers", ``spills`` the bytes of spill stores (loads are
  in ``details``). None if ptxas cannot run.
- AMD: the kernel's metadata notes in the amdgcn text: ``registers`` is ``.vgpr_count``
  (VGPRs bound occupancy; ``.sgpr_count`` and ``.agpr_count`` are in ``details``),
  ``spills`` is ``.vgpr_spill_count + .sgpr_spill_count``.
- ``shared_memory``: triton's ``metadata.shared``, the bytes of shared memory (LDS on
  AMD) a launch requests.
- ``global_load_bits`` / ``async_copies`` (:func:`load_facts`): the widest load from
  global memory and the count of asynchronous global-to-shared copies, read from the
  PTX or amdgcn. A memory-bound kernel that the compiler did not vectorise shows up
  here as 8/16/32 bits, where 128 (``ld.global.v4.b32``, ``global_load_dwordx4``) is
  what moves bytes at bandwidth. ``details["global_loads_<N>b"]`` counts the loads of
  each width, so narrow loads beside a wide one (a kernel's weights beside its
  activations) show too. AMD's direct-to-LDS copies (``buffer_load_* ... lds``) are
  counted as async copies; triton 3.9 emits them only on gfx950+ (or with
  ``TRITON_HIP_USE_ASYNC_COPY=1``, where gfx942's are 32 bits wide), so gfx942
  builds report 0 and pipeline through registers instead.
- ``details["int_to_float_converts"]``: integer-to-float convert instructions in the PTX
  (``cvt.rn.f16.s16``, ...) or amdgcn (``v_cvt_f32_u32``, ...). They run at a fraction of
  the FMA rate (an eighth on sm_80/sm_90), so a dequantizing kernel that converts every
  code is bound by them, not by memory (the INT4 GEMV's first H200 run).

For a kernel with several functions (flash_decoding, or every variant with ``tuning``)
the top-level registers, spills and shared memory are the maxima over its functions,
``global_load_bits`` the minimum (the narrowest variant is the one to look at) and
``async_copies`` the sum. Builds are cached in a private TRITON_CACHE_DIR (a temp dir
unless ``cache_dir`` is given), never in ~/.triton.

A process running under ``TRITON_INTERPRET=1`` holds interpreted kernels, which cannot
be compiled, and the interpreter leaves ``triton.language`` patched after a run; such a
process builds in child processes with the interpreter off.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field

from .registry import KERNELS

# arch -> (backend, arch as GPUTarget wants it, warp size)
ARCHS: dict[str, tuple[str, int | str, int]] = {
    "sm_80": ("cuda", 80, 32),
    "sm_90": ("cuda", 90, 32),
    "gfx90a": ("hip", "gfx90a", 64),
    "gfx942": ("hip", "gfx942", 64),
}
# Most shared memory (LDS) one block may use: A100 and H100 opt-in maxima, 64 KiB on CDNA.
MAX_SHARED = {"sm_80": 166912, "sm_90": 232448, "gfx90a": 65536, "gfx942": 65536}
_ELF_MAGIC = b"\x7fELF"
_ELF_MACHINE = {"cuda": 190, "hip": 224}  # EM_CUDA, EM_AMDGPU
_ARTIFACTS = {"cuda": ("ptx", "cubin"), "hip": ("amdgcn", "hsaco")}


@dataclass
class FunctionBuild:
    """One compiled ``@triton.jit`` function of a kernel."""

    name: str
    artifacts: dict[str, str]  # "ptx"/"cubin" or "amdgcn"/"hsaco" -> path in the cache dir
    label: str = ""  # the spec's variant, e.g. an autotune config
    registers: int | None = None
    spills: int | None = None
    shared_memory: int | None = None
    global_load_bits: int | None = None  # widest global load (0: the function loads nothing)
    async_copies: int | None = None      # cp.async / direct-to-LDS buffer loads in the code
    details: dict[str, int] = field(default_factory=dict)


@dataclass
class BuildResult:
    kernel: str
    arch: str
    built: bool
    error: str | None = None
    registers: int | None = None
    shared_memory: int | None = None
    spills: int | None = None
    global_load_bits: int | None = None
    async_copies: int | None = None
    functions: list[FunctionBuild] = field(default_factory=list)

    @classmethod
    def from_dict(cls, d: dict) -> BuildResult:
        return cls(**{**d, "functions": [FunctionBuild(**f) for f in d.get("functions", [])]})


_default_cache: str | None = None


def default_cache_dir() -> str:
    """A per-process temp dir, so builds neither read nor pollute ~/.triton; removed at exit
    (pass ``cache_dir`` to keep the artifacts)."""
    global _default_cache
    if _default_cache is None:
        _default_cache = tempfile.mkdtemp(prefix="graphopt-triton-aot-")
        atexit.register(shutil.rmtree, _default_cache, True)
    return _default_cache


def build(kernel: str, arch: str, *, tuning: bool = False, cache_dir: str | None = None) -> BuildResult:
    """Compile every function of ``kernel`` for ``arch`` ("sm_80", "sm_90", "gfx90a", "gfx942").

    ``tuning`` also builds the tuned function once per autotune config of that vendor.
    """
    return build_all([arch], [kernel], tuning=tuning, cache_dir=cache_dir)[0]


def build_all(archs=tuple(ARCHS), kernels=None, *, tuning: bool = False, cache_dir: str | None = None,
              jobs: int | None = None) -> list[BuildResult]:
    """Build ``kernels`` (default: all registered) for each of ``archs``, kernel-major order.

    ``jobs`` child processes share the work; None builds in this process, unless it is
    interpreting kernels, in which case it uses one child per CPU.
    """
    kernels = list(KERNELS) if kernels is None else list(kernels)
    for a in archs:
        if a not in ARCHS:
            raise ValueError(f"unknown arch {a!r}; known: {', '.join(ARCHS)}")
    for k in kernels:
        if k not in KERNELS:
            raise ValueError(f"unknown kernel {k!r}; known: {', '.join(KERNELS)}")
    pairs = [(k, a) for k in kernels for a in archs]
    cache_dir = cache_dir or default_cache_dir()
    if jobs is None and _interpreting():
        jobs = os.cpu_count() or 1
    if jobs is None:
        return [_build_here(k, a, cache_dir, tuning) for k, a in pairs]
    return _build_in_children(pairs, cache_dir, max(1, min(jobs, len(pairs))), tuning)


def prove(result: BuildResult) -> list[str]:
    """Why the artifacts on disk do not prove ``result`` built; empty when they do.

    NVIDIA: the PTX declares ``.entry <name>`` for the arch and the cubin is a CUDA ELF
    (e_machine EM_CUDA) naming the kernel. AMD: the amdgcn text opens the kernel's
    ``.amdhsa_kernel`` descriptor for the arch and the hsaco is an AMDGPU ELF naming it.
    """
    backend, arch, _ = ARCHS[result.arch]
    problems = [] if result.functions else ["no compiled function"]
    for f in result.functions:
        text_kind, bin_kind = _ARTIFACTS[backend]
        try:
            with open(f.artifacts[text_kind]) as fh:
                text = fh.read()
            with open(f.artifacts[bin_kind], "rb") as fh:
                binary = fh.read()
        except (KeyError, OSError) as e:
            problems.append(f"{f.name}: artifact missing ({e})")
            continue
        if backend == "cuda":
            if not re.search(rf"\.visible\s+\.entry\s+{re.escape(f.name)}\(", text):
                problems.append(f"{f.name}: no .entry {f.name} in the PTX")
            if not re.search(rf"\.target\s+sm_{arch}a?\b", text):
                problems.append(f"{f.name}: PTX does not target sm_{arch}")
        else:
            if not re.search(rf"^\s*\.amdhsa_kernel\s+{re.escape(f.name)}\s*$", text, re.M):
                problems.append(f"{f.name}: no .amdhsa_kernel {f.name} in the amdgcn")
            if not re.search(rf'\.amdgcn_target\s+"[^"]*-{arch}(:[^"]*)?"', text):
                problems.append(f"{f.name}: amdgcn does not target {arch}")
        if binary[:4] != _ELF_MAGIC or int.from_bytes(binary[18:20], "little") != _ELF_MACHINE[backend]:
            problems.append(f"{f.name}: {bin_kind} is not a {backend} ELF ({len(binary)} bytes)")
        elif f.name.encode() not in binary:
            problems.append(f"{f.name}: {bin_kind} has no symbol {f.name}")
    return problems


# -- building in this process -------------------------------------------------------------


def _interpreting() -> bool:
    from triton import knobs
    return bool(knobs.runtime.interpret)


def _max(values):
    known = [v for v in values if v is not None]
    return max(known) if known else None


def _build_here(kernel: str, arch: str, cache_dir: str, tuning: bool = False) -> BuildResult:
    from triton import knobs

    backend, target_arch, warp = ARCHS[arch]
    try:
        if _interpreting():
            raise RuntimeError("this process interprets kernels (TRITON_INTERPRET=1): use build_all(jobs=...)")
        specs = KERNELS[kernel].aot_specs(warp) + (KERNELS[kernel].tuning_specs(warp) if tuning else [])
        with knobs.cache.scope():
            knobs.cache.dir = cache_dir
            funcs = [_compile(spec, backend, target_arch, warp) for spec in specs]
    except Exception as e:  # any failure is the result: one line of why, not a traceback
        return BuildResult(kernel, arch, False, error=f"{type(e).__name__}: {str(e).strip()[:2000]}")
    result = BuildResult(kernel, arch, True, functions=funcs,
                         registers=_max(f.registers for f in funcs), spills=_max(f.spills for f in funcs),
                         shared_memory=_max(f.shared_memory for f in funcs),
                         global_load_bits=min((f.global_load_bits for f in funcs if f.global_load_bits is not None),
                                              default=None),
                         async_copies=sum(f.async_copies or 0 for f in funcs))
    problems = prove(result)
    if problems:
        result.built, result.error = False, "; ".join(problems)
    return result


def _compile(spec, backend: str, target_arch, warp: int) -> FunctionBuild:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    # A config may carry backend options next to its constexprs (waves_per_eu, kpack, ...), as
    # triton.Config does: the JIT passes those to the compiler, so AOT does the same.
    constexprs = {k: v for k, v in spec.constexprs.items() if k in spec.fn.arg_names}
    backend_options = {k: v for k, v in spec.constexprs.items() if k not in spec.fn.arg_names}
    src = ASTSource(spec.fn, spec.full_signature(), constexprs, spec.attrs())
    # fp fusion stated explicitly: triton 3.9 warns when it has to pick the default.
    options = {"num_warps": spec.num_warps, "num_stages": spec.num_stages, "enable_fp_fusion": True,
               **backend_options}
    compiled = triton.compile(src, target=GPUTarget(backend, target_arch, warp), options=options)
    artifacts = {}
    for filename, path in compiled.metadata_group.items():
        ext = filename.rsplit(".", 1)[-1]
        if ext in _ARTIFACTS[backend]:
            artifacts[ext] = path
    fb = FunctionBuild(compiled.name, artifacts, spec.label, shared_memory=compiled.metadata.shared)
    text = compiled.asm["ptx" if backend == "cuda" else "amdgcn"]
    widths, fb.async_copies = load_widths(text, backend)
    fb.global_load_bits = max(widths, default=0)
    for bits in sorted(set(widths)):  # how many loads of each width: the narrow ones are what to fix
        fb.details[f"global_loads_{bits}b"] = widths.count(bits)
    fb.details["int_to_float_converts"] = len((_PTX_I2F if backend == "cuda" else _AMD_I2F).findall(text))
    if backend == "cuda":
        _nvidia_resources(fb, target_arch)
    else:
        _amd_resources(fb, text)
    return fb


# PTX: `[@%p] ld.global[.nc][.L1::...][.v2|.v4].<type>` and `cp.async.{ca,cg}.shared.global [dst], [src], bytes`
# (the Ampere+ copy into shared memory that Triton's pipeliner issues), plus Hopper's TMA copies.
_PTX_LOAD = re.compile(r"^\s*(?:@!?%p\w*\s+)?ld\.global((?:\.[\w:]+)+)\s", re.M)
_PTX_CP_ASYNC = re.compile(r"^\s*(?:@!?%p\w*\s+)?cp\.async\.c[ag]\.shared(?:::cta)?\.global\S*\s+\[[^\]]*\],"
                           r"\s*\[[^\]]*\],\s*(0x[0-9a-fA-F]+|\d+)", re.M)
_PTX_TMA = re.compile(r"^\s*(?:@!?%p\w*\s+)?cp\.async\.bulk\.", re.M)
# int -> float converts: PTX `cvt.rn.f32.s32`, `cvt.rn.f16.u16`, ... (float <- signed / unsigned
# integer); amdgcn `v_cvt_f32_i32`, `v_cvt_f16_u16`, `v_cvt_f32_ubyte0`, ...
_PTX_I2F = re.compile(r"^\s*(?:@!?%p\w*\s+)?cvt(?:\.\w+)*\.(?:f16|bf16|f32|f64)\.[su]\d+\s", re.M)
_AMD_I2F = re.compile(r"^\s*v_cvt_f(?:16|32|64)_(?:[iu]\d+|ubyte\d)\b", re.M)
# amdgcn: global_load_* / buffer_load_* by width; `buffer_load_... lds` and `global_load_lds_*` write LDS
# directly (the AMD async copy; Triton uses it on gfx950+, or with TRITON_HIP_USE_ASYNC_COPY=1).
_AMD_LOAD = re.compile(r"^\s*(global_load|buffer_load)_(lds_)?(\w+)([^\n]*)$", re.M)
_AMD_BITS = {"ubyte": 8, "sbyte": 8, "ushort": 16, "sshort": 16, "short_d16": 16, "short_d16_hi": 16,
             "ubyte_d16": 8, "sbyte_d16": 8, "ubyte_d16_hi": 8, "sbyte_d16_hi": 8, "dword": 32,
             "dwordx2": 64, "dwordx3": 96, "dwordx4": 128, "b32": 32, "b64": 64, "b96": 96, "b128": 128,
             "u8": 8, "i8": 8, "u16": 16, "i16": 16}


def load_facts(text: str, backend: str) -> tuple[int, int]:
    """(widest global load in bits, count of async global-to-shared copies) in PTX or amdgcn.

    The width counts ``cp.async`` copies too (a 16-byte ``cp.async`` moves 128 bits from
    global memory), so a kernel whose loads all go through the pipeliner still shows
    its width. 0 bits: no global load at all.
    """
    widths, copies = load_widths(text, backend)
    return max(widths, default=0), copies


def load_widths(text: str, backend: str) -> tuple[list[int], int]:
    """The bit width of every global load (``cp.async`` included) and the async copy count."""
    widths, copies = [], 0
    if backend == "cuda":
        for m in _PTX_LOAD.finditer(text):
            parts = m.group(1).split(".")
            vec = next((int(p[1:]) for p in parts if re.fullmatch(r"v\d", p)), 1)
            bits = next((int(p[1:]) for p in parts if re.fullmatch(r"[bsuf]\d+", p)), 0)
            widths.append(vec * bits)
        for m in _PTX_CP_ASYNC.finditer(text):
            widths.append(8 * int(m.group(1), 0))
            copies += 1
        copies += len(_PTX_TMA.findall(text))
    else:
        for m in _AMD_LOAD.finditer(text):
            widths.append(_AMD_BITS.get(m.group(3), 0))
            if m.group(2) or re.search(r"\blds\b", m.group(4).split(";")[0]):
                copies += 1
    return widths, copies


def _nvidia_resources(fb: FunctionBuild, capability: int) -> None:
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.TemporaryDirectory() as tmp:
        try:
            proc = subprocess.run(
                [get_ptxas(capability).path, "-v", "--regAllocOptLevel=2",
                 f"--gpu-name={sm_arch_from_capability(capability)}", fb.artifacts["ptx"],
                 "-o", os.path.join(tmp, "k.cubin")],
                capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.SubprocessError):
            return  # registers and spills stay unknown
    log = proc.stdout + proc.stderr
    if m := re.search(r"Used (\d+) registers", log):
        fb.registers = int(m.group(1))
    if m := re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log):
        fb.spills = int(m.group(1))
        fb.details["spill_load_bytes"] = int(m.group(2))
    if m := re.search(r"(\d+) bytes stack frame", log):
        fb.details["stack_frame_bytes"] = int(m.group(1))


def _amd_resources(fb: FunctionBuild, amdgcn: str) -> None:
    notes = {k: int(v) for k, v in re.findall(r"^\s*\.(\w+_count):\s+(\d+)\s*$", amdgcn, re.M)}
    fb.registers = notes.get("vgpr_count")
    if "vgpr_spill_count" in notes or "sgpr_spill_count" in notes:
        fb.spills = notes.get("vgpr_spill_count", 0) + notes.get("sgpr_spill_count", 0)
    fb.details.update({k: v for k, v in notes.items() if k in ("sgpr_count", "agpr_count")})


# -- building in child processes ----------------------------------------------------------


def _build_in_children(pairs, cache_dir: str, jobs: int, tuning: bool) -> list[BuildResult]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = cache_dir
    work = tempfile.mkdtemp(prefix="jobs-", dir=cache_dir)
    children = []
    for i in range(jobs):
        chunk = pairs[i::jobs]  # interleaved, so each child gets a mix of cheap and costly builds
        req, out, log = (os.path.join(work, f"{i}.{ext}") for ext in ("req.json", "out.json", "log"))
        with open(req, "w") as fh:
            json.dump({"pairs": chunk, "cache_dir": cache_dir, "out": out, "tuning": tuning}, fh)
        code = f"import sys; from {__name__} import _child_main; _child_main(sys.argv[1])"
        with open(log, "w") as log_fh:
            proc = subprocess.Popen([sys.executable, "-c", code, req], env=env, stdout=log_fh, stderr=log_fh)
        children.append((proc, chunk, out, log))
    by_pair = {}
    for proc, chunk, out, log in children:
        proc.wait()
        try:
            with open(out) as fh:
                results = [BuildResult.from_dict(d) for d in json.load(fh)]
        except (OSError, ValueError):
            with open(log) as fh:
                tail = fh.read()[-2000:]
            results = [BuildResult(k, a, False, error=f"build process exited {proc.returncode}: {tail}")
                       for k, a in chunk]
        by_pair.update({(r.kernel, r.arch): r for r in results})
    return [by_pair[p] for p in pairs]


def _child_main(request_path: str) -> None:
    """Entry point of a build child: the request names the pairs and where results go."""
    with open(request_path) as fh:
        req = json.load(fh)
    results = [_build_here(k, a, req["cache_dir"], req["tuning"]) for k, a in req["pairs"]]
    with open(req["out"], "w") as fh:
        json.dump([dataclasses.asdict(r) for r in results], fh)
