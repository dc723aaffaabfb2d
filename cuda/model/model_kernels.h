// model_kernels.h: the small CUDA kernels of the GPU target model (cuda/model/cuda_model.cpp):
// embedding gather, RMSNorm, the MLA preparation step (latent norm + RoPE + cache write), SwiGLU,
// MoE routing with HF DeepseekV3 semantics, expert grouping (device-side count / scan /
// stable placement, no host work), the grouped expert GEMMs, the MoE combine, and cache
// compaction. The GEMMs over dense weights go through cuBLAS (cuda_model.cpp); the attention
// is verify_attention (cuda/kernels.h). FP32 throughout; each op mirrors its CPU twin in
// cpp/model/ops.cpp / cpu_model.cpp (same formulas, same order of the sequential reductions).
//
// Every launcher takes device pointers + a Params struct + a cudaStream_t, launches
// asynchronously and returns the launch error (cudaErrorInvalidValue for bad sizes).
//
// Legend: T = new tokens, Dm = hidden, H = heads, C = kv_lora_rank, R = rope dim, Dn/Dv = nope /
// value head dims, Dqk = Dn + R, E = routed experts, K = experts per token, G = expert groups,
// A = T*K (token, expert) assignments, N/Kd = GEMM output / reduction dims.
#pragma once
#include <cstdint>

#include <cuda_runtime.h>

