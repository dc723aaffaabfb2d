// expert_fused.cu: a MoE layer's routed experts in one kernel (gate/up, SwiGLU and the down
// projection) on the CUDA cores in FP32, for steps with few slots per expert (decode and the verify
// of small trees). See model_kernels.h (expert_ffn_fused) for the contract.
//
// Why: at a B = 16 verify of mini-kimi (17 tokens, ~4.7 slots per touched expert) the two grouped
// GEMMs (expert_mma.cu) are ~21 + ~12 us for ~88 MB of weights, ~64 % of the copy bandwidth, with a
// dependent kernel boundary between them; their 3xTF32 products on tiles of 8 slots do three
// products per weight for ~5 useful rows. Here a block takes one schedule tile (<= 16 slots of one
// expert) and one slice of kSlice intermediate columns: it streams those columns' gate and up rows
// (64 rows of Dm floats), forms silu(gate) * up for its slots, then streams the slice's columns of
// the down matrix (Dm rows of kSlice floats) and writes the slice's part of every slot's output.
// The down weights are known once the schedule is, so they are prefetched into L2 at the block's
// start and stream while the gate/up products run; no kernel boundary between the two products.
// The last block of a tile to finish (a counter per tile) adds the slices' parts in slice order.
//
// Gate/up: a warp takes a (gate row, up row) pair at a time; each lane loads float4 pieces of a row
// at k = 4 lane + 128 i (coalesced: a warp reads 512 contiguous bytes per load) and multiplies them
// with the tile's x rows (gathered into shared memory), keeping one partial sum per slot in
// registers; the 32 lanes' partials are then added by a butterfly that halves the values a lane
// holds at each step (16 shuffles for 16 slots, not 80). Down: the slice's columns are copied into
// shared memory (cp.async, 8 threads per 128-byte row piece) in pieces of kPiece rows, double
// buffered; a thread takes one output row of a piece and sums its kSlice columns for every slot.
//
// Deterministic: every sum has a fixed order (a lane's k pieces in ascending i, then the butterfly;
// the slice's columns in ascending j; the slices in ascending order), independent of timing.
#include <cstdint>

#include "model_kernels.h"
#include "launch.h"
#include "model/device_math.h"

namespace kdtree {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kSlice = kExpertFusedSlice;  // intermediate columns per block
constexpr int kRows = kExpertFusedRows;    // slots per tile
constexpr int kChunk = 8;                  // float4 pieces per lane and weight load step (1024 floats of a row)
constexpr int kPiece = kThreads;           // down rows per staged piece (one per thread)
constexpr int kPad = kSlice + 4;           // staged row stride in floats: 16-byte rows, conflict-free LDS.128
static_assert(kSlice == 32 && kRows == 16, "the butterfly and the staging assume 32 columns and 16 slots");
static_assert(kSlice % kWarps == 0, "pairs per warp");

__device__ __forceinline__ float4 ld_stream4(const float* p) {  // read-once weights, past L1
  float4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "l"(p));
  return v;
}
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// one weight row's step: the lane's float4 pieces i < kChunk of 1024 floats starting at `row`
// (pieces at or past `n4` float4s of the row are zero and not loaded)
__device__ __forceinline__ void load_step(float4 (&b)[kChunk], const float* row, int lane, int n4) {
#pragma unroll
  for (int i = 0; i < kChunk; ++i) {
    const int q = lane + 32 * i;
    b[i] = q < n4 ? ld_stream4(row + 4 * q) : make_float4(0.f, 0.f, 0.f, 0.f);
  }
}

