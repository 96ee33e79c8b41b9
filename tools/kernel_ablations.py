#!/usr/bin/env python3
"""Kernel ablations: copies of the CUDA kernels with one piece of work removed, to time what that
piece costs a decode token (docs/perf-notes.md, "Eleventh session").

An ablation's output is wrong by design; only its time means something. Each writes a folder that
`MEGAGEMMA_KERNELS` reads at run time, so no Rust rebuild is needed on the GPU machine:

    python3 tools/kernel_ablations.py .gpu/abl floor noloop noatt
    ROUNDS=2 DECODES=graph tools/gpu_ab.sh .gpu base \\
      floor:MEGAGEMMA_KERNELS=.gpu/abl/floor noloop:MEGAGEMMA_KERNELS=.gpu/abl/noloop ...

or, in one line on the GPU machine (`--variants` prints gpu_ab.sh's variant arguments instead of the folders):

    tools/gpu_ab.sh .gpu base $(python3 tools/kernel_ablations.py .gpu/abl --variants floor noloop noatt)

`--list` prints the ablations; `--check DIR` writes every one of them (each edit must match the
kernel source exactly once, so a kernel change that breaks an ablation fails `cargo test`).
Every ablation also makes `argmax_final` return token 0 when no logit compares (all NaN), so a
run whose values are garbage still produces valid ids.
"""

import argparse
import shutil
import sys
from pathlib import Path

KERNELS = Path(__file__).resolve().parent.parent / "crates" / "megagemma-cuda" / "kernels"

# A token id every ablation can emit (garbage inputs can make every logit NaN).
ARGMAX_SAFE = (
    "ops.cu",
    "  if (threadIdx.x == 0) ids[vb] = (unsigned)bi;",
    "  if (threadIdx.x == 0) ids[vb] = bi == 0x7fffffff ? 0u : (unsigned)bi;",
)

ATT_AFTER_WAIT = (
    "attention.cu",
    "  pdl_start();\n  const float* qrow = q + ((u64)t * heads + head) * hd;\n",
    "  pdl_start();\n  return;\n  const float* qrow = q + ((u64)t * heads + head) * hd;\n",
)
MMA_AFTER_WAIT = (
    "matvec_mma.cu",
    "  pdl_start();\n  float4 keep[RES_F4] = {};",
    "  pdl_start();\n  return;\n  float4 keep[RES_F4] = {};",
)
NORM_AFTER_WAIT = (
    "ops.cu",
    "  pdl_start();\n  float* row = h + (u64)b * hd;",
    "  pdl_start();\n  return;\n  float* row = h + (u64)b * hd;",
)
CODE_LOAD_LINE = "      bt.q[u] = __ldcs(codes + (u64)cc * 32);\n"
SB_LOAD_FN = "__device__ __forceinline__ void sb_load(float& v, const float* p) { v = __ldcs(p); }"
SB_LOAD_LINE = "      for (int p = 0; p < UPC; p++) sb_load(bt.sb[u][p], sbt + (u64)((cc * 64 + p * (64 / UPC)) >> gsh) * 32);\n"
BUILD_INPUTS = "      build_inputs<H, UPC, GATED, ONE>(xf, xs, x, gate, gstride, W.cols, m, c0, n, res, mma_rstat, keep, kept);\n"


STAT1_REDUCTION = "  ss = block_sum_stat(ss);\n"


def build_only_if(cond: str) -> tuple:
    """The tensor-core matvec's input build kept only in launches where `cond` (device code) holds."""
    return ("matvec_mma.cu", BUILD_INPUTS, f"      if ({cond}) " + BUILD_INPUTS.lstrip())


def mma_returns_after_wait(cond: str) -> tuple:
    """Tensor-core matvec launches where `cond` (device code) holds return right after their wait
    (MMA_AFTER_WAIT for those launches only)."""
    wait, after = MMA_AFTER_WAIT[1], MMA_AFTER_WAIT[2]
    return ("matvec_mma.cu", wait, after.replace("  return;\n", f"  if ({cond}) return;\n"))


