// cpu_model.cpp: CPU forward of the DeepSeek-V3 / Kimi-K2 target model (see cpu_model.h and
// docs/MODEL.md). Every projection over the T new tokens is one SGEMM (sgemm.h); the small
// row-wise ops are in ops.h. Attention runs in the latent space with weight absorption:
//
//   q_lat[t,h,:]  = q_nope[t,h,:] @ W_UK[h]              [T,H,C]   (W_UK[h]: [Dn,C])
//   scores        = [q_lat | q_rope] @ cache[0:S]^T * sc  [T*H, S]  (one GEMM over all heads:
//                                                                   the cache row is shared)
//   o_lat         = softmax(mask(scores)) @ cache[0:S, 0:C]  [T*H, C]
//   o[t,h,:]      = o_lat[t,h,:] @ W_UV[h]^T              [T,H,Dv]  (W_UV[h]: [Dv,C])
//   out           = o @ o_proj^T                          [T,Dm]
//
// which equals HF's expand-then-attend (k_nope = latent @ W_UK^T, v = latent @ W_UV^T) up to
// float rounding, without ever materialising per-head K/V.
#include "model/cpu_model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "common.h"
#include "model/bf16.h"
#include "model/ops.h"
#include "model/parallel.h"
#include "model/sgemm.h"

#ifdef _OPENMP
#include <omp.h>
#define KD_PRAGMA(x) _Pragma(#x)
#else
#define KD_PRAGMA(x)
#endif

// Parallel row loop when there is enough work to pay for waking the OpenMP team.
#define KD_PARALLEL_FOR_IF(cond) KD_PRAGMA(omp parallel for schedule(static) if (cond))

namespace kdtree {

namespace {
constexpr int64_t kScoresBudget = 1 << 22;  // floats of attention scores per chunk (16 MiB)
constexpr int64_t kParallelWork = 1 << 18;  // elements below which row loops stay serial
const float kNegInf = -std::numeric_limits<float>::infinity();

template <class V>
void grow(V& v, int64_t n) {
  if ((int64_t)v.size() < n) v.resize((size_t)n);
}
}  // namespace

const char* bf16_weights_name(Bf16Weights m) {
  return m == Bf16Weights::kOnly ? "only" : m == Bf16Weights::kCopies ? "copies" : "off";
}

Bf16Weights bf16_weights_from_name(const std::string& s) {
  if (s == "only") return Bf16Weights::kOnly;
  if (s == "copies") return Bf16Weights::kCopies;
  if (s == "off") return Bf16Weights::kOff;
  throw Error("bf16_weights must be 'only', 'copies' or 'off', got '" + s + "'");
}

CpuModel::CpuModel(const ModelConfig& cfg, int64_t max_seq_len, Bf16Weights bf16)
    : cfg_(cfg), max_seq_len_(max_seq_len), bf16_mode_(bf16), built_mode_(bf16) {
  cfg_.validate();
  if (max_seq_len <= 0) throw Error("CpuModel: max_seq_len must be > 0, got " + std::to_string(max_seq_len));
  const ModelConfig& c = cfg_;
  const int64_t Dm = c.hidden_size, H = c.num_attention_heads, C = c.kv_lora_rank, R = c.qk_rope_head_dim;
  const int64_t Dn = c.qk_nope_head_dim, Dv = c.v_head_dim;
  if ((double)max_seq_len * (double)(C + R) * (double)c.num_hidden_layers > 4e10)
    throw Error("CpuModel: max_seq_len " + std::to_string(max_seq_len) + " needs a latent cache of more than 160 GB");

  // Size every tensor and register where each HF name lands (weight matrices are allocated when
  // their first values arrive, in the form the mode holds them).
  struct Where {
    float* dst = nullptr;
    Weight* w = nullptr;
    int64_t off = 0;
  };
  std::unordered_map<std::string, Where> where;
  auto wreg = [&](Weight& w, int64_t n, const std::string& name) {
    w.n = n;
    where[name] = Where{nullptr, &w, 0};
  };
  wreg(embed_, c.vocab_size * Dm, "model.embed_tokens.weight");
  embed_.gemm = c.tie_word_embeddings;
  final_ln_.assign((size_t)Dm, 0.f);
  where["model.norm.weight"] = Where{final_ln_.data(), nullptr, 0};
  if (!c.tie_word_embeddings) wreg(lm_head_, c.vocab_size * Dm, "lm_head.weight");
  layers_.resize((size_t)c.num_hidden_layers);
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    Layer& ly = layers_[(size_t)l];
    const std::string p = "model.layers." + std::to_string(l) + ".";
    auto reg = [&](std::vector<float>& v, int64_t n, const std::string& name) {
      v.assign((size_t)n, 0.f);
      where[p + name] = Where{v.data(), nullptr, 0};
    };
    auto mreg = [&](Weight& w, int64_t n, const std::string& name) { wreg(w, n, p + name); };
    reg(ly.input_ln, Dm, "input_layernorm.weight");
    reg(ly.post_ln, Dm, "post_attention_layernorm.weight");
    if (c.q_lora_rank > 0) {
      mreg(ly.q_a, c.q_lora_rank * Dm, "self_attn.q_a_proj.weight");
      reg(ly.q_a_ln, c.q_lora_rank, "self_attn.q_a_layernorm.weight");
      mreg(ly.q_b, H * c.qk_head_dim() * c.q_lora_rank, "self_attn.q_b_proj.weight");
    } else {
      mreg(ly.q_proj, H * c.qk_head_dim() * Dm, "self_attn.q_proj.weight");
    }
    mreg(ly.kv_a, (C + R) * Dm, "self_attn.kv_a_proj_with_mqa.weight");
    reg(ly.kv_a_ln, C, "self_attn.kv_a_layernorm.weight");
    ly.w_uk.n = H * Dn * C;
    ly.w_uv.n = H * Dv * C;
    mreg(ly.o_proj, Dm * H * Dv, "self_attn.o_proj.weight");
    ly.moe = c.is_moe_layer(l);
    if (!ly.moe) {
      const int64_t I = c.intermediate_size;
      ly.mlp_gate_up.n = 2 * I * Dm;
      where[p + "mlp.gate_proj.weight"] = Where{nullptr, &ly.mlp_gate_up, 0};
      where[p + "mlp.up_proj.weight"] = Where{nullptr, &ly.mlp_gate_up, I * Dm};
      mreg(ly.mlp_down, Dm * I, "mlp.down_proj.weight");
    } else {
      const int64_t E = c.n_routed_experts, Ie = c.moe_intermediate_size;
      mreg(ly.router, E * Dm, "mlp.gate.weight");
      reg(ly.router_bias, E, "mlp.gate.e_score_correction_bias");
      ly.experts_gate_up.n = E * 2 * Ie * Dm;
      ly.experts_down.n = E * Dm * Ie;
      for (int64_t e = 0; e < E; ++e) {
        const std::string q = p + "mlp.experts." + std::to_string(e) + ".";
        where[q + "gate_proj.weight"] = Where{nullptr, &ly.experts_gate_up, e * 2 * Ie * Dm};
        where[q + "up_proj.weight"] = Where{nullptr, &ly.experts_gate_up, e * 2 * Ie * Dm + Ie * Dm};
        where[q + "down_proj.weight"] = Where{nullptr, &ly.experts_down, e * Dm * Ie};
      }
      if (c.n_shared_experts > 0) {
        const int64_t Is = Ie * c.n_shared_experts;
        ly.shared_gate_up.n = 2 * Is * Dm;
        where[p + "mlp.shared_experts.gate_proj.weight"] = Where{nullptr, &ly.shared_gate_up, 0};
        where[p + "mlp.shared_experts.up_proj.weight"] = Where{nullptr, &ly.shared_gate_up, Is * Dm};
        mreg(ly.shared_down, Dm * Is, "mlp.shared_experts.down_proj.weight");
      }
    }
    ly.cache.assign((size_t)(max_seq_len * (C + R)), 0.f);
  }
  for (const WeightSpec& s : model_weight_specs(c)) {
    Slot slot;
    slot.shape = s.shape;
    auto it = where.find(s.name);
    if (it != where.end()) {
      slot.dst = it->second.dst;
      slot.w = it->second.w;
      slot.off = it->second.off;
    } else if (s.name.find("self_attn.kv_b_proj.weight") != std::string::npos) {
      slot.kind = kKvB;
      slot.layer = std::stoll(s.name.substr(13));  // after "model.layers."
    } else {
      throw RuntimeFailure("CpuModel: internal error, no storage for " + s.name);
    }
    slots_.emplace(s.name, std::move(slot));
    slot_order_.push_back(s.name);
  }
  lm_head_w_ = c.tie_word_embeddings ? &embed_ : &lm_head_;
}

