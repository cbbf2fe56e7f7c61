"""experiments.compare_blocks parses its variants into BlockSizes: "default", or `+`-joined overrides (ints,
True / False, "auto"; strings for the fp32_dots fields); an invalid value is the BlockSizes ValueError."""
import pytest

from experiments.compare_blocks import blocks_of
from pallas_kernels.gpu.config import DEFAULT_BLOCKS


def test_variants():
  assert blocks_of("default") is DEFAULT_BLOCKS
  b = blocks_of("warps_scores=4+fp32_dots_bf16=tf32x3+chunk_channel_forward=0")
  assert (b.warps_scores, b.fp32_dots_bf16, b.chunk_channel_forward) == (4, "tf32x3", 0)
  assert b.block_k_scores == DEFAULT_BLOCKS.block_k_scores
  b = blocks_of("scores_tiles=False+predecay=auto+fuse_inter=True")
  assert (b.scores_tiles, b.predecay, b.fuse_inter) == (False, "auto", True)
  with pytest.raises(ValueError, match="fp32_dots_bf16"):
    blocks_of("fp32_dots_bf16=fp16")
  with pytest.raises(ValueError, match="predecay"):
    blocks_of("predecay=maybe")