def stat1_by_warps(lane_sum: str) -> tuple:
    """The first statistic's block reduction replaced by each warp adding dim/16 partials (`stat_t`) at `part`
    (the row's first bytes, standing in for per-tile partials): `lane_sum` adds a lane's share
    into `s`, then the warp's shuffles add the lanes."""
    return (
        "matvec_mma.cu",
        STAT1_REDUCTION,
        "  {\n"
        "    const stat_t* part = (const stat_t*)orow;\n"
        "    stat_t s = 0;\n"
        + lane_sum
        + "#pragma unroll\n"
        "    for (int o = 16; o; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);\n"
        "    ss = s;\n"
        "  }\n",
    )


def sb_load_and_prefetch(prefetch: str) -> str:
    """`load_batch`'s scale loads (SB_LOAD_LINE), each followed by `prefetch` (a format string
    taking the address) of the same unit's scales two register batches ahead."""
    ahead = "sbt + (u64)(((cc + 2 * U * ks) * 64 + p * (64 / UPC)) >> gsh) * 32"
    then = " if (cc + 2 * U * ks < end) " + prefetch.format(ahead) + "; }\n"
    return SB_LOAD_LINE.replace("sb_load(", "{ sb_load(", 1).removesuffix("\n") + then


# name -> (what it removes, [(file, text, replacement)])
ABLATIONS = {
    "floor": (
        "tensor-core matvec, attention and q/k/v norm bodies end right after their wait (weights "
        "are still asked of L2 before it): the launch chain plus the weight stream",
        [MMA_AFTER_WAIT, ATT_AFTER_WAIT, NORM_AFTER_WAIT],
    ),
    "noloop": (
        "the tensor-core matvec's inner loop (tile_slice: weight loads, mma, scaling)",
        [
            (
                "matvec_mma.cu",
                "        tile_slice<H, UPC, scales_f4()>(W, tile, ws, ks, c0, n, xf, xs, yp, m, first_batch, started);\n",
                "",
            )
        ],
    ),
    "noatt": ("attention after its wait (the cache rows are still asked of L2)", [ATT_AFTER_WAIT]),
    "attnocomb": (
        "attention's split combine (arrival counter, last block's sum)",
        [(
            "attention.cu",
            "  if (!last_to_arrive(&counters[query], nsplit, last)) return;\n",
            "  return;\n",
        )],
    ),
    "attnokv": (
        "attention's K and V loads (the query row in shared memory stands in for both)",
        [
            (
                "attention.cu",
                "const float4 x = *(const float4*)(k + d), y = *(const float4*)(qs + d);",
                "const float4 x = *(const float4*)(qs + d), y = *(const float4*)(qs + d);",
            ),
            ("attention.cu", "const float4 x = *(const float4*)(v + d);", "const float4 x = *(const float4*)(qs + d);"),
        ],
    ),
    "attnosoftmax": (
        "attention's two block reductions of the softmax (each thread keeps its own maximum and sum)",
        [
            ("attention.cu", "  mx = block_max(mx);\n", ""),
            ("attention.cu", "  sum = block_sum(sum);\n", ""),
        ],
    ),
    "nostats": (
        "a folded residual step's two row statistics (1/rms taken as 1)",
        [(
            "matvec_mma.cu",
            "    for (int j = 0; j < m; j++) residual_stats(res, j, mats.get(0).cols, bid == 0, mma_rstat, keep, kept, w2);\n",
            "    if (threadIdx.x < 16) mma_rstat[threadIdx.x / 8][threadIdx.x % 8] = 1.f;\n",
        )],
    ),
    "nostat1": (
        "a folded residual step's first block reduction (Σo² of the thread's own elements): the ceiling of "
        "statistics a producer would hand over as per-tile partials",
        [("matvec_mma.cu", STAT1_REDUCTION, "")],
    ),
    "stat1warp": (
        "a folded residual step's first block reduction replaced by what per-tile partials would cost the "
        "consumer: every warp reads dim/16 partials (the row's first bytes stand in for a producer's Σo² per "
        "16-row tile) and adds them by shuffles, no block barrier (the producer's side is not included)",
        [stat1_by_warps("    for (int t = threadIdx.x & 31; t < dim / 16; t += 32) s += part[t];\n")],
    ),
    "stat1warpu": (
        "as stat1warp, with every lane's partial loads issued at once (unrolled, up to 8 a lane: rows of up to "
        "4,096) and added in a fixed order after they arrive",
        [stat1_by_warps(
            "    stat_t v[8];\n"
            "#pragma unroll\n"
            "    for (int i = 0; i < 8; i++) {\n"
            "      const int t = (threadIdx.x & 31) + 32 * i;\n"
            "      v[i] = t < dim / 16 ? part[t] : (stat_t)0;\n"
            "    }\n"
            "#pragma unroll\n"
            "    for (int i = 0; i < 8; i++) s += v[i];\n"
        )],
    ),
    "nostat2": (
        "a folded residual step's second block reduction (Σx'² of the thread's own elements)",
        [("matvec_mma.cu", "  ss2 = block_sum_stat(ss2);\n", "")],
    ),
    "nocombine": (
        "the tensor-core matvec's column-part combine (arrival counter, last block's sum)",
        [("matvec_mma.cu", "  if (parts == 1 || fixed) return;\n", "  return;\n")],
    ),
    "noinplain": (
        "the input build (digit planes, unit sums, a folded step's norm) of plain matvec launches",
        [build_only_if("GATED")],
    ),
    "noinO": (
        "the input build of plain launches without a folded residual step (O's: its digit planes and sums)",
        [build_only_if("GATED || res.o")],
    ),
    "copyO": (
        "O's input build replaced by a copy of ready digit planes from L2 (a stand-in: its 8 KB input row "
        "read again and again), the time of a matvec that copies planes its producer wrote",
        [("matvec_mma.cu", BUILD_INPUTS,
          "      if (!GATED && !res.o) {\n"
          "        const uint4* src = (const uint4*)x;\n"
          "#pragma unroll 4\n"
          "        for (int i = threadIdx.x; i < n * 32 * (2 * H); i += blockDim.x)\n"
          "          if ((i & 63) < 32) xf[i] = __ldcg(src + (i & 511));\n"
          "        for (int i = threadIdx.x; i < n * MMA_XS_FLOATS(H, UPC); i += blockDim.x) xs[i] = __ldcg(x + (i & 2047));\n"
          "      } else\n" + BUILD_INPUTS)],
    ),
    "noO": (
        "everything O's launch does after its wait (the launch and its weights before the wait stay)",
        [mma_returns_after_wait("!GATED && !res.o")],
    ),
    "noPLEgate": (
        "everything the PLE gate's launch does after its wait (the folded step without a second norm)",
        [mma_returns_after_wait("!GATED && res.o && !res.w2")],
    ),
    "noPLEgatein": (
        "the PLE gate's input build (digit planes and sums of the whole row; its statistic stays)",
        [build_only_if("GATED || !res.o || res.w2")],
    ),
    "noPLEgatestat": (
        "the PLE gate's block reduction of its residual statistic (each thread keeps its own partial)",
        [("matvec_mma.cu", STAT1_REDUCTION, "  if (res.w2) ss = block_sum_stat(ss);\n")],
    ),
    "noPLEproj": (
        "everything the PLE projection's launch does after its wait (the gated launch of 256 columns)",
        [mma_returns_after_wait("GATED && mats.get(0).cols <= 256")],
    ),
    "noingated": (
        "the input build (GeGLU / PLE gate, digit planes) of gated matvec launches",
        [build_only_if("!GATED")],
    ),
    "halfsb": (
        "half the tensor-core matvec's scale bytes (lanes 16-31 read lanes 0-15's: the bytes 16-bit "
        "scale and bias pairs would take)",
        [(
            "matvec_mma.cu",
            "(const float*)W.sb + (u64)tile * groups * 32 + sb_lane<F4>(lane),",
            "(const float*)W.sb + (u64)tile * groups * 32 + (sb_lane<F4>(lane) & 15),",
        )],
    ),
    "nosb": (
        "the tensor-core matvec's scale and bias loads (every unit's taken as zero)",
        [(
            "matvec_mma.cu",
            SB_LOAD_LINE,
            "      for (int p = 0; p < UPC; p++) bt.sb[u][p] = typename ScaleOf<F4>::type{};\n",
        )],
    ),
    "noshfl": (
        "the shuffles that share a unit's four scale values across a quad (each lane uses its own for all four)",
        [(
            "matvec_mma.cu",
            "    for (int q = 0; q < UPC; q++) us[q] = unit_scales(bt.sb[u][q]);\n",
            "    for (int q = 0; q < UPC; q++) us[q] = UnitScales{bt.sb[u][q], bt.sb[u][q], bt.sb[u][q], bt.sb[u][q]};\n",
        )],
    ),
    "sbonce": (
        "all but the first chunk's scale loads of each register batch (the batch reuses the first chunk's)",
        [(
            "matvec_mma.cu",
            SB_LOAD_LINE,
            "      for (int p = 0; p < UPC; p++) {\n"
            "        if (u == 0) sb_load(bt.sb[u][p], sbt + (u64)((cc * 64 + p * (64 / UPC)) >> gsh) * 32);\n"
            "        else bt.sb[u][p] = bt.sb[0][p];\n"
            "      }\n",
        )],
    ),
    "sbpf": (
        "not an ablation (same bits): each scale load also asks L2 for the scales two register "
        "batches ahead, so a batch's scales arrive before its codes (every lane asks for the warp's "
        "one line: 32 requests; sbpf1 asks once)",
        [("matvec_mma.cu", SB_LOAD_LINE, sb_load_and_prefetch("prefetch_l2({})"))],
    ),
    "sbfirst": (
        "not an ablation (same bits): each chunk's scale loads issued before its codes' load, so the "
        "smaller load is not queued behind the larger",
        [("matvec_mma.cu", CODE_LOAD_LINE + "#pragma unroll\n" + SB_LOAD_LINE,
          "#pragma unroll\n" + SB_LOAD_LINE + CODE_LOAD_LINE)],
    ),
    "sbpf1": (
        "not an ablation (same bits): as sbpf, but one lane asks for the warp's line (sbpf's 32 "
        "lanes each ask for the same line)",
        [("matvec_mma.cu", SB_LOAD_LINE,
          sb_load_and_prefetch("if ((threadIdx.x & 31) == 0) prefetch_l2({})"))],
    ),
    "sbca": (
        "not an ablation (same bits): the scales loaded cached in L1 (`ld.global.ca`) instead of "
        "streaming (`.cs`)",
        [("matvec_mma.cu", SB_LOAD_FN, SB_LOAD_FN.replace("__ldcs(p)", "__ldca(p)"))],
    ),
    "sbldg": (
        "not an ablation (same bits): the scales loaded through the read-only path (`ld.global.nc`)",
        [("matvec_mma.cu", SB_LOAD_FN, SB_LOAD_FN.replace("__ldcs(p)", "__ldg(p)"))],
    ),
    "sbdead": (
        "the scale loads issued as before but their values unused (zeros, as nosb): whether a batch "
        "pays for the loads themselves or for waiting on them",
        [(
            "matvec_mma.cu",
            SB_LOAD_FN,
            "__device__ __forceinline__ void sb_load(float& v, const float* p) {\n"
            "  float dead;\n"
            "  asm volatile(\"ld.volatile.global.f32 %0, [%1];\" : \"=f\"(dead) : \"l\"(p));\n"
            "  v = 0.f;\n"
            "}",
        )],
    ),
    "sbpfl1": (
        "not an ablation (same bits): as sbpf, into L1, and the scales read through L1",
        [("matvec_mma.cu", SB_LOAD_LINE,
          sb_load_and_prefetch('asm volatile("prefetch.global.L1 [%0];" ::"l"({}))')), (
            "matvec_mma.cu",
            SB_LOAD_FN,
            "__device__ __forceinline__ void sb_load(float& v, const float* p) { v = __ldca(p); }",
        )],
    ),
    "pairsb": (
        "timing model of 16-bit scales: a lane reads one (scale, bias) pair of 4 bytes, a tile's group "
        "64 bytes, and takes its quad's other pair by one shuffle (the values read are wrong)",
        [(
            "matvec_mma.cu",
            "(const float*)W.sb + (u64)tile * groups * 32 + sb_lane<F4>(lane),",
            "(const float*)W.sb + (u64)tile * groups * 16 + ((lane >> 2) * 2 + (lane & 1)),",
        ), (
            "matvec_mma.cu",
            SB_LOAD_LINE,
            SB_LOAD_LINE.replace(") * 32);", ") * 16);"),
        ), (
            "matvec_mma.cu",
            "  const int quad = (threadIdx.x & 31) & ~3;\n"
            "  return UnitScales{__shfl_sync(0xffffffffu, v, quad), __shfl_sync(0xffffffffu, v, quad + 1),\n"
            "                    __shfl_sync(0xffffffffu, v, quad + 2), __shfl_sync(0xffffffffu, v, quad + 3)};\n",
            "  const float o = __shfl_xor_sync(0xffffffffu, v, 1);\n"
            "  const unsigned a = __float_as_uint((threadIdx.x & 1) ? o : v), b = __float_as_uint((threadIdx.x & 1) ? v : o);\n"
            "  return UnitScales{__uint_as_float(a << 16), __uint_as_float(a & 0xffff0000u), __uint_as_float(b << 16),\n"
            "                    __uint_as_float(b & 0xffff0000u)};\n",
        )],
    ),
    "pdlearly": (
        "not an ablation (same bits): each launch lets the next one launch before it waits for the "
        "previous one (`launch_dependents` before `griddepcontrol.wait` in `pdl_start`), so a launch "
        "is queued a link earlier; every reader still waits for its predecessor's completion",
        [(
            "common.cuh",
            '  asm volatile("griddepcontrol.wait;" ::: "memory");\n'
            '  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");\n',
            '  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");\n'
            '  asm volatile("griddepcontrol.wait;" ::: "memory");\n',
        )],
    ),
    "mkempty": (
        "megakernel: no stage body runs; every block still waits for the previous stage and "
        "signals its own (the stage barriers alone)",
        [(
            "megakernel.cu",
            "    if (blockIdx.x < g && !st.waits_itself) mk_wait();\n"
            "    for (int b = blockIdx.x; b < g; b += gridDim.x) mk_dispatch<GENERAL, WIDE>(st, b, g);\n",
            "    if (blockIdx.x < g) mk_wait();\n",
        )],
    ),
}


