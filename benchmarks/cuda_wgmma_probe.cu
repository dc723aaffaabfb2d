// cuda_wgmma_probe.cu: the 3xTF32 products of one linear_tile chunk (64 weight rows x BM token rows x 64 k) with
// wgmma (sm_90a warpgroup MMA) against the mma.sync path linear_tile runs (tile_mma.h's mma_chunk_3xtf32). Every
// mode is checked against a double-precision reference, then timed: the chunk is staged in shared memory once and
// its products repeated R = 16 times (clock64 per block, the median block; 1 and 3 blocks per SM), so the rows
// measure the products and their operand preparation, not the copies. Not part of the module's build.
//
// Modes (128 threads = 4 warps = one warpgroup):
//   mma.sync    linear_tile's chunk: each warp splits its A (weights) and B (tokens) fragments into hi / lo and runs
//               the three products per m16n8k8 step into three accumulators.
//   wgmma       A from registers (the m16n8k8 fragment per warp, split per element), B split once per chunk into a
//               no-swizzle K-major canonical buffer (core matrices of 8 rows x 4 floats; LBO 128, SBO 256 bytes);
//               per k-step three m64nBMk8 wgmma, one commit and wait per chunk.
//   wgmma-pipe  as wgmma, but B double-buffered, stored conflict-free, the A fragments in two register sets and each
//               chunk's group left in flight (wait_group 1). ptxas serialises it (C7515: every HGMMA followed by a
//               wait), so it shows what register-sourced A costs here, not a pipeline.
//   wgmma-ss    both operands split once per chunk into canonical shared buffers (16-byte loads and stores,
//               conflict-free), 24 wgmma from descriptors, issued back to back (no serialisation in the SASS).
//
//   nvcc -gencode arch=compute_90a,code=sm_90a -O3 -o /tmp/wgmma_probe benchmarks/cuda_wgmma_probe.cu
//   /tmp/wgmma_probe
//
// Forty-eighth session, H200 (docs/BENCHMARKS.md "Forty-eighth session"): every wgmma mode is slower than mma.sync at
// every height (BM = 16, one block per SM: 843 cycles a chunk against 1418 / 2179 / 1769), so wgmma with an FP32
// operand split per chunk does not pay for linear_tile's skinny products; the errors are equal (~2e-6 of sum |x w|
// after 16 repeats).
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <algorithm>

#include <cuda_runtime.h>

#include "cuda_tool.h"
#include "../cuda/model/tile_mma.h"

constexpr const char* kTool = "cuda_wgmma_probe";
#define CHECK(x) tool_check((x), #x, kTool)

namespace {
using kdtree::cuda::mma_chunk_3xtf32;
using kdtree::cuda::split_tf32;

constexpr int kBN = 64, kBK = 64, kPad = kBK + 4, kThreads = 128;

__device__ __forceinline__ uint64_t smem_desc(const void* p, uint32_t lbo, uint32_t sbo) {
  const uint32_t a = (uint32_t)__cvta_generic_to_shared(p);
  return (uint64_t)((a & 0x3FFFF) >> 4) | ((uint64_t)(lbo >> 4) << 16) | ((uint64_t)(sbo >> 4) << 32);
}
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
__device__ __forceinline__ void wg_wait1() { asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory"); }

// d += a (registers, tf32 bits) * B (descriptor), m64 n{8,16,24} k8
template <int N>
__device__ __forceinline__ void wgmma_tf32(float (&d)[N / 2], const uint32_t (&a)[4], uint64_t desc);
template <>
__device__ __forceinline__ void wgmma_tf32<8>(float (&d)[4], const uint32_t (&a)[4], uint64_t desc) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n8k8.f32.tf32.tf32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, %8, 1, 1, 1;\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}
template <>
__device__ __forceinline__ void wgmma_tf32<16>(float (&d)[8], const uint32_t (&a)[4], uint64_t desc) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n16k8.f32.tf32.tf32 {%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, "
      "1, 1, 1;\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}
template <>
__device__ __forceinline__ void wgmma_tf32<24>(float (&d)[12], const uint32_t (&a)[4], uint64_t desc) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n24k8.f32.tf32.tf32 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11}, "
      "{%12, %13, %14, %15}, %16, 1, 1, 1;\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}


// d += A (descriptor) * B (descriptor), m64 n{8,16,24} k8
template <int N>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 2], uint64_t da, uint64_t db);
template <>
__device__ __forceinline__ void wgmma_ss<8>(float (&d)[4], uint64_t da, uint64_t db) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n8k8.f32.tf32.tf32 {%0, %1, %2, %3}, %4, %5, 1, 1, 1;\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "l"(da), "l"(db));
}
template <>
__device__ __forceinline__ void wgmma_ss<16>(float (&d)[8], uint64_t da, uint64_t db) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n16k8.f32.tf32.tf32 {%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, 1, 1, 1;\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
               : "l"(da), "l"(db));
}
template <>
__device__ __forceinline__ void wgmma_ss<24>(float (&d)[12], uint64_t da, uint64_t db) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n24k8.f32.tf32.tf32 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11}, "
               "%12, %13, 1, 1, 1;\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),
                 "+f"(d[9]), "+f"(d[10]), "+f"(d[11])
               : "l"(da), "l"(db));
}

