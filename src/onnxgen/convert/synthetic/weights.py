"""The weights of a synthetic package under Hugging Face Llama names ([out, in] Linear layout): random
(deterministic in the seed) or given, produced one tensor at a time, and the float reference a package
effectively computes with (dtype rounding and the int4 round trip applied)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from onnxgen.convert.synthetic.arrays import as_np, round_to_dtype
from onnxgen.convert.synthetic.config import SyntheticConfig, hf_weight_shapes
from onnxgen.convert.synthetic.quant import dequantize_int4, quantize_int4
from onnxgen.errors import ConversionError

# Above this many parameters, weights=None may use torch on CUDA (values then differ from random_weights).
DETERMINISTIC_MAX_PARAMS = 1 << 27


def _init_scale(name: str, shape: tuple[int, ...], cfg: SyntheticConfig) -> tuple[float, float]:
    """(mean, std) of a weight: norms ~1, linears 1/sqrt(in) (outputs into the residual halved),
    embeddings/lm_head 2/sqrt(hidden) so logits have std ~2 (peaked enough to be non-degenerate)."""
    if name.endswith("norm.weight"):
        return 1.0, 0.1
    if "embed_tokens" in name or name == "lm_head.weight":
        return 0.0, 2.0 / math.sqrt(cfg.hidden_size)
    std = 1.0 / math.sqrt(shape[1])
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        std *= 0.5
    return 0.0, std


def _np_weight(cfg: SyntheticConfig, seed: int, index: int, name: str, shape: tuple[int, ...]) -> np.ndarray:
    mean, std = _init_scale(name, shape, cfg)
    rng = np.random.default_rng([seed, index])
    x = rng.standard_normal(shape, dtype=np.float32)
    x *= np.float32(std)
    if mean:
        x += np.float32(mean)
    return x


def random_weights(cfg: SyntheticConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """float32 weights under Hugging Face Llama names, shapes as in transformers (Linear = [out, in]).

    Deterministic in (cfg shapes, seed): each tensor comes from `np.random.default_rng([seed, i])`
    with i its index in `hf_weight_shapes(cfg)`. Norm weights ~ 1 + 0.1 N(0,1), linear weights
    N(0, 1/in) (o_proj/down_proj halved), embeddings and lm_head N(0, 4/hidden): activations stay
    O(1) and logits have std ~2. No `lm_head.weight` when embeddings are tied.
    """
    return {n: _np_weight(cfg, seed, i, n, s) for i, (n, s) in enumerate(hf_weight_shapes(cfg).items())}


class WeightSource:
    """Yields HF-named float32 tensors, one at a time (nothing is cached).

    Given weights: numpy float32 copies. Random weights: numpy (== `random_weights`) up to
    2**27 parameters; above that torch (CUDA when available, else CPU), which is several times
    faster. Torch-generated 2-D weights are drawn in the ONNX [in, out] layout and returned as a
    transposed view, so writing them needs no transpose copy (the values are iid, so the
    distribution is the same). Raises ConversionError at creation for missing/mis-shaped weights.
    """

    def __init__(self, cfg: SyntheticConfig, weights: Mapping[str, Any] | None, seed: int) -> None:
        self.cfg = cfg
        self.seed = seed
        self.shapes = hf_weight_shapes(cfg)
        self.index = {n: i for i, n in enumerate(self.shapes)}
        self.weights = weights
        self.torch_device: str | None = None
        if weights is None and cfg.num_parameters > DETERMINISTIC_MAX_PARAMS:
            try:
                import torch

                self.torch_device = "cuda" if torch.cuda.is_available() else "cpu"
            except ImportError:
                pass
        if weights is not None:
            self._check_given(weights)

    def _check_given(self, weights: Mapping[str, Any]) -> None:
        for name, shape in self.shapes.items():
            if name not in weights:
                raise ConversionError(
                    f"weights lack {name!r} (expected shape {shape}); pass every HF Llama weight"
                )
            got = tuple(weights[name].shape)
            if got != shape:
                raise ConversionError(f"weights[{name!r}] has shape {got}, expected {shape}")

    def get(self, name: str) -> Any:
        """The float32 weight `name` [out, in]: a numpy array, or a torch tensor for torch-drawn weights."""
        shape = self.shapes[name]
        if self.weights is not None:
            return as_np(self.weights[name])
        if self.torch_device is not None:
            import torch

            mean, std = _init_scale(name, shape, self.cfg)
            g = torch.Generator(device=self.torch_device).manual_seed(
                self.seed * 1_000_003 + self.index[name]
            )
            transposed = len(shape) == 2 and (name != "model.embed_tokens.weight" or self.cfg.tie_embeddings)
            draw = shape[::-1] if transposed else shape
            x = torch.randn(draw, generator=g, device=self.torch_device, dtype=torch.float32)
            x = x.mul_(std).add_(mean) if mean else x.mul_(std)
            return x.t() if transposed else x
        return _np_weight(self.cfg, self.seed, self.index[name], name, shape)


def reference_weights(
    cfg: SyntheticConfig, weights: Mapping[str, Any] | None = None, seed: int = 0
) -> dict[str, np.ndarray]:
    """The float32 HF-named weights a package written with (cfg, weights, seed) effectively uses.

    Without quantization these are the weights themselves (rounded to cfg.dtype); with
    `quant="int4"` every linear layer (and the embedding when `quant_embeddings`) is replaced by its
    int4 round trip, so a float reference forward pass on these matches the package's graph.
    With tied embeddings and int4, the result holds a separate `lm_head.weight`: the embedding and
    the lm_head then differ (one is quantized, the other not, unless quant_embeddings).
    """
    src = WeightSource(cfg, weights, seed)
    out = {name: round_to_dtype(as_np(src.get(name)), cfg.dtype) for name in src.shapes}
    if cfg.quant is None:
        return out
    emb = out["model.embed_tokens.weight"]
    head = out.get("lm_head.weight", emb)
    for name in list(out):
        if name.endswith("proj.weight"):
            out[name] = _int4_round_trip(out[name], cfg)
    out["lm_head.weight"] = _int4_round_trip(head, cfg)
    if cfg.quant_embeddings:
        out["model.embed_tokens.weight"] = (
            out["lm_head.weight"] if cfg.tie_embeddings else _int4_round_trip(emb, cfg)
        )
    return out


def _int4_round_trip(w: np.ndarray, cfg: SyntheticConfig) -> np.ndarray:
    """The weight as the package's int4 kernels see it (scales rounded to the model dtype)."""
    packed, scales, zp = quantize_int4(w, cfg.quant_zero_points)
    return dequantize_int4(packed, round_to_dtype(scales, cfg.dtype), zp, w.shape[1])
