"""Tensor parallelism for the native backend (docs/tensor-parallel.md): `shard` (the Megatron-style pass over a
decoder graph), `comm` (the process group: gloo on the CPU, NCCL on CUDA), `workers` (ranks 1..N-1 in
processes of their own, driven by rank 0), `twins` (a worker's side of rank 0's calls), `runner` (`TPRunner`:
the paged batched runner's contract on rank 0) and `decoder` (`TPDecoder`: the Decoder contract on rank 0)."""
