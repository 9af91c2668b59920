"""Every registered kernel compiles ahead of time for NVIDIA and AMD on this GPU-less machine."""

from __future__ import annotations

import re
import subprocess

import pytest

from graphopt.backends.triton import aot
from graphopt.backends.triton.registry import KERNELS, AotSpec

ARCHS = list(aot.ARCHS)  # sm_80, sm_90, gfx90a, gfx942


@pytest.fixture(scope="module")
def builds(aot_builds):
    """All kernels x all archs, with every autotune config: the session's one build
    (conftest's aot_builds), in its throwaway TRITON_CACHE_DIR."""
    return aot_builds.cache_dir, aot_builds.get()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kernel", list(KERNELS))
def test_kernel_builds(builds, kernel, arch):
    cache, results = builds
    r = results[(kernel, arch)]
    assert r.built, r.error
    assert aot.prove(r) == []
    warp = aot.ARCHS[arch][2]
    entry = KERNELS[kernel]
    assert len(r.functions) == len(entry.aot_specs(warp)) + len(entry.tuning_specs(warp))
    assert all(p.startswith(cache) for f in r.functions for p in f.artifacts.values())
    for f in r.functions:
        variant = f"{kernel} [{f.label or 'representative'}] on {arch}"
        assert f.registers is not None and f.registers > 0, variant
        # Every config the autotuner may pick must fit the part and keep its registers.
        assert f.spills == 0, f"{variant} spills {f.spills} bytes"
        assert f.shared_memory is not None and f.shared_memory <= aot.MAX_SHARED[arch], variant


LOAD_FACT_KERNELS = ["int4_gemm", "rms_norm", "add_rms_norm", "softmax_rms_norm", "layer_norm", "flash_attention",
                     "flash_decoding"]


@pytest.mark.parametrize("arch", ["sm_80", "sm_90", "gfx942"])
@pytest.mark.parametrize("kernel", LOAD_FACT_KERNELS)
def test_load_facts(builds, kernel, arch):
    """Every representative build of the INT4, norm and attention kernels loads global memory in
    128-bit vectors; the ones that feed tl.dot prefetch through cp.async on NVIDIA."""
    _, results = builds
    r = results[(kernel, arch)]
    assert r.built, r.error
    n_specs = len(KERNELS[kernel].aot_specs(aot.ARCHS[arch][2]))
    for f in r.functions[:n_specs]:  # the specs; the tuning configs follow them
        assert f.global_load_bits is not None and f.global_load_bits >= 128, (kernel, f.label or f.name, arch)
        dot_fed = kernel in ("flash_attention", "flash_decoding", "int4_gemm") and "reduce" not in f.name + f.label \
            and "M=1" not in f.label
        if dot_fed and arch.startswith("sm_"):
            assert f.async_copies > 0, (kernel, f.label or f.name, arch)
    assert r.global_load_bits == min(f.global_load_bits for f in r.functions)
    assert r.async_copies == sum(f.async_copies for f in r.functions)


ROW_KERNELS = ["rms_norm", "add_rms_norm", "softmax_rms_norm", "layer_norm", "add_layer_norm", "swiglu", "geglu",
               "bias_gelu", "rope", "rope_kv_cache_update"]


@pytest.mark.parametrize("arch", ARCHS)
def test_every_tuning_config_of_the_memory_bound_kernels_loads_128_bits(builds, arch):
    """The autotuner may pick any config: none of the norm / activation / rope configs may split
    a thread's share below one 128-bit vector, and none needs an MI300 waves_per_eu cap
    (<= 128 VGPRs: at least 4 waves per SIMD; see kernels/_common.py)."""
    from graphopt.backends.triton.kernels import _common

    _, results = builds
    for kernel in ROW_KERNELS:
        r = results[(kernel, arch)]
        assert r.built, r.error  # a failed build has no functions to pass this vacuously
        for f in r.functions:
            assert f.global_load_bits >= 128, (kernel, f.label or "spec", arch, f.details)
            if arch.startswith("gfx"):
                assert f.registers <= _common.ROW_MAX_VGPRS, (kernel, f.label or "spec", arch, f.registers)