std::vector<CpuModel::Weight*> CpuModel::weights() {
  std::vector<Weight*> v{&embed_};
  if (lm_head_w_ == &lm_head_) v.push_back(&lm_head_);
  for (Layer& ly : layers_)
    for (Weight* w : {&ly.q_a, &ly.q_b, &ly.q_proj, &ly.kv_a, &ly.w_uk, &ly.w_uv, &ly.o_proj, &ly.mlp_gate_up, &ly.mlp_down,
                      &ly.router, &ly.experts_gate_up, &ly.experts_down, &ly.shared_gate_up, &ly.shared_down})
      if (w->n > 0) v.push_back(w);
  return v;
}

namespace {
// The pieces store() takes: float32 values (exactly BF16 or not) or BF16 bits (always exact).
bool bf16_exact_piece(const float* p, int64_t n) { return bf16_exact(p, n); }
bool bf16_exact_piece(const uint16_t*, int64_t) { return true; }
void bf16_piece(const float* p, int64_t n, uint16_t* out) { bf16_high_halves(p, n, out); }
void bf16_piece(const uint16_t* p, int64_t n, uint16_t* out) { std::memcpy(out, p, (size_t)n * sizeof(uint16_t)); }
void copy_widened(float* dst, const float* src, int64_t n) { std::memcpy(dst, src, (size_t)n * sizeof(float)); }
void copy_widened(float* dst, const uint16_t* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = bf16_widen(src[i]);
}
}  // namespace

void CpuModel::widen_held(Weight& w) {
  if (!w.f.empty()) return;
  w.f.assign((size_t)w.n, 0.f);  // zeros where nothing arrived yet
  copy_widened(w.f.data(), w.h.data(), (int64_t)w.h.size());
}

template <class T>
void CpuModel::store(Weight& w, int64_t off, const T* data, int64_t n) {
  if (n <= 0) return;
  if (!w.q.empty()) unpack_int4(w);  // a piece of another form: the matrix leaves the packed form
  if (bf16_mode_ == Bf16Weights::kOnly && w.f.empty() && bf16_exact_piece(data, n)) {
    if (w.h.empty()) w.h.assign((size_t)w.n, 0);
    bf16_piece(data, n, w.h.data() + off);
    return;
  }
  widen_held(w);  // FP32 from now on
  copy_widened(w.f.data() + off, data, n);
  w.h.clear();  // (kCopies: a stale copy; made again at finalize)
  w.h.shrink_to_fit();
}

void CpuModel::hold(Weight& w, bool final) {
  if (w.empty()) return;
  if (!w.q.empty()) {
    if (bf16_mode_ == Bf16Weights::kOnly) return;  // packed 4-bit stays packed
    unpack_int4(w);
  }
  // (no scan of the values in kOff: every matrix is FP32 there)
  const bool exact = bf16_mode_ != Bf16Weights::kOff && (w.f.empty() || bf16_exact(w.f.data(), w.n));
  if (!exact) {
    widen_held(w);
    w.h.clear();
    w.h.shrink_to_fit();
    return;
  }
  if (w.h.empty() && (bf16_mode_ == Bf16Weights::kOnly || (final && w.gemm))) {
    w.h.resize((size_t)w.n);
    bf16_high_halves(w.f.data(), w.n, w.h.data());
  }
  if (bf16_mode_ == Bf16Weights::kOnly) {
    w.f.clear();
    w.f.shrink_to_fit();
  } else {  // kCopies: FP32 beside the bits
    widen_held(w);
  }
  if (bf16_mode_ == Bf16Weights::kCopies && !w.gemm) {  // a lookup table needs no copy
    w.h.clear();
    w.h.shrink_to_fit();
  }
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
// AVX-512: a group's 16 values computed in one vector (the same multiply and rounding as bf16_round),
// then 16 weights a step: 8 bytes split into their nibbles, interleaved (element 2j = low nibble of byte
// j), widened to 16 indices and looked up in the table by one permute.
__attribute__((target("avx512f,avx512bw,avx512vl,avx2"))) static void dequant_row_avx512(const uint8_t* q,
                                                                                        const float* sc, int64_t K,
                                                                                        int64_t g, float* d) {
  const __m512 ints = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
  const __m512i half = _mm512_set1_epi32(0x7FFF), one = _mm512_set1_epi32(1), top = _mm512_set1_epi32((int)0xFFFF0000u);
  const __m128i low4 = _mm_set1_epi8(0x0F);
  for (int64_t k0 = 0; k0 < K; k0 += g) {
    const __m512i u = _mm512_castps_si512(_mm512_mul_ps(ints, _mm512_set1_ps(sc[k0 / g])));
    const __m512i r = _mm512_and_si512(
        _mm512_add_epi32(u, _mm512_add_epi32(half, _mm512_and_si512(_mm512_srli_epi32(u, 16), one))), top);
    const __m512 table = _mm512_castsi512_ps(r);
    for (int64_t k = k0; k < k0 + g; k += 16) {
      const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + k / 2));
      const __m128i lo = _mm_and_si128(b, low4), hi = _mm_and_si128(_mm_srli_epi16(b, 4), low4);
      const __m512i idx = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi));
      _mm512_storeu_ps(d + k, _mm512_permutexvar_ps(idx, table));
    }
  }
}

