// cuda_chain_floor.cu: what one kernel boundary costs in a chain of dependent kernels replayed from a CUDA
// graph, with and without programmatic dependent launch (PDL), against one persistent kernel that runs the
// same phases separated by a grid-wide barrier (not part of the build).
//
// Why: a mini-kimi verify step of 17 tokens is ~144 dependent kernels in one graph (docs/CUDA_MODEL.md), and
// the forty-fifth session's stream floors showed every small projection at ~5-6 us whatever its bytes. This
// measures the boundary alone: N = 128 kernels, each of `blocks` blocks x 256 threads, where every thread
// reads the element the previous kernel wrote and writes the next (a true data dependence through global
// memory, so no kernel may start its reads before its predecessor's writes are visible):
//   * "chain pdl": each kernel launched with the PDL attribute (cudaLaunchAttributeProgrammatic-
//     StreamSerialization, as cuda/launch.h), griddepcontrol.launch_dependents at its start and
//     griddepcontrol.wait before its read, as every kernel of the model does;
//   * "chain plain": the same launches without the attribute (stream order: the next kernel's blocks are
//     scheduled only after this one has drained);
//   * each chain also with 160 KB of dynamic shared memory held per block ("smem 160 KB": one block an SM,
//     like the tensor-core attention's 194 KB), so a dependent block can only become resident where a
//     block of the previous kernel has exited: what PDL's early launch is worth when it cannot overlap;
//   * "persistent": one kernel of `blocks` co-resident blocks running the N phases, a grid barrier (an
//     atomic arrival counter in global memory, release / acquire) between them: the cost a fused
//     per-layer kernel would pay per step instead of a kernel boundary.
// Each is timed as the median of 20 graph replays (the persistent kernel: 20 launches) between events,
// divided by N: microseconds per boundary (per phase).
//
//   nvcc -gencode arch=compute_90,code=sm_90 -O3 -o /tmp/chain_floor benchmarks/cuda_chain_floor.cu && /tmp/chain_floor
//
// H200 figures: docs/BENCHMARKS.md ("Forty-sixth session" under the GPU model).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <cuda_runtime.h>

#include "cuda_tool.h"

constexpr const char* kTool = "cuda_chain_floor";
#define CHECK(x) tool_check((x), #x, kTool)

constexpr int kThreads = 256, kN = 128;

// one link of the chain: out[i] = in[i] + 1 for this thread's element (in = what the previous kernel wrote)
__global__ void __launch_bounds__(kThreads) link_kernel(const float* in, float* out) {
  extern __shared__ float held[];  // (dynamic shared memory only held: at 160 KB one block fits an SM)
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  asm volatile("griddepcontrol.wait;" ::: "memory");
  const int i = blockIdx.x * kThreads + threadIdx.x;
  out[i] = __ldcg(in + i) + 1.f;
}

// every block arrives once per phase; the counter only grows (phase p waits for (p + 1) * gridDim.x arrivals)
__device__ __forceinline__ void grid_barrier(unsigned* count, unsigned target) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(count, 1u);
    unsigned v;
    do {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(count) : "memory");
    } while (v < target);
  }
  __syncthreads();
}

__global__ void __launch_bounds__(kThreads) persistent_kernel(float* a, float* b, unsigned* count, int phases) {
  const int i = blockIdx.x * kThreads + threadIdx.x;
  for (int p = 0; p < phases; ++p) {
    const float* in = p % 2 ? b : a;
    float* out = p % 2 ? a : b;
    out[i] = __ldcg(in + i) + 1.f;
    grid_barrier(count, (unsigned)(p + 1) * gridDim.x);
  }
}

