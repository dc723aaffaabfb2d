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
// The row blocks of 32 query rows but the last take s_full key splits each, the last row block
// s_last (at most 16 rows: one m-tile, cheaper per chunk, so it can take fewer, longer splits).
// With max(s_full, s_last) > 1 it writes that many partial slots in the split-KV kernel's layout
// to p.workspace (a row block with fewer splits marks its other slots empty) for the combine
// kernel, else the normalised output.
cudaError_t launch_verify_mma(const VerifyAttentionParams& p, int s_full, int s_last, cudaStream_t stream);

}  // namespace cuda
}  // namespace kdtree