// AVX2: the same, the 16 values in two 8-float halves: each index looked up in both by a permute of its
// low 3 bits, the half chosen by its bit 3 (moved to the sign bit for the blend).
__attribute__((target("avx2,fma"), always_inline)) static inline __m256 bf16_round_avx2(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  return _mm256_castsi256_ps(_mm256_and_si256(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb)),
                                              _mm256_set1_epi32((int)0xFFFF0000u)));
}

__attribute__((target("avx2,fma"), always_inline)) static inline __m256 lookup16_avx2(__m256 lo, __m256 hi, __m256i idx) {
  const __m256 sel = _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28));  // bit 3 -> the sign bit
  return _mm256_blendv_ps(_mm256_permutevar8x32_ps(lo, idx), _mm256_permutevar8x32_ps(hi, idx), sel);
}

__attribute__((target("avx2,fma"))) static void dequant_row_avx2(const uint8_t* q, const float* sc, int64_t K,
                                                                 int64_t g, float* d) {
  const __m256 ints_lo = _mm256_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1), ints_hi = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
  const __m128i low4 = _mm_set1_epi8(0x0F);
  for (int64_t k0 = 0; k0 < K; k0 += g) {
    const __m256 s = _mm256_set1_ps(sc[k0 / g]);
    const __m256 tlo = bf16_round_avx2(_mm256_mul_ps(ints_lo, s)), thi = bf16_round_avx2(_mm256_mul_ps(ints_hi, s));
    for (int64_t k = k0; k < k0 + g; k += 16) {
      const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + k / 2));
      const __m128i lo = _mm_and_si128(b, low4), hi = _mm_and_si128(_mm_srli_epi16(b, 4), low4);
      const __m128i x = _mm_unpacklo_epi8(lo, hi);  // 16 indices, element order
      _mm256_storeu_ps(d + k, lookup16_avx2(tlo, thi, _mm256_cvtepu8_epi32(x)));
      _mm256_storeu_ps(d + k + 8, lookup16_avx2(tlo, thi, _mm256_cvtepu8_epi32(_mm_srli_si128(x, 8))));
    }
  }
}
#endif

CpuModel::DequantIsa CpuModel::dequant_isa(int64_t g) {
  // The vector lookups where the skinny kernels run, in their ISA (KDTREE_CPU_ISA=avx2 /
  // sgemm_set_skinny_isa("avx2") take the AVX2 one); with the portable SGEMM forced, or no AVX2, the
  // scalar loop (what the tests check the vector ones against).
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  if (g % 16 == 0 && sgemm_skinny_takes(1, 16, 16))
    return std::strcmp(sgemm_skinny_isa(), "avx512") == 0 ? DequantIsa::kAvx512 : DequantIsa::kAvx2;
#else
  (void)g;
#endif
  return DequantIsa::kScalar;
}

void CpuModel::dequant_rows(const Weight& w, int64_t off, int64_t rows, int64_t K, int64_t ldw, float* dst,
                            DequantIsa isa) {
  // per group of qg weights along a row: the 16 values its nibbles stand for, then a lookup a weight
  const int64_t g = w.qg;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  if (isa != DequantIsa::kScalar) {
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t e0 = off + r * ldw;
      if (isa == DequantIsa::kAvx512) dequant_row_avx512(w.q.data() + e0 / 2, w.qs.data() + e0 / g, K, g, dst + r * K);
      else dequant_row_avx2(w.q.data() + e0 / 2, w.qs.data() + e0 / g, K, g, dst + r * K);
    }
    return;
  }
#else
  (void)isa;
#endif
  float table[16];
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t e0 = off + r * ldw;  // a multiple of g (rows start on group boundaries), so even
    const uint8_t* q = w.q.data() + e0 / 2;
    const float* sc = w.qs.data() + e0 / g;
    float* d = dst + r * K;
    for (int64_t k0 = 0; k0 < K; k0 += g) {
      const float s = sc[k0 / g];
      for (int j = 0; j < 16; ++j) table[j] = bf16_round((float)(j - 8) * s);
      for (int64_t k = k0; k < k0 + g; k += 2) {
        const uint8_t b = q[k / 2];
        d[k] = table[b & 15];
        d[k + 1] = table[b >> 4];
      }
    }
  }
}

void CpuModel::unpack_int4(Weight& w) {
  std::vector<float> v((size_t)w.n);
  dequant_rows(w, 0, 1, w.n, w.n, v.data(), dequant_isa(w.qg));  // one "row" of n: groups run along it
  w.q.clear();
  w.q.shrink_to_fit();
  w.qs.clear();
  w.qs.shrink_to_fit();
  w.qg = 0;
  if (bf16_mode_ == Bf16Weights::kOnly) {  // the values are exactly BF16
    w.h.resize((size_t)w.n);
    bf16_high_halves(v.data(), w.n, w.h.data());
  } else {
    w.f = std::move(v);
  }
}