int main() {
  if (!tool_has_device(kTool)) return 1;
  cudaDeviceProp pr;
  CHECK(cudaGetDeviceProperties(&pr, 0));
  const int sms = pr.multiProcessorCount;
  float *a = nullptr, *b = nullptr;
  unsigned* count = nullptr;
  const size_t n = (size_t)4 * sms * kThreads;
  CHECK(cudaMalloc(&a, n * sizeof(float)));
  CHECK(cudaMalloc(&b, n * sizeof(float)));
  CHECK(cudaMalloc(&count, sizeof(unsigned)));
  CHECK(cudaMemset(a, 0, n * sizeof(float)));
  cudaStream_t st;
  CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  printf("%s, %d SMs; %d dependent phases of 256-thread blocks, us per boundary (median of 20)\n", pr.name, sms, kN);
  auto median_us = [&](auto run) {
    std::vector<float> ts;
    for (int it = 0; it < 23; ++it) {
      CHECK(cudaEventRecord(e0, st));
      run();
      CHECK(cudaEventRecord(e1, st));
      CHECK(cudaEventSynchronize(e1));
      float ms = 0.f;
      CHECK(cudaEventElapsedTime(&ms, e0, e1));
      if (it >= 3) ts.push_back(ms * 1000.f / kN);
    }
    std::sort(ts.begin(), ts.end());
    return ts[ts.size() / 2];
  };
  // link k of a chain: a -> b for even k, b -> a for odd (with the PDL attribute when pdl)
  auto link = [&](int k, int blocks, int smem, int pdl) {
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(blocks);
    cfg.blockDim = dim3(kThreads);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = st;
    cfg.attrs = attr;
    cfg.numAttrs = pdl;
    CHECK(cudaLaunchKernelEx(&cfg, link_kernel, (const float*)(k % 2 ? b : a), k % 2 ? a : b));
  };
  int max_resident = 0;  // blocks of the persistent kernel that fit at once (all must, for its barrier)
  CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&max_resident, persistent_kernel, kThreads, 0));
  max_resident *= sms;
  constexpr int kBigSmem = 160 << 10;
  CHECK(cudaFuncSetAttribute(link_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kBigSmem));
  for (int blocks : {1, 17, sms, 2 * sms}) {
    for (int v = 0; v < 4; ++v) {
      const int pdl = v % 2 == 0, smem = v < 2 ? 0 : kBigSmem;
      cudaGraph_t g;
      cudaGraphExec_t ge;
      CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
      for (int k = 0; k < kN; ++k) link(k, blocks, smem, pdl);
      CHECK(cudaStreamEndCapture(st, &g));
      CHECK(cudaGraphInstantiate(&ge, g, 0));
      const float us = median_us([&] { CHECK(cudaGraphLaunch(ge, st)); });
      printf("chain %-10s blocks %4d smem %3d KB: %7.3f us per boundary\n", pdl ? "pdl" : "plain", blocks, smem >> 10, us);
      CHECK(cudaGraphExecDestroy(ge));
      CHECK(cudaGraphDestroy(g));
    }
    if (blocks <= max_resident) {
      const float us = median_us([&] {
        CHECK(cudaMemsetAsync(count, 0, sizeof(unsigned), st));
        persistent_kernel<<<blocks, kThreads, 0, st>>>(a, b, count, kN);
        CHECK(cudaGetLastError());
      });
      printf("persistent       blocks %4d smem   0 KB: %7.3f us per boundary\n", blocks, us);
    }
  }
  // the values: from zeros, 128 phases of +1 leave 128 in every element a phase wrote (a and b alternate,
  // phase 127 writes a), through the persistent kernel and through a chain of PDL launches
  float got[2] = {0.f, 0.f};
  const size_t last = (size_t)sms * kThreads - 1;
  for (int way = 0; way < 2; ++way) {
    CHECK(cudaMemsetAsync(a, 0, n * sizeof(float), st));
    CHECK(cudaMemsetAsync(b, 0, n * sizeof(float), st));
    CHECK(cudaMemsetAsync(count, 0, sizeof(unsigned), st));
    if (way == 0) {
      persistent_kernel<<<sms, kThreads, 0, st>>>(a, b, count, kN);
      CHECK(cudaGetLastError());
    } else {
      for (int k = 0; k < kN; ++k) link(k, sms, 0, 1);
    }
    float v0 = 0.f, v1 = 0.f;
    CHECK(cudaMemcpyAsync(&v0, a, sizeof(float), cudaMemcpyDeviceToHost, st));
    CHECK(cudaMemcpyAsync(&v1, a + last, sizeof(float), cudaMemcpyDeviceToHost, st));
    CHECK(cudaStreamSynchronize(st));
    got[way] = v0 == v1 ? v0 : -1.f;
  }
  printf("check: persistent %.0f, chain %.0f (expected %d)\n", got[0], got[1], kN);
  return 0;
}
