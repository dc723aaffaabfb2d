#include "cpu_features.h"

namespace kdtree {

#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__)
bool cpu_has_avx2_fma() {
  static const bool ok = [] {
    __builtin_cpu_init();  // we may run before libgcc's own constructor (static initialisation)
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }();
  return ok;
}

bool cpu_has_avx512() {
  static const bool ok = [] {
    __builtin_cpu_init();
    return cpu_has_avx2_fma() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl");
  }();
  return ok;
}
#else
bool cpu_has_avx2_fma() { return false; }
bool cpu_has_avx512() { return false; }
#endif

}  // namespace kdtree
