"""PCX's side of `scripts/tree_pc_peers.py`: the digits MLP, timed and trained as the driver
asks (requests: `_worker.py`).

Run with the python of an environment holding `pcx==0.6.3` (its own venv: PCX pins
jax < 0.5 and equinox < 0.12); the driver starts it, never import it from fusedpc's
environment.

The model is PCX's usual MLP: `pcx.nn.Linear` layers, a `Vode` (squared-error energy) after
each hidden tanh and a cross-entropy `Vode` on the logits whose value is frozen at the one-hot
label. One step, as PCX's own examples write it: a forward in the `init` status (every vode
starts at its feed-forward value), T gradient steps of the vodes on the batch's energy with
`optax.sgd(rate)` (a Python loop inside the one `pcx.functional.jit`), then one gradient step
of the weights with Adam, the gradient summed over rows and scaled by 1 / rows. The test
accuracy is the feed-forward readout (`init` status), in batches of the training batch size
(PCX's vodes keep that size).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pcx.functional as pxf
import pcx.nn as pxnn
import pcx.predictive_coding as pxc
import pcx.utils as pxu
from _worker import WARM, first_calls, load, ms_per_step, serve


class MLP(pxc.EnergyModule):
    """Linear layers of the driver's weights, a vode after each tanh, a cross-entropy vode
    on the logits."""

    def __init__(self, arrays: dict[str, np.ndarray]):
        super().__init__()
        sizes = [int(s) for s in arrays["sizes"]]
        self.layers = []
        for l, (a, b) in enumerate(zip(sizes, sizes[1:])):
            layer = pxnn.Linear(a, b)
            layer.nn.weight.set(jnp.asarray(arrays[f"w{l}"]))  # eqx layout (out, in)
            layer.nn.bias.set(jnp.asarray(arrays[f"b{l}"]))
            self.layers.append(layer)
        self.vodes = [pxc.Vode() for _ in sizes[1:-1]] + [pxc.Vode(pxc.ce_energy)]
        self.vodes[-1].h.frozen = True

    def __call__(self, x, y=None):
        for layer, vode in zip(self.layers[:-1], self.vodes[:-1]):
            x = vode(jnp.tanh(layer(x)))
        x = self.vodes[-1](self.layers[-1](x))
        if y is not None:
            self.vodes[-1].set("h", y)
        return self.vodes[-1].get("u")


_PER_ROW = pxu.M(pxc.VodeParam | pxc.VodeParam.Cache).to((None, 0))


@pxf.vmap(_PER_ROW, in_axes=(0, 0), out_axes=0)
def forward(x, y, *, model):
    return model(x, y)


@pxf.vmap(_PER_ROW, in_axes=(0,), out_axes=(None, 0), axis_name="batch")
def energy(x, *, model):
    out = model(x)
    return jax.lax.psum(model.energy(), "batch"), out


def free_vodes() -> pxu.M:
    """The vodes that relax (all but the frozen label); a fresh mask each time, as `.to`
    changes the mask it is called on."""
    return pxu.M_hasnot(pxc.VodeParam, frozen=True)


@pxf.jit(static_argnums=0)
def train_step(steps, x, y, *, model, optim_w, optim_h):
    with pxu.step(model, pxc.STATUS.INIT, clear_params=pxc.VodeParam.Cache):
        forward(x, y, model=model)
    optim_h.init(free_vodes()(model))
    for _ in range(steps):
        with pxu.step(model, clear_params=pxc.VodeParam.Cache):
            _, grads = pxf.value_and_grad(free_vodes().to([False, True]), has_aux=True)(
                energy)(x, model=model)
        optim_h.step(model, grads["model"])
    optim_h.clear()
    with pxu.step(model, clear_params=pxc.VodeParam.Cache):
        (total, _), grads = pxf.value_and_grad(
            pxu.M_hasnot(pxnn.LayerParam).to([False, True]), has_aux=True)(energy)(
            x, model=model)
    optim_w.step(model, grads["model"], scale_by=1.0 / x.shape[0])
    return total


@pxf.jit()
def readout(x, *, model):
    with pxu.step(model, pxc.STATUS.INIT, clear_params=pxc.VodeParam.Cache):
        return forward(x, None, model=model)


class Side:
    """What the side holds between requests: the data and the built models."""

    def __init__(self):
        self.arrays: dict[str, np.ndarray] = {}
        self.timed: dict[str, dict] = {}

    def load(self, path: str) -> dict:
        self.arrays = load(path)
        return {"pcx": _version("pcx"), "jax": jax.__version__}

    def _mlp(self, lr: float, rate: float):
        model = MLP(self.arrays)
        optim_h = pxu.Optim(lambda: optax.sgd(rate))
        optim_w = pxu.Optim(lambda: optax.adam(lr), pxu.M(pxnn.LayerParam)(model))
        return model, optim_w, optim_h

    def _batches(self, rows: np.ndarray) -> list[tuple[jax.Array, jax.Array]]:
        a = self.arrays
        classes = int(a["sizes"][-1])
        return [(jnp.asarray(a["x_train"][r]),
                 jax.nn.one_hot(jnp.asarray(a["y_train"][r]), classes)) for r in rows]

    def mlp_build(self, name: str, steps: int, rate: float, lr: float) -> dict:
        model, optim_w, optim_h = self._mlp(lr, rate)
        order = self.arrays["order"]
        self.timed[name] = {"steps": steps, "model": model, "optim_w": optim_w,
                            "optim_h": optim_h, "at": 0, "last": None,
                            "batches": self._batches(order.reshape(-1, order.shape[-1]))}
        seconds = first_calls(lambda i: self._one(name, i), lambda: self._sync(name))
        self.timed[name]["at"] = WARM
        return {"first_call_s": seconds}

    def _one(self, name: str, i: int) -> None:
        t = self.timed[name]
        x, y = t["batches"][(t["at"] + i) % len(t["batches"])]
        t["last"] = train_step(t["steps"], x, y, model=t["model"], optim_w=t["optim_w"],
                               optim_h=t["optim_h"])

    def _sync(self, name: str) -> None:
        jax.block_until_ready(self.timed[name]["last"])

    def time(self, name: str, n: int) -> dict:
        ms = ms_per_step(n, lambda i: self._one(name, i), lambda: self._sync(name))
        self.timed[name]["at"] += n
        return {"ms": ms}

    def mlp_train(self, steps: int, rate: float, lr: float) -> dict:
        model, optim_w, optim_h = self._mlp(lr, rate)
        a = self.arrays
        for epoch in a["order"]:
            for x, y in self._batches(epoch):
                train_step(steps, x, y, model=model, optim_w=optim_w, optim_h=optim_h)
        width = a["order"].shape[-1]
        rows = a["x_test"].shape[0]
        padded = np.zeros((-(-rows // width) * width, a["x_test"].shape[1]), np.float32)
        padded[:rows] = a["x_test"]
        logits = np.concatenate([np.asarray(readout(jnp.asarray(padded[i:i + width]),
                                                    model=model))
                                 for i in range(0, padded.shape[0], width)])[:rows]
        return {"test_accuracy": float(np.mean(np.argmax(logits, -1) == a["y_test"]))}


def _version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


if __name__ == "__main__":
    side = Side()
    serve({"load": side.load, "mlp_build": side.mlp_build, "mlp_train": side.mlp_train,
           "time": side.time})