void CpuModel::store_int4(Weight& w, int64_t off, const uint8_t* packed, const float* scales, int64_t g, int64_t n) {
  if (n <= 0) return;
  const bool keep = bf16_mode_ == Bf16Weights::kOnly && w.f.empty() && w.h.empty() && (w.qg == 0 || w.qg == g) &&
                    off % g == 0 && n % g == 0 && w.n % g == 0;
  if (!keep) {  // dequantized on arrival
    Weight piece;
    piece.n = n;
    piece.qg = g;
    piece.q.assign(packed, packed + n / 2);
    piece.qs.assign(scales, scales + n / g);
    std::vector<float> v((size_t)n);
    dequant_rows(piece, 0, 1, n, n, v.data(), dequant_isa(g));
    store(w, off, v.data(), n);
    return;
  }
  if (w.q.empty()) {
    w.q.assign((size_t)(w.n / 2), 0x88);  // nibble 8: the integer 0 (zeros where nothing arrived yet)
    w.qs.assign((size_t)(w.n / g), 0.f);
    w.qg = g;
  }
  std::memcpy(w.q.data() + off / 2, packed, (size_t)(n / 2));
  std::memcpy(w.qs.data() + off / g, scales, (size_t)(n / g) * sizeof(float));
}

void CpuModel::set_weight_int4(const std::string& name, const uint8_t* packed, const float* scales, int64_t group,
                               const std::vector<int64_t>& shape) {
  std::lock_guard<std::mutex> lock(mu_);
  ++epoch_;
  int64_t n = 0;
  Slot& s = slot_for(name, shape, &n);
  if (s.kind != kCopy || s.w == nullptr || s.w == &embed_ || shape.size() != 2)  // (the embedding is looked up)
    throw Error("set_weight_int4: '" + name + "' is not a weight matrix the CPU model takes packed");
  const int64_t K = shape[1];
  if (group <= 0 || group % 2 || K % group)
    throw Error("set_weight_int4: '" + name + "': group size " + std::to_string(group) + " must be even and divide " +
                "the input width " + std::to_string(K));
  if (n > 0 && (packed == nullptr || scales == nullptr)) throw Error("set_weight_int4: null data for '" + name + "'");
  // the loader's checks: finite scales, and no weight overflowing BF16
  const std::string bad = int4_groups_problem(name, packed, scales, group, n);
  if (!bad.empty()) throw Error(bad);
  store_int4(*s.w, s.off, packed, scales, group, n);
  s.set = true;
  finalized_ = false;
}

int64_t CpuModel::int4_weight_bytes() const {
  int64_t n = 0;
  for (Weight* w : const_cast<CpuModel*>(this)->weights()) n += (int64_t)(w->q.size() + w->qs.size() * sizeof(float));
  return n;
}

CpuModel::Slot& CpuModel::slot_for(const std::string& name, const std::vector<int64_t>& shape, int64_t* n) {
  auto it = slots_.find(name);
  if (it == slots_.end()) {
    std::string hint;
    if (name == "lm_head.weight" && cfg_.tie_word_embeddings) hint = " (tie_word_embeddings: the embedding is used)";
    throw Error("set_weight: unexpected tensor '" + name + "' for this config" + hint);
  }
  Slot& s = it->second;
  if (shape != s.shape)
    throw Error("set_weight: '" + name + "' has shape " + shape_str(shape) + ", the config needs " +
                shape_str(s.shape));
  *n = 1;
  for (int64_t d : shape) *n *= d;
  return s;
}

template <class T>
void CpuModel::set_any(const std::string& name, const T* data, const std::vector<int64_t>& shape) {
  std::lock_guard<std::mutex> lock(mu_);
  ++epoch_;
  int64_t n = 0;
  Slot& s = slot_for(name, shape, &n);
  if (n > 0 && data == nullptr) throw Error("set_weight: null data for '" + name + "'");
  if (s.kind == kCopy) {
    if (s.w) store(*s.w, s.off, data, n);
    else copy_widened(s.dst, data, n);
  } else {
    // kv_b_proj [H*(Dn+Dv), C]: per head h, rows [0, Dn) are W_UK[h] (latent -> k_nope) and
    // rows [Dn, Dn+Dv) are W_UV[h] (latent -> v). Stored split: w_uk [H, Dn, C], w_uv [H, Dv, C].
    Layer& ly = layers_[(size_t)s.layer];
    const int64_t H = cfg_.num_attention_heads, C = cfg_.kv_lora_rank;
    const int64_t Dn = cfg_.qk_nope_head_dim, Dv = cfg_.v_head_dim;
    for (int64_t h = 0; h < H; ++h) {
      const T* src = data + h * (Dn + Dv) * C;
      store(ly.w_uk, h * Dn * C, src, Dn * C);
      store(ly.w_uv, h * Dv * C, src + Dn * C, Dv * C);
    }
  }
  s.set = true;
  finalized_ = false;
}

void CpuModel::set_weight(const std::string& name, const float* data, const std::vector<int64_t>& shape) {
  set_any(name, data, shape);
}

void CpuModel::set_weight_bf16(const std::string& name, const uint16_t* bits, const std::vector<int64_t>& shape) {
  set_any(name, bits, shape);
}

std::vector<std::string> CpuModel::missing_weights() const { return unset_slots(slot_order_, slots_); }

void CpuModel::finalize() {
  std::vector<std::string> missing = missing_weights();
  std::lock_guard<std::mutex> lock(mu_);
  ++epoch_;
  check_no_missing_weights(missing);
  // The absorbed matrices W_UK / W_UV were split from kv_b_proj as it arrived (set_weight); what
  // is left is holding each weight matrix as the mode says (kCopies: the copies are made here). The
  // cache starts empty.
  for (Weight* w : weights()) hold(*w, true);
  finalized_ = true;
  cache_len_ = 0;
  pending_ = 0;
}

void CpuModel::reset() {
  std::lock_guard<std::mutex> lock(mu_);
  ++epoch_;
  cache_len_ = 0;
  pending_ = 0;
}

