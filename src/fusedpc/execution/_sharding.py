"""Scale-out on JAX's own sharding: device meshes, state placement, multi-host helpers.

Data parallelism here is not a hand-written all-reduce. The batch is placed with
`NamedSharding(mesh, P("data"))` (rows split over the devices), the state with `P()` (a full
copy on every device), and the same step program is compiled for that placement. Every local
learning step takes a row mean,

$$\\Delta W = \\frac{1}{R} \\sum_{r=1}^{R} u_r \\otimes a_r
            = \\frac{1}{R} \\sum_{d=1}^{D} \\sum_{r \\in \\text{rows}(d)} u_r \\otimes a_r,$$

and XLA's sharding propagation turns the outer sum over the $D$ devices into an `all-reduce`;
the state leaving the step is pinned to the sharding it came in with (`out_shardings`), so the
donated buffers are reused in place.

Optionally the widest weights may also be split over a `"model"` axis (`shard_widest`); the
compiler then inserts the gathers and reductions that the matmuls over those weights need.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any, overload

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

PyTree = Any
DATA_AXIS = "data"
MODEL_AXIS = "model"
StateSharding = Callable[[str, Any], PartitionSpec | None]


# --------------------------------------------------------------------------- meshes
def data_mesh(
    n_devices: int | None = None,
    *,
    model: int = 1,
    devices: Sequence[jax.Device] | None = None,
) -> Mesh:
    """A mesh with a `"data"` axis (and a `"model"` axis when `model > 1`).

    Args:
        n_devices: how many devices in all (`data * model`); default every device JAX sees,
            which in a multi-host run (after `initialize_distributed`) is every device of every
            process: a data-parallel mesh must span them all.
        model: the size of the `"model"` axis (1: no model axis, pure data parallelism).
        devices: the devices to use (default `jax.devices()`); the first `n_devices` are taken.

    The axes are `AxisType.Auto`: the compiler propagates shardings through the step and
    inserts the cross-device reductions itself.
    """
    available = list(jax.devices() if devices is None else devices)
    n = len(available) if n_devices is None else int(n_devices)
    if n < 1 or n > len(available):
        raise ValueError(
            f"data_mesh: n_devices must be between 1 and the {len(available)} available "
            f"devices, got {n_devices!r}. On CPU, emulate more devices with "
            "fusedpc.training.emulate_cpu_devices(n) before JAX starts."
        )
    if model < 1 or n % model:
        raise ValueError(
            f"data_mesh: model={model!r} must be >= 1 and divide n_devices={n}."
        )
    shape: tuple[int, ...]
    names: tuple[str, ...]
    if model == 1:
        shape, names = (n,), (DATA_AXIS,)
    else:
        shape, names = (n // model, model), (DATA_AXIS, MODEL_AXIS)
    return jax.make_mesh(
        shape, names, axis_types=(AxisType.Auto,) * len(names), devices=available[:n]
    )


@overload
def resolve_mesh(mesh: Mesh) -> Mesh: ...


@overload
def resolve_mesh(mesh: None) -> None: ...


@overload
def resolve_mesh(mesh: Mesh | None) -> Mesh | None: ...


def resolve_mesh(mesh: Mesh | None) -> Mesh | None:
    """Check that `mesh` has a `"data"` axis and return it with every axis `Auto`.

    `jax.make_mesh` gives `Explicit` axes by default, which ask every gather and matmul in the
    parts to name its output sharding; the step program relies on propagation instead, so the
    same devices and axis names are kept and the axis types set to `Auto`.
    """
    if mesh is None:
        return None
    if not isinstance(mesh, Mesh):
        raise TypeError(
            f"mesh: expected a jax.sharding.Mesh (e.g. fusedpc.data_mesh()), got "
            f"{type(mesh).__name__}."
        )
    if DATA_AXIS not in mesh.axis_names:
        raise ValueError(
            f"mesh: expected a mesh with a {DATA_AXIS!r} axis, got axes {mesh.axis_names}; "
            "build one with fusedpc.data_mesh() or jax.make_mesh((n,), ('data',))."
        )
    if all(t == AxisType.Auto for t in mesh.axis_types):
        return mesh
    return mesh.update(axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def batch_sharding(mesh: Mesh, ndim: int, axis: int = 0) -> NamedSharding:
    """Rows along `axis` split over `"data"`, every other axis whole."""
    spec: list[str | None] = [None] * ndim
    spec[axis] = DATA_AXIS
    return NamedSharding(mesh, PartitionSpec(*spec))


def check_batch_divides(size: int, mesh: Mesh, axis: int) -> None:
    """A clear error when a batch axis of `size` rows does not split evenly over `"data"`."""
    n = mesh.shape[DATA_AXIS]
    if size % n:
        options = " or ".join(str(m) for m in sorted({size - size % n, size - size % n + n}) if m)
        raise ValueError(
            f"batch: the batch axis (axis {axis}, size {size}) must divide over the mesh's "
            f"'data' axis of {n} devices; use a multiple of {n} rows (e.g. {options}). Padding "
            "is yours to do, with rows whose error_fn gives a zero error (see docs/scaling.md)."
        )


def shard_batch(x: Any, mesh: Mesh | None, axis: int = 0) -> Any:
    """`x` placed with its rows (along `axis`) split over the mesh's `"data"` axis, every
    other axis whole; without a mesh, `x` as it is. Refuses rows that do not divide.

    Args:
        x: a host or device array.
        mesh: a mesh with a `"data"` axis, or None.
        axis: the row axis (0 for `step`'s batches, 1 for `run`'s `(K, rows, ...)`).

    Returns:
        The placed array (or `x` unchanged without a mesh).
    """
    if mesh is None:
        return x
    if not isinstance(x, jax.Array):
        x = jnp.asarray(x)
    check_batch_divides(x.shape[axis], mesh, axis)
    return jax.device_put(x, batch_sharding(mesh, x.ndim, axis))


# --------------------------------------------------------------------------- state placement
def state_shardings(
    state: PyTree, mesh: Mesh, state_sharding: StateSharding | None = None
) -> PyTree:
    """The `NamedSharding` of every state leaf: replicated, unless `state_sharding(path, leaf)`
    returns a `PartitionSpec` for it (`path` is `jax.tree_util.keystr` of the leaf's key path,
    e.g. `".blocks.blocks.feed_forward.params.weights[0]"`; `None` means replicated)."""

    def one(path, leaf):
        spec = None if state_sharding is None else state_sharding(jax.tree_util.keystr(path), leaf)
        spec = PartitionSpec() if spec is None else spec
        if not isinstance(spec, PartitionSpec):
            raise TypeError(
                f"state_sharding: expected a PartitionSpec or None for leaf "
                f"{jax.tree_util.keystr(path)}, got {spec!r}."
            )
        for dim, names in enumerate(spec):
            names = (names,) if isinstance(names, str) else (names or ())
            size = int(np.prod([mesh.shape[n] for n in names])) if names else 1
            if dim >= np.ndim(leaf) or np.shape(leaf)[dim] % size:
                raise ValueError(
                    f"state_sharding: leaf {jax.tree_util.keystr(path)} of shape "
                    f"{tuple(np.shape(leaf))} cannot be split as {spec} over mesh axes "
                    f"{dict(mesh.shape)}; return a spec whose axes divide the leaf's."
                )
        return NamedSharding(mesh, spec)

    return jax.tree_util.tree_map_with_path(one, state)


def shard_widest(
    mesh: Mesh, min_size: int = 1 << 16, axis: str = MODEL_AXIS
) -> StateSharding:
    """A `state_sharding` rule: split the wider of each matrix's last two axes over `axis`.

    Leaves with at least two axes and at least `min_size` entries qualify (feed-forward,
    head, embedding and attention weights, and their optimiser moments, which share their
    shapes); the wider of the last two axes (the first on a tie) is split when `axis`'s size
    in `mesh` divides it. Leading axes are never split, so a scanned stack of blocks keeps
    its block axis whole. Everything else stays replicated.
    """
    if axis not in mesh.axis_names:
        raise ValueError(
            f"shard_widest: the mesh has no {axis!r} axis (axes {mesh.axis_names}); build one "
            "with fusedpc.data_mesh(n, model=m)."
        )
    size = mesh.shape[axis]

    def rule(path: str, leaf: Any) -> PartitionSpec | None:
        del path
        shape = np.shape(leaf)
        if len(shape) < 2 or int(np.prod(shape)) < min_size:
            return None
        dim = len(shape) - 2 if shape[-2] >= shape[-1] else len(shape) - 1
        if shape[dim] % size:
            return None
        spec: list[str | None] = [None] * len(shape)
        spec[dim] = axis
        return PartitionSpec(*spec)

    return rule


# --------------------------------------------------------------------------- multi-host
ENV_COORDINATOR = "FUSEDPC_COORDINATOR"
ENV_NUM_PROCESSES = "FUSEDPC_NUM_PROCESSES"
ENV_PROCESS_ID = "FUSEDPC_PROCESS_ID"


def initialize_distributed(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    **kwargs: Any,
) -> None:
    """Join a multi-process (multi-host) JAX run; call once per process before using devices.

    The three settings come from the arguments, else from the environment variables
    `FUSEDPC_COORDINATOR` (`host:port` of process 0), `FUSEDPC_NUM_PROCESSES` and
    `FUSEDPC_PROCESS_ID`, else from `jax.distributed.initialize`'s own cluster detection
    (Slurm, Open MPI, Kubernetes, TPU pods; `JAX_COORDINATOR_ADDRESS`). Give all three or
    none. A local launch of 2 processes on one machine: process `i` calls
    `initialize_distributed("127.0.0.1:12345", 2, i)`. CPU processes exchange their
    reductions over gloo. Extra keyword arguments go to `jax.distributed.initialize`
    (`local_device_ids`, `initialization_timeout`, ...).
    """
    if coordinator is None and num_processes is None and process_id is None:
        coordinator = os.environ.get(ENV_COORDINATOR) or None
        num_processes = _env_int(ENV_NUM_PROCESSES)
        process_id = _env_int(ENV_PROCESS_ID)
    given = [coordinator is None, num_processes is None, process_id is None]
    if any(given) and not all(given):
        raise ValueError(
            "initialize_distributed: give coordinator, num_processes and process_id together "
            f"(as arguments or as {ENV_COORDINATOR}, {ENV_NUM_PROCESSES}, {ENV_PROCESS_ID}), or "
            "none of them (read from the cluster's environment); got "
            f"coordinator={coordinator!r}, num_processes={num_processes!r}, "
            f"process_id={process_id!r}."
        )
    # jax.config's flags are attributes made at runtime, unknown to its type stubs
    if jax.config.jax_cpu_collectives_implementation is None:  # type: ignore[attr-defined]
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=coordinator,
        num_processes=num_processes,
        process_id=process_id,
        **kwargs,
    )


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}: expected an integer, got {value!r}.") from None


def process_batch_slice(
    global_batch: int, process_index: int | None = None, process_count: int | None = None
) -> slice:
    """The rows of a global batch that this process feeds: the `process_index`-th of
    `process_count` equal, contiguous slices (defaults: `jax.process_index()`,
    `jax.process_count()`)."""
    index = jax.process_index() if process_index is None else int(process_index)
    count = jax.process_count() if process_count is None else int(process_count)
    if global_batch % count:
        raise ValueError(
            f"process_batch_slice: the global batch of {global_batch} rows must divide over "
            f"{count} processes; use a multiple of {count}."
        )
    per = global_batch // count
    return slice(index * per, (index + 1) * per)


def make_global_batch(local_array: Any, mesh: Mesh, axis: int = 0) -> jax.Array:
    """One global array, rows split over `"data"`, from each process's own rows.

    Every process calls it with its slice (`process_batch_slice`) along `axis` (0 for `step`,
    1 for `run`'s `(K, B, ...)` arrays); the global batch has `process_count` times the rows.
    Pass the result to `FusedPipeline.step` / `run` as is.
    """
    local_array = np.asarray(local_array)
    sharding = batch_sharding(resolve_mesh(mesh), local_array.ndim, axis)
    return jax.make_array_from_process_local_data(sharding, local_array)
