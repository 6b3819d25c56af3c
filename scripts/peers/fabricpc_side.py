"""FabricPC's side of `scripts/tree_pc_peers.py`: the digits MLP and the fully-PC
transformer, timed and trained as the driver asks (requests: `_worker.py`).

Run with the python of an environment holding `fabricpc==0.6.0` (its own venv: it needs a
newer jax than PCX); the driver starts it, never import it from fusedpc's environment.

The MLP is FabricPC's graph of `Linear` nodes, input -> tanh -> tanh -> softmax, the output
clamped to the one-hot label with `CrossEntropyEnergy` (the cross-entropy is the output's
energy), latents started at the feed-forward values (`FeedforwardStateInit`) and relaxed by
`InferenceSGD`. The weights are the driver's (FabricPC stores `(in, out)`, so the transposes
of the driver's `(out, in)`). The step is `fabricpc.training.make_train_step`; the test
accuracy is `fabricpc.evaluate(..., algorithm="backprop")`, the feed-forward readout.

The transformer is `fabricpc.models.create_deep_transformer` (every node relaxes, muPC
scaling on, rotary positions), trained on the driver's token batches with Adam.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _worker import WARM, first_calls, load, ms_per_step, serve
from fabricpc import evaluate
from fabricpc.core.activations import SoftmaxActivation, TanhActivation
from fabricpc.core.energy import CrossEntropyEnergy
from fabricpc.core.inference import InferenceSGD
from fabricpc.core.topology import Edge
from fabricpc.graph_assembly import TaskMap, graph
from fabricpc.graph_initialization import FeedforwardStateInit, initialize_params
from fabricpc.models import create_deep_transformer
from fabricpc.nodes import Linear
from fabricpc.training import make_train_step

KEY = jax.random.key(0)  # FabricPC's step takes a key; feed-forward initial latents ignore it


def mlp_graph(sizes: list[int], steps: int, rate: float):
    """The input -> tanh ... -> softmax graph of `sizes`, relaxing `steps` times at `rate`."""
    nodes = [Linear(shape=(sizes[0],), name="x")]
    for i, width in enumerate(sizes[1:-1]):
        nodes.append(Linear(shape=(width,), name=f"h{i + 1}", activation=TanhActivation()))
    nodes.append(Linear(shape=(sizes[-1],), name="y", activation=SoftmaxActivation(),
                        energy=CrossEntropyEnergy()))
    edges = [Edge(source=a, target=b.slot("in")) for a, b in zip(nodes, nodes[1:])]
    return graph(nodes=nodes, edges=edges, task_map=TaskMap(x=nodes[0], y=nodes[-1]),
                 inference=InferenceSGD(eta_infer=rate, infer_steps=steps),
                 graph_state_initializer=FeedforwardStateInit())


def given_params(structure, arrays: dict[str, np.ndarray], n_mats: int):
    """FabricPC parameters holding the driver's weights `w<l>` `(out, in)` and `b<l>`."""
    params = initialize_params(structure, KEY)
    names = ["x"] + [f"h{i + 1}" for i in range(n_mats - 1)] + ["y"]
    nodes = dict(params.nodes)
    for l, name in enumerate(names[1:]):
        node = nodes[name]
        (edge,) = node.weights
        weights = {edge: jnp.asarray(arrays[f"w{l}"].T)}
        biases = {"b": jnp.asarray(arrays[f"b{l}"])[None, :]}
        assert weights[edge].shape == node.weights[edge].shape, (name, node.weights[edge].shape)
        nodes[name] = node._replace(weights=weights, biases=biases)
    return params._replace(nodes=nodes)


