"""A learning part written only in the tests (`helpers.DeltaLinear`, and the example of
`docs/architecture.md`) runs fused inside trees of built-in parts, reports under its path,
learns, and matches `jax.grad` + the same optimiser step for step."""

from __future__ import annotations

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import (
    DeltaLinear,
    assert_tree_allclose,
    delta_linear,
    linear_params,
    norm_rel_error,
    normal,
)

import fusedpc
from fusedpc import frozen

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs"


def _regression_task(steps: int, rows: int = 32):
    """A smooth teacher $t = \\sin(x A^\\top)$ on fresh batches: `(steps, rows, 4) -> (.., 2)`."""
    teacher = normal(50, (2, 4)) / np.float32(2.0)
    xs = normal(51, (steps, rows, 4))
    return xs, jnp.sin(xs @ teacher.T)


def _hybrid_tree() -> fusedpc.Sequential:
    return fusedpc.Sequential(
        [
            delta_linear(60, 4, 6, optax.adam(3e-2)),
            frozen.tanh(),
            fusedpc.Residual(
                fusedpc.Sequential(
                    [frozen.layer_norm(width=6), delta_linear(61, 6, 6, optax.adam(1e-2))]
                )
            ),
            frozen.gelu(),
            delta_linear(62, 6, 2, optax.adam(3e-2)),
        ]
    )


def test_user_part_trains_fused_in_a_hybrid_tree_and_reports_its_path():
    xs, targets = _regression_task(steps=150)
    pipeline = fusedpc.FusedPipeline(_hybrid_tree())
    _, _, metrics = pipeline.run(xs, targets, keep_outputs=False)
    losses = np.asarray(metrics.loss)
    assert np.all(np.isfinite(losses)) and bool(np.all(np.asarray(metrics.committed)))
    assert losses[-10:].mean() < 0.2 * losses[:10].mean(), losses[[0, 10, 50, 100, -1]]

    report = pipeline.report()
    assert [row["part"] for row in report] == ["parts[0]", "parts[2].branch.parts[1]", "parts[4]"]
    assert [row["layer_sizes"] for row in report] == [[4, 6], [6, 6], [6, 2]]
    assert all(row["finite"] and row["update_norm"] > 0 for row in report)

    merged = pipeline.merge()
    assert isinstance(merged.parts[2].branch.parts[1], DeltaLinear)
    # The trained tree, rebuilt from the merge, predicts what the pipeline predicts.
    again = fusedpc.FusedPipeline(merged)
    assert_tree_allclose(again.predict(xs[0]), pipeline.predict(xs[0]), rtol=1e-6, atol=1e-7)


def _params(pipeline_or_tree) -> list[dict[str, jax.Array]]:
    tree = pipeline_or_tree.merge() if hasattr(pipeline_or_tree, "merge") else pipeline_or_tree
    return [
        {"weight": tree.parts[0].weight, "bias": tree.parts[0].bias},
        {"weight": tree.parts[2].branch.weight, "bias": tree.parts[2].branch.bias},
    ]


def _twin(params, frozen_weight, frozen_bias, x):
    """Plain JAX twin of the tree below."""
    h = jnp.tanh(x @ params[0]["weight"].T + params[0]["bias"])
    h = h + (h @ params[1]["weight"].T + params[1]["bias"])
    return h @ frozen_weight.T + frozen_bias


