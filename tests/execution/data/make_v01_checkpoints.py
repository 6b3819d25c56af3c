"""Writes the release-0.1 checkpoints that test_checkpoint.py loads (run with 0.1 on the path:
`git worktree add /tmp/v01 bd87611 && PYTHONPATH=/tmp/v01/src python make_v01_checkpoints.py`).

Release 0.1 stored frozen parameters as dicts (`['weight']`, in sorted key order) and the
frozen LayerNorm's `eps` as a leaf; later releases must still load these files.
"""

import pathlib
import sys

import jax
import optax

import fusedpc

OUT = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).parent)
CASES = {"ff_head": dict(learn="ff_head"), "none_tuple": dict(learn="none", scan=False)}

for name, settings in CASES.items():
    config = fusedpc.GPTConfig(
        vocab_size=11, width=16, n_heads=2, n_blocks=2, ff_width=32, max_len=8, **settings
    )
    part, _ = fusedpc.build_gpt(config, optax.adam(1e-3), jax.random.key(0))
    pipeline = fusedpc.FusedPipeline(part, error_fn=config.error_fn)
    ids = jax.random.randint(jax.random.key(1), (2, 8), 0, 11)
    pipeline.step(ids, ids)
    pipeline.save(str(OUT / f"v0.1_{name}.fpc"), metadata={"made_by": fusedpc.__version__})
    print(name, "saved")
