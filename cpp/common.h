// common.h: error type and checks shared by every host-side file (cpp/) of kdtree-native.
// Errors are C++ exceptions carrying a message that names the problem; the bindings turn
// kdtree::Error into Python's ValueError (bad input) and other std::exception into
// RuntimeError.
#pragma once
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace kdtree {

// Bad input from the caller (shapes, ranges, corrupt files): surfaces as ValueError.
struct Error : std::runtime_error {
  explicit Error(const std::string& msg) : std::runtime_error(msg) {}
};

// An environment/runtime failure (CUDA error, out of memory): surfaces as RuntimeError.
struct RuntimeFailure : std::runtime_error {
  explicit RuntimeFailure(const std::string& msg) : std::runtime_error(msg) {}
};

// "[2, 3]": a tensor shape for error messages (model/config.cpp)
std::string shape_str(const std::vector<int64_t>& shape);

#define KD_CHECK(cond, msg)                                  \
  do {                                                       \
    if (!(cond)) throw ::kdtree::Error(std::string(msg));    \
  } while (0)

// What the build contains (filled from CMake definitions).
struct BuildInfo {
  std::string version, compiler, cpu_blas, cuda_archs, cublas_libdir;
  bool cuda_compiled = false;
};
BuildInfo build_info();

// Whether a CUDA device can be used now (false when not compiled, no driver or no device);
// `why` gets a human-readable reason.
bool cuda_available(std::string* why);

}  // namespace kdtree
