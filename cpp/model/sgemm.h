// sgemm.h: the one single-precision GEMM every CPU projection goes through.
//
//   C[M,N] = alpha * A[M,K] @ op(B) + beta * C        (row-major, leading dimensions in floats)
//   op(B) = B^T with B stored [N,K] when trans_b (the nn.Linear layout: y = x @ W^T),
//   op(B) = B   with B stored [K,N] otherwise.
//
// sgemm() uses the skinny AVX2 kernels for few rows (decode, tree verify, experts; threaded through
// parallel.h), else CBLAS when the build found one (KDTREE_HAVE_CBLAS: OpenBLAS on Linux) and the
// portable kernel otherwise; sgemm_portable() is always the portable kernel (tested against a
// plain triple loop and against CBLAS in tests/cpp/test_cpu_model.cpp and in pytest via
// _native.sgemm_selftest). With beta == 0, C is not read (it may hold garbage or NaN).
#pragma once
#include <cstdint>

namespace kdtree {

void sgemm(bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
           const float* B, int64_t ldb, float beta, float* C, int64_t ldc);

// Cache-blocked portable kernel: packed 6x16 micro-tiles (GCC/Clang vector extensions; on x86-64 Linux
// with GCC an AVX2+FMA clone is picked at load time when the CPU has it), a direct
// dot/axpy path for small M (decode), OpenMP over columns when available.
void sgemm_portable(bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
                    const float* B, int64_t ldb, float beta, float* C, int64_t ldc);

// C = alpha * A @ W^T + beta * C with the weight W [N, K] (row stride ldb) stored as BF16 (the
// high 16 bits of each FP32 value): exactly what sgemm(true, ...) computes on W widened to FP32
// (widening is exact; the same kernels, tiles and threads), reading half the bytes. trans_b =
// false: C = alpha * A @ W + beta * C with W [K, N], as sgemm(false, ...). Only where sgemm()
// would take its skinny AVX2 kernels (few rows); returns false without touching C otherwise (then
// call sgemm() on the widened FP32 values).
bool sgemm_bf16_weights(int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda, const uint16_t* B,
                        int64_t ldb, float beta, float* C, int64_t ldc, bool trans_b = true);

// sgemm() with the skinny kernels whatever the shape, where the CPU has them (AVX2+FMA; else, or with
// the portable kernel forced, plain sgemm()). The skinny kernels compute every output element the same
// way whatever M and N are (the same FMA sequence over k, the same lane sums; tests/cpp/test_cpu_model.cpp
// and tests/python/test_cpu_model.py check it), so a row's result does not depend on the rows or columns
// computed with it. The CPU model uses it for every GEMM of a row-exact window (kRowExactWindow, cpu_model.h:
// up to 128 tokens, or a tree of any size), where the attention's column count (cache + visible window) and
// row counts (window x heads; the window's tokens for the weights) vary.
void sgemm_rows_exact(bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
                      const float* B, int64_t ldb, float beta, float* C, int64_t ldc);

// Whether sgemm() / sgemm_bf16_weights() would take the skinny kernels for a B^T GEMM of this shape now
// (false with the portable kernel forced, or without AVX2).
bool sgemm_skinny_takes(int64_t M, int64_t N, int64_t K);

// Which implementation sgemm() uses now: "cblas" or "portable".
const char* sgemm_backend();
// The skinny kernels' vector ISA on this CPU: "avx512", "avx2" or "none" (no skinny kernels);
// KDTREE_CPU_ISA=avx2 in the environment (read once) keeps AVX2 on an AVX-512 CPU.
const char* sgemm_skinny_isa();
// Tests and benchmarks: "avx2" or "avx512" for the skinny kernels from now on (process-wide; not
// while GEMMs run on other threads). Returns false (and changes nothing for "avx512") where the
// CPU lacks that ISA.
bool sgemm_set_skinny_isa(const char* isa);

// Make sgemm() use the portable kernel even when CBLAS is built in (process-wide; for tests
// and benchmarks that exercise the fallback through the whole model).
void sgemm_force_portable(bool on);

}  // namespace kdtree
