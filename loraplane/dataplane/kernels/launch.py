"""Which Triton LoRA kernel a step launches: SGMV (token blocks per segment) or BGMV (one
program per token), decided once per step from the step's segments (`LoRABatch.launch`).

The two kernels launch the same column blocks (rank blocks for the shrink, output blocks for
the expand); they differ in the token dimension of their grids:
- SGMV: `num_segments x cdiv(max_seg_len, block_m)` programs, each covering `block_m` tokens of
  one segment (`sgmv_block_m`: 16 to 64 tokens); a segment shorter than the longest still gets
  every block, and the blocks past its end exit at once.
- BGMV: `num_tokens` programs, each one token, reading its slot and rank from the table.
Every program reads one tile of its slot's weights, so the rule is the grid with fewer programs:
BGMV when `num_tokens <= num_segments * cdiv(max_seg_len, sgmv_block_m(max_seg_len))`, so a
launch is never more than one program per token per column block. Decode steps whose adapters
have a token each, and steps where one adapter has hundreds of tokens and many have one (300
and 100 x 1: 505 SGMV programs against 400), take BGMV; prefill chunks and decodes of adapters
with several rows each (SGMV reads each weight tile once for up to 16-64 of them) take SGMV.
A captured decode graph, which cannot know its segments, always takes BGMV over its b rows
(`cuda_graphs.py`): its launches grow with b, not b^2.
"""

from __future__ import annotations

SGMV = "sgmv"
BGMV = "bgmv"
SGMV_MIN_BLOCK_M = 16  # tl.dot's smallest tile
SGMV_MAX_BLOCK_M = 64


def sgmv_block_m(max_seg_len: int) -> int:
    """SGMV's tokens per program for a step whose longest segment is `max_seg_len`."""
    pow2 = 1 << max(0, max_seg_len - 1).bit_length()
    return min(SGMV_MAX_BLOCK_M, max(SGMV_MIN_BLOCK_M, pow2))


def sgmv_token_blocks(num_segments: int, max_seg_len: int) -> int:
    """The token dimension of SGMV's grid: segments x token blocks of the longest one."""
    return num_segments * -(-max_seg_len // sgmv_block_m(max_seg_len))


def choose_launch(num_segments: int, num_tokens: int, max_seg_len: int) -> str:
    """BGMV when one program per token is no more programs than SGMV's grid, else SGMV."""
    return BGMV if num_tokens <= sgmv_token_blocks(num_segments, max_seg_len) else SGMV