def test_one_step_equals_jax_grad_of_the_mean_loss_and_the_same_optimiser():
    make_optimiser = lambda: optax.adam(1e-2)  # noqa: E731 - one per part, as in the tree
    w, b = linear_params(70, 5, 3)
    tree = fusedpc.Sequential(
        [
            delta_linear(71, 4, 5, make_optimiser()),
            frozen.tanh(),
            fusedpc.Residual(delta_linear(72, 5, 5, make_optimiser())),
            frozen.linear(w, b),
        ]
    )
    x, target = normal(73, (8, 4)), normal(74, (8, 3))
    params = _params(tree)

    def mean_loss(params, x):
        diff = _twin(params, w, b, x) - target
        return 0.5 * jnp.mean(jnp.sum(diff * diff, axis=-1))

    @jax.jit
    def oracle(params, x):
        grads = jax.grad(mean_loss)(params, x)
        expected = []
        for p, g in zip(params, grads, strict=True):
            optimiser = make_optimiser()
            with jax.numpy_dtype_promotion("standard"):  # optax's adam: see helpers.DeltaLinear
                updates, _ = optimiser.update(g, optimiser.init(p), p)
            expected.append(optax.apply_updates(p, updates))
        # Per-row input errors: the gradient of the SUM over rows (the mean times the rows).
        return expected, jax.grad(mean_loss, argnums=1)(params, x) * x.shape[0]

    expected, expected_input_error = oracle(params, x)

    pipeline = fusedpc.FusedPipeline(tree, error_normalisation="rows")
    _, input_error = pipeline.step(x, target)
    got = _params(pipeline)
    for part in range(2):
        for name in ("weight", "bias"):
            error = norm_rel_error(got[part][name], expected[part][name])
            assert error <= 1e-5, (part, name, error)
    assert norm_rel_error(input_error, expected_input_error) <= 1e-5
    # Adam's first step moves every weight by about its rate: this is not a trivial match.
    assert norm_rel_error(got[0]["weight"], params[0]["weight"]) > 1e-3


def _docs_example(name: str = "own-part") -> str:
    text = (DOCS / "architecture.md").read_text()
    pattern = rf"<!-- example: {re.escape(name)} -->\s*```python\n(.*?)```"
    match = re.search(pattern, text, re.DOTALL)
    assert match, f"docs/architecture.md lost its `<!-- example: {name} -->` code block"
    return match.group(1)


def _run_docs_example(name: str) -> dict:
    namespace: dict = {"__name__": "docs_example"}
    # run as the standalone script it is: not under this module's `from __future__` imports
    code = compile(_docs_example(name), "docs/architecture.md", "exec", dont_inherit=True)
    exec(code, namespace)  # noqa: S102
    return namespace


@pytest.mark.slow
def test_the_guide_examples_of_frozen_parts_and_of_calling_parts_run(capsys):
    # The three other ways of the guide's "Writing your own part", as printed there.
    def checked(line: str) -> float:  # the worst error printed as "BackwardCheck(6.2e-08: ..."
        assert line.startswith("BackwardCheck("), line
        return float(line[len("BackwardCheck("):].split(":")[0])

    hand = _run_docs_example("frozen-part")
    assert checked(capsys.readouterr().out) <= 1e-6  # float32 rounding
    assert fusedpc.check_backward(hand["part"], hand["x"]) <= 1e-6
    autodiff = _run_docs_example("autodiff-part")
    printed = capsys.readouterr().out.splitlines()
    assert checked(printed[0]) <= 1e-6 and "MLP" in printed[1]
    assert autodiff["pipeline"].steps == 1
    called = _run_docs_example("callable-part")
    assert capsys.readouterr().out.strip() == "(3, 2)"
    trained, h = called["trained"], called["h"]
    np.testing.assert_allclose(trained(h), called["pipeline"].predict(h), atol=1e-6)


def test_the_architecture_guide_example_runs_and_learns(capsys):
    namespace = _run_docs_example("own-part")
    pipeline = namespace["pipeline"]
    x, target = namespace["x"], namespace["target"]
    printed = capsys.readouterr().out
    assert "'part': 'parts[0]'" in printed and "'layer_sizes': [3, 3]" in printed
    # Started at scale 1 against a teacher of scale 2: the scale moved towards 2 and the
    # squared error fell well below its starting value.
    scale = np.asarray(pipeline.merge().parts[0].scale)
    assert np.all(scale > 1.5), scale
    start = float(jnp.mean((jnp.tanh(x) - target) ** 2))
    now = float(jnp.mean((pipeline.predict(x) - target) ** 2))
    assert now < 0.1 * start, (start, now)
    assert fusedpc.check_backward(pipeline.merge(), x) <= 1e-5
