// tile_mma.h: the shared-memory tile machinery of the tiled linear layer (linear_tile.cu) and the
// tensor-core expert GEMM (expert_mma.cu): cp.async copies, and FP32-accurate products on the
// tensor cores as 3xTF32. CUDA sources only.
//
// A tile holds kTileBN = 64 weight rows x BM token rows; each k-chunk of BK floats of both sits in
// shared memory with rows padded to PAD = BK + 4 floats (16-byte aligned rows, conflict-free
// fragment reads). 128 threads = 4 warps; warp w owns weight rows [16 w, 16 w + 16) as the A
// operand of mma.sync m16n8k8, the token groups of 8 are the B operands.
#pragma once
#include <cstdint>

#include <cuda_runtime.h>

#include "vec_load.h"  // (same folder: the benchmarks include this header by its path)

namespace kdtree {
namespace cuda {

constexpr int kTileBN = 64;  // weight rows (outputs) per tile

// BF16 weight rows in shared memory (the exact BF16 copies): BK + 8 uint16, 16-byte rows whose
// fragment reads are conflict-free (mma_chunk_bf16w)
template <int BK>
constexpr int kTilePadB = BK + 8;

// Dynamic shared memory of a tile kernel: ST stages of kTileBN weight rows (BK floats padded to
// BK + 4, or with BF the BF16 rows of kTilePadB) + BM token rows of BK floats (padded to BK + 4),
// reused afterwards for the BM x kTileBN output tile.
template <int BM, int BK, int ST, bool BF = false>
constexpr size_t tile_smem_bytes() {
  constexpr size_t wrow = BF ? kTilePadB<BK> * sizeof(uint16_t) : (BK + 4) * sizeof(float);
  constexpr size_t stages = (size_t)ST * (kTileBN * wrow + (size_t)BM * (BK + 4) * sizeof(float));
  constexpr size_t out = (size_t)BM * kTileBN * sizeof(float);
  return stages > out ? stages : out;
}

// 16-byte global -> shared copy through L2 only; full = false zero-fills the 16 bytes (the source
// address must still be valid)
__device__ __forceinline__ void cp_async16(float* smem, const float* gmem, bool full) {
  const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(full ? 16 : 0) : "memory");
}
// 4-byte global -> shared copy (through L1; full = false zero-fills): the INT4 tiles' scales
__device__ __forceinline__ void cp_async4(float* smem, const float* gmem, bool full) {
  const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(s), "l"(gmem), "r"(full ? 4 : 0) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

// x rounded to TF32 (10 mantissa bits, the low 13 bits zero), to nearest, ties to even. sm_90 has
// this as one instruction (cvt.rn.tf32.f32 -> F2FP.TF32.F32.PACK_B; NaN stays NaN, inf stays inf);
// cvt.rna.tf32.f32 has none (ptxas emulates it in four instructions plus an inf test), so older
// targets round to nearest, ties away from zero, with two integer instructions (a NaN whose top 11
// mantissa bits are all ones carries into the sign there: split_tf32 then still has a NaN lo).
__device__ __forceinline__ uint32_t tf32_round(float x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  uint32_t r;
  asm("cvt.rn.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
  return r;
#else
  return (__float_as_uint(x) + 0x1000u) & 0xffffe000u;
#endif
}

// 3xTF32: x = hi + lo with hi = TF32(x) rounded to nearest and lo = x - hi (exact in FP32, |lo| <=
// 2^-11 |x|) truncated to TF32 (one LOP: |lo error| <= 2^-10 |lo| <= 2^-21 |x|). A product is
// hi_a hi_b + hi_a lo_b + lo_a hi_b (the dropped lo_a lo_b is <= 2^-22 of it), FP32 accumulation:
// FP32-accurate, ~2^-21 of a product at worst. Two SASS instructions on sm_90 (F2FP, FADD): ptxas
// drops the LOP where lo feeds an HMMA .tf32 operand, since the tensor core reads only the top 19
// bits (seen in the SASS of verify_attention_mma.cu, twenty-fifth session).
// NaN: x - hi is NaN (CUDA's canonical NaN, all mantissa bits set), and truncation keeps it a NaN
// (exponent all ones, top mantissa bits set), so a NaN input gives NaN products. An infinite x
// has hi = inf and a NaN lo (inf - inf), so its products are NaN, not +-inf (as before this
// split; tests/python/test_cuda_*.py hold the NaN cases).
__device__ __forceinline__ void split_tf32(float x, uint32_t& hi, uint32_t& lo) {
  hi = tf32_round(x);
  lo = __float_as_uint(x - __uint_as_float(hi)) & 0xffffe000u;
}
__device__ __forceinline__ void mma_tf32(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// One k-step (8 k) of a warp's products against every token group j (8 tokens): the x fragments
// split into TF32 hi + lo, then lo(w)*hi(x) (LO: only when the weights have a low part), hi*lo and
// hi*hi, in that order, to s1 / s2 / big (SPLIT: three independent chains) or all to big. xs: the
// chunk's token rows [8 TM][PAD]; g = lane / 4, q = lane % 4: the mma fragment coordinates.
template <int TM, int PAD, bool LO, bool SPLIT>
__device__ __forceinline__ void mma_kstep(float (&big)[TM][4], float (&s1)[TM][4], float (&s2)[TM][4],
                                          const uint32_t (&ah)[4], const uint32_t (&al)[4], const float* xs, int g,
                                          int q, int kk) {
#pragma unroll
  for (int j = 0; j < TM; ++j) {
    const float* xb = xs + (8 * j + g) * PAD + q + kk;
    uint32_t bh[2], bl[2];
    split_tf32(xb[0], bh[0], bl[0]);
    split_tf32(xb[4], bh[1], bl[1]);
    if constexpr (LO) mma_tf32(SPLIT ? s1[j] : big[j], al, bh);
    mma_tf32(SPLIT ? s2[j] : big[j], ah, bl);
    mma_tf32(big[j], ah, bh);
  }
}

// One k-chunk of a warp's products, 3xTF32: token group j (8 tokens) x the warp's 16 weight rows.
// ws / xs: the chunk's weight rows [kTileBN][PAD] and token rows [8 TM][PAD] (BK floats of k each);
// warp, g = lane / 4, q = lane % 4: the mma fragment coordinates. Each accumulator holds m16n8
// fragments (c0: row g, token 2q; c1: g, 2q + 1; c2: g + 8, 2q; c3: g + 8, 2q + 1).
// SPLIT = false: all three partial products (lo*hi, hi*lo, hi*hi, in that order) go to `big`
// (s1, s2 unused: pass big again); SPLIT = true: to s1, s2 and big, three independent mma chains
// (a third of the latency of one chain; the caller sums big + (s1 + s2)).
template <int TM, int BK, int PAD, bool SPLIT = false>
__device__ __forceinline__ void mma_chunk_3xtf32(float (&big)[TM][4], float (&s1)[TM][4], float (&s2)[TM][4],
                                                 const float* ws, const float* xs, int warp, int g, int q) {
  const float* wa = ws + (16 * warp + g) * PAD + q;  // conflict-free: bank 4 g + q (PAD = 4 mod 32)
#pragma unroll
  for (int kk = 0; kk < BK; kk += 8) {
    uint32_t ah[4], al[4];
    split_tf32(wa[kk], ah[0], al[0]);
    split_tf32(wa[8 * PAD + kk], ah[1], al[1]);
    split_tf32(wa[kk + 4], ah[2], al[2]);
    split_tf32(wa[8 * PAD + kk + 4], ah[3], al[3]);
    mma_kstep<TM, PAD, true, SPLIT>(big, s1, s2, ah, al, xs, g, q, kk);
  }
}

// The same chunk with BF16 weights (exact BF16 copies, rows of PADB uint16 in shared memory): a BF16
// value widened to FP32 is exactly its TF32 high part and its low part is zero, so of the three
// products only hi*hi (to big) and hi*lo (x's low part, to s2) are left; the lo*hi chain of the FP32
// weights adds only zeros there (s1 stays +0 for finite inputs). Same operand bits in the two
// remaining chains as mma_chunk_3xtf32<..., true>: the same sums. PADB = 8 mod 64 keeps the
// fragment reads conflict-free (row g at bank 4 g, the q pairs share a word).
template <int TM, int BK, int PADB, int PAD>
__device__ __forceinline__ void mma_chunk_bf16w(float (&big)[TM][4], float (&s2)[TM][4], const uint16_t* ws,
                                                const float* xs, int warp, int g, int q) {
  const uint16_t* wa = ws + (16 * warp + g) * PADB + q;
#pragma unroll
  for (int kk = 0; kk < BK; kk += 8) {
    uint32_t ah[4];
    ah[0] = (uint32_t)wa[kk] << 16;
    ah[1] = (uint32_t)wa[8 * PADB + kk] << 16;
    ah[2] = (uint32_t)wa[kk + 4] << 16;
    ah[3] = (uint32_t)wa[8 * PADB + kk + 4] << 16;
    mma_kstep<TM, PAD, false, true>(big, s2, s2, ah, ah, xs, g, q, kk);
  }
}

// INT4 weight rows in shared memory (ExpertGemmParams::w_int4), a chunk of BK = 64 k a row: 32 bytes of
// nibbles padded to kTileRowQ4 = 48 (12 words: the fragment reads of rows g = 0..7 fall in distinct banks)
// and the row's two group scales (k 0-31, 32-63 of the chunk; groups are multiples of 32).
constexpr int kTileRowQ4 = 48;

// The same chunk as mma_chunk_bf16w from INT4 weights: word kk / 8 of a row holds the nibbles of k = kk ..
// kk + 7 (element kk + i at bits 4 i), each turned into its BF16 value (int4_value, vec_load.h) with the
// row's scale of that 32-k half. The same operand bits as mma_chunk_bf16w on the dequantized weights, so
// the same sums. wq: the warp's part of the chunk's rows [kTileBN][kTileRowQ4 / 4] words; sc: the chunk's
// scales [kTileBN][2]; h0: which half of the chunk BK starts at (0, or 1 when the warp takes k 32-63).
template <int TM, int BK, int PAD>
__device__ __forceinline__ void mma_chunk_int4w(float (&big)[TM][4], float (&s2)[TM][4], const uint32_t* wq,
                                                const float* sc, int h0, const float* xs, int warp, int g, int q) {
  constexpr int RW = kTileRowQ4 / 4;
  const int r0 = 16 * warp + g;
  const uint32_t* wa = wq + r0 * RW;
#pragma unroll
  for (int kk = 0; kk < BK; kk += 8) {
    const int h = h0 + kk / 32;
    const float sa = sc[2 * r0 + h], sb = sc[2 * (r0 + 8) + h];
    const uint32_t va = wa[kk / 8], vb = wa[8 * RW + kk / 8];
    uint32_t ah[4];
    ah[0] = __float_as_uint(int4_value((va >> (4 * q)) & 15u, sa));
    ah[1] = __float_as_uint(int4_value((vb >> (4 * q)) & 15u, sb));
    ah[2] = __float_as_uint(int4_value((va >> (4 * q + 16)) & 15u, sa));
    ah[3] = __float_as_uint(int4_value((vb >> (4 * q + 16)) & 15u, sb));
    mma_kstep<TM, PAD, false, true>(big, s2, s2, ah, ah, xs, g, q, kk);
  }
}

}  // namespace cuda
}  // namespace kdtree
