"""The Triton device code of the native kernels (imported only when Triton runs; CUDA or its interpreter)."""