def write(name: str, out: Path) -> Path:
    """Writes ablation `name` into out/name (every kernel file, the edits applied)."""
    _, edits = ABLATIONS[name]
    dest = out / name
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    for f in KERNELS.iterdir():
        if f.suffix in (".cu", ".cuh"):
            shutil.copy(f, dest / f.name)
    for file, text, replacement in [ARGMAX_SAFE] + edits:
        path = dest / file
        src = path.read_text()
        if src.count(text) != 1:
            raise SystemExit(
                f"kernel_ablations: ablation {name}: the text to replace occurs {src.count(text)} times "
                f"in {file} (expected once); update tools/kernel_ablations.py"
            )
        path.write_text(src.replace(text, replacement))
    return dest


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", nargs="?", type=Path, help="folder to write the ablations into")
    ap.add_argument("names", nargs="*", help="ablations to write (default: all)")
    ap.add_argument("--list", action="store_true", help="print the ablations and exit")
    ap.add_argument("--check", action="store_true", help="write every ablation (what cargo test runs)")
    ap.add_argument(
        "--variants",
        action="store_true",
        help="print each written ablation as a tools/gpu_ab.sh variant (NAME:MEGAGEMMA_KERNELS=DIR), space-separated",
    )
    a = ap.parse_intermixed_args()
    if a.list:
        for name, (what, _) in ABLATIONS.items():
            print(f"{name:<10} {what}")
        return 0
    if a.out is None:
        ap.error("give a folder to write the ablations into (or --list)")
    names = list(ABLATIONS) if a.check or not a.names else a.names
    unknown = [n for n in names if n not in ABLATIONS]
    if unknown:
        ap.error(f"unknown ablation(s) {', '.join(unknown)}; --list shows them")
    written = [(name, write(name, a.out)) for name in names]
    if a.variants:
        print(" ".join(f"{name}:MEGAGEMMA_KERNELS={path}" for name, path in written))
    else:
        for _, path in written:
            print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
