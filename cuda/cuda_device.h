// cuda_device.h: host-callable queries about the CUDA runtime/device. No Python here.
#pragma once
#include <string>

namespace kdtree {
// True when the CUDA runtime finds a driver and at least one device; else `why` says why.
bool cuda_device_usable(std::string* why);
// Name of device 0 and its compute capability, e.g. "NVIDIA H200 (sm_90)"; "" if none.
std::string cuda_device_name();
}  // namespace kdtree
