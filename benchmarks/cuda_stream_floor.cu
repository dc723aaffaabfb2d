// cuda_stream_floor.cu: how fast a weight matrix can be streamed the way linear_tile / expert_mma stream it,
// with no products (not part of the build).
//
// A block streams 64 rows x its share of k (k split `splits` ways) in 64-float chunks through a
// cp.async ring of NBUF chunks (NBUF - 1 in flight), reading each landed chunk back from shared
// memory once (a stand-in for the products, a few instructions a chunk), 256 threads. Two layouts of
// the same bytes: row-major [R][K] (a chunk = 64 segments of 256 B, K * 4 bytes apart: what the
// kernels read) and tiled [R/64][K/64][64][64] (a chunk = 16 KB contiguous). The shapes are
// mini-kimi's at a verify step: the head, the routed experts' gate/up and down over ~29 experts (what
// 17 tokens touch), o_proj, q_b, the fused q_a / kv_a, at the split counts linear_tile takes and more.
// Each launch reads another copy of the matrix (2 GiB rotated, > 30x the L2), ten launches between two
// events, the median of ten such groups per row: the time of one stream, launch gaps included.
// So a row is a floor for the real kernel of that shape and grid: what the memory system gives this
// access pattern, before any arithmetic.
//
//   nvcc -gencode arch=compute_90,code=sm_90 -O3 -o /tmp/stream_floor benchmarks/cuda_stream_floor.cu && /tmp/stream_floor
//
// H200 (forty-fifth session, docs/BENCHMARKS.md "Forty-fifth session" under the GPU model): the layout
// changes nothing (the head and the experts within 1.5 % of the other layout, the small shapes scatter
// by up to 10 % either way); the head streams at ~4.0 TB/s (the copy rate), the experts' gate/up at 3.5 and
// down at 3.0 TB/s, and every small projection takes ~5-6 us however it is split (0.6-1.5 TB/s): a kernel's
// ramp, latency and drain, not its bytes.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <cuda_runtime.h>

#include "cuda_tool.h"
#include "../cuda/model/tile_mma.h"

constexpr const char* kTool = "cuda_stream_floor";
#define CHECK(x) tool_check((x), #x, kTool)

using kdtree::cuda::cp_async16;  // the kernels' own copy helpers (cuda/model/tile_mma.h)
using kdtree::cuda::cp_async_commit;
using kdtree::cuda::cp_async_wait;

// grid: (R / 64) * splits blocks; block b streams rows [64 (b / splits), + 64) over chunks
// [(b % splits) * cps, + cps) with cps = (K / 64) / splits
template <int NBUF>
__global__ void __launch_bounds__(256) stream_kernel(const float* __restrict__ w, int K, int tiled, int splits,
                                                     float* out) {
  extern __shared__ __align__(16) float ring[];
  const int b = blockIdx.x, rb = b / splits, t = threadIdx.x;
  const int nch = K / 64, cps = nch / splits, c0 = (b % splits) * cps;
  auto issue = [&](int c, int slot) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int i = t + 256 * j;  // 16-byte piece i of the chunk: row i / 16, columns 4 (i % 16) ..
      const float* src = tiled ? w + ((size_t)(rb * nch + c) * 4096 + (size_t)i * 4)
                               : w + ((size_t)(rb * 64 + (i >> 4)) * K + c * 64 + (i & 15) * 4);
      cp_async16(ring + slot * 4096 + i * 4, src, true);
    }
    cp_async_commit();
  };
  float acc = 0.f;
#pragma unroll
  for (int k = 0; k < NBUF - 1; ++k) {
    if (k < cps) issue(c0 + k, k);
    else cp_async_commit();  // (empty groups keep the wait count uniform)
  }
  for (int k = 0; k < cps; ++k) {
    cp_async_wait<NBUF - 2>();
    __syncthreads();
    const float* c = ring + (k % NBUF) * 4096;
#pragma unroll
    for (int j = 0; j < 16; ++j) acc += c[t + 256 * j];
    __syncthreads();
    if (k + NBUF - 1 < cps) issue(c0 + k + NBUF - 1, (k + NBUF - 1) % NBUF);
    else cp_async_commit();
  }
  if (acc == 12345.f) out[b * 256 + t] = acc;  // (never true: keeps the reads)
}

