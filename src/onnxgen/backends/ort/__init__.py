"""The onnxruntime backend: `onnxgen.backends.ort.decoder.OrtDecoder` (onnxruntime is imported there).

`OPTIONS` declares the keyword options `OrtDecoder` takes (`onnxgen.load(..., **options)` passes them on):
threads (intra-op threads), kv_floor (smallest KV capacity bucket), kv_mode ("shared" | "concat"),
last_logits (run the lm_head on the last position only), spinning (intra-op threads spin-wait between
ops; off by default). See `OrtDecoder` for each.
"""

OPTIONS = ("threads", "kv_floor", "kv_mode", "last_logits", "spinning")
