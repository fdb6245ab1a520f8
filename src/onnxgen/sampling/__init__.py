"""Sampling: parameters, logits processors and samplers (numpy and torch paths)."""

from onnxgen.sampling.params import SamplingParams
from onnxgen.sampling.sampler import LogitsProcessor, Sampler, sample_rows

__all__ = ["LogitsProcessor", "Sampler", "SamplingParams", "sample_rows"]