// acc[t] += sum over the step's pieces of b . x[t] (x rows of ldx floats in shared memory, the step's
// first float at column c0), for t < n
__device__ __forceinline__ void fma_step(float (&acc)[kRows], const float4 (&b)[kChunk], const float* xs, int ldx,
                                         int c0, int lane, int n, int n4) {
#pragma unroll
  for (int t = 0; t < kRows; ++t) {
    if (t < n) {
      const float* xr = xs + t * ldx + c0;
#pragma unroll
      for (int i = 0; i < kChunk; ++i) {
        const int q = lane + 32 * i;
        if (q < n4) {
          const float4 xv = *reinterpret_cast<const float4*>(xr + 4 * q);
          float a = acc[t];
          a = fmaf(b[i].x, xv.x, a);
          a = fmaf(b[i].y, xv.y, a);
          a = fmaf(b[i].z, xv.z, a);
          a = fmaf(b[i].w, xv.w, a);
          acc[t] = a;
        }
      }
    }
  }
}

// The 32 lanes' partial sums of 16 slots -> each lane holds the full sum of slot slot_of_lane(lane)
// (lanes l and l ^ 1 the same value): at each step a lane keeps half of its values and adds the
// partner's copy of that half.
template <int H>
__device__ __forceinline__ void butterfly_step(float (&v)[kRows], int lane) {
  constexpr int off = 2 * H;
  const bool upper = (lane & off) != 0;
#pragma unroll
  for (int i = 0; i < H; ++i) {
    const float send = upper ? v[i] : v[i + H];
    const float keep = upper ? v[i + H] : v[i];
    v[i] = keep + __shfl_xor_sync(0xffffffffu, send, off);
  }
}
__device__ __forceinline__ float butterfly16(float (&v)[kRows], int lane) {
  butterfly_step<8>(v, lane);
  butterfly_step<4>(v, lane);
  butterfly_step<2>(v, lane);
  butterfly_step<1>(v, lane);
  return v[0] + __shfl_xor_sync(0xffffffffu, v[0], 1);
}
__device__ __forceinline__ int slot_of_lane(int lane) {
  return ((lane >> 4) & 1) * 8 + ((lane >> 3) & 1) * 4 + ((lane >> 2) & 1) * 2 + ((lane >> 1) & 1);
}

// floats before the act rows in shared memory: the larger of the x rows and the two staging buffers
__host__ __device__ __forceinline__ size_t expert_fused_act_offset(int Dm) {
  const size_t x = (size_t)kRows * Dm, stage = (size_t)2 * kPiece * kPad;
  return x > stage ? x : stage;
}

