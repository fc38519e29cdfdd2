"""Tensor parallelism within a node (issue 31): one replica's model split over N processes.

Rank 0 is the engine (its scheduler, block table and LoRA manager decide every step); ranks
1..N-1 are workers (`worker.py`) that hold their shard of the weights, the KV cache of their
heads and their slice of every adapter, and run each step rank 0 sends them (`group.py`).
Megatron-style layout (`shard.py`): attention heads and MLP columns split, the row-parallel
projections (o_proj, down_proj) summed by an all-reduce, the embedding and the logits split by
vocabulary (`layers.py`). LoRA follows vLLM's default: a column-parallel projection keeps A
whole and B's slice of rows, a row-parallel one A's slice of columns and B whole, so each
rank's slots are rank-exact and no collective is added.
"""
