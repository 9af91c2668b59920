"""The INT4 GEMM's autotune configs per vendor and shape, with a reason for each choice, and the
pruning that keeps, for a launch, the configs whose K steps suit its group size.

int4_gemm.py launches with them; registry.tuning_specs builds every MMA config ahead of time.
"""

from __future__ import annotations

import triton

# Bytes of packed weight each thread loads per K step: 16 is one 128-bit vector load.
GEMV_BYTES_PER_THREAD = 16


def gemv_bytes_per_thread(block_n: int, block_k: int, num_warps: int, warp: int) -> int:
    return (block_k // 2) * block_n // (num_warps * warp)


def decode_gpu_configs(hip: bool) -> list[triton.Config]:
    """(BLOCK_N, BLOCK_K, warps, stages, reason) for M <= 16; BLOCK_M comes from the launcher.

    Each tile gives every thread >= 16 bytes of packed weight per step at one token, so
    a thread's codes are one 128-bit load: a 64-wide wavefront needs twice the tile (or
    half the waves) of a 32-wide warp. Stages only matter at BLOCK_M = 16 (the MMA path;
    the FMA path prefetches by hand).
    """
    if hip:
        # gfx942: stream pipeliner stages through registers + LDS: 2 keeps LDS under 64 KiB.
        # matrix_instr_nonkdim=16: a 16-row decode tile is one 16x16 MFMA row; 32x32 would be half padding.
        amd = {"matrix_instr_nonkdim": 16}
        shapes = [(128, 64, 4, 2, "256 lanes x 16 B: the widest tile that is one dwordx4 per lane"),
                  (128, 32, 2, 2, "two waves: the same bytes per lane for any group size"),
                  (64, 64, 2, 2, "half the columns: twice the programs for N <= 4096 on 304 CUs"),
                  (64, 128, 4, 2, "group >= 128: long K steps, fewer loop trips")]
        return [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk, **amd}, num_warps=w, num_stages=st)
                for bn, bk, w, st, _ in shapes]
    # Hopper / Ampere: 4 stages of cp.async on the 16-row MMA path (16 x 64 tiles are small: 4 fit easily).
    shapes = [(128, 32, 4, 4, "128 threads x 16 B: one ld.global.v4 per thread, any group size"),
              (64, 64, 4, 3, "half the columns, twice the programs: fills 132 SMs at N = 4096"),
              (128, 64, 4, 3, "two 128-bit loads per thread: more bytes in flight per SM"),
              (64, 32, 2, 4, "two warps: small N still gets 16 B per thread"),
              (32, 128, 4, 3, "group >= 128: long K steps, fewer loop trips")]
    return [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=st) for bn, bk, w, st, _ in shapes]


def gemv_gpu_configs(hip: bool) -> list[triton.Config]:
    """One token's configs: the grouped tiles first, then the decode tiles (16 bytes a step)."""
    return grouped_gemv_configs(hip) + decode_gpu_configs(hip)


def grouped_gemv_configs(hip: bool) -> list[triton.Config]:
    """(BLOCK_N, BLOCK_K, warps, reason) for one token, on the FMA units, stages 1 (the loop
    prefetches by hand).

    The first H200 run (README) timed the 16-byte steps of decode_gpu_configs at 0.14 of copy
    bandwidth on 4096 x 4096: 16 dependent steps a program, about 8 KB in flight per SM where
    HBM needs some 26 KB (4.25 TB/s over 132 SMs times ~0.8 us of latency). These tiles step
    over 4-8 groups, 64 bytes of codes per thread (four 128-bit loads, twice that with the
    prefetch), a quarter of the steps; the 16-byte tiles stay for the autotuner to compare.
    """
    warp = 64 if hip else 32
    shapes = [(64, 128, 2 * 32 // warp, "64 threads x 64 B: four 128-bit loads per thread a step"),
              (128, 128, 4 * 32 // warp, "twice the columns: half the programs, the same bytes per thread"),
              (64, 256, 4 * 32 // warp, "8 groups a step: half the steps of BLOCK_K = 128"),
              (32, 256, 2 * 32 // warp, "narrow tiles: twice the programs for N <= 4096")]
    return [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=max(1, w), num_stages=1)
            for bn, bk, w, _ in shapes]


def prefill_gpu_configs(hip: bool) -> list[triton.Config]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) for M > 16, on MMA / MFMA tiles.

    The knobs are reasoned, not yet timed on a device (scripts/gpu_check.sh times them).
    """
    if hip:
        # LDS is 64 KiB: two stages at most for the large tiles. MI300 knobs:
        # matrix_instr_nonkdim=16 (16x16x16 fp16 MFMA: the dequantized tile is written to LDS
        # in 16-wide rows, and 16x16 needs half the accumulator VGPRs of 32x32);
        # kpack=2 (8 k-values per LDS read: ds_read_b128 of the MFMA operands);
        # waves_per_eu=2 on 8-wave 128x128 tiles (caps VGPRs at 256 so two workgroups
        # share a CU and one's dequant hides the other's loads), 0 (compiler's choice) on smaller tiles.
        shapes = [(128, 128, 64, 8, 2, 2), (128, 128, 32, 8, 2, 2), (128, 64, 64, 4, 2, 0), (64, 128, 32, 4, 2, 0),
                  (64, 64, 32, 4, 2, 0)]
        return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "matrix_instr_nonkdim": 16, "kpack": 2,
                               "waves_per_eu": wpe}, num_warps=w, num_stages=st)
                for bm, bn, bk, w, st, wpe in shapes]
    # Hopper: 8 warps (two warpgroups) on 128x128 tiles for wgmma, 3-4 stages of cp.async
    # (3 x 24 KiB at BLOCK_K = 64 leaves room for a second block per SM in 228 KiB);
    # 4 warps on the smaller tiles, where 4 stages still fit twice per SM.
    shapes = [(128, 128, 64, 8, 3), (128, 128, 32, 8, 4), (128, 64, 64, 4, 4), (64, 128, 32, 4, 4),
              (64, 64, 32, 4, 4)]
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=st)
            for bm, bn, bk, w, st in shapes]


def gpu_configs(hip: bool) -> list[triton.Config]:
    """Every MMA config either tuning may pick (registry.tuning_specs builds each of them on
    the prefill spec; aot_specs builds the GEMV's first grouped tile)."""
    return decode_gpu_configs(hip) + prefill_gpu_configs(hip)


def gemv_sub_group(group: int) -> int:
    """The k a GEMV thread dequantizes with one scale: 32 when it divides the group (groups of
    64 or 128 too: a thread holding a whole group of 128 runs out of registers), else the group."""
    return 32 if group % 32 == 0 else group


def prune_configs(configs, named_args, warp: int | None = None, **kwargs):
    """Keep the configs whose BLOCK_K divides the group size (one scale per step, unmasked
    128-bit loads) or, for the GEMV, is a multiple of its sub-group (whole sub-groups a step), else those
    with the smallest BLOCK_K (the masked fallback). ``warp`` is accepted for
    registry.tuning_specs; the choice does not depend on it."""
    args = {**named_args, **kwargs}
    group, gemv = args["GROUP"], args.get("BLOCK_M") == 1

    def unmasked(bk: int) -> bool:
        return group % bk == 0 or (gemv and bk % gemv_sub_group(group) == 0)

    kept = [c for c in configs if unmasked(c.kwargs.get("BLOCK_K", group))]
    if not kept:
        smallest = min(c.kwargs.get("BLOCK_K", 0) for c in configs)
        kept = [c for c in configs if c.kwargs.get("BLOCK_K", 0) == smallest]
    return kept