class Side:
    """What the side holds between requests: the data and the built steps."""

    def __init__(self):
        self.arrays: dict[str, np.ndarray] = {}
        self.timed: dict[str, dict] = {}

    def load(self, path: str) -> dict:
        self.arrays = load(path)
        return {"fabricpc": __import__("fabricpc").__version__, "jax": jax.__version__}

    def _mlp(self, steps: int, rate: float, lr: float):
        a = self.arrays
        sizes = [int(s) for s in a["sizes"]]
        structure = mlp_graph(sizes, steps, rate)
        params = given_params(structure, a, len(sizes) - 1)
        optimiser = optax.adam(lr)
        return structure, params, optimiser, optimiser.init(params)

    def _batches(self, rows: np.ndarray) -> list[dict]:
        a = self.arrays
        return [{"x": jnp.asarray(a["x_train"][r]), "y": jnp.asarray(a["y_train"][r])}
                for r in rows]

    def mlp_build(self, name: str, steps: int, rate: float, lr: float) -> dict:
        structure, params, optimiser, opt_state = self._mlp(steps, rate, lr)
        order = self.arrays["order"]
        self.timed[name] = {"step": make_train_step(structure, optimiser), "params": params,
                            "opt_state": opt_state, "at": 0, "last": None,
                            "batches": self._batches(order.reshape(-1, order.shape[-1]))}
        return {"first_call_s": self._warm(name)}

    def _one(self, name: str, i: int) -> None:
        t = self.timed[name]
        b = t["batches"][(t["at"] + i) % len(t["batches"])]
        t["params"], t["opt_state"], t["last"], _ = t["step"](t["params"], t["opt_state"], b, KEY)

    def _sync(self, name: str) -> None:
        jax.block_until_ready(self.timed[name]["last"])

    def _warm(self, name: str) -> float:
        seconds = first_calls(lambda i: self._one(name, i), lambda: self._sync(name))
        self.timed[name]["at"] = WARM
        return seconds

    def time(self, name: str, n: int) -> dict:
        ms = ms_per_step(n, lambda i: self._one(name, i), lambda: self._sync(name))
        self.timed[name]["at"] += n
        return {"ms": ms}

    def mlp_train(self, steps: int, rate: float, lr: float) -> dict:
        structure, params, optimiser, opt_state = self._mlp(steps, rate, lr)
        step = make_train_step(structure, optimiser)
        a = self.arrays
        for epoch in a["order"]:
            for b in self._batches(epoch):
                params, opt_state, _, _ = step(params, opt_state, b, KEY)
        rows = a["y_test"].shape[0]
        width = a["order"].shape[-1]
        test = [(a["x_test"][i:i + width], a["y_test"][i:i + width])
                for i in range(0, rows, width)]
        result = evaluate(params, structure, test, {}, KEY, algorithm="backprop")
        return {"test_accuracy": float(result["accuracy"])}

    def gpt_build(self, name: str, width: int, n_heads: int, n_blocks: int, ff_width: int,
                  vocab: int, steps: int, rate: float, lr: float) -> dict:
        xs, ys = self.arrays["xs"], self.arrays["ys"]
        structure = create_deep_transformer(
            depth=n_blocks, embed_dim=width, num_heads=n_heads, mlp_dim=ff_width,
            seq_len=xs.shape[-1], vocab_size=vocab,
            inference=InferenceSGD(eta_infer=rate, infer_steps=steps))
        params = initialize_params(structure, KEY)
        optimiser = optax.adam(lr)
        opt_state = optimiser.init(params)
        step = make_train_step(structure, optimiser)
        batches = [{"x": jnp.asarray(x), "y": jnp.asarray(y)} for x, y in zip(xs, ys)]
        self.timed[name] = {"step": step, "params": params, "opt_state": opt_state,
                            "batches": batches, "at": 0, "last": None}
        n_params = sum(int(v.size) for v in jax.tree_util.tree_leaves(params))
        return {"first_call_s": self._warm(name), "params": n_params}


if __name__ == "__main__":
    side = Side()
    serve({"load": side.load, "mlp_build": side.mlp_build, "mlp_train": side.mlp_train,
           "gpt_build": side.gpt_build, "time": side.time})