// rows x 64 k of a [rows][kPad] float tile -> canonical K-major hi / lo buffers (k-step s: rows / 8 x 2 cores of
// 128 bytes; core (r / 8, half) at (r / 8) * 256 + half * 128), one float4 (a core row) per unit; eight lanes
// take the eight rows of one core: conflict-free loads (row stride 68 floats) and stores (consecutive 16 bytes)
template <int ROWS>
__device__ __forceinline__ void split_canon(const float* src, unsigned char* hi, unsigned char* lo, int tid) {
#pragma unroll
  for (int u = tid; u < ROWS * 16; u += kThreads) {
    const int rlo = u & 7, h = (u >> 3) & 1, st = (u >> 4) & 7, rhi = u >> 7;
    const float4 v = *reinterpret_cast<const float4*>(src + (8 * rhi + rlo) * kPad + 8 * st + 4 * h);
    uint4 vh, vl;
    split_tf32(v.x, vh.x, vl.x);
    split_tf32(v.y, vh.y, vl.y);
    split_tf32(v.z, vh.z, vl.z);
    split_tf32(v.w, vh.w, vl.w);
    const int o = st * (ROWS / 8 * 256) + rhi * 256 + h * 128 + rlo * 16;
    *reinterpret_cast<uint4*>(hi + o) = vh;
    *reinterpret_cast<uint4*>(lo + o) = vl;
  }
}

// Byte offset of token row n, k index kk (0..63) of a chunk in the canonical B layout: k-step s = kk / 8 is a block
// of BM / 8 x 2 core matrices (BM / 8 * 256 bytes); in it core (n / 8, (kk % 8) / 4) at (n / 8) * 256 + half * 128,
// row n % 8 at 16 bytes a row, the float at 4 bytes.
template <int BM>
__device__ __forceinline__ int b_off(int n, int kk) {
  return (kk >> 3) * (BM / 8 * 256) + (n >> 3) * 256 + ((kk >> 2) & 1) * 128 + (n & 7) * 16 + (kk & 3) * 4;
}

// The chunk's A fragments of warp w (rows 16 w + g (+8), k 8 s + q (+4)), split into hi / lo registers.
__device__ __forceinline__ void split_a_frags(const float* wa, uint32_t (&ah)[kBK / 8][4], uint32_t (&al)[kBK / 8][4]) {
#pragma unroll
  for (int s = 0; s < kBK / 8; ++s) {
    const int kk = 8 * s;
    split_tf32(wa[kk], ah[s][0], al[s][0]);
    split_tf32(wa[8 * kPad + kk], ah[s][1], al[s][1]);
    split_tf32(wa[kk + 4], ah[s][2], al[s][2]);
    split_tf32(wa[8 * kPad + kk + 4], ah[s][3], al[s][3]);
  }
}

