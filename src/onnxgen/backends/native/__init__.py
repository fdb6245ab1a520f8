"""The native backend: ONNX graphs lowered to torch (CPU, CUDA) with the KV cache owned by the runtime.

Import `onnxgen.backends.native.decoder.NativeDecoder` (torch is imported there, not here).
"""
