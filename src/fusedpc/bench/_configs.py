"""The GPT sizes that the scripts in `scripts/` compare (`compare_trees.py`,
`count_kernels.py`, `matmul_ceiling.py`): each as `GPTConfig` fields and the batch's
`(rows, seq)`, with the bench's vocabulary of 65."""

from __future__ import annotations

from typing import Any

CONFIGS: dict[str, tuple[dict[str, Any], tuple[int, int]]] = {
    # docs/benchmarks.md's S and M
    "S": ({"width": 64, "n_heads": 4, "n_blocks": 2, "ff_width": 256, "max_len": 64}, (16, 64)),
    "M": ({"width": 256, "n_heads": 8, "n_blocks": 4, "ff_width": 1024, "max_len": 128},
          (32, 128)),
    # a tiny GPT for the scripts' --smoke (their tests)
    "smoke": ({"width": 16, "n_heads": 2, "n_blocks": 2, "ff_width": 32, "max_len": 8}, (4, 8)),
}
"""`name -> (GPTConfig fields, (rows, seq))`."""
