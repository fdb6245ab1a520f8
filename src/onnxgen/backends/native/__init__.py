"""The native backend: ONNX graphs lowered to torch (CPU, CUDA) with the KV cache owned by the runtime.

Import `onnxgen.backends.native.decoder.NativeDecoder` (torch is imported there, not here).

`OPTIONS` declares the keyword options `NativeDecoder` takes (`onnxgen.load(..., **options)` passes them on):
kv_floor (smallest KV capacity bucket), cuda_graphs, graph_max_tokens, static_steps (testing), int4 ("dense":
MatMulNBits dequantized at load, the default; "packed": executed on the packed bytes). See `NativeDecoder` for
each. `TP_OPTIONS`: tensor_parallel (N > 1: a `tp.runner.TPRunner` over N ranks, each running a `NativeRunner`
with the runner options below on its part of every layer and its pool; or with a decoder per request a
`tp.decoder.TPDecoder`, each rank a `NativeDecoder` with the options above). `RUNNER_OPTIONS` are those of the
batched `NativeRunner` (paged KV): kv_bytes (the pool's size), page_size, cuda_graphs (decode steps replayed
from CUDA graphs), int4, part_steps (a run of decode steps reaches the host in parts of this many steps; 0:
whole), first_multi (a greedy run's first replay may be its several-step graph). See `NativeRunner`.

Kernel switches are environment variables, not options (`onnxgen.envs`).
"""

OPTIONS = ("kv_floor", "cuda_graphs", "graph_max_tokens", "static_steps", "int4")
TP_OPTIONS = ("tensor_parallel",)
RUNNER_OPTIONS = ("kv_bytes", "page_size", "cuda_graphs", "int4", "part_steps", "first_multi")
