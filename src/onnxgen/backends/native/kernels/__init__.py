"""The native backend's kernels, by concern: Triton on CUDA (or under its interpreter), plain torch elsewhere.

Each public function has one torch path (used on the CPU and as the ground truth in tests) and, when its
tensors live on a CUDA device and Triton imports (`dispatch.use_triton`), a Triton launch. Import the
concern's module; this package re-exports nothing.

    dispatch    whether Triton runs (`use_triton`), its launch options (programmatic dependent launch), the
                table of compiled kernels, `triton_cdiv`
    reference   torch references: (skip-)RMSNorm, attention over a KV buffer, the decode advance
    norms       `rms_norm`, `silu_mul`, `silu_mul_halves`, the token `embedding` gather
    linear      `linear` / `rms_linear` / `linear_rope`: which kernel runs a product over a constant weight
                (one-row GEMV, few-row GEMM, cuBLAS), chosen per shape
    gemv        the GEMV and few-row GEMM launches, their configurations, `x_in_tile`, `residual_rows`
    autotune    per-shape choices timed in CUDA graphs over cold weight copies (`choose_config`, `fastest`)
    attention   `cache_attention` (a contiguous KV buffer) and `rope_qkv_write`
    advance     a captured decode step's tail: `decode_advance`, `greedy_advance`; `copy_page_prefix`
    triton/     the Triton device code (imported only when Triton runs)
    cpu/        onnxgen's C kernels for the CPU's float32 decode work (products, rotary write, attention),
                compiled at first use; each call falls back to the torch path where they do not apply

Which `ONNXGEN_*` switches (`onnxgen.envs`) are read when: FORCE_TRITON, NO_TRITON and PDL when a program is
loaded (`dispatch.load_switches`, and at first use); the GEMV's (NORM_LATE, FOLD_NORMS, GEMV_X2D, GEMV_ROWS),
GREEDY_IN_ADVANCE and EMBEDDING_KERNEL at each choice or Triton launch that depends on them.
"""
