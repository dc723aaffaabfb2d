// parallel.h: a tiny work-sharing thread pool for the CPU model's small GEMMs (sgemm.cpp).
//
// parallel_chunks(n, fn) runs fn(0) .. fn(n-1) on the calling thread and the pool's helpers and
// returns when all are done. Chunks are claimed one at a time from a shared counter, and the
// caller claims too, so a helper that is asleep or descheduled (a loaded machine) never holds the
// call up: the caller simply does the work itself; only a chunk a helper has already started is
// waited for. Helpers spin briefly after a job (the next GEMM of a forward follows within
// microseconds), then sleep on a condition variable.
//
// Why not OpenMP: an OpenMP region ends in a barrier that waits for every thread of the team,
// including one the OS has not scheduled yet; with hundreds of short GEMMs per forward on a
// machine whose cores are shared, those waits cost more than the work (measured: 10-40x slower
// forwards). The pool is used only for calls of at least ~100 us of work (see sgemm.cpp).
//
// Size: KDTREE_NUM_THREADS if set (1 = no helpers), else OMP_NUM_THREADS / the OpenMP default,
// else std::thread::hardware_concurrency(); at most kMaxThreads. Concurrent callers (two models
// used from two threads) are fine: whoever finds the pool busy runs its chunks alone.
#pragma once
#include <cstdint>

namespace kdtree {

// Threads that share a parallel_chunks call (the caller included), >= 1.
int parallel_threads();

// fn(ctx, i) for i in [0, n); returns when every call has returned.
void parallel_chunks(int64_t n, void (*fn)(void* ctx, int64_t i), void* ctx);

template <class F>
void parallel_chunks(int64_t n, F& f) {
  parallel_chunks(n, [](void* c, int64_t i) { (*static_cast<F*>(c))(i); }, &f);
}

}  // namespace kdtree
