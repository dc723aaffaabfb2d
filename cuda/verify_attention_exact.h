// verify_attention_exact.h: the row-exact verify attention (verify_attention_exact.cu), for verify_attention.cu.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>

#include "kernels.h"

namespace kdtree {
namespace cuda {

// Shapes the blocked exact kernel takes (C <= 512, C and R multiples of 4, C + R <= 576, 16-byte aligned rows,
// T <= 2048, a split length that is a multiple of 32); others run the rows kernel's exact form.
bool verify_exact_fast_ok(const VerifyAttentionParams& p);
// its workspace: the partials of ceil((L + T) / split length) splits of every row (0 where it does not run)
size_t verify_exact_workspace_bytes(const VerifyAttentionParams& p);
// the kernel and the merge of its splits (p.workspace holds verify_exact_workspace_bytes(p))
cudaError_t launch_verify_exact(const VerifyAttentionParams& p, cudaStream_t stream);

}  // namespace cuda
}  // namespace kdtree
