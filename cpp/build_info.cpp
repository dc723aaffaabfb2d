// build_info.cpp: what this build contains, and whether a CUDA device is usable right now.
#include "common.h"

#ifdef KDTREE_HAVE_CUDA
#include "cuda_device.h"
#endif

namespace kdtree {

BuildInfo build_info() {
  BuildInfo b;
  b.version = KDTREE_VERSION;
  b.compiler = KDTREE_CXX_COMPILER;
  b.cpu_blas = KDTREE_CPU_BLAS;
  b.cuda_archs = KDTREE_CUDA_ARCHS;
  b.cublas_libdir = KDTREE_CUBLAS_LIBDIR;
#ifdef KDTREE_HAVE_CUDA
  b.cuda_compiled = true;
#endif
  return b;
}

bool cuda_available(std::string* why) {
#ifdef KDTREE_HAVE_CUDA
  return cuda_device_usable(why);
#else
  if (why) *why = "built without CUDA";
  return false;
#endif
}

}  // namespace kdtree
