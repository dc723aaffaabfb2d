// cuda_device.cu: runtime checks for a usable CUDA device (driver present, device count).
#include <cuda_runtime.h>

#include <atomic>
#include <cstdlib>

#include "cuda_device.h"
#include "kernels.h"

namespace kdtree {

bool cuda_device_usable(std::string* why) {
  int n = 0;
  cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) {
    if (why) *why = std::string("CUDA runtime: ") + cudaGetErrorString(err);
    cudaGetLastError();  // clear the sticky-free error state
    return false;
  }
  if (n == 0) {
    if (why) *why = "no CUDA device found";
    return false;
  }
  if (why) *why = "";
  return true;
}

std::string cuda_device_name() {
  if (!cuda_device_usable(nullptr)) return "";
  cudaDeviceProp p;
  if (cudaGetDeviceProperties(&p, 0) != cudaSuccess) return "";
  return std::string(p.name) + " (sm_" + std::to_string(p.major * 10 + p.minor) + ")";
}

int cuda_pointer_device(const void* ptr) {
  if (ptr == nullptr) return -1;
  cudaPointerAttributes attr;
  if (cudaPointerGetAttributes(&attr, ptr) != cudaSuccess) {
    cudaGetLastError();
    return -1;
  }
  if (attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged) return -1;
  return attr.device;
}

std::string cuda_copy_to_host(void* dst, const void* src, size_t bytes, int stream_kind, unsigned long long stream) {
  if (bytes == 0) return "";  // nothing to read: no wait on the producer's stream (whatever handle it names)
  {  // refuse a pointer CUDA does not know as device memory (a bogus address would
                    // otherwise be read as host memory by the copy and could crash the process)
    cudaPointerAttributes attr;
    cudaError_t pe = cudaPointerGetAttributes(&attr, src);
    if (pe != cudaSuccess) {
      cudaGetLastError();
      return cudaGetErrorString(pe);
    }
    if (attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged)
      return "the pointer is not CUDA device memory";
  }
  cudaError_t e = cudaSuccess;
  if (stream_kind == 0) e = cudaDeviceSynchronize();
  else if (stream_kind == 1) {
    cudaStream_t st = stream == 1 ? cudaStreamLegacy : stream == 2 ? cudaStreamPerThread : (cudaStream_t)stream;
    e = cudaStreamSynchronize(st);
  }
  if (e == cudaSuccess) e = cudaMemcpy(dst, src, bytes, cudaMemcpyDefault);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return cudaGetErrorString(e);
  }
  return "";
}

}  // namespace kdtree

namespace kdtree {
namespace cuda {

// The Programmatic Dependent Launch switch of cuda/launch.h (declared in kernels.h).
namespace {
std::atomic<int>& pdl_state() {
  static std::atomic<int> s{[] {
    const char* e = std::getenv("KDTREE_CUDA_PDL");
    return (e && e[0] == '0' && e[1] == '\0') ? 0 : 1;
  }()};
  return s;
}
}  // namespace
bool pdl_enabled() { return pdl_state().load(std::memory_order_relaxed) != 0; }

int num_sms() {
  static int n = 0;
  if (n == 0) {
    int dev = 0;
    cudaGetDevice(&dev);
    if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || n <= 0) {
      cudaGetLastError();
      n = 132;
    }
  }
  return n;
}
bool set_pdl(bool on) { return pdl_state().exchange(on ? 1 : 0) != 0; }

}  // namespace cuda
}  // namespace kdtree
