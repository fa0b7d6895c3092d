"""Rank-side parallel building blocks. Each takes a process group (None means the whole world),
so data, tensor and pipeline parallelism compose on sub-groups of one world."""
