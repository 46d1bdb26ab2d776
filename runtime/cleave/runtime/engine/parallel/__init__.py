"""Tensor parallelism: one process per rank, Megatron-style sharded weights, KV pool by heads."""
