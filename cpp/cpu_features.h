// cpu_features.h: what the running x86-64 CPU offers to the run-time-dispatched kernels (the
// skinny GEMMs, the row ops, the tree's top-k); false elsewhere. Computed once, safe to call
// from static initialisers (__builtin_cpu_init runs first).
#pragma once

namespace kdtree {

bool cpu_has_avx2_fma();
bool cpu_has_avx512();  // avx512f, avx512bw and avx512vl, with AVX2 + FMA

}  // namespace kdtree