__global__ void plain_kernel(const float4* __restrict__ a, size_t n, float* out) {
  float acc = 0.f;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    const float4 v = __ldcs(a + i);
    acc += v.x + v.y + v.z + v.w;
  }
  if (acc == 12345.f) out[threadIdx.x] = acc;
}

int main() {
  if (!tool_has_device(kTool)) return 1;
  cudaDeviceProp pr;
  CHECK(cudaGetDeviceProperties(&pr, 0));
  const size_t total = 1ull << 31;  // 2 GiB of matrix copies to rotate over
  float* w = nullptr;
  float* out = nullptr;
  CHECK(cudaMalloc(&w, total));
  CHECK(cudaMemset(w, 0, total));
  CHECK(cudaMalloc(&out, 1 << 24));
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  printf("%s, %d SMs, L2 %d MB\n", pr.name, pr.multiProcessorCount, pr.l2CacheSize >> 20);
  CHECK(cudaFuncSetAttribute(stream_kernel<3>, cudaFuncAttributeMaxDynamicSharedMemorySize, 3 * 16384));
  CHECK(cudaFuncSetAttribute(stream_kernel<4>, cudaFuncAttributeMaxDynamicSharedMemorySize, 4 * 16384));
  CHECK(cudaFuncSetAttribute(stream_kernel<6>, cudaFuncAttributeMaxDynamicSharedMemorySize, 6 * 16384));
  auto median_us = [&](auto launch) {  // ten launches between two events, median of ten groups
    std::vector<float> ts;
    for (int it = 0; it < 12; ++it) {
      CHECK(cudaEventRecord(e0));
      for (int r = 0; r < 10; ++r) launch(it * 10 + r);
      CHECK(cudaEventRecord(e1));
      CHECK(cudaEventSynchronize(e1));
      float ms = 0.f;
      CHECK(cudaEventElapsedTime(&ms, e0, e1));
      if (it >= 2) ts.push_back(ms * 100.f);  // us per launch
    }
    std::sort(ts.begin(), ts.end());
    return ts[ts.size() / 2];
  };
  {
    const size_t n = (512ull << 20) / 16;  // 512 MiB as float4, three copies
    const float us = median_us([&](int i) { plain_kernel<<<pr.multiProcessorCount * 8, 512>>>((const float4*)w + (i % 3) * n, n, out); });
    CHECK(cudaGetLastError());
    printf("plain 512MiB: %.1f us, %.2f TB/s\n", us, (512.0 * 1048576) / (us * 1e-6) / 1e12);
  }
  struct Shape {
    const char* name;
    int R, K;
    std::vector<int> splits;
  };
  const Shape shapes[] = {{"head", 32000, 1024, {1, 2}},      {"experts_gateup", 14848, 1024, {1, 2}},
                          {"experts_down", 29696, 256, {1}},  {"o_proj", 1024, 2048, {4, 8, 16, 32}},
                          {"q_b", 3072, 384, {1, 2, 3, 6}},   {"qkv_a", 960, 1024, {2, 4, 8, 16}}};
  for (const Shape& sh : shapes) {
    const size_t bytes = (size_t)sh.R * sh.K * 4;
    const int copies = (int)std::min<size_t>(total / bytes, 64);
    for (int splits : sh.splits) {
      const int blocks = (sh.R / 64) * splits;
      for (int nb : {3, 4, 6}) {
        for (int tiled = 0; tiled < 2; ++tiled) {
          const float us = median_us([&](int i) {
            const float* m = w + (size_t)(i % copies) * (bytes / 4);
            if (nb == 3) stream_kernel<3><<<blocks, 256, 3 * 16384>>>(m, sh.K, tiled, splits, out);
            else if (nb == 4) stream_kernel<4><<<blocks, 256, 4 * 16384>>>(m, sh.K, tiled, splits, out);
            else stream_kernel<6><<<blocks, 256, 6 * 16384>>>(m, sh.K, tiled, splits, out);
          });
          CHECK(cudaGetLastError());
          printf("%-15s %5dx%-5d splits %2d  %4d blocks  NBUF %d  %-9s %8.2f us  %.2f TB/s\n", sh.name, sh.R, sh.K,
                 splits, blocks, nb, tiled ? "tiled" : "row-major", us, bytes / (us * 1e-6) / 1e12);
        }
      }
    }
  }
  CHECK(cudaDeviceSynchronize());
  return 0;
}