void CpuModel::ensure_workspace(int64_t T) {
  const ModelConfig& c = cfg_;
  const int64_t Dm = c.hidden_size, H = c.num_attention_heads, C = c.kv_lora_rank, R = c.qk_rope_head_dim;
  if (scores_.empty()) {
    // Room for one query token against the whole cache, or kScoresBudget, whichever is larger.
    scores_.resize((size_t)std::max<int64_t>(H * max_seq_len_, std::min<int64_t>(kScoresBudget, H * max_seq_len_ * max_seq_len_)));
  }
  if (T <= ws_T_) return;
  const int64_t I = std::max({c.first_k_dense_replace > 0 ? c.intermediate_size : 0, c.moe_intermediate_size,
                              c.moe_intermediate_size * std::max<int64_t>(c.n_shared_experts, 0)});
  const int64_t E = c.n_routed_experts, K = c.num_experts_per_tok, G = std::max<int64_t>(c.n_group, 1);
  grow(x_, T * Dm);
  grow(hn_, T * Dm);
  grow(qa_, T * c.q_lora_rank);
  grow(q_, T * H * c.qk_head_dim());
  grow(kv_, T * (C + R));
  grow(qfull_, T * H * (C + R));
  grow(cs_, T * R);
  grow(olat_, T * H * C);
  grow(ov_, T * H * c.v_head_dim);
  grow(mlp_out_, T * Dm);
  grow(gu_, T * 2 * I);
  grow(act_, T * I);
  grow(xe_, T * std::max<int64_t>(K, 1) * Dm);
  grow(ye_, T * std::max<int64_t>(K, 1) * Dm);
  if (E > 0) {
    grow(router_logits_, T * E);
    grow(biased_, T * E);
    grow(group_score_, T * G);
    grow(group_sel_, T * G);
    grow(topk_idx_, T * K);
    grow(topk_w_, T * K);
    grow(expert_count_, E + 1);
    grow(expert_tok_, T * K);
    grow(expert_w_, T * K);
    grow(expert_active_, E);
    grow(egu_, T * K * 2 * c.moe_intermediate_size);
    grow(eact_, T * K * c.moe_intermediate_size);
  }
  ws_T_ = T;
}

void CpuModel::forward(const int32_t* tokens, const int32_t* positions, const uint8_t* visibility, int64_t T,
                       float* logits_out) {
  run(tokens, positions, visibility, T, T, logits_out);
}

void CpuModel::forward_last(const int32_t* tokens, const int32_t* positions, const uint8_t* visibility, int64_t T,
                            int64_t rows, float* logits_out) {
  if (rows < 0 || rows > T)
    throw Error("forward_last: rows " + std::to_string(rows) + " outside [0, T = " + std::to_string(T) + "]");
  run(tokens, positions, visibility, T, rows, logits_out);
}

namespace {
// no visibility, or exactly the causal one (token i sees tokens 0..i of the window): a prefill chunk
bool causal_window(const uint8_t* vis, int64_t T) {
  if (!vis) return true;
  for (int64_t i = 0; i < T; ++i)
    for (int64_t j = 0; j < T; ++j)
      if ((vis[i * T + j] != 0) != (j <= i)) return false;
  return true;
}
}  // namespace

void CpuModel::run(const int32_t* tokens, const int32_t* positions, const uint8_t* visibility, int64_t T, int64_t rows,
                   float* logits_out) {
  std::lock_guard<std::mutex> lock(mu_);
  ++epoch_;
  check_forward_args(*this, tokens, positions, T);
  ensure_workspace(T);
  const ModelConfig& c = cfg_;
  const int64_t Dm = c.hidden_size;
  pending_ = 0;  // the previous uncommitted window is overwritten
  exact_window_ = T <= kRowExactWindow || !causal_window(visibility, T);

  float* x = x_.data();
  for (int64_t t = 0; t < T; ++t) {
    const int64_t row = (int64_t)tokens[t] * Dm;
    if (!embed_.f.empty()) {
      std::memcpy(x + t * Dm, embed_.f.data() + row, (size_t)Dm * sizeof(float));
    } else {
      const uint16_t* h = embed_.h.data() + row;
      for (int64_t i = 0; i < Dm; ++i) x[t * Dm + i] = bf16_widen(h[i]);
    }
  }

  for (Layer& ly : layers_) {
    KD_PARALLEL_FOR_IF(T * Dm >= kParallelWork)
    for (int64_t t = 0; t < T; ++t) rmsnorm_row(x + t * Dm, ly.input_ln.data(), Dm, c.rms_norm_eps, hn_.data() + t * Dm);
    attention(ly, positions, visibility, T);  // x += attn(hn)
    KD_PARALLEL_FOR_IF(T * Dm >= kParallelWork)
    for (int64_t t = 0; t < T; ++t) rmsnorm_row(x + t * Dm, ly.post_ln.data(), Dm, c.rms_norm_eps, hn_.data() + t * Dm);
    if (ly.moe) moe_mlp(ly, T);
    else dense_mlp(ly, T);
    const float* o = mlp_out_.data();
    KD_PARALLEL_FOR_IF(T * Dm >= kParallelWork)
    for (int64_t i = 0; i < T * Dm; ++i) x[i] += o[i];
  }
  const int64_t t0 = T - rows;  // the LM head over the last `rows` tokens
  KD_PARALLEL_FOR_IF(rows * Dm >= kParallelWork)
  for (int64_t t = t0; t < T; ++t) rmsnorm_row(x + t * Dm, final_ln_.data(), Dm, c.rms_norm_eps, hn_.data() + t * Dm);
  if (rows > 0) wgemm(rows, c.vocab_size, Dm, hn_.data() + t0 * Dm, Dm, *lm_head_w_, 0, Dm, logits_out, c.vocab_size);
  pending_ = T;
}

