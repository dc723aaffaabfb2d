// choose_kernels.h: the GPU round's per-node choice of the target's token (argmax or the seeded
// sampler, identical to kdtree::Sampler), launcher API. Implemented in choose_kernels.cu; called by
// cuda_rounds.cpp and the test binding (bindings/bind_cuda.cpp).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace kdtree {
namespace cuda {

// ---------------------------------------------------------------- the target's choice
// sample_uniform of cpp/engine/sampler.cpp, the same integer arithmetic and the same exact
// double scaling, so host and device give identical doubles: uniform in [0, 1) from
// (seed, index).
__host__ __device__ inline uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
__host__ __device__ inline double sample_uniform(uint64_t seed, int64_t index) {
  const uint64_t h = splitmix64(splitmix64(seed) ^ (static_cast<uint64_t>(index) * 0xD6E8FEB86659FD93ull));
  return static_cast<double>(h >> 11) * (1.0 / 9007199254740992.0);
}

// Per row t of logits: the target's token, as kdtree::Sampler::choose (cpp/engine/sampler.cpp)
// with index = positions[t] + 1. temperature == 0: argmax, lowest id on ties, NaN never chosen
// (all NaN: 0). temperature > 0: softmax(logits / temperature) in double, optionally cut to the
// top_k largest logits (ties by lower id, NaN ranks as -inf), then to the smallest prefix of that
// order whose mass reaches top_p of it, and the inverse CDF at u = sample_uniform(seed, index) over
// the candidates (in id order when nothing is filtered, else in that order). One block per row.
// Greedy: a float4 block argmax (memory bound). Sampling: top_k <= 2048 and nuclei of up to
// ~1000 tokens are gathered into shared memory, sorted, and run through the CPU's own loops
// (same double operations in the same order); larger ones (top_k > 2048, flat distributions
// under top_p) go through an exact radix selection over the logit order, several passes over the
// row (slower: ~1-3 ms per row at V = 163840 on an H200, vs ~60-200 us for the common cases).
// The GPU can pick another token than the CPU only through rounding: the device's double exp()
// may differ from glibc's in the last bit, and some sums are added in another order (the total of
// an unfiltered softmax and the whole-row total of a nucleus-only one, and the per-bin sums of the
// radix path) -- each moves an inverse-CDF or nucleus boundary by ~1e-16 relative, so a
// difference needs the uniform to fall that close to one (~1e-13 per sample). Deterministic: the
// same inputs always give the same choices.
struct ChooseParams {
  const float* logits;       // [T, ldl] device, row t at logits + t * ldl, V valid entries
  long long ldl;             // floats between rows (>= V); rows starting 16-byte aligned are read
                             // with float4 loads
  int T;                     // rows (0: nothing is launched)
  int V;                     // vocabulary size (>= 1; sampling: <= 2^26)
  const int32_t* positions;  // [T] device; row t samples with index positions[t] + 1 (the
                             // absolute index of the token it produces); unused when greedy
  float temperature;         // 0 = greedy argmax; > 0 (finite) = sampling
  long long top_k;           // 0 or >= V: off; else keep the top_k largest logits (sampling only)
  float top_p;               // in (0, 1]; 1 = off; nucleus cut (sampling only)
  uint64_t seed;             // sampling seed (SamplingParams::seed)
  int32_t* choice;           // [T] device: the chosen token id of each row
};
cudaError_t choose_tokens(const ChooseParams& p, cudaStream_t stream);

}  // namespace cuda
}  // namespace kdtree
