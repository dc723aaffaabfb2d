// parallel.cpp: the work-sharing pool of parallel.h.
#include "model/parallel.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define KD_PAUSE() _mm_pause()
#else
#define KD_PAUSE() std::this_thread::yield()
#endif

namespace kdtree {

namespace {

constexpr int kMaxThreads = 8;
constexpr auto kHelperSpin = std::chrono::microseconds(200);  // a helper's spin before sleeping
// A caller that waited this long for a helper's chunk (the helper was descheduled mid-chunk: the
// cores are shared) runs alone for kBackoff, so a loaded machine costs at most one such wait per
// kBackoff instead of one per GEMM.
constexpr auto kStall = std::chrono::microseconds(300);
constexpr auto kBackoff = std::chrono::milliseconds(100);

int configured_threads() {
  if (const char* v = std::getenv("KDTREE_NUM_THREADS"); v && *v) return std::clamp(std::atoi(v), 1, kMaxThreads);
  int n = 0;
#ifdef _OPENMP
  n = omp_get_max_threads();
#endif
  if (n <= 0) n = (int)std::thread::hardware_concurrency();
  return std::clamp(n, 1, kMaxThreads);
}

thread_local bool t_in_job = false;  // this thread is running a chunk: nested calls run alone

class Pool {
 public:
  explicit Pool(int helpers) {
    for (int i = 0; i < helpers; ++i) threads_.emplace_back([this] { helper(); });
  }
  ~Pool() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
      gen_pub_.store(~0ull, std::memory_order_release);
    }
    cv_.notify_all();
    for (std::thread& t : threads_) t.join();
  }
  int threads() const { return (int)threads_.size() + 1; }

  // false when another caller holds the pool (the caller then runs alone)
  bool run(int64_t n, void (*fn)(void*, int64_t), void* ctx) {
    const int64_t now = std::chrono::steady_clock::now().time_since_epoch().count();
    if (now < backoff_until_.load(std::memory_order_relaxed)) return false;
    std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
    if (!busy.owns_lock()) return false;
    bool wake;
    {
      std::lock_guard<std::mutex> lock(mu_);
      fn_ = fn;
      ctx_ = ctx;
      n_ = n;
      next_ = 0;
      done_.store(0, std::memory_order_relaxed);
      ++gen_;
      gen_pub_.store(gen_, std::memory_order_release);
      wake = sleepers_ > 0;
    }
    if (wake) cv_.notify_all();
    work();
    // Wait only for chunks a helper has claimed (it is running them now).
    if (done_.load(std::memory_order_acquire) < n) {
      const auto t0 = std::chrono::steady_clock::now();
      for (int spins = 0; done_.load(std::memory_order_acquire) < n; ++spins) {
        if (spins < 4096) KD_PAUSE();
        else std::this_thread::yield();
      }
      const auto t1 = std::chrono::steady_clock::now();
      if (t1 - t0 > kStall)
        backoff_until_.store((t1 + kBackoff).time_since_epoch().count(), std::memory_order_relaxed);
    }
    return true;
  }

 private:
  void work() {
    for (;;) {
      int64_t i;
      void (*fn)(void*, int64_t);
      void* ctx;
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (next_ >= n_) return;
        i = next_++;
        fn = fn_;
        ctx = ctx_;
      }
      t_in_job = true;
      fn(ctx, i);
      t_in_job = false;
      done_.fetch_add(1, std::memory_order_release);
    }
  }

  void helper() {
    uint64_t seen = 0;
    for (;;) {
      const auto t0 = std::chrono::steady_clock::now();
      int spins = 0;
      while (gen_pub_.load(std::memory_order_acquire) == seen) {
        KD_PAUSE();
        if (++spins % 256 == 0 && std::chrono::steady_clock::now() - t0 > kHelperSpin) break;
      }
      {
        std::unique_lock<std::mutex> lock(mu_);
        if (gen_ == seen && !stop_) {
          ++sleepers_;
          cv_.wait(lock, [&] { return gen_ != seen || stop_; });
          --sleepers_;
        }
        if (stop_) return;
        seen = gen_;
      }
      work();
    }
  }

  std::vector<std::thread> threads_;
  std::mutex busy_;  // one job at a time
  std::mutex mu_;    // job fields and chunk claims
  std::condition_variable cv_;
  void (*fn_)(void*, int64_t) = nullptr;
  void* ctx_ = nullptr;
  int64_t n_ = 0, next_ = 0;
  uint64_t gen_ = 0;
  int sleepers_ = 0;
  bool stop_ = false;
  std::atomic<uint64_t> gen_pub_{0};
  std::atomic<int64_t> done_{0};
  std::atomic<int64_t> backoff_until_{0};  // steady_clock ticks
};

Pool* pool() {
  static Pool* p = [] {
    const int n = configured_threads();
    return n > 1 ? new Pool(n - 1) : nullptr;  // never destroyed: helpers live as long as the process
  }();
  return p;
}

}  // namespace

int parallel_threads() {
  Pool* p = pool();
  return p ? p->threads() : 1;
}

void parallel_chunks(int64_t n, void (*fn)(void*, int64_t), void* ctx) {
  Pool* p = (n > 1 && !t_in_job) ? pool() : nullptr;
  if (p && p->run(n, fn, ctx)) return;
  for (int64_t i = 0; i < n; ++i) fn(ctx, i);
}

}  // namespace kdtree