// The chunk's 24 wgmma with A from registers and B from the canonical hi / lo buffers bh / bl: lo*hi, hi*lo and
// hi*hi of each k-step into d1, d2, d0.
template <int BM>
__device__ __forceinline__ void wgmma_rs_chunk(float (&d0)[BM / 2], float (&d1)[BM / 2], float (&d2)[BM / 2],
                                               const uint32_t (&ah)[kBK / 8][4], const uint32_t (&al)[kBK / 8][4],
                                               const unsigned char* bh, const unsigned char* bl) {
#pragma unroll
  for (int s = 0; s < kBK / 8; ++s) {
    const uint64_t dh = smem_desc(bh + s * (BM / 8 * 256), 128, 256);
    const uint64_t dl = smem_desc(bl + s * (BM / 8 * 256), 128, 256);
    wgmma_tf32<BM>(d1, al[s], dh);
    wgmma_tf32<BM>(d2, ah[s], dl);
    wgmma_tf32<BM>(d0, ah[s], dh);
  }
}

// Y[BM][64] = R x (X[BM][0:64] W[64][0:64]^T) with R = K / 64, every block the same problem (a rate probe).
// MODE 0 mma.sync, 1 wgmma, 2 wgmma-pipe, 3 wgmma-ss (the header).
template <int BM, int MODE>
__global__ void __launch_bounds__(kThreads) probe(const float* W, const float* X, float* Y, int K, long long* cyc) {
  extern __shared__ __align__(128) float sm[];
  float* const Ws = sm;                      // [64][kPad]
  float* const Xs = Ws + kBN * kPad;         // [BM][kPad]
  unsigned char* const Bh = reinterpret_cast<unsigned char*>(Xs + BM * kPad);  // [BM * 64] canonical, hi
  unsigned char* const Bl = Bh + BM * kBK * 4;                                  // ... lo
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, q = lane & 3;
  constexpr int TM = BM / 8;
  float acc[TM][4], s1[TM][4], s2[TM][4];   // MODE 0
  float d0[BM / 2], d1[BM / 2], d2[BM / 2]; // MODE 1
  for (int i = 0; i < TM; ++i)
    for (int j = 0; j < 4; ++j) acc[i][j] = s1[i][j] = s2[i][j] = 0.f;
  for (int j = 0; j < BM / 2; ++j) d0[j] = d1[j] = d2[j] = 0.f;
  // the chunk (k = 0..63 of W and X) staged once; the timed loop repeats the products over it R times
  for (int e = tid; e < kBN * kBK; e += kThreads) Ws[(e / kBK) * kPad + e % kBK] = W[(size_t)(e / kBK) * K + e % kBK];
  for (int e = tid; e < BM * kBK; e += kThreads) Xs[(e / kBK) * kPad + e % kBK] = X[(size_t)(e / kBK) * K + e % kBK];
  __syncthreads();
  const long long t0 = clock64();
  if (MODE == 3) {  // both operands split once a chunk into canonical shared buffers (A: 64 x 64 hi / lo, 32 KB)
    unsigned char* const Ah = Bh + 2 * BM * kBK * 4;
    unsigned char* const Al = Ah + kBN * kBK * 4;
    for (int c = 0; c < K / kBK; ++c) {
      split_canon<kBN>(Ws, Ah, Al, tid);
      split_canon<BM>(Xs, Bh, Bl, tid);
      asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
      __syncthreads();
      wg_fence();
#pragma unroll
      for (int s = 0; s < kBK / 8; ++s) {
        const uint64_t ah = smem_desc(Ah + s * 2048, 128, 256), al = smem_desc(Al + s * 2048, 128, 256);
        const uint64_t bh = smem_desc(Bh + s * (BM / 8 * 256), 128, 256), bl = smem_desc(Bl + s * (BM / 8 * 256), 128, 256);
        wgmma_ss<BM>(d1, al, bh);
        wgmma_ss<BM>(d2, ah, bl);
        wgmma_ss<BM>(d0, ah, bh);
      }
      wg_commit();
      wg_wait0();
      __syncthreads();
    }
  }
  if (MODE == 2) {
    // conflict-free split (lanes cover 8 token rows x 4 k of a core-matrix pair), B double-buffered, the
    // A fragments in two register sets, each chunk's wgmma group left in flight while the next is prepared
    uint32_t ah0[kBK / 8][4], al0[kBK / 8][4], ah1[kBK / 8][4], al1[kBK / 8][4];
    auto fence_acc = [&]() {
#pragma unroll
      for (int j = 0; j < BM / 2; ++j) asm volatile("" : "+f"(d0[j]), "+f"(d1[j]), "+f"(d2[j])::"memory");
    };
    auto step = [&](int c, uint32_t (&ah)[kBK / 8][4], uint32_t (&al)[kBK / 8][4]) {
      unsigned char* bh = Bh + (c & 1) * 2 * BM * kBK * 4;
      unsigned char* bl = bh + BM * kBK * 4;
      wg_wait1();  // the group of chunk c - 2 (this buffer, these registers) has completed
      for (int e = tid; e < BM * kBK; e += kThreads) {
        const int nlo = e & 7, kq = (e >> 3) & 3, h = (e >> 5) & 1, rest = e >> 6, st = rest & 7, nhi = rest >> 3;
        uint32_t hv, lv;
        split_tf32(Xs[(8 * nhi + nlo) * kPad + 8 * st + 4 * h + kq], hv, lv);
        const int o = st * (BM / 8 * 256) + nhi * 256 + h * 128 + nlo * 16 + kq * 4;
        *reinterpret_cast<uint32_t*>(bh + o) = hv;
        *reinterpret_cast<uint32_t*>(bl + o) = lv;
      }
      asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
      split_a_frags(Ws + (16 * warp + g) * kPad + q, ah, al);
#pragma unroll
      for (int s = 0; s < kBK / 8; ++s)
        asm volatile("" : "+r"(ah[s][0]), "+r"(ah[s][1]), "+r"(ah[s][2]), "+r"(ah[s][3]), "+r"(al[s][0]), "+r"(al[s][1]),
                     "+r"(al[s][2]), "+r"(al[s][3])::"memory");
      __syncthreads();  // every thread's B stores are in
      fence_acc();
      wg_fence();
      wgmma_rs_chunk<BM>(d0, d1, d2, ah, al, bh, bl);
      wg_commit();
      fence_acc();
    };
    for (int c = 0; c < K / kBK; c += 2) {
      step(c, ah0, al0);
      step(c + 1, ah1, al1);
    }
    wg_wait0();
  }
  for (int c = 0; c < (MODE >= 2 ? 0 : K / kBK); ++c) {
    if (MODE == 1) {  // the chunk's token rows split once into the canonical hi / lo buffers (per chunk, as a kernel would)
      for (int e = tid; e < BM * kBK; e += kThreads) {
        uint32_t h, l;
        split_tf32(Xs[(e / kBK) * kPad + e % kBK], h, l);
        const int o = b_off<BM>(e / kBK, e % kBK);
        *reinterpret_cast<uint32_t*>(Bh + o) = h;
        *reinterpret_cast<uint32_t*>(Bl + o) = l;
      }
      asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    }
    __syncthreads();
    if (MODE == 0) {
      mma_chunk_3xtf32<TM, kBK, kPad, true>(acc, s1, s2, Ws, Xs, warp, g, q);
    } else {
      uint32_t ah[kBK / 8][4], al[kBK / 8][4];
      split_a_frags(Ws + (16 * warp + g) * kPad + q, ah, al);
      wg_fence();
      wgmma_rs_chunk<BM>(d0, d1, d2, ah, al, Bh, Bl);
      wg_commit();
      wg_wait0();
    }
    __syncthreads();
  }
  const long long t1 = clock64();
  // out: MODE 0 fragments (row 16 w + g (+8), token 8 i + 2 q (+1)); MODE 1 the same per 8-token group j
  float* y = Y + (size_t)blockIdx.x * BM * kBN;
  for (int i = 0; i < TM; ++i) {
    float v[4];
    for (int j = 0; j < 4; ++j)
      v[j] = MODE == 0 ? acc[i][j] + (s1[i][j] + s2[i][j]) : d0[4 * i + j] + (d1[4 * i + j] + d2[4 * i + j]);
    const int r = 16 * warp + g, t = 8 * i + 2 * q;
    y[t * kBN + r] = v[0];
    y[(t + 1) * kBN + r] = v[1];
    y[t * kBN + r + 8] = v[2];
    y[(t + 1) * kBN + r + 8] = v[3];
  }
  if (tid == 0) cyc[blockIdx.x] = t1 - t0;
}