// grid (max_tiles, slices), kThreads threads; dynamic shared memory expert_fused_smem_bytes(Dm)
__global__ void __launch_bounds__(kThreads, 2) expert_fused_kernel(ExpertFusedParams p) {
  pdl_trigger();
  pdl_wait();  // the schedule and the x rows come from earlier kernels
  const int tile = blockIdx.x, slice = blockIdx.y;
  const int nt = __ldg(p.num_tiles);
  if (tile >= nt) return;  // block-uniform
  const int e = __ldg(p.tile_expert + tile), r0 = __ldg(p.tile_row0 + tile);
  if (e < 0 || r0 < 0) return;
  const int n = min(kRows, __ldg(p.offsets + e + 1) - r0);
  const int Dm = p.Dm, Ie = p.Ie, j0 = slice * kSlice, jn = min(kSlice, Ie - j0);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  extern __shared__ __align__(16) float smem[];
  float* const xs = smem;  // [kRows][Dm] x rows; later the staged down pieces (2 x kPiece x kPad)
  float* const act = smem + expert_fused_act_offset(Dm);  // [kRows][kSlice]
  __shared__ int s_last;

  // the slice's down columns into L2 now: they stream while the gate/up products run
  const float* const Wd = p.w_down + (size_t)e * Dm * Ie + j0;
  for (int o = tid; o < Dm; o += kThreads) prefetch_l2(Wd + (size_t)o * Ie);

  // the tile's x rows, gathered by slot
  const int n4 = Dm / 4;
  for (int t = 0; t < n; ++t) {
    const float* src = p.x + (size_t)__ldg(p.x_row + r0 + t) * p.ldx;
    for (int q = tid; q < n4; q += kThreads) cp_async16(xs + (size_t)t * Dm + 4 * q, src + 4 * q);
  }
  cp_async_commit();

  // gate / up: warp w takes the pairs j = w, w + 8, ... (< jn): the gate row's steps of 1024 floats,
  // then the up row's, as one sequence of row steps; a step's loads are issued one step ahead
  const float* const Wg = p.w_gu + (size_t)e * 2 * Ie * Dm;
  const int steps = (n4 + 32 * kChunk - 1) / (32 * kChunk);
  const int npairs = jn > warp ? (jn - warp + kWarps - 1) / kWarps : 0;
  const int total = 2 * npairs * steps;
  auto row_of = [&](int rs) {  // a row step's first float
    const int pr = rs / (2 * steps), half = (rs / steps) & 1, st = rs % steps;
    return Wg + (size_t)((half ? Ie : 0) + j0 + warp + kWarps * pr) * Dm + (size_t)st * 32 * kChunk * 4;
  };
  auto left4 = [&](int rs) { return n4 - (rs % steps) * 32 * kChunk; };
  float acc[kRows];
#pragma unroll
  for (int t = 0; t < kRows; ++t) acc[t] = 0.f;
  float g = 0.f;
  auto consume = [&](const float4 (&b)[kChunk], int rs) {
    const int st = rs % steps;
    fma_step(acc, b, xs, Dm, st * 32 * kChunk * 4, lane, n, left4(rs));
    if (st + 1 == steps) {  // the row is done
      const float v = butterfly16(acc, lane);
#pragma unroll
      for (int t = 0; t < kRows; ++t) acc[t] = 0.f;
      if (((rs / steps) & 1) == 0) {
        g = v;
      } else {
        const int t = slot_of_lane(lane);
        if ((lane & 1) == 0 && t < n) act[t * kSlice + warp + kWarps * (rs / (2 * steps))] = silu_mul(g, v);
      }
    }
  };
  float4 b0[kChunk], b1[kChunk];
  if (total > 0) load_step(b0, row_of(0), lane, left4(0));
  cp_async_wait<0>();
  __syncthreads();
  for (int rs = 0; rs < total; rs += 2) {  // total is even
    load_step(b1, row_of(rs + 1), lane, left4(rs + 1));
    consume(b0, rs);
    if (rs + 2 < total) load_step(b0, row_of(rs + 2), lane, left4(rs + 2));
    consume(b1, rs + 1);
  }
  __syncthreads();  // act complete; xs free

  // down: the slice's columns [j0, j0 + jn) of rows o of W_down[e] in pieces of kPiece rows, two
  // buffers of kPiece x kPad floats in the x rows' space; thread tid takes row tid of each piece
  float* const stage = xs;
  const int pieces = (Dm + kPiece - 1) / kPiece, q4 = jn / 4;  // Ie % 4 == 0: jn a multiple of 4
  auto issue = [&](int pc) {
    float* const buf = stage + (size_t)(pc & 1) * kPiece * kPad;
    const int rbase = pc * kPiece;
    for (int c = tid; c < kPiece * (kSlice / 4); c += kThreads) {
      const int r = c >> 3, qq = c & 7;  // 8 pieces of 16 bytes per 128-byte row
      if (rbase + r < Dm && qq < q4) cp_async16(buf + r * kPad + 4 * qq, Wd + (size_t)(rbase + r) * Ie + 4 * qq);
    }
    cp_async_commit();
  };
  issue(0);
  float* const part = p.partials + (size_t)slice * p.part_rows * Dm;
  for (int pc = 0; pc < pieces; ++pc) {
    if (pc + 1 < pieces) {
      issue(pc + 1);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const int o = pc * kPiece + tid;
    if (o < Dm) {
      const float* const wr = stage + (size_t)(pc & 1) * kPiece * kPad + tid * kPad;
      float4 w[kSlice / 4];
#pragma unroll
      for (int i = 0; i < kSlice / 4; ++i)
        w[i] = i < q4 ? *reinterpret_cast<const float4*>(wr + 4 * i) : make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
      for (int t = 0; t < kRows; ++t) {
        if (t < n) {
          float a = 0.f;
#pragma unroll
          for (int i = 0; i < kSlice / 4; ++i) {
            if (i < q4) {
              const float4 av = *reinterpret_cast<const float4*>(act + t * kSlice + 4 * i);
              a = fmaf(w[i].x, av.x, a);
              a = fmaf(w[i].y, av.y, a);
              a = fmaf(w[i].z, av.z, a);
              a = fmaf(w[i].w, av.w, a);
            }
          }
          part[(size_t)(r0 + t) * Dm + o] = a;
        }
      }
    }
    __syncthreads();  // the buffer is refilled by the issue two pieces on
  }

  // the last slice block of this tile adds the slices' parts, in slice order
  __threadfence();
  __syncthreads();
  if (tid == 0) {
    const unsigned prev = atomicAdd(p.counters + tile, 1u);
    s_last = prev + 1 == gridDim.y;
  }
  __syncthreads();
  if (!s_last) return;
  __threadfence();
  const int S = gridDim.y;
  for (int idx = tid; idx < n * n4; idx += kThreads) {
    const int t = idx / n4, o4 = idx - t * n4;
    const size_t off = (size_t)(r0 + t) * Dm + 4 * o4;
    float4 sum = __ldcg(reinterpret_cast<const float4*>(p.partials + off));
    for (int s = 1; s < S; ++s) {
      const float4 v = __ldcg(reinterpret_cast<const float4*>(p.partials + (size_t)s * p.part_rows * Dm + off));
      sum.x += v.x;
      sum.y += v.y;
      sum.z += v.z;
      sum.w += v.w;
    }
    *reinterpret_cast<float4*>(p.y + (size_t)(r0 + t) * p.ldy + 4 * o4) = sum;
  }
  if (tid == 0) p.counters[tile] = 0u;  // for the next launch (stream-ordered after this grid)
}

}  // namespace

