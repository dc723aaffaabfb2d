// cuda_tool.h: what the standalone CUDA tools of benchmarks/ share (cuda_mma_rate.cu, cuda_stream_floor.cu,
// cuda_chain_floor.cu: each still one .cu built by one nvcc line, this header beside them): the CUDA error check and
// the refusal without a device, both naming the tool on stderr (tests/python/cuda_tools.py reads that prefix).
#pragma once
#include <cstdio>
#include <cstdlib>

#include <cuda_runtime.h>

// Exit 1 with "<tool>: <what> failed: <error>" on stderr when e is an error.
inline void tool_check(cudaError_t e, const char* what, const char* tool) {
  if (e == cudaSuccess) return;
  fprintf(stderr, "%s: %s failed: %s\n", tool, what, cudaGetErrorString(e));
  exit(1);
}

// Whether a CUDA device is there; if not, "<tool>: no CUDA device" on stderr (the tool then exits 1).
inline bool tool_has_device(const char* tool) {
  int n = 0;
  if (cudaGetDeviceCount(&n) == cudaSuccess && n > 0) return true;
  fprintf(stderr, "%s: no CUDA device\n", tool);
  return false;
}
