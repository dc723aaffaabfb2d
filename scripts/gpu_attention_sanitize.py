"""A small set of verify-attention calls for compute-sanitizer (racecheck / memcheck). The tensor-core
kernel: uneven key splits between the full row blocks and the last one, one-m-tile last row blocks, the
context length read from a device int (l_bound), skipped tree chunks, tiny shapes. The split-KV kernel
(4, 8 and 16 query rows per block): key splits, chunks cut by N, the device int, the first chunk
loaded before the PDL wait (L >= 32). Every output is checked against the float64 reference. Exit
status 1 on a mismatch (an assertion).

    compute-sanitizer --tool racecheck --error-exitcode 9 python3 scripts/gpu_attention_sanitize.py
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "python"))
from kdtree_native import _cuda_ops as cu  # noqa: E402
from test_cuda_ops import attn_case_t, check_attn, ref64  # noqa: E402

# (L, T, H, l_bound): l_bound = None: L on the host; else the device-int path sized for l_bound
CASES = [(4096, 17, 16, None), (4096, 17, 16, 4400), (517, 17, 16, None), (33, 65, 16, 100), (0, 1, 1, None),
         (100, 2, 16, None), (1500, 33, 3, 1600)]

for L, T, H, lb in CASES:
    ql, qr, kvl, kr, vis, scale = attn_case_t(L + T, L, H, T, "tree")
    out = cu.verify_attention(ql, qr, kvl, kr, vis, scale, force_kernel=4, l_bound=lb)
    check_attn(out, ref64(ql, qr, kvl, kr, vis, scale), (L, T, H, lb))
    print(L, T, H, lb, cu.verify_attention_choice(T, H, L, force_kernel=4, detail=True), flush=True)
# (L, T, H, l_bound, rows, splits): the split-KV kernel forced (force_kernel=2)
SPLITKV = [(512, 1, 16, None, 4, 0), (517, 2, 16, 600, 8, 3), (4099, 4, 16, None, 16, 0), (40, 1, 3, None, 4, 2),
           (0, 5, 7, None, 8, 0)]
for L, T, H, lb, rows, splits in SPLITKV:
    ql, qr, kvl, kr, vis, scale = attn_case_t(L + 3 * T, L, H, T, "tree")
    out = cu.verify_attention(ql, qr, kvl, kr, vis, scale, force_kernel=2, force_rows=rows, force_splits=splits,
                              l_bound=lb)
    check_attn(out, ref64(ql, qr, kvl, kr, vis, scale), (L, T, H, lb, rows, splits))
    print(L, T, H, lb, rows, cu.verify_attention_choice(T, H, L, force_kernel=2, force_splits=splits,
                                                         force_rows=rows, detail=True), flush=True)
print(f"gpu_attention_sanitize: {len(CASES)} tensor-core and {len(SPLITKV)} split-KV cases ok")
