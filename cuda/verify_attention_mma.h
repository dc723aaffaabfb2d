// verify_attention_mma.h: the tensor-core (3xTF32) verify attention kernel of
// verify_attention_mma.cu, for verify_attention() (cuda/verify_attention.cu), which chooses it,
// sizes its key splits and workspace and runs the shared combine kernel after it.
#pragma once
#include <cuda_runtime.h>

#include "kernels.h"

namespace kdtree {
namespace cuda {

int verify_mma_rows();   // query rows per block (32)
int verify_mma_chunk();  // keys per chunk (32)
// raise the kernel's shared-memory limit once; false on a GPU that cannot give it (then it is not used)
bool verify_mma_ready();
// grid = (row groups, splits); with splits > 1 it writes the split-KV kernel's partial layout to
// p.workspace (the combine kernel merges them), else the normalised output
cudaError_t launch_verify_mma(const VerifyAttentionParams& p, int splits, cudaStream_t stream);

}  // namespace cuda
}  // namespace kdtree
