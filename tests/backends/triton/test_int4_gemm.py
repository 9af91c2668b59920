"""The INT4 GEMM / GEMV kernel vs graphopt.int4_linear under the interpreter, and its
ahead-of-time builds for sm_80, sm_90, gfx90a and gfx942."""

from __future__ import annotations

import importlib

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

import graphopt.ops  # noqa: F401  (registers torch.ops.graphopt.*)
from graphopt.backends.triton.kernels import int4_gemm
from graphopt.quant.groupwise import quantize_int4

from ._numerics import TOLERANCES, poisoned, randn

if not int4_gemm._common.interpreting():  # pragma: no cover - conftest sets TRITON_INTERPRET first
    pytest.skip("TRITON_INTERPRET=1 must be set before the kernels are imported", allow_module_level=True)
if isinstance(int4_gemm.int4_gemm_kernel, JITFunction):  # imported earlier without the interpreter
    importlib.reload(int4_gemm)  # (conftest reloads the kernel modules it knows of; this one is new)

ref_op = torch.ops.graphopt.int4_linear


def weight(n: int, k: int, group: int, symmetric: bool, dtype=torch.float16):
    w = randn(n, k, dtype=torch.float32, scale=0.05)
    q = quantize_int4(w, group, symmetric, "float16" if dtype != torch.bfloat16 else "bfloat16", "rtn")
    return q.packed, q.scales, q.zeros


def misaligned(packed: torch.Tensor) -> torch.Tensor:
    """The same codes 8 bytes past a 16-byte boundary: the word GEMV cannot take them."""
    buf = torch.empty(packed.numel() + 16, dtype=torch.uint8)
    start = (8 - buf.data_ptr()) % 16
    view = buf[start:start + packed.numel()].view(packed.shape)
    view.copy_(packed)
    assert view.data_ptr() % 16 == 8
    return view


def check(m, n, k, group, dtype, symmetric=True, bias=False, lead=(), split_k=None, aligned=True):
    """int4_linear against the reference op; M = 1 is the GEMV (int4_gemv.py's word kernel
    when the rows are aligned, else int4_gemm's own), 2-16 rows one MMA tile, more the prefill."""
    packed, scales, zeros = weight(n, k, group, symmetric, dtype)
    packed = packed if aligned else misaligned(packed)
    x = randn(*lead, m, k, dtype=dtype)
    b = randn(n, dtype=dtype) if bias else None
    out = poisoned((*lead, m, n), dtype)
    got = int4_gemm.int4_linear(x, packed, scales, zeros, group, b, out=out, split_k=split_k)
    assert got is out
    want = ref_op(x, packed, scales, zeros, group, b)
    assert got.dtype == want.dtype and got.shape == want.shape
    tol = TOLERANCES[dtype]
    if dtype != torch.float32:  # K-long sums of rounded products: a few ulps of the output's magnitude
        tol = {"rtol": 2 * tol["rtol"], "atol": 2 * tol["atol"]}
    torch.testing.assert_close(got.float(), want.float(), **tol)


DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 3, 16])
def test_decode_rows(m, dtype):
    check(m, 96, 128, 32, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_rows(dtype):
    check(40, 80, 128, 64, dtype, bias=True)


@pytest.mark.parametrize("m", [1, 24])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_asymmetric_with_bias_each_group_size(m, group):
    check(m, 48, 256, group, torch.float16, symmetric=False, bias=True)


@pytest.mark.parametrize("m", [1, 20])
def test_k_not_a_multiple_of_the_group(m):
    check(m, 40, 72, 32, torch.float32, symmetric=False, bias=True)  # 3 groups, the last 8/32 full


@pytest.mark.parametrize("m", [1, 20])
@pytest.mark.parametrize("k,group", [(71, 32), (48, 16), (96, 48)])
def test_odd_k_and_groups_that_take_the_masked_fallback(m, k, group):
    # K = 71: odd, the common (unmasked-weight) path with x masked past K; groups 16 and 48
    # do not divide BLOCK_K = 32, so steps span groups: the masked per-byte fallback.
    check(m, 24, k, group, torch.float32, symmetric=False, bias=True)
    check(m, 24, k, group, torch.float16, symmetric=True)


@pytest.mark.parametrize("split_k", [2, 3])
@pytest.mark.parametrize("bias", [False, True])
def test_split_k_decode(split_k, bias):
    check(2, 64, 256, 32, torch.float32, symmetric=False, bias=bias, split_k=split_k)


def test_leading_dims():
    check(5, 32, 64, 32, torch.float16, lead=(2,))


def test_bad_input_fails_with_one_line():
    packed, scales, zeros = weight(32, 64, 32, True)
    with pytest.raises(ValueError, match="input has 100 features"):
        int4_gemm.int4_linear(torch.randn(1, 100), packed, scales, zeros, 32)
    with pytest.raises(ValueError, match="bias must be"):
        int4_gemm.int4_linear(torch.randn(1, 64), packed, scales, zeros, 32, torch.randn(3))


def test_prune_keeps_block_k_dividing_the_group():
    configs = int4_gemm.gpu_configs(hip=False)
    for group in (32, 64, 128):
        kept = int4_gemm.prune_configs(configs, {"GROUP": group})
        assert kept and all(group % c.kwargs["BLOCK_K"] == 0 for c in kept)
    # No BLOCK_K divides 16: the smallest BLOCK_K (the masked fallback) is kept.
    assert {c.kwargs["BLOCK_K"] for c in int4_gemm.prune_configs(configs, {"GROUP": 16})} == {32}


@pytest.mark.parametrize("hip,warp", [(False, 32), (True, 64)])
def test_gemv_tiles_give_each_lane_a_128_bit_load(hip, warp):
    # One token: every decode tile hands each lane of a 32-wide warp / 64-wide wavefront
    # at least 16 bytes of packed weight per step, so its codes can be one vector load.
    for c in int4_gemm.gemv_gpu_configs(hip):  # the grouped tiles and the MMA decode tiles
        bn, bk = c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"]
        assert int4_gemm.gemv_bytes_per_thread(bn, bk, c.num_warps, warp) >= 16, c
    grouped = int4_gemm.grouped_gemv_configs(hip)
    # The grouped tiles: four 128-bit loads per thread a step, the bytes in flight HBM needs.
    assert grouped and all(int4_gemm.gemv_bytes_per_thread(c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.num_warps,
                                                            warp) == 64 for c in grouped)


def test_prune_gives_the_gemv_whole_group_steps_and_the_mma_tiles_none():
    configs = int4_gemm.gemv_gpu_configs(hip=False)
    gemv = int4_gemm.prune_configs(configs, {"GROUP": 32, "BLOCK_M": 1})
    assert {c.kwargs["BLOCK_K"] for c in gemv} == {32, 64, 128, 256}
    mma = int4_gemm.prune_configs(configs, {"GROUP": 32, "BLOCK_M": 16})
    assert {c.kwargs["BLOCK_K"] for c in mma} == {32}


@pytest.mark.parametrize("aligned", [True, False])
@pytest.mark.parametrize("k,group,split_k", [(160, 32, 2), (160, 32, 3), (96, 16, 2), (200, 64, 1), (256, 128, 2)])
def test_gemv_steps_of_whole_groups_stop_at_their_split(k, group, split_k, aligned):
    # int4_gemm's GEMV tile (interpreter) steps over 64 k: two groups of 32, four of 16, or two
    # sub-groups of 32 inside a group of 64 or 128; a split of 3 groups of 32 ends inside a
    # step, so its second group must not be read twice. Aligned rows with groups of 32-128
    # take int4_gemv's word kernel instead, whose steps are 32 k.
    assert int4_gemm.int4_gemm_gemv.configs[0].kwargs["BLOCK_K"] == 64
    check(1, 40, k, group, torch.float32, symmetric=False, bias=True, split_k=split_k, aligned=aligned)
    check(1, 40, k, group, torch.bfloat16, split_k=split_k, aligned=aligned)


class _Launches:
    """Counts the launches of an autotuned kernel while passing them through."""

    def __init__(self, tuned):
        self.tuned, self.count = tuned, 0

    def __getitem__(self, grid):
        self.count += 1
        return self.tuned[grid]


@pytest.mark.parametrize("group,aligned,word_kernel", [(32, True, True), (128, True, True), (16, True, False),
                                                       (48, True, False), (32, False, False)])
def test_one_token_takes_the_word_kernel_when_groups_and_rows_allow(monkeypatch, group, aligned, word_kernel):
    launches = _Launches(int4_gemm.int4_gemv.int4_gemv_tuned)
    monkeypatch.setattr(int4_gemm.int4_gemv, "int4_gemv_tuned", launches)
    check(1, 24, 2 * group if group != 48 else 96, group, torch.float16, symmetric=False, aligned=aligned)
    assert launches.count == (1 if word_kernel else 0)


def test_split_k_sums_on_the_device_not_in_torch(monkeypatch):
    # The reduction is the second kernel: no torch reduction may touch the partials.
    packed, scales, zeros = weight(40, 128, 32, True)
    x, b = randn(1, 128, dtype=torch.float16), randn(40, dtype=torch.float16)
    want = ref_op(x, packed, scales, zeros, 32, b)

    def no_torch_reduction(*args, **kwargs):
        raise AssertionError("split-K partials reduced in torch")

    for name in ("sum", "add_", "copy_"):
        monkeypatch.setattr(torch.Tensor, name, no_torch_reduction)
    got = int4_gemm.int4_linear(x, packed, scales, zeros, 32, b, out=poisoned((1, 40), torch.float16), split_k=4)
    monkeypatch.undo()
    torch.testing.assert_close(got.float(), want.float(), rtol=8e-3, atol=8e-3)


@triton.jit
def _weights_kernel(codes_ptr, s_ptr, z_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    codes, zero = tl.load(codes_ptr + i), tl.load(z_ptr + i)
    tl.store(out_ptr + i, int4_gemm._weights(codes, tl.load(s_ptr + i), zero, out_ptr.dtype.element_ty))


@pytest.mark.parametrize("dtype,scale_dtype", [(torch.float16, torch.float16), (torch.float32, torch.float16),
                                               (torch.float32, torch.float32), (torch.float16, torch.float32),
                                               (torch.bfloat16, torch.bfloat16)])
def test_codes_become_the_references_weights_value_for_value(dtype, scale_dtype):
    # Every code against every zero point, with random scales (some tiny, some large): the
    # bit trick that replaces the int -> float convert gives the reference's rounded weight.
    codes, zeros = torch.meshgrid(torch.arange(16), torch.arange(16), indexing="ij")
    codes, zeros = codes.reshape(-1).to(torch.uint8), zeros.reshape(-1).float()
    scales = (torch.randn(256) * torch.logspace(-6, 2, 256)).to(scale_dtype)
    want = ((codes.float() - zeros) * scales.float()).to(dtype)
    got = torch.empty(256, dtype=dtype)
    _weights_kernel[(1,)](codes, scales, zeros, got, N=256)
    if dtype == torch.bfloat16:  # the interpreter truncates fp32 -> bf16 where a GPU rounds (_numerics)
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=0)
    else:
        assert torch.equal(got, want)


@pytest.fixture(scope="module")
def builds(aot_builds):
    """The four archs' builds from the session's AOT build (conftest's aot_builds; test_aot
    reads the same one), as the rows the assertions below read."""
    from graphopt.backends.triton import aot

    return {arch: dict(arch=r.arch, built=r.built, error=r.error, problems=aot.prove(r) if r.built else [],
                       functions=[dict(label=f.label, registers=f.registers, spills=f.spills, shared=f.shared_memory,
                                       bits=f.global_load_bits, async_copies=f.async_copies,
                                       byte_loads=f.details.get("global_loads_8b", 0),
                                       int_to_float=f.details["int_to_float_converts"])
                                  for f in r.functions])
            for (_, arch), r in aot_builds.get(["int4_gemm"]).items()}


@pytest.mark.parametrize("arch", ["sm_80", "sm_90", "gfx90a", "gfx942"])
def test_builds_ahead_of_time(builds, arch):
    from graphopt.backends.triton import aot

    r = builds[arch]
    assert r["built"], r["error"]
    assert r["problems"] == []
    warp = aot.ARCHS[arch][2]
    hip = warp == 64
    n_tuning = (len(int4_gemm.prune_configs(int4_gemm.gpu_configs(hip), {"GROUP": 32}))
                + len(int4_gemm.prune_configs(int4_gemm.grouped_gemv_configs(hip), {"GROUP": 32, "BLOCK_M": 1}))
                + len(int4_gemm.int4_gemv.gpu_configs(hip)))
    assert len(r["functions"]) == len(int4_gemm.aot_specs("int4_gemm", warp)) + n_tuning
    for f in r["functions"]:
        assert f["registers"] and f["spills"] == 0, f"{f['label'] or 'spec'} on {arch} spills {f['spills']} bytes"
        # No byte-wide loads anywhere: the packed weight (the only u8 tensor read on the
        # group-aligned path) moves in vectors, in every config the tuner may pick.
        assert f["byte_loads"] == 0, f
        assert f["shared"] <= aot.MAX_SHARED[arch], f
        # Codes become floats by bit tricks (int4_gemm._weights), never by a convert
        # instruction: those run at an eighth of the FMA rate and bound the first GEMV.
        if f["label"] != "split-K reduce":
            assert f["int_to_float"] == 0, f
    # The representative builds (GEMV, MMA paths, reduction) load in 128-bit vectors on every
    # arch: the weight bytes carry no per-k mask on the group-aligned path.
    specs = [f for f in r["functions"] if f["label"] in ("prefill 128x128x32", "decode M=16", "decode M=1 split-K",
                                                            "decode M=1 split-K, 4 groups a step", "split-K reduce",
                                                            int4_gemm.WORD_GEMV_SPEC)]
    assert len(specs) == 6 and all(f["bits"] >= 128 for f in specs), specs
    if not hip:  # the MMA paths' weight and x loads are software-pipelined: cp.async stages in flight
        mma = [f for f in specs if f["label"] in ("prefill 128x128x32", "decode M=16")]
        assert all(f["async_copies"] > 0 for f in mma), mma