def test_load_facts_parse_ptx_and_amdgcn():
    ptx = """
    @%p1 ld.global.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd1 + 0 ];
    ld.global.nc.b16 %rs1, [ %rd2 + 0 ];
    @!%p2 ld.global.L1::evict_last.v2.b32 { %r5, %r6 }, [ %rd3 + 0 ];
    @%p3 cp.async.cg.shared.global [ %r7 + 0 ], [ %rd4 + 0 ], 0x10, %r8;
    cp.async.ca.shared.global [ %r9 + 0 ], [ %rd5 + 0 ], 4;
    cp.async.commit_group;
    cp.async.wait_group 0;
    st.global.v4.b32 [ %rd6 + 0 ], { %r1, %r2, %r3, %r4 };
    """
    assert aot.load_widths(ptx, "cuda") == ([128, 16, 64, 128, 32], 2)
    assert aot.load_facts("ld.global.b8 %rs1, [ %rd1 + 0 ];", "cuda") == (8, 0)
    gcn = """
    global_load_dwordx4 v[0:3], v4, s[0:1]
    buffer_load_ushort v5, v6, s[4:7], 0 offen
    buffer_load_dword v7, s[8:11], 0 offen lds ; async into LDS
    global_load_lds_dwordx4 v8, s[0:1]
    global_load_ubyte v9, v4, s[0:1] ; not lds
    global_store_dwordx4 v4, v[0:3], s[0:1]
    """
    assert aot.load_widths(gcn, "hip") == ([128, 16, 32, 128, 8], 2)
    assert aot.load_facts("s_endpgm", "hip") == (0, 0)


def test_register_counts_match_the_cubin(builds):
    """ptxas -v re-run on the PTX must agree with the registers the cubin records."""
    from triton import knobs

    _, results = builds
    cuobjdump = knobs.nvidia.cuobjdump
    if cuobjdump is None:
        pytest.skip("triton ships no cuobjdump here")
    for (kernel, arch), r in results.items():
        if arch != "sm_90":
            continue
        for f in r.functions:
            dump = subprocess.run([cuobjdump.path, "--dump-resource-usage", f.artifacts["cubin"]],
                                  capture_output=True, text=True, check=True).stdout
            m = re.search(rf"Function {re.escape(f.name)}:\s*REG:(\d+)", dump)
            assert m and int(m.group(1)) == f.registers, (kernel, f.name, dump)


def test_prove_rejects_artifacts_that_are_not_builds(tmp_path):
    ptx, cubin = tmp_path / "k.ptx", tmp_path / "k.cubin"
    ptx.write_text(".version 8.0\n.target sm_90a\n// no entry point\n")
    cubin.write_bytes(b"not an elf")
    fake = aot.BuildResult("k", "sm_90", True, functions=[aot.FunctionBuild("k", {"ptx": str(ptx),
                                                                                     "cubin": str(cubin)})])
    problems = aot.prove(fake)
    assert any(".entry" in p for p in problems) and any("ELF" in p for p in problems)
    assert aot.prove(aot.BuildResult("k", "gfx942", True)) == ["no compiled function"]


def test_rejects_unknown_arch_and_kernel():
    with pytest.raises(ValueError, match="unknown arch"):
        aot.build("rms_norm", "sm_70")
    with pytest.raises(ValueError, match="unknown kernel"):
        aot.build("matmul", "sm_90")


def test_spec_must_type_every_argument():
    spec = KERNELS["kv_cache_update"].aot_specs(32)[0]
    partial = {k: v for k, v in spec.signature.items() if k != "new_len"}
    with pytest.raises(ValueError, match="new_len"):
        AotSpec(spec.fn, partial, spec.constexprs).full_signature()