template <int BM, int MODE>
void run(int K, int blocks) {
  std::vector<float> w((size_t)kBN * K), x((size_t)BM * K);
  uint32_t s = 12345u;
  auto rnd = [&]() { s = s * 1664525u + 1013904223u; return ((int)(s >> 8) - (1 << 23)) / (float)(1 << 23); };
  for (auto& v : w) v = rnd();
  for (auto& v : x) v = rnd() * 3.f;
  float *dw, *dx, *dy;
  long long* dc;
  CHECK(cudaMalloc(&dw, sizeof(float) * w.size()));
  CHECK(cudaMalloc(&dx, sizeof(float) * x.size()));
  CHECK(cudaMalloc(&dy, sizeof(float) * (size_t)blocks * BM * kBN));
  CHECK(cudaMalloc(&dc, sizeof(long long) * blocks));
  CHECK(cudaMemcpy(dw, w.data(), sizeof(float) * w.size(), cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(dx, x.data(), sizeof(float) * x.size(), cudaMemcpyHostToDevice));
  const size_t smem = sizeof(float) * (kBN + BM) * kPad + 4 * (size_t)BM * kBK * 4 + 2 * (size_t)kBN * kBK * 4;
  CHECK(cudaFuncSetAttribute(probe<BM, MODE>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  probe<BM, MODE><<<blocks, kThreads, smem>>>(dw, dx, dy, K, dc);
  CHECK(cudaGetLastError());
  CHECK(cudaDeviceSynchronize());
  std::vector<float> y((size_t)BM * kBN);
  std::vector<long long> cyc(blocks);
  CHECK(cudaMemcpy(y.data(), dy, sizeof(float) * y.size(), cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(cyc.data(), dc, sizeof(long long) * blocks, cudaMemcpyDeviceToHost));
  double worst = 0.0;  // |y - exact| / sum |x w| over the tile
  for (int t = 0; t < BM; ++t)
    for (int r = 0; r < kBN; ++r) {
      double e = 0.0, a = 0.0;
      for (int k = 0; k < kBK; ++k) {
        e += (double)x[(size_t)t * K + k] * (double)w[(size_t)r * K + k];
        a += std::fabs((double)x[(size_t)t * K + k] * (double)w[(size_t)r * K + k]);
      }
      e *= K / kBK;
      a *= K / kBK;
      const double rel = std::fabs((double)y[(size_t)t * kBN + r] - e) / (a > 0 ? a : 1.0);
      if (!(rel <= worst)) worst = rel;  // (NaN counts as worst)
    }
  std::vector<long long> sorted(cyc);
  std::sort(sorted.begin(), sorted.end());
  printf("PROBE BM=%d mode=%s K=%d blocks=%d: worst |err| / sum|xw| %.2e, cycles per chunk repeat (median block, R = K / 64) %.0f\n",
         BM, MODE == 0 ? "mma.sync" : MODE == 1 ? "wgmma" : MODE == 2 ? "wgmma-pipe" : "wgmma-ss", K, blocks, worst, (double)sorted[blocks / 2] / (K / kBK));
  CHECK(cudaFree(dw));
  CHECK(cudaFree(dx));
  CHECK(cudaFree(dy));
  CHECK(cudaFree(dc));
}
}  // namespace

int main() {
  if (!tool_has_device(kTool)) return 1;
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  for (int blocks : {sms, 3 * sms}) {
    run<8, 0>(1024, blocks);
    run<8, 1>(1024, blocks);
    run<8, 2>(1024, blocks);
    run<8, 3>(1024, blocks);
    run<16, 0>(1024, blocks);
    run<16, 1>(1024, blocks);
    run<16, 2>(1024, blocks);
    run<16, 3>(1024, blocks);
    run<24, 0>(1024, blocks);
    run<24, 1>(1024, blocks);
    run<24, 2>(1024, blocks);
    run<24, 3>(1024, blocks);
  }
  return 0;
}
