// device_util.h: small host-side helpers shared by the CUDA backend's C++ files
// (cuda/model/cuda_model.cpp, cuda/engine/cuda_rounds.cpp). Host code only.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
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