size_t expert_fused_smem_bytes(int Dm) { return (expert_fused_act_offset(Dm) + (size_t)kRows * kSlice) * sizeof(float); }

bool expert_fused_supported(const ExpertFusedParams& p) {
  if (p.Dm <= 0 || p.Ie <= 0 || p.Dm % 4 || p.Ie % 4 || p.ldx % 4 || p.ldy % 4) return false;
  if (expert_fused_smem_bytes(p.Dm) > kExpertFusedMaxSmem) return false;
  const uintptr_t a = reinterpret_cast<uintptr_t>(p.x) | reinterpret_cast<uintptr_t>(p.w_gu) |
                      reinterpret_cast<uintptr_t>(p.w_down) | reinterpret_cast<uintptr_t>(p.partials) |
                      reinterpret_cast<uintptr_t>(p.y);
  return (a & 15u) == 0;
}

int expert_fused_slices(int Ie) { return (Ie + kSlice - 1) / kSlice; }

cudaError_t expert_ffn_fused(const ExpertFusedParams& p, cudaStream_t stream) {
  if (!expert_fused_supported(p) || p.tile_rows != kRows || p.max_tiles <= 0 || !p.counters || !p.partials ||
      p.part_rows <= 0)
    return cudaErrorInvalidValue;
  const size_t smem = expert_fused_smem_bytes(p.Dm);
  static bool attr = false;
  if (!attr) {
    const cudaError_t e =
        cudaFuncSetAttribute(expert_fused_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)kExpertFusedMaxSmem);
    if (e != cudaSuccess) return e;
    attr = true;
  }
  return launch_kernel(expert_fused_kernel, dim3(p.max_tiles, expert_fused_slices(p.Ie)), kThreads, smem, stream, p);
}

}  // namespace cuda
}  // namespace kdtree