void CpuModel::attention(Layer& ly, const int32_t* positions, const uint8_t* vis, int64_t T) {
  const ModelConfig& c = cfg_;
  const int64_t Dm = c.hidden_size, H = c.num_attention_heads, C = c.kv_lora_rank, R = c.qk_rope_head_dim;
  const int64_t Dn = c.qk_nope_head_dim, Dv = c.v_head_dim, Dqk = c.qk_head_dim(), CR = C + R, half = R / 2;
  const int64_t L = cache_len_, S = L + T;
  const float* hn = hn_.data();
  float* q = q_.data();
  float* kv = kv_.data();
  float* qf = qfull_.data();
  float* cs = cs_.data();
  float* cache = ly.cache.data();

  // Projections over all T tokens.
  if (c.q_lora_rank > 0) {
    const int64_t qr = c.q_lora_rank;
    wgemm(T, qr, Dm, hn, Dm, ly.q_a, 0, Dm, qa_.data(), qr);
    for (int64_t t = 0; t < T; ++t) rmsnorm_row(qa_.data() + t * qr, ly.q_a_ln.data(), qr, c.latent_norm_eps, qa_.data() + t * qr);
    wgemm(T, H * Dqk, qr, qa_.data(), qr, ly.q_b, 0, qr, q, H * Dqk);
  } else {
    wgemm(T, H * Dqk, Dm, hn, Dm, ly.q_proj, 0, Dm, q, H * Dqk);
  }
  wgemm(T, CR, Dm, hn, Dm, ly.kv_a, 0, Dm, kv, CR);

  // RoPE tables, the new cache rows (normed latent | roped k_rope) and the roped query parts.
  KD_PARALLEL_FOR_IF(T * H * R >= kParallelWork)
  for (int64_t t = 0; t < T; ++t) {
    float* cst = cs + t * R;
    rope_cos_sin(positions[t], c.rope_inv_freq.data(), half, c.rope_attention_factor, cst);
    float* row = cache + (L + t) * CR;
    rmsnorm_row(kv + t * CR, ly.kv_a_ln.data(), C, c.latent_norm_eps, row);
    rope_row(kv + t * CR + C, cst, half, c.rope_interleave, row + C);
    for (int64_t h = 0; h < H; ++h)
      rope_row(q + t * H * Dqk + h * Dqk + Dn, cst, half, c.rope_interleave, qf + (t * H + h) * CR + C);
  }
  // Absorption: q_lat[:, h, :] = q_nope[:, h, :] @ W_UK[h]  ([T,Dn] @ [Dn,C]).
  for (int64_t h = 0; h < H; ++h)
    wgemm(T, C, Dn, q + h * Dqk, H * Dqk, ly.w_uk, h * Dn * C, C, qf + h * CR, H * CR, /*trans_b=*/false);

  // Scores over [committed cache | visible new tokens], in query chunks bounded by kScoresBudget.
  const int64_t chunk = std::max<int64_t>(1, std::min<int64_t>(T, (int64_t)scores_.size() / (H * S)));
  const float scale = (float)c.softmax_scale;
  // (row-exact windows, trees of any size among them: the skinny kernels whatever tc * H and Sc, cpu_model.h)
  const auto gemm = exact_window_ ? sgemm_rows_exact : sgemm;
  for (int64_t t0 = 0; t0 < T; t0 += chunk) {
    const int64_t tc = std::min(chunk, T - t0);
    int64_t jmax = -1;  // last new token any query of the chunk sees
    for (int64_t t = t0; t < t0 + tc; ++t) {
      if (!vis) { jmax = std::max(jmax, t); continue; }
      for (int64_t j = T - 1; j > jmax; --j)
        if (vis[t * T + j]) { jmax = j; break; }
    }
    const int64_t Sc = L + jmax + 1;
    float* olat = olat_.data() + t0 * H * C;
    if (Sc == 0) {  // nothing visible at all: attention output 0
      std::fill(olat, olat + tc * H * C, 0.f);
      continue;
    }
    float* sc = scores_.data();
    gemm(true, tc * H, Sc, CR, scale, qf + t0 * H * CR, CR, cache, CR, 0.f, sc, Sc);
    KD_PARALLEL_FOR_IF(tc * H * Sc >= kParallelWork)
    for (int64_t r = 0; r < tc * H; ++r) {
      const int64_t t = t0 + r / H;
      float* s = sc + r * Sc;
      float* win = s + L;  // the window's Sc - L entries
      const int64_t nw = Sc - L;
      if (!vis) {  // causal: the visible entries are a prefix; the masked ones after it change nothing
        for (int64_t j = t + 1; j < nw; ++j) win[j] = kNegInf;
        softmax_row(s, Sc);
        continue;
      }
      // A tree: the visible window entries (the node's ancestors and itself) moved to the window's
      // front, in order, for the softmax, then back to their places (zeros elsewhere). The softmax
      // sums its lanes by index, so an entry must sit where it sits in the AR step's row (committed
      // tokens, then the path one by one) for the row to come out the same bits
      // (kRowExactWindow); P @ V then meets the same products in the same order, with exact zeros
      // between them.
      int64_t w = 0;
      for (int64_t j = 0; j < nw; ++j)
        if (vis[t * T + j]) win[w++] = win[j];  // (w <= j: a forward copy)
      softmax_row(s, L + w);
      for (int64_t k = w; k < nw; ++k) win[k] = 0.f;
      for (int64_t j = nw - 1, k = w - 1; k >= 0; --j) {  // back to the places, the last first
        if (!vis[t * T + j]) continue;                   // (j >= k: the destination is past every
        const float p = win[k];                          // compacted entry still to move)
        win[k] = 0.f;
        win[j] = p;
        --k;
      }
    }
    gemm(false, tc * H, C, Sc, 1.f, sc, Sc, cache, CR, 0.f, olat, C);
  }
  // Values: o[:, h, :] = o_lat[:, h, :] @ W_UV[h]^T, then o_proj; x += out.
  for (int64_t h = 0; h < H; ++h)
    wgemm(T, Dv, C, olat_.data() + h * C, H * C, ly.w_uv, h * Dv * C, C, ov_.data() + h * Dv, H * Dv);
  float* out = mlp_out_.data();
  wgemm(T, Dm, H * Dv, ov_.data(), H * Dv, ly.o_proj, 0, H * Dv, out, Dm);
  float* x = x_.data();
  KD_PARALLEL_FOR_IF(T * Dm >= kParallelWork)
  for (int64_t i = 0; i < T * Dm; ++i) x[i] += out[i];
}

void CpuModel::swiglu_mlp(const float* x, int64_t n, const Weight& gate_up, int64_t gu_off, const Weight& down,
                          int64_t down_off, int64_t I, float* y, float* gu, float* act) {
  const int64_t Dm = cfg_.hidden_size;
  wgemm(n, 2 * I, Dm, x, Dm, gate_up, gu_off, Dm, gu, 2 * I);
  KD_PARALLEL_FOR_IF(n * I >= kParallelWork)
  for (int64_t r = 0; r < n; ++r) swiglu_row(gu + r * 2 * I, I, act + r * I);
  wgemm(n, Dm, I, act, I, down, down_off, I, y, Dm);
}

void CpuModel::dense_mlp(const Layer& ly, int64_t T) {
  swiglu_mlp(hn_.data(), T, ly.mlp_gate_up, 0, ly.mlp_down, 0, cfg_.intermediate_size, mlp_out_.data(), gu_.data(),
             act_.data());
}

