// cublas_loader.h: cuBLAS loaded at run time (dlopen), so that the module imports and the CPU
// backend works on machines without cuBLAS (or without any GPU); only the GPU model needs it.
//
// Where it sits: used by cuda/model/cuda_model.cpp for the FP32 GEMMs. The library is looked
// for, in order: next to the Python module (<site-packages>/nvidia/cu13/lib/libcublas.so.13,
// the `nvidia-cublas` wheel; the module's directory is found with dladdr), the build-time
// directory KDTREE_CUBLAS_LIBDIR (build_info().cublas_libdir), then the plain names
// libcublas.so.13 and libcublas.so through the dynamic loader's search path. Only the functions
// the model calls are resolved, each typed by decltype of its real prototype in cublas_v2.h.
// This header exposes no cuBLAS types: it compiles without the cuBLAS headers.
#pragma once
#include <string>

namespace kdtree {
namespace cuda {

struct CublasApi;  // the resolved function table (cublas_loader.cpp)

// The loaded API, loading it on first use (thread-safe). Throws kdtree::RuntimeFailure naming
// every path tried and the loader's error when cuBLAS cannot be loaded or lacks a function, or
// when this build had no cuBLAS headers.
const CublasApi& cublas_api();

// Non-throwing probe for tests and diagnostics: true when cuBLAS loads; `info` gets the path
// loaded, or the error message (with every path tried).
bool cublas_probe(std::string* info);

}  // namespace cuda
}  // namespace kdtree
