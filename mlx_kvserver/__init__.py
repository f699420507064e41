"""mlx-kvserver: a local OpenAI-compatible chat server on MLX with a paged, persistent KV cache."""

import os

# NOTE: on CUDA, MLX runs float32 matmuls in TF32 by default; measured on an H100, greedy answers
# with the cache then differed from those without it (prefills of other lengths round
# differently). Exact reuse comes first: TF32 is off unless the user asks for it. No effect on
# the CPU or Metal backends.
os.environ.setdefault("MLX_ENABLE_TF32", "0")
