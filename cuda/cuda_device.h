// cuda_device.h: host-callable queries about the CUDA runtime/device. No Python here.
#pragma once
#include <string>

namespace kdtree {
// True when the CUDA runtime finds a driver and at least one device; else `why` says why.
bool cuda_device_usable(std::string* why);
// Name of device 0 and its compute capability, e.g. "NVIDIA H200 (sm_90)"; "" if none.
std::string cuda_device_name();
// Copies `bytes` from device (or managed) memory to host memory after making the producer's
// work visible: stream_kind 0 = no stream given (synchronise the device), 1 = the given stream
// handle `stream` (synchronised), 2 = nothing to wait for. Returns "" or the CUDA error.
std::string cuda_copy_to_host(void* dst, const void* src, size_t bytes, int stream_kind, unsigned long long stream);
// The CUDA device ordinal whose memory `ptr` points into (device or managed memory); -1 when
// CUDA does not know it as device memory (host memory, a bogus address).
int cuda_pointer_device(const void* ptr);
}  // namespace kdtree