namespace kdtree {
namespace cuda {

// ---------------------------------------------------------------- MLA preparation
// Per token t: cache[r0 + t] = [kv_norm_w * rmsnorm(kv[t, :C]) | rope(kv[t, C:C+R])] with r0 =
// row0, or r0 = *row0_dev + row0 when row0_dev is given (the committed length read on the device
// at run time, so that the launch can be captured in a CUDA graph); q_rope[t, h] = rope(q[t, h,
// Dn:Dn+R]). The rotations' cos / sin come from the step's RoPE table cs (EmbedParams::cs). RoPE
// input layout: interleaved pairs or NeoX halves; output layout: halves (HF's for both).
struct MlaPrepParams {
  const float* q;          // [T, ldq] per head h: [nope (Dn) | rope (R)] at h * Dqk
  int ldq;
  const float* kv;         // [T, ldkv] [latent (C) | k_rope (R)]
  int ldkv;
  const float* kv_norm_w;  // [C]
  const float* cs;         // [T, R] per token: cos (R/2) | sin (R/2), times the attention factor
  int T, H, Dn, C, R;
  double eps;              // latent norm eps
  int interleaved;         // 1 = rope_interleave (pairs), 0 = NeoX halves
  float* cache;            // [>= row0 + T, ldc] this layer's latent cache
  int ldc;
  long long row0;          // first cache row written (committed length + chunk offset); with
                           // row0_dev: the offset added to *row0_dev (>= 0 either way)
  float* q_rope;           // [T, H, R]
  const int32_t* row0_dev; // [1] device base row (committed length), or nullptr (default)
  int skip_q = 0;          // 1: the cache rows only (the W_UK product ropes the queries,
                           // LinearParams::rope_out): q is not read (may be null), q_rope not written
  // optional (CudaModel's folded query norm, q_fold): q_scale_out[t] = 1 / rms of the qa_n floats at
  // qa + t * ldqa (with qa_eps, as the rmsnorm kernel computes it): the factor the attention applies to
  // token t's scores, whose queries were projected without that norm
  const float* qa = nullptr;
  int ldqa = 0, qa_n = 0;
  double qa_eps = 0.0;
  float* q_scale_out = nullptr;
};
// whether mla_prep (and linear_skinny's prep blocks, LinearParams::prep_on) accept these parameters
bool mla_prep_params_ok(const MlaPrepParams& p);

// ---------------------------------------------------------------- skinny linear layer
// y[b][t, n] = beta * y[b][t, n] + sum_k x[b][t, k] * w[b][n, k] for b < batch, t < T, n < N, k < Kd:
// w row-major [N, Kd] (PyTorch's nn.Linear layout), T <= kLinearSkinnyMaxT token rows. For the
// few-token steps (decode, small trees: CudaModel uses it for 1-5 and 17-20 tokens, linear_tile between) in place of cuBLAS
// (linear_kernels.cu says why); batch
// > 1 runs the per-head absorbed MLA products. FP32, deterministic. x and y must not overlap.
constexpr int kLinearSkinnyMaxT = 64;  // more than 16 tokens run in slices of 16 (grid.z)
struct LinearParams {
  const float* x;          // [batch] x [T, ldx], batch stride x_batch floats
  long long ldx, x_batch;
  const float* w;          // [batch] x [N, Kd] row-major, batch stride w_batch floats
  long long w_batch;
  float* y;                // [batch] x [T, ldy], batch stride y_batch floats
  long long ldy, y_batch;
  int T, N, Kd, batch;
  float beta;              // 0: y is only written (may hold garbage); else y = beta * y + x w^T
  const float* norm_w = nullptr;  // optional RMSNorm of the x rows first (T <= kLinearNormMaxT):
  double norm_eps = 0.0;          // x[t] -> norm_w * x[t] / sqrt(mean(x[t]^2) + norm_eps) (over Kd)
  int x_swiglu = 0;               // 1: an x row is [gate | up] (2 Kd floats, ldx >= 2 Kd) and the
                                  // product uses silu(gate) * up (the SwiGLU before a down
                                  // projection; not with norm_w)
  float* norm_out = nullptr;      // with norm_w: also write the normalised rows [T, ldn] (as the
  long long ldn = 0;              // rmsnorm kernel would), for later consumers of the same input
  int force_config = 0;           // tests / benchmarks: 1 + an index into the configuration table
                                  // (linear_skinny_config); 0 = the automatic choice
  int tile_splits = 0;            // linear_tile: k splits (a cluster of that many blocks), 0 = auto,
                                  // else 1..kLinearTileMaxSplits (tests / benchmarks)
  int tile_math = 0;              // linear_tile: 0 = tensor cores, 3xTF32 (FP32-accurate), 1 = FP32 CUDA cores
  int tile_rows = 0;              // linear_tile: token rows per tile (8, 16, 24, 32, 48, 64 or 72), 0 = auto
                                  // (linear_tile_rows(T, weight bytes)); tests / benchmarks
  int row_exact = 0;              // linear_tile: each output the same bits whatever T and the other token rows
                                  // (GPU row-exact steps): tiles of kLinearTileExactRows rows and the split count
                                  // the automatic rule gives one such tile (a function of the matrix alone);
                                  // overrides tile_rows
  const uint16_t* w_bf16 = nullptr;  // the same weights as BF16 (same layout; every value of w exactly a
                                     // BF16), read instead of w and widened: the same results from half the
                                     // bytes. linear_skinny: with 16-byte aligned rows and an 8-byte aligned
                                     // w_bf16; linear_tile: tensor-core math, Kd and w_batch multiples of 8,
                                     // w_bf16 16-byte aligned; else w
  // linear_skinny, optional (the W_UK product of MLA): one extra block per batch entry (head) and
  // token slice (the first of its row of blocks) applies RoPE to that head's query rope part, rope_R
  // floats at x + rope_off of each token row (the floats after the Kd that the product reads), with the
  // step's table rope_cs ([T, R]: cos | sin, times the attention factor) and writes them to rope_out[t, head, :]
  // (row stride rope_ld): what mla_prep writes to q_rope, the same bits. Vector path only.
  const float* rope_cs = nullptr;
  float* rope_out = nullptr;
  long long rope_ld = 0;
  int rope_off = 0, rope_R = 0, rope_interleaved = 0;
  // linear_skinny with rope_out, optional (the W_UK product of MLA): the rope blocks also do mla_prep's
  // work (prep.skip_q must be 1 and prep.T == T): the rope block of head y and token slice z (the f-th in
  // launch order, f = z batch + y) writes the cache rows (and q_scale_out) of tokens f, f + batch * slices,
  // ..., with mla_prep's arithmetic and reduction order (the same bits). One launch instead of two, and no
  // stream fork / join between the q_a / kv_a projection and the attention.
  int prep_on = 0;
  MlaPrepParams prep{};
};
// One kernel configuration: RW weight rows per warp, TT token rows per slice (more tokens run in
// balanced slices along grid.z), U k-steps of loads in flight per lane.
struct LinearSkinnyConfig {
  int RW, TT, U;
};
int linear_skinny_num_configs();
LinearSkinnyConfig linear_skinny_config(int i);
constexpr int kLinearNormMaxT = 4;
// x_swiglu is exact for any T, but every warp recomputes the SwiGLU of its token rows: it pays
// only for a few tokens (H200, mini-kimi: the T = 17 dense down projection took 57 us fused
// against ~25 us for swiglu + linear), so the model fuses it up to this many tokens.
constexpr int kLinearSwigluFuseMaxT = 4;
cudaError_t linear_skinny(const LinearParams& p, cudaStream_t stream);
// Whether linear_skinny runs the rope block (LinearParams::rope_out) for these parameters: the vector
// path, no prologue, and a configuration that has it (the W_UK product's for 1-5 tokens).
bool linear_skinny_rope_ok(const LinearParams& p);

// ---------------------------------------------------------------- tiled linear layer
// The same product (no prologues: norm_w, x_swiglu and norm_out must be unset) for any T, tiled
// through shared memory with the k range split over a thread-block cluster (linear_tile.cu says
// why): for the verify steps between linear_skinny's few tokens and cuBLAS's many. Needs 16-byte
// aligned x / w and Kd, ldx, x_batch, w_batch multiples of 4 (linear_tile_supported); sm_90+.
// FP32, deterministic (the split count is a function of the shape and the device's SM count).
constexpr int kLinearTileMaxSplits = 8;
constexpr int kLinearTileExactRows = 16;  // token rows per tile of a row-exact product (LinearParams::row_exact)
bool linear_tile_supported(const LinearParams& p);
// a product's weights as FP32 bytes, all batches (the tile-height and split rules' measure, also
// for a BF16 copy)
long long linear_weight_bytes(const LinearParams& p);
// Matrices of at most this many FP32 bytes stay in the H200's L2 through a call (every mini-kimi
// projection but the head): linear_tile gives them several small token tiles (linear_tile_rows) and
// CudaModel keeps them on linear_tile for larger steps than bigger ones
constexpr long long kLinearTileSmallBytes = 32LL << 20;
// token rows per tile for a T-token step over weight_bytes of weights (8, 16, 24, 32, 48, 64 or 72)
int linear_tile_rows(int T, long long weight_bytes);
// the smallest tile height that holds T token rows in one tile (what linear_tile_rows gives large matrices),
// 0 past 72 tokens (no one tile holds them)
int linear_tile_one_tile_rows(int T);
cudaError_t linear_tile(const LinearParams& p, cudaStream_t stream);

// ---------------------------------------------------------------- attention combine + W_UV
// out[t, h, :] = o_lat[t, h, :] @ W_UV[h]^T where o_lat is the merge of the attention's key splits
// (verify_attention with defer_splits: partials [S][T*H][C] then [S][T*H][2]), merged with the
// combine kernel's arithmetic (the same o_lat bits) inside this kernel: one launch instead of
// two for steps of few tokens. Grid (H, Dv / 16), 256 threads; limits in uv_combine_ok.
constexpr int kUvMaxT = 8, kUvMaxS = 128;
struct UvCombineParams {
  const float* partials;       // the attention workspace
  int S, T, H, C, Dv;          // splits (2..kUvMaxS), tokens (<= kUvMaxT), heads, C = 512, Dv % 16 == 0
  const float* w_uv;           // [H, Dv, C]
  const uint16_t* w_uv_bf16;   // its exact BF16 copy, read instead when given and 8-byte aligned, or nullptr
  float* out;                  // [T, H * Dv]
};
bool uv_combine_ok(int T, int S, int C, int Dv);
cudaError_t uv_combine(const UvCombineParams& p, cudaStream_t stream);

// ---------------------------------------------------------------- embedding
struct EmbedParams {
  const int32_t* tokens;   // [T]
  const float* table;      // [V, Dm]
  int T, V, Dm;
  float* out;              // [T, Dm]; a token outside [0, V) gives a row of NaN
  // optional, the step's RoPE table for mla_prep (computed once per step, not once per layer):
  // cs[t] = [cos | sin](angle_j) * attention_factor, angle_j = float(positions[t]) * inv_freq[j]
  // rounded to float, cos / sin in double (ops.cpp rope_cos_sin)
  const int32_t* positions = nullptr;  // [T]
  const float* inv_freq = nullptr;     // [half]
  int half = 0;
  float attention_factor = 1.f;
  float* cs = nullptr;                 // [T, 2 half]
  const uint16_t* table_bf16 = nullptr;  // the table as BF16 bits, read (widened exactly) instead of table when set
};
cudaError_t embed(const EmbedParams& p, cudaStream_t stream);

// ---------------------------------------------------------------- RMSNorm
// y[t] = w * (x[t] * rsqrt(mean(x[t]^2) + eps)), the sum of squares in double (as the CPU).
struct RmsNormParams {
  const float* x;          // [T, ldx]
  const float* w;          // [D]
  int T, D, ldx, ldy;
  double eps;
  float* y;                // [T, ldy]; may alias x (same ld)
};
cudaError_t rmsnorm(const RmsNormParams& p, cudaStream_t stream);

// The MLA preparation of the step's tokens (MlaPrepParams above).
cudaError_t mla_prep(const MlaPrepParams& p, cudaStream_t stream);

// The folded query projection of a q-LoRA model (q_fold): out[n, k] = sum_j w_qb[n, j] g[j] w_qa[j, k]
// (accumulated in double, rounded once), n < N, j < J, k < Kd; all row-major.
cudaError_t fold_q_projection(const float* w_qb, const float* g, const float* w_qa, int N, int J, int Kd, float* out,
                              cudaStream_t stream);

// ---------------------------------------------------------------- SwiGLU
// out[r, i] = silu(gu[r, i]) * gu[r, I + i]; rows r < *n_rows when n_rows (device) is given,
// else r < rows.
struct SwigluParams {
  const float* gu;         // [rows, 2I] (row stride ldg)
  int rows, I;
  const int32_t* n_rows;   // [1] device row count, or nullptr
  float* out;              // [rows, I]
  long long ldg = 0;       // gu row stride (0: 2I)
};
cudaError_t swiglu(const SwigluParams& p, cudaStream_t stream);

// ---------------------------------------------------------------- MoE routing
// HF DeepseekV3TopkRouter on router logits: s = sigmoid(logits); b = s + bias (selection only);
// group score = sum of the top-2 b of each group; the topk_group best groups are kept (others
// excluded, HF masks them to -inf); top-K experts by b among the kept groups (ties: lower
// index); weights = s of the chosen, divided by (sum + 1e-20) when norm_topk_prob, times
// routed_scaling_factor. One block per token, one thread per expert (E <= 1024): the top-K and
// the kept groups come from parallel ranks (model_kernels.cu), no sequential rounds.
struct RouteParams {
  const float* logits;     // [T, E] (row stride ldl)
  const float* bias;       // [E] e_score_correction_bias
  int T, E, K, G, topk_group;
  int norm_topk_prob;
  float routed_scaling_factor;
  int32_t* topk_idx;       // [T, K] in selection order
  float* topk_w;           // [T, K]
  int ldl = 0;             // logits row stride (0: E)
  int force_block = 0;     // testing / A/B: moe_route_group's block-per-token path even where its two-barrier
                           // path (T <= kRouteGroupMaxT, topk_group == G, K <= 32) would run; same results
};
cudaError_t moe_route(const RouteParams& p, cudaStream_t stream);

// Group the A = T*K assignments by expert, deterministically: slots [offsets[e], offsets[e+1])
// hold expert e's assignments in ascending assignment order (token-major). Also writes the
// tile schedule of the grouped GEMMs: tiles of `tile_rows` slots of one expert, in expert order.
struct MoeGroupParams {
  const int32_t* topk_idx; // [T, K] (A = T * K)
  int T, K, E, tile_rows;
  int32_t* counts;         // [E]
  int32_t* offsets;        // [E + 1]
  int32_t* slot_token;     // [A] token of each slot
  int32_t* slot_of;        // [A] slot of each assignment
  int32_t* tile_expert;    // [max_tiles] expert of tile i
  int32_t* tile_row0;      // [max_tiles] first slot of tile i
  int32_t* num_tiles;      // [1]
  int force_two_pass = 0;  // testing: the count + place kernels even when the one-block kernel
                           // (A <= 1024 and E <= 1024) would run
};
// moe_route then moe_group; for T <= kRouteGroupMaxT tokens (decode, tiny trees) in one launch
// (one block routes the tokens one after the other, then builds the schedule: the same results).
// The two must describe the same assignments (T, K, E, topk_idx).
constexpr int kRouteGroupMaxT = 4;
cudaError_t moe_route_group(const RouteParams& rp, const MoeGroupParams& gp, cudaStream_t stream);
// Upper bound of the tiles the schedule can hold (what tile_expert/tile_row0 must fit).
inline int moe_max_tiles(int A, int E, int tile_rows) {
  return (A + tile_rows - 1) / tile_rows + (A < E ? A : E);
}
cudaError_t moe_group(const MoeGroupParams& p, cudaStream_t stream);

// ---------------------------------------------------------------- grouped expert GEMM
// For every scheduled tile (expert e, slots s in [row0, min(row0 + tile_rows, offsets[e+1]))):
//   y[s, n] = sum_k x[xrow(s), k] * w[e, n, k]       (y = x @ w_e^T)
// xrow(s) = slot_token[s] when x_row is given (gather), else s. With swiglu = 1 the weight holds
// gate rows [0, N) then up rows [N, 2N) of each expert and y[s, n] = silu(gate) * up.
struct ExpertGemmParams {
  const float* x;          // [*, ldx]
  int ldx;
  const int32_t* x_row;    // [A] source row of x per slot, or nullptr (row = slot)
  const float* w;          // [E, (swiglu ? 2N : N), Kd] row-major
  int N, Kd;
  int swiglu;
  const int32_t* offsets;  // [E + 1]
  const int32_t* tile_expert, *tile_row0, *num_tiles;  // from moe_group
  int tile_rows;           // must equal MoeGroupParams::tile_rows
  int max_tiles;           // grid bound (moe_max_tiles)
  float* y;                // [A, ldy]
  int ldy;
  const uint16_t* w_bf16 = nullptr;  // w as exact BF16 (as LinearParams::w_bf16), read by the GEMV-style kernel
                                     // (8-byte aligned) and the tensor-core one (Kd % 8 == 0, 16-byte aligned)
  // w as 4-bit integers (INT4 W4A16, Kimi K2's routed experts): the weight at flat element i of w (i = its
  // offset from w) is bf16_round((q - 8) * w_scale[i / int4_group]), q the low (i even) or high (i odd)
  // nibble of w_int4[i / 2]: the value the loader dequantizes it to (python/kdtree_native/quantization.py):
  // the tensor-core kernel's sums are the ones it forms from those BF16 values, the GEMV-style kernel's INT4
  // version sums them in its own lane order (expert_gemv_int4_kernel). Read instead of w and w_bf16 when set
  // (both kernels; no widening anywhere): needs expert_gemm_int4_ok. w may then be an address with nothing
  // behind it.
  const uint8_t* w_int4 = nullptr;   // [elements of w / 2], 16-byte aligned
  const float* w_scale = nullptr;    // [elements of w / int4_group], the BF16 scales as float32
  int int4_group = 0;                // a multiple of 32 dividing Kd
  // every w_scale value is a BF16 value (Kimi's scales are): the GEMV-style kernel then dequantizes in bf16x2
  // arithmetic (int4x8_values), else one weight at a time in FP32 (int4_value); the same values either way
  bool int4_scales_bf16 = false;
  // expert_gemm_mma only, ignored elsewhere: 1 promises that the schedule (offsets, tile_*, num_tiles) was
  // written two launches back or earlier and that the launch just before this one on the stream is
  // expert_gemm_mma's SwiGLU form (gate/up), which triggers its dependents only after its PDL wait. A down
  // projection (FP32 weights, tiles of <= 16 slots) may then read the schedule and start its weight copies
  // before its own wait (expert_mma.cu, PRE).
  int pdl_pre = 0;
};
// Two kernels: a GEMV-style one for tiles of <= kExpertSkinnyRows slots (weights streamed once
// per tile; decode and small verify steps) and a shared-memory tiled SGEMM for tiles of
// kExpertTileRows slots (prefill, large trees; no fused SwiGLU).
constexpr int kExpertSkinnyRows = 8;
constexpr int kExpertTileRows = 64;
cudaError_t expert_gemm(const ExpertGemmParams& p, cudaStream_t stream);
// The same GEMM on the tensor cores (expert_mma.cu; 3xTF32, FP32-accurate): a block streams 64
// weight rows of the tile's expert through shared memory (cp.async) against the tile's slots,
// for schedules of 8, 16, 32 or 64 slots per tile (tile_rows), SwiGLU fused as above. Needs Kd, ldx
// multiples of 4 and x, w 16-byte aligned (expert_mma_supported); else cudaErrorInvalidValue.
bool expert_mma_supported(const ExpertGemmParams& p);
cudaError_t expert_gemm_mma(const ExpertGemmParams& p, cudaStream_t stream);

// out[t] (+)= sum over the token's experts, in ascending expert index, of w * y[slot] (then
// + shared[t] when given); accumulate = 1 adds into out (the residual stream).
struct MoeCombineParams {
  const float* y;          // [A, Dm] expert outputs by slot
  const int32_t* topk_idx; // [T, K]
  const float* topk_w;     // [T, K]
  const int32_t* slot_of;  // [T * K]
  const float* shared;     // [T, Dm] shared-expert output, or nullptr
  int T, K, Dm;
  float* out;              // [T, Dm]
  int accumulate;
  // Optional: then norm_out[t] = norm_w * rmsnorm(out[t]) (eps norm_eps), the RMSNorm that follows
  // the combine (the next layer's input norm, or the final one), in the same launch. out gets the
  // bits of the plain combine; norm_out those of rmsnorm() on out afterwards in every case tested (its
  // double sum of squares runs in another order, which could move a last float bit in a rare row).
  // Needs moe_combine_norm_ok(Dm, K).
  const float* norm_w = nullptr;  // [Dm]
  double norm_eps = 0.0;
  float* norm_out = nullptr;      // [T, Dm], not aliasing out
};
cudaError_t moe_combine(const MoeCombineParams& p, cudaStream_t stream);
bool moe_combine_norm_ok(int Dm, int K);  // Dm <= 2048, K <= 64

// ---------------------------------------------------------------- cache compaction
// For every layer: row L + j <- row L + keep[j], j < *count (keep strictly increasing, so
// keep[j] >= j); chunked read-all-then-write, safe in place. One block per layer.
struct CompactParams {
  float* cache;            // layer l row s at cache + l * layer_stride + s * ld
  int num_layers;
  long long layer_stride;  // floats
  int ld, row_len;         // floats between rows, floats moved per row
  long long L;
  const int32_t* keep;     // [*count] device
  const int32_t* count;    // [1] device
};
cudaError_t cache_compact(const CompactParams& p, cudaStream_t stream);

// Causal visibility bitmask: row i has bits j <= i set, [T, W] words.
cudaError_t causal_bits(uint64_t* bits, int T, int W, cudaStream_t stream);

// dst[i] = the high 16 bits of src[i] (its BF16 value when src[i] is exactly a BF16), n elements:
// the BF16 weight copies of CudaModel.
cudaError_t f32_to_bf16_high(const float* src, uint16_t* dst, long long n, cudaStream_t stream);
// dst[i] = the float32 whose high 16 bits are src[i] (BF16 widened exactly), n elements: the weights
// a cuBLAS product of a bf16_weights_only CudaModel reads.
cudaError_t bf16_to_f32(const uint16_t* src, float* dst, long long n, cudaStream_t stream);

// Whether the kernel reads the weights from w_bf16 (and never from w) for these parameters: the
// same test each launcher makes. A bf16_weights_only CudaModel widens the weights first where not.
bool linear_skinny_reads_bf16(const LinearParams& p);
bool linear_tile_reads_bf16(const LinearParams& p);
bool expert_gemm_reads_bf16(const ExpertGemmParams& p);      // the GEMV-style rows (kExpertSkinnyRows)
bool expert_gemm_mma_reads_bf16(const ExpertGemmParams& p);
// Whether both expert kernels take p's INT4 weights (w_int4 / w_scale / int4_group as described there, and
// the shapes each kernel's INT4 path needs: Kd a multiple of int4_group and of 8, x 16-byte aligned, ldx % 4
// == 0). The tiled SGEMM kernel (kExpertTileRows without the tensor cores) never reads INT4.
bool expert_gemm_int4_ok(const ExpertGemmParams& p);

}  // namespace cuda
}  // namespace kdtree
