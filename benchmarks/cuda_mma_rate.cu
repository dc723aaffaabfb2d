// cuda_mma_rate.cu: how fast the tensor cores take mma.sync on this GPU (not part of the build).
//
// Every SM runs W warps; each warp issues `iters` rounds of NACC independent mma.sync (m16n8k8 TF32,
// or m16n8k16 F16 / BF16, FP32 accumulators) and the block's clock64 span gives cycles per mma per SM.
// With one accumulator a warp the chain is dependent, so that row shows the mma latency. The operand
// values do not matter (they are fixed bit patterns); only the issue rate is measured.
//
//   nvcc -gencode arch=compute_90,code=sm_90 -O3 -o /tmp/mma_rate benchmarks/cuda_mma_rate.cu && /tmp/mma_rate
//
// H200 (forty-third session, docs/BENCHMARKS.md "Verify attention at T = 17"): 1.50 cycles per mma per
// SM for all three with 8+ warps and 2+ accumulators a warp (TF32 682, F16 / BF16 1364 FMA / cycle / SM);
// ~24 cycles of latency per dependent mma.
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <cuda_runtime.h>

#include "cuda_tool.h"

constexpr const char* kTool = "cuda_mma_rate";
#define CHECK(x) tool_check((x), #x, kTool)
template <int KIND, int NACC>
__global__ void k(float* out, long long* cyc, int iters) {
  float c[NACC][4];
  for (int j = 0; j < NACC; ++j) c[j][0] = c[j][1] = c[j][2] = c[j][3] = 0.f;
  uint32_t a0 = threadIdx.x * 2654435761u, a1 = a0 ^ 0x1234567u, a2 = a0 + 77u, a3 = a0 * 3u, b0 = a0 >> 3, b1 = a1 >> 5;
  a0 &= 0x3f7fe000u; a1 &= 0x3f7fe000u; a2 &= 0x3f7fe000u; a3 &= 0x3f7fe000u; b0 &= 0x3f7fe000u; b1 &= 0x3f7fe000u;
  __syncthreads();
  long long t0 = clock64();
  for (int it = 0; it < iters; ++it) {
#pragma unroll
    for (int j = 0; j < NACC; ++j) {
      if (KIND == 0)
        asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                     : "+f"(c[j][0]), "+f"(c[j][1]), "+f"(c[j][2]), "+f"(c[j][3]) : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
      else if (KIND == 1)
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                     : "+f"(c[j][0]), "+f"(c[j][1]), "+f"(c[j][2]), "+f"(c[j][3]) : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
      else
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                     : "+f"(c[j][0]), "+f"(c[j][1]), "+f"(c[j][2]), "+f"(c[j][3]) : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    }
  }
  __syncthreads();
  long long t1 = clock64();
  float s = 0.f;
  for (int j = 0; j < NACC; ++j) s += c[j][0] + c[j][1] + c[j][2] + c[j][3];
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;
  if (threadIdx.x == 0) cyc[blockIdx.x] = t1 - t0;
}
template <int KIND, int NACC>
void run(const char* name, int warps_per_block, int blocks_per_sm, int nsm) {
  const int iters = 4096, nb = nsm * blocks_per_sm, nt = 32 * warps_per_block;
  float* out; long long* cyc;
  CHECK(cudaMalloc(&out, sizeof(float) * nb * nt));
  CHECK(cudaMalloc(&cyc, sizeof(long long) * nb));
  k<KIND, NACC><<<nb, nt>>>(out, cyc, 64);  // warm-up
  CHECK(cudaGetLastError());
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  CHECK(cudaEventRecord(e0));
  k<KIND, NACC><<<nb, nt>>>(out, cyc, iters);
  CHECK(cudaGetLastError());
  CHECK(cudaEventRecord(e1));
  CHECK(cudaEventSynchronize(e1));
  float ms;
  CHECK(cudaEventElapsedTime(&ms, e0, e1));
  static long long h[1 << 16];
  if (nb > (1 << 16)) return;
  CHECK(cudaMemcpy(h, cyc, sizeof(long long) * nb, cudaMemcpyDeviceToHost));
  long long mx = 0; for (int i = 0; i < nb; ++i) mx = h[i] > mx ? h[i] : mx;
  const double mmas_per_sm = (double)warps_per_block * blocks_per_sm * iters * NACC;
  const double fma_per = KIND == 0 ? 16 * 8 * 8 : 16 * 8 * 16;
  printf("%-5s acc %d warps/SM %3d: %.2f cycles per mma per SM, %.0f FMA/clk/SM, %.1f TFLOP/s (%.3f ms)\n", name, NACC,
         warps_per_block * blocks_per_sm, mx / mmas_per_sm, mmas_per_sm * fma_per / mx,
         2.0 * mmas_per_sm * nsm * fma_per / (ms * 1e-3) / 1e12, ms);
  CHECK(cudaFree(out));
  CHECK(cudaFree(cyc));
  CHECK(cudaEventDestroy(e0));
  CHECK(cudaEventDestroy(e1));
}
int main() {
  if (!tool_has_device(kTool)) return 1;
  int nsm = 0, major = 0;
  CHECK(cudaDeviceGetAttribute(&nsm, cudaDevAttrMultiProcessorCount, 0));
  CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0));
  if (major < 8) {
    fprintf(stderr, "cuda_mma_rate: needs sm_80 or newer (TF32 / BF16 mma.sync), found sm_%d\n", major);
    return 1;
  }
  for (int w : {4, 8, 16}) { run<0, 8>("tf32", w, 1, nsm); run<1, 8>("f16", w, 1, nsm); run<2, 8>("bf16", w, 1, nsm); }
  run<0, 4>("tf32", 8, 1, nsm); run<0, 2>("tf32", 8, 1, nsm); run<0, 1>("tf32", 8, 1, nsm);
  run<1, 1>("f16", 8, 1, nsm); run<0, 1>("tf32", 32, 1, nsm);
  return 0;
}
