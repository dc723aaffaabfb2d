// cublas_loader.cpp: dlopen + dlsym of the cuBLAS functions in cublas_api.h (see
// cublas_loader.h for the search order).
#include "model/cublas_loader.h"

#include <dlfcn.h>

#include <mutex>
#include <string>
#include <vector>

#include "common.h"
#include "model/cublas_api.h"

namespace kdtree {
namespace cuda {

#ifdef KDTREE_HAVE_CUBLAS
namespace {

// Directory of the shared object holding this code (the Python extension module), or "".
std::string own_dir() {
  Dl_info info;
  if (dladdr(reinterpret_cast<void*>(&own_dir), &info) == 0 || info.dli_fname == nullptr) return "";
  std::string f = info.dli_fname;
  const size_t slash = f.rfind('/');
  return slash == std::string::npos ? std::string() : f.substr(0, slash);
}

std::vector<std::string> candidates() {
  std::vector<std::string> c;
  const std::string dir = own_dir();
  if (!dir.empty()) {
    // <site-packages>/kdtree_native/_native*.so -> <site-packages>/nvidia/cu13/lib
    const size_t slash = dir.rfind('/');
    if (slash != std::string::npos) c.push_back(dir.substr(0, slash) + "/nvidia/cu13/lib/libcublas.so.13");
    c.push_back(dir + "/libcublas.so.13");
  }
  const std::string libdir = build_info().cublas_libdir;
  if (!libdir.empty()) c.push_back(libdir + "/libcublas.so.13");
  c.push_back("libcublas.so.13");
  c.push_back("libcublas.so");
  return c;
}

struct Loaded {
  CublasApi api;
  std::string error;  // empty when loaded
};

template <class F>
bool resolve(void* lib, const char* name, F& fn, std::string& missing) {
  fn = reinterpret_cast<F>(dlsym(lib, name));
  if (fn == nullptr) missing += std::string(missing.empty() ? "" : ", ") + name;
  return fn != nullptr;
}

Loaded load() {
  Loaded out;
  std::string tried;
  for (const std::string& path : candidates()) {
    dlerror();
    void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      const char* e = dlerror();
      tried += "\n  " + path + ": " + (e ? e : "not found");
      continue;
    }
    CublasApi& a = out.api;
    std::string missing;
    resolve(lib, "cublasCreate_v2", a.create, missing);
    resolve(lib, "cublasDestroy_v2", a.destroy, missing);
    resolve(lib, "cublasSetStream_v2", a.set_stream, missing);
    resolve(lib, "cublasSetMathMode", a.set_math_mode, missing);
    resolve(lib, "cublasSetWorkspace_v2", a.set_workspace, missing);
    resolve(lib, "cublasSgemm_v2", a.sgemm, missing);
    resolve(lib, "cublasSgemmStridedBatched", a.sgemm_strided_batched, missing);
    resolve(lib, "cublasGetStatusString", a.status_string, missing);
    if (!missing.empty()) {
      tried += "\n  " + path + ": loaded but lacks " + missing;
      dlclose(lib);
      out.api = CublasApi();
      continue;
    }
    a.path = path;
    return out;  // the library stays loaded for the life of the process
  }
  out.error = "cuBLAS could not be loaded (install the nvidia-cublas wheel, or put libcublas.so.13 on the "
              "loader path); tried:" + tried;
  return out;
}

const Loaded& loaded() {
  static std::once_flag once;
  static Loaded l;
  std::call_once(once, [] { l = load(); });
  return l;
}

}  // namespace

const CublasApi& cublas_api() {
  const Loaded& l = loaded();
  if (!l.error.empty()) throw RuntimeFailure(l.error);
  return l.api;
}

bool cublas_probe(std::string* info) {
  const Loaded& l = loaded();
  if (info) *info = l.error.empty() ? l.api.path : l.error;
  return l.error.empty();
}

#else  // !KDTREE_HAVE_CUBLAS

const CublasApi& cublas_api() {
  throw RuntimeFailure("this build of kdtree_native has no cuBLAS (its headers were not found at build time), "
                       "so the GPU model is unavailable");
}

bool cublas_probe(std::string* info) {
  if (info) *info = "built without cuBLAS headers";
  return false;
}

#endif

}  // namespace cuda
}  // namespace kdtree
