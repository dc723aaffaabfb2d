// cublas_api.h: the table of cuBLAS functions the GPU model uses, resolved at run time by
// cublas_loader.cpp (see cublas_loader.h). Internal to cuda/: it includes cublas_v2.h, whose
// directory only the kdtree_cuda target has (KDTREE_HAVE_CUBLAS is defined when it was found).
#pragma once
#ifdef KDTREE_HAVE_CUBLAS
#include <cublas_v2.h>

#include <string>

#include "model/cublas_loader.h"

namespace kdtree {
namespace cuda {

struct CublasApi {
  std::string path;  // the library that was loaded
  decltype(&cublasCreate_v2) create = nullptr;
  decltype(&cublasDestroy_v2) destroy = nullptr;
  decltype(&cublasSetStream_v2) set_stream = nullptr;
  decltype(&cublasSetMathMode) set_math_mode = nullptr;
  decltype(&cublasSetWorkspace_v2) set_workspace = nullptr;
  decltype(&cublasSgemm_v2) sgemm = nullptr;
  decltype(&cublasSgemmStridedBatched) sgemm_strided_batched = nullptr;
  decltype(&cublasGetStatusString) status_string = nullptr;
};

}  // namespace cuda
}  // namespace kdtree
#endif  // KDTREE_HAVE_CUBLAS
