"""onnxgen's C kernels for the CPU's decode-size float32 work, compiled at first use.

build   compiles `kernels.c` with the system's C compiler into `$ONNXGEN_HOME/kernels/` and loads it
        (`library()`, None where it cannot run: `unavailable()` says why)
ops     the torch-facing calls (`linear`, `rope_qkv_write`, `paged_attention`, `buffer_attention`), each
        returning None where its tensors are not for it, so the caller runs its torch path
"""
