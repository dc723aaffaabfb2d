// ops.h: the small row-wise CPU ops of the model forward (RMSNorm, RoPE, SwiGLU, softmax),
// each matching HF transformers' fp32 DeepseekV3 arithmetic. Plain loops over raw pointers;
// rows are independent, so callers may run rows in parallel.
#pragma once
#include <cstdint>

namespace kdtree {

// y[D] = w * (x * rsqrt(mean(x^2) + eps)); y may alias x.
void rmsnorm_row(const float* x, const float* w, int64_t D, double eps, float* y);

// cos/sin of one position: cs[0:R/2] = cos(pos * inv_freq) * factor, cs[R/2:R] = sin(...) * factor.
// The angle is rounded to float first, as HF computes it (position.float() * inv_freq).
void rope_cos_sin(int64_t pos, const float* inv_freq, int64_t half, double factor, float* cs);

// Rotate one head's R rope dims with cos/sin from rope_cos_sin. Input layout: interleaved pairs
// (x0,x1),(x2,x3)... when `interleaved` (HF rope_interleave=True), else NeoX halves
// (x_j, x_{j+R/2}). Output layout is the same for both (HF's): y[j] = x_a cos_j - x_b sin_j,
// y[j+R/2] = x_b cos_j + x_a sin_j, where (x_a, x_b) is pair j. y must not alias x.
void rope_row(const float* x, const float* cs, int64_t half, bool interleaved, float* y);

// SwiGLU on a fused row gu = [gate(I), up(I)]: out[I] = silu(gate) * up.
void swiglu_row(const float* gu, int64_t I, float* out);

// In-place softmax over s[0:n] (entries equal to -inf get 0). Returns false when every entry
// is -inf (the row is then set to 0).
bool softmax_row(float* s, int64_t n);

}  // namespace kdtree