// Router, exactly as HF DeepseekV3TopkRouter: sigmoid scores; selection on scores + bias with
// group-limited top-k (group score = sum of its top-2 biased scores; experts outside the
// topk_group best groups are excluded); weights = unbiased scores of the chosen experts,
// normalised (+1e-20) when norm_topk_prob, times routed_scaling_factor. Ties: lower index first.
void CpuModel::route(const Layer& ly, int64_t T) {
  const ModelConfig& c = cfg_;
  const int64_t Dm = c.hidden_size, E = c.n_routed_experts, K = c.num_experts_per_tok;
  const int64_t G = c.n_group, per = E / G, TG = c.topk_group;
  float* logits = router_logits_.data();
  wgemm(T, E, Dm, hn_.data(), Dm, ly.router, 0, Dm, logits, E);
  const float* bias = ly.router_bias.data();
  const float rsf = (float)c.routed_scaling_factor;
  KD_PARALLEL_FOR_IF(T * E >= kParallelWork)
  for (int64_t t = 0; t < T; ++t) {
    float* s = logits + t * E;  // becomes the sigmoid scores
    float* b = biased_.data() + t * E;
    float* gs = group_score_.data() + t * G;
    uint8_t* gsel = group_sel_.data() + t * G;
    for (int64_t e = 0; e < E; ++e) {
      s[e] = 1.f / (1.f + std::exp(-s[e]));
      b[e] = s[e] + bias[e];
    }
    for (int64_t g = 0; g < G; ++g) {
      const float* bg = b + g * per;
      int64_t i1 = 0;
      for (int64_t i = 1; i < per; ++i)
        if (bg[i] > bg[i1]) i1 = i;
      int64_t i2 = (i1 == 0) ? 1 : 0;
      for (int64_t i = 0; i < per; ++i)
        if (i != i1 && bg[i] > bg[i2]) i2 = i;
      gs[g] = bg[i1] + bg[i2];
      gsel[g] = 0;
    }
    for (int64_t k = 0; k < TG; ++k) {
      int64_t best = -1;
      for (int64_t g = 0; g < G; ++g)
        if (!gsel[g] && (best < 0 || gs[g] > gs[best])) best = g;
      gsel[best] = 1;
    }
    int32_t* idx = topk_idx_.data() + t * K;
    float* w = topk_w_.data() + t * K;
    float sum = 0.f;
    for (int64_t k = 0; k < K; ++k) {
      int64_t best = -1;
      for (int64_t e = 0; e < E; ++e) {
        if (!gsel[e / per]) continue;  // outside the chosen groups (HF: masked to -inf)
        bool taken = false;
        for (int64_t j = 0; j < k; ++j) taken |= (idx[j] == e);
        if (taken) continue;
        if (best < 0 || b[e] > b[best]) best = e;
      }
      idx[k] = (int32_t)best;
      w[k] = s[best];
      sum += s[best];
    }
    if (c.norm_topk_prob) {
      const float den = sum + 1e-20f;
      for (int64_t k = 0; k < K; ++k) w[k] /= den;
    }
    for (int64_t k = 0; k < K; ++k) w[k] *= rsf;
  }
}

void CpuModel::moe_mlp(const Layer& ly, int64_t T) {
  const ModelConfig& c = cfg_;
  const int64_t Dm = c.hidden_size, E = c.n_routed_experts, K = c.num_experts_per_tok, Ie = c.moe_intermediate_size;
  route(ly, T);
  // Group the (token, expert) assignments by expert: counting sort, tokens ascending per expert.
  int32_t* off = expert_count_.data();
  std::fill(off, off + E + 1, 0);
  for (int64_t i = 0; i < T * K; ++i) ++off[topk_idx_[i] + 1];
  for (int64_t e = 0; e < E; ++e) off[e + 1] += off[e];
  for (int64_t t = 0; t < T; ++t)
    for (int64_t k = 0; k < K; ++k) {
      const int32_t e = topk_idx_[t * K + k];
      // slot: off[e] counts up while filling, restored below
      expert_tok_[off[e]] = (int32_t)t;
      expert_w_[off[e]] = topk_w_[t * K + k];
      ++off[e];
    }
  for (int64_t e = E; e > 0; --e) off[e] = off[e - 1];
  off[0] = 0;

  // Every assignment's input row, grouped by expert: xe_[j] = hn[expert_tok_[j]].
  const int64_t A = T * K;
  for (int64_t j = 0; j < A; ++j)
    std::memcpy(xe_.data() + j * Dm, hn_.data() + (int64_t)expert_tok_[j] * Dm, (size_t)Dm * sizeof(float));
  // Routed experts: one fused SwiGLU (two GEMMs) over each expert's rows, in that expert's own rows
  // of the expert workspaces. Independent of each other, so they are shared out whole among the
  // pool's threads (parallel.h: one hand-off per layer instead of two per expert; a GEMM inside a
  // shared-out expert runs on its thread alone). The arithmetic of every row is the same either way.
  int32_t* active = expert_active_.data();
  int64_t n_active = 0;
  for (int64_t e = 0; e < E; ++e)
    if (off[e + 1] > off[e]) active[n_active++] = (int32_t)e;
  auto run_expert = [&](int64_t i) {
    const int64_t e = active[i], r0 = off[e], n = off[e + 1] - off[e];
    swiglu_mlp(xe_.data() + r0 * Dm, n, ly.experts_gate_up, e * 2 * Ie * Dm, ly.experts_down, e * Dm * Ie, Ie,
               ye_.data() + r0 * Dm, egu_.data() + r0 * 2 * Ie, eact_.data() + r0 * Ie);
  };
  parallel_chunks(n_active, run_expert);
  // Weighted sum into each token's row, in ascending expert order (HF's index_add order).
  float* out = mlp_out_.data();
  std::fill(out, out + T * Dm, 0.f);
  for (int64_t j = 0; j < A; ++j) {
    float* o = out + (int64_t)expert_tok_[j] * Dm;
    const float* y = ye_.data() + j * Dm;
    const float wr = expert_w_[j];
    for (int64_t i = 0; i < Dm; ++i) o[i] += y[i] * wr;
  }
  if (c.n_shared_experts > 0) {
    swiglu_mlp(hn_.data(), T, ly.shared_gate_up, 0, ly.shared_down, 0, Ie * c.n_shared_experts, ye_.data(),
               gu_.data(), act_.data());
    const float* y = ye_.data();
    KD_PARALLEL_FOR_IF(T * Dm >= kParallelWork)
    for (int64_t i = 0; i < T * Dm; ++i) out[i] += y[i];
  }
}

