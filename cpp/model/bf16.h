// bf16.h: exact BF16 copies of float32 weights (host side), shared by the CPU model's copies
// (cpu_model.cpp), the GPU model's exactness test (cuda/model/cuda_model.cpp) and the kernel test
// bindings. A float32 is exactly a BF16 value when its low 16 bits are zero; its BF16 is then the
// high 16 bits, and widening them back gives the same float.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

namespace kdtree {

// whether every one of the n values is exactly a BF16 (stops at the first that is not)
inline bool bf16_exact(const float* w, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, w + i, sizeof u);
    if (u & 0xffffu) return false;
  }
  return true;
}

// out[i] = the high 16 bits of w[i] (the BF16 value of an exact w[i])
inline void bf16_high_halves(const float* w, int64_t n, uint16_t* out) {
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, w + i, sizeof u);
    out[i] = (uint16_t)(u >> 16);
  }
}

// the float32 value of BF16 bits (exact)
inline float bf16_widen(uint16_t h) {
  const uint32_t u = (uint32_t)h << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// x rounded to the nearest BF16 (ties to even) as a float32 (x finite): the rounding a BF16-scaled
// INT4 weight gets in the loader (quantization.py _round_to)
inline float bf16_round(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
  float r;
  std::memcpy(&r, &u, sizeof r);
  return r;
}

// The loader's checks of a 4-bit group-quantized matrix handed over packed (set_weight_int4 of the CPU and GPU
// models): every scale finite, and no weight overflowing BF16 (each group's largest integer times its scale,
// rounded). n values, two a byte (element 2j in the low nibble of byte j, each the integer + 8), one scale a
// group of `group`. "" when they pass, else the message.
inline std::string int4_groups_problem(const std::string& name, const uint8_t* packed, const float* scales,
                                       int64_t group, int64_t n) {
  for (int64_t i = 0; i < n / group; ++i) {
    if (!std::isfinite(scales[i]))
      return "set_weight_int4: '" + name + "': scale " + std::to_string(i) + " is not finite";
    int most = 0;
    for (int64_t k = i * group; k < (i + 1) * group; k += 2) {
      const uint8_t b = packed[k / 2];
      most = std::max({most, std::abs((int)(b & 15) - 8), std::abs((int)(b >> 4) - 8)});
    }
    if (!std::isfinite(bf16_round((float)most * std::fabs(scales[i]))))
      return "set_weight_int4: '" + name + "': the dequantized weight overflows BF16 (scale " + std::to_string(i) +
             " too large)";
  }
  return "";
}

}  // namespace kdtree
