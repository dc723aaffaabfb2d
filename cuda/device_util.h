// device_util.h: small host-side helpers shared by the CUDA backend's C++ files
// (cuda/model/cuda_model.cpp, cuda/engine/cuda_rounds.cpp). Host code only.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

namespace kdtree {
namespace cuda {

constexpr int64_t kArenaAlign = 256;
inline int64_t arena_align_up(int64_t n) { return (n + kArenaAlign - 1) / kArenaAlign * kArenaAlign; }

// Lays out many buffers in one allocation: add() records (where to store the pointer, bytes,
// 256-byte aligned, at least one element), commit() assigns the pointers once the base is known.
struct Arena {
  struct Item {
    void** where;
    int64_t offset;
  };
  std::vector<Item> items;
  int64_t bytes = 0;
  template <class P>
  void add(P** where, int64_t count) {
    items.push_back({reinterpret_cast<void**>(where), bytes});
    bytes += arena_align_up(std::max<int64_t>(count, 1) * (int64_t)sizeof(P));
  }
  void commit(void* base) {
    for (const Item& it : items) *it.where = static_cast<char*>(base) + it.offset;
  }
};

// One device block and one pinned host block (either size may be 0: that block is skipped),
// both or neither: on failure nothing stays allocated, the CUDA error is cleared, and the
// return says which allocation failed, its size and CUDA's reason; "" on success.
inline std::string alloc_device_and_pinned(int64_t dev_bytes, void** dev, int64_t host_bytes, void** host) {
  *dev = nullptr;
  *host = nullptr;
  auto mib = [](int64_t b) { return std::to_string((b + (1 << 20) - 1) >> 20); };
  if (dev_bytes > 0) {
    cudaError_t e = cudaMalloc(dev, (size_t)dev_bytes);
    if (e != cudaSuccess) {
      cudaGetLastError();
      *dev = nullptr;
      return "cannot allocate " + mib(dev_bytes) + " MiB of device memory: " + cudaGetErrorString(e);
    }
  }
  if (host_bytes > 0) {
    cudaError_t e = cudaMallocHost(host, (size_t)host_bytes);
    if (e != cudaSuccess) {
      cudaGetLastError();
      *host = nullptr;
      if (*dev) cudaFree(*dev);
      *dev = nullptr;
      return "cannot allocate " + mib(host_bytes) + " MiB of pinned host memory: " + cudaGetErrorString(e);
    }
  }
  return "";
}

// Makes `dev` the current device for the scope and restores the previous one.
struct DeviceGuard {
  int prev = -1;
  explicit DeviceGuard(int dev) {
    if (cudaGetDevice(&prev) != cudaSuccess) prev = -1;
    if (prev != dev) cudaSetDevice(dev);
  }
  ~DeviceGuard() {
    int cur = -1;
    if (prev >= 0 && cudaGetDevice(&cur) == cudaSuccess && cur != prev) cudaSetDevice(prev);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;
};

}  // namespace cuda
}  // namespace kdtree