void CpuModel::commit(const int32_t* keep, int64_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  ++epoch_;
  check_commit_args(*this, keep, n);
  const int64_t CR = cfg_.kv_lora_rank + cfg_.qk_rope_head_dim, L = cache_len_;
  for (Layer& ly : layers_) {
    float* cache = ly.cache.data();
    for (int64_t j = 0; j < n; ++j)  // keep[j] >= j: copying forward never clobbers a later source
      if (keep[j] != j) std::memcpy(cache + (L + j) * CR, cache + (L + keep[j]) * CR, (size_t)CR * sizeof(float));
  }
  cache_len_ += n;
  pending_ = 0;
}

void CpuModel::truncate(int64_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  ++epoch_;
  check_truncate_args(*this, n);
  cache_len_ = n;  // rows past n are simply overwritten by later forwards
  pending_ = 0;
}

void CpuModel::read_cache(int64_t layer, int64_t begin, int64_t n, float* out) const {
  if (layer < 0 || layer >= cfg_.num_hidden_layers) throw Error("read_cache: layer out of range");
  if (begin < 0 || n < 0 || begin + n > cache_len_ + pending_)
    throw Error("read_cache: rows [" + std::to_string(begin) + ", " + std::to_string(begin + n) +
                ") outside the filled cache [0, " + std::to_string(cache_len_ + pending_) + ")");
  const int64_t CR = cfg_.kv_lora_rank + cfg_.qk_rope_head_dim;
  std::memcpy(out, layers_[(size_t)layer].cache.data() + begin * CR, (size_t)(n * CR) * sizeof(float));
}

void CpuModel::set_bf16_weights(Bf16Weights mode) {
  std::lock_guard<std::mutex> lock(mu_);
  ++epoch_;
  bf16_mode_ = mode;
  for (Weight* w : weights()) hold(*w, finalized_);
}

int64_t CpuModel::bf16_weight_bytes() const {
  int64_t n = 0;
  for (Weight* w : const_cast<CpuModel*>(this)->weights()) n += (int64_t)(w->h.size() * sizeof(uint16_t));
  return n;
}

int64_t CpuModel::fp32_weight_bytes() const {
  int64_t n = 0;
  for (Weight* w : const_cast<CpuModel*>(this)->weights()) n += (int64_t)(w->f.size() * sizeof(float));
  return n;
}

void CpuModel::wgemm(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const Weight& w, int64_t off,
                     int64_t ldw, float* C, int64_t ldc, bool trans_b) const {
  static thread_local std::vector<float> widen_;  // (kept: prefill calls come in series; not in memory_bytes)
  // row-exact windows: the skinny kernels at any row count (kRowExactWindow; at <= 128 rows sgemm takes them anyway)
  const auto gemm = exact_window_ ? sgemm_rows_exact : sgemm;
  const bool packed = !w.q.empty() && trans_b;
  if (!packed) {
    if (!w.h.empty() && sgemm_bf16_weights(M, N, K, 1.f, A, lda, w.h.data() + off, ldw, 0.f, C, ldc, trans_b)) return;
    if (!w.f.empty()) {
      gemm(trans_b, M, N, K, 1.f, A, lda, w.f.data() + off, ldw, 0.f, C, ldc);
      return;
    }
    if (!trans_b) {  // W [K, N] (a head's W_UK: small): widened whole
      if ((int64_t)widen_.size() < K * N) widen_.resize((size_t)(K * N));
      for (int64_t k = 0; k < K; ++k) copy_widened(widen_.data() + k * N, w.h.data() + off + k * ldw, N);
      gemm(false, M, N, K, 1.f, A, lda, widen_.data(), N, 0.f, C, ldc);
      return;
    }
  }
  // Blocks of whole weight rows made FP32 in this thread's buffer, each block one sgemm over its columns
  // of C: BF16 rows widened (BF16 only, a GEMM the skinny kernels do not take: prefill, or the portable
  // kernel forced), or packed 4-bit rows dequantized. sgemm's results do not depend on where a column
  // sits in the call (it shares columns out over threads the same way), so these are the bits of one
  // call on the FP32 matrix. A block is >= 2 MiB or 1024 rows, so the packing of A is spread over enough
  // columns; packed rows where the skinny kernels take the whole shape go 16 at a time (each block takes
  // them too, and its tiles start on the same multiples of 8 and 4 as the whole call's).
  const int64_t rows = packed && sgemm_skinny_takes(M, N, K)
                           ? 16
                           : std::min<int64_t>(N, std::max<int64_t>((int64_t)1 << 19, 1024 * K) / std::max<int64_t>(K, 1));
  const DequantIsa isa = packed ? dequant_isa(w.qg) : DequantIsa::kScalar;
  if ((int64_t)widen_.size() < rows * K) widen_.resize((size_t)(rows * K));
  for (int64_t n0 = 0; n0 < N; n0 += rows) {
    const int64_t nr = std::min(rows, N - n0);
    if (packed) {
      dequant_rows(w, off + n0 * ldw, nr, K, ldw, widen_.data(), isa);
    } else {
      for (int64_t r = 0; r < nr; ++r) copy_widened(widen_.data() + r * K, w.h.data() + off + (n0 + r) * ldw, K);
    }
    gemm(true, M, nr, K, 1.f, A, lda, widen_.data(), K, 0.f, C + n0, ldc);
  }
}

int64_t CpuModel::memory_bytes() const {
  size_t n = final_ln_.size() + (size_t)(bf16_weight_bytes() + fp32_weight_bytes() + int4_weight_bytes()) / sizeof(float);
  for (const Layer& ly : layers_) {
    for (const std::vector<float>* v : {&ly.input_ln, &ly.post_ln, &ly.q_a_ln, &ly.kv_a_ln, &ly.router_bias, &ly.cache})
      n += v->size();
  }
  for (const std::vector<float>* v : {&x_, &hn_, &qa_, &q_, &kv_, &qfull_, &cs_, &scores_, &olat_, &ov_, &mlp_out_,
                                      &gu_, &act_, &xe_, &ye_, &egu_, &eact_, &router_logits_, &topk_w_, &expert_w_, &biased_,
                                      &group_score_})
    n += v->size();
  return (int64_t)(n * sizeof(float));
}

}  // namespace kdtree
