"""The bench's settings: one frozen `BenchArgs`, built from the command line once and handed
whole to every measuring process (as JSON)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import warnings
from typing import Any

from fusedpc._deprecation import warn_deprecated
from fusedpc.cli._flags import parse_bool
from fusedpc.training import HOST_MEMORY_MODES, OPTIMISERS

VARIANTS = ("fused", "fused_run", "unfused", "backprop")
"""The variants measured by default (one depth)."""
UNROLLED_VARIANTS = ("fused_unrolled", "fused_run_unrolled")
"""Fused variants with the blocks as a `Blocks` chain, unrolled (`GPTConfig(scan=False)`)."""
SCANNED_VARIANTS = ("fused_scan", "fused_run_scan")
"""Fused variants with the blocks always scanned (`GPTConfig(scan=True)`)."""
SWEEP_VARIANTS = ("fused_scan", "fused_unrolled")
"""The variants a depth sweep measures by default."""
PROBES = ("peak", "donation")
"""Measurements that are not a training step: the matmul peak and the donation probe."""
GUARD_VARIANTS = ("fused_guards", "fused_unguarded")
"""`fused` with every guard on (`max_update_ratio`, `loss_spike`, bounds loose enough that
nothing is skipped) and with none (`nonfinite="ignore"`): the guards' cost, side by side with
`fused` (the default rule)."""
CADENCE_VARIANTS = ("fused_run_cadence",)
"""`fused_run` with the parts' report norms on the call's last step only
(`run(..., report_every=k)`)."""
CALIBRATED_VARIANTS = ("fused_calibrated", "fused_run_calibrated")
"""`fused` and `fused_run` with every optimiser carrying a rate multiplier
(`fusedpc.training.with_rate_multiplier`, as `fusedpc train --calibrate` builds them): the
automatic calibration's cost per step, side by side with `fused` and `fused_run`."""
ITERATIVE_VARIANTS = ("fused_iterative", "fused_run_iterative")
"""`fused` and `fused_run` with every feed-forward learning by iterative inference
(`GPTConfig(learning_kind="iterative")`, `--inference-steps` relaxation steps at
`--inference-rate`): its cost, side by side with the single-sweep `fused` and the twin."""
TREE_PC_VARIANTS = ("fused_tree_pc", "fused_run_tree_pc")
"""`fused` and `fused_run` of the fully-PC GPT (`GPTConfig(latents="all")`: a latent after
every slot, relaxed on the whole transformer's energy for `--inference-steps` sweeps at
`--inference-rate`, `fusedpc.Relaxation`): its cost, side by side with the single sweep and
the twin."""
INFILL_VARIANTS = ("infill",)
"""Not a training step: one call of `fusedpc.transformer.infill` on the batch (every 8th
token hidden, relaxed for `--inference-steps` sweeps at `--inference-rate` as generative
latents; `fusedpc infill`): what filling in costs, side by side with a step."""
RUN_VARIANTS = (
    "fused_run", "fused_run_scan", "fused_run_unrolled", *CADENCE_VARIANTS,
    "fused_run_calibrated", "fused_run_iterative", "fused_run_tree_pc",
)
"""The variants that time `FusedPipeline.run` (`k` steps per call)."""
FUSED_VARIANTS = (
    "fused", "fused_run", *SCANNED_VARIANTS, *UNROLLED_VARIANTS, *GUARD_VARIANTS,
    *CADENCE_VARIANTS, *CALIBRATED_VARIANTS, *ITERATIVE_VARIANTS, *TREE_PC_VARIANTS,
)
"""Every variant that runs a `FusedPipeline`."""
ALL_VARIANTS = (
    VARIANTS + UNROLLED_VARIANTS + SCANNED_VARIANTS + GUARD_VARIANTS + CADENCE_VARIANTS
    + CALIBRATED_VARIANTS + ITERATIVE_VARIANTS + TREE_PC_VARIANTS + INFILL_VARIANTS + PROBES
)
"""Every name `--variants` accepts, besides the iterative and tree-PC variants at a given T
(`fused_iterative_T16`, `fused_run_tree_pc_T4`: see `base_variant`)."""

_AT_STEPS = re.compile(r"(fused(?:_run)?_(?:iterative|tree_pc)|infill)_T([0-9]+)")


def base_variant(variant: str) -> str:
    """The variant a name measures: `fused_iterative_T16` (T = 16, whatever
    `--inference-steps` says) is `fused_iterative`; every other name is itself. Naming several
    T in one run (`fused_iterative_T4,fused_iterative_T16`) measures the cost as a function of
    T, side by side."""
    match = _AT_STEPS.fullmatch(variant)
    return match.group(1) if match else variant


def variant_inference_steps(variant: str, default: int) -> int | None:
    """T of an iterative, tree-PC or infill variant (from its name, else `default`); None for
    the others."""
    match = _AT_STEPS.fullmatch(variant)
    if match:
        return int(match.group(2))
    return default if variant in ITERATIVE_VARIANTS + TREE_PC_VARIANTS + INFILL_VARIANTS else None


@dataclasses.dataclass(frozen=True)
class BenchArgs:
    """Every setting of one bench run, checked on construction.

    The fields are the command line's flags (`--ff-width` is `ff_width`), with the defaults
    that depend on other flags resolved by `from_namespace`: `ff_width` (4 x `width`) and
    `variants` (`VARIANTS`, or `SWEEP_VARIANTS` for a depth sweep).

    Raises:
        ValueError: on construction, for a setting out of range; the message names the flag.
    """

    vocab: int = 65
    width: int = 64
    n_heads: int = 4
    n_blocks: tuple[int, ...] = (2,)
    ff_width: int = 256
    max_len: int = 64
    batch: int = 16
    steps: int = 20
    warmup: int = 3
    learning: str = "all"
    k: int = 10
    optimiser: str = "adam"
    lr: float = 1e-3
    variants: tuple[str, ...] = VARIANTS
    nonfinite: str = "skip"
    profile: bool = False
    compare: bool = False
    peak: bool = False
    peak_sizes: tuple[int, ...] = (1024, 2048)
    no_donate_probe: bool = False
    devices: int = 1
    in_process: bool = False
    interleave: bool = False
    host_memory: str = "auto"
    seed: int = 0
    dtype: str = "float32"
    inference_steps: int = 8
    inference_rate: float = 0.1
    inference_tolerance: float = 0.0
    incremental_inference: bool = False
    parameterisation: str = "standard"

    def __post_init__(self):
        for name in ("vocab", "width", "n_heads", "max_len", "batch", "steps", "k", "devices"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{_flag(name)} must be >= 1, got {getattr(self, name)}")
        if self.warmup < 0:
            raise ValueError(f"--warmup must be >= 0, got {self.warmup}")
        if self.inference_steps < 0:
            raise ValueError(f"--inference-steps must be >= 0, got {self.inference_steps}")
        if not self.inference_rate > 0:
            raise ValueError(f"--inference-rate must be > 0, got {self.inference_rate}")
        if not self.inference_tolerance >= 0:
            raise ValueError(
                f"--inference-tolerance must be >= 0 (0: none), got {self.inference_tolerance}")
        if self.parameterisation not in ("standard", "mupc"):
            raise ValueError(f"--parameterisation must be standard or mupc, got "
                             f"{self.parameterisation!r}")
        if self.incremental_inference and self.inference_tolerance:
            raise ValueError("--incremental-inference and --inference-tolerance: an incremental "
                             "relaxation runs every sweep; choose one")
        if self.ff_width < 1:
            raise ValueError(f"--ff-width must be >= 1, got {self.ff_width}")
        if self.width % self.n_heads:
            raise ValueError(f"--n-heads {self.n_heads} must divide --width {self.width}")
        if self.batch % self.devices:
            raise ValueError(f"--batch {self.batch} must divide over --devices {self.devices}")
        if not self.n_blocks or any(b < 1 for b in self.n_blocks):
            raise ValueError(f"--n-blocks must be integers >= 1, got {list(self.n_blocks)}")
        if not self.peak_sizes or any(n < 1 for n in self.peak_sizes):
            raise ValueError(f"--peak-sizes must be integers >= 1, got {list(self.peak_sizes)}")
        unknown = [v for v in self.variants if base_variant(v) not in ALL_VARIANTS]
        if unknown or not self.variants:
            raise ValueError(
                f"unknown variants {unknown or list(self.variants)}; choose from "
                f"{', '.join(ALL_VARIANTS)}"
            )
        choices = {
            "learning": ("all", "ff_head", "none"),
            "optimiser": OPTIMISERS,
            "nonfinite": ("skip", "raise", "ignore"),
            "host_memory": HOST_MEMORY_MODES,
            "dtype": ("float32", "bfloat16"),
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(
                    f"--{_flag(name)} must be one of {allowed}, "
                    f"got {getattr(self, name)!r}"
                )

    @property
    def sweep(self) -> bool:
        """Whether this is a depth sweep (more than one `n_blocks`)."""
        return len(self.n_blocks) > 1

    @classmethod
    def from_namespace(cls, namespace: argparse.Namespace) -> BenchArgs:
        """The settings of a parsed command line (`build_parser().parse_args(...)`).

        Args:
            namespace: the parsed flags.

        Returns:
            The `BenchArgs`, with `ff_width` and `variants` resolved when not given.

        Raises:
            ValueError: for a setting out of range.
        """
        values = dict(vars(namespace))
        values.pop("worker", None)
        values.pop(_RENAMED_GIVEN, None)
        if values["ff_width"] is None:
            values["ff_width"] = 4 * values["width"]
        if values["variants"] is None:
            values["variants"] = SWEEP_VARIANTS if len(values["n_blocks"]) > 1 else VARIANTS
        for name in ("n_blocks", "variants", "peak_sizes"):
            values[name] = tuple(values[name])
        return cls(**values)

    def to_json(self) -> str:
        """These settings as a JSON object (`from_json` reads it back equal)."""
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> BenchArgs:
        """The settings written by `to_json`.

        Args:
            text: a JSON object with one member per field.

        Returns:
            The `BenchArgs`, equal to the one written.
        """
        values: dict[str, Any] = json.loads(text)
        for name in ("n_blocks", "variants", "peak_sizes"):
            values[name] = tuple(values[name])
        return cls(**values)


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected an integer or a comma-separated list of integers, got {text!r}"
        ) from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def _variant_list(text: str) -> list[str]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    unknown = [v for v in values if base_variant(v) not in ALL_VARIANTS]
    if unknown or not values:
        raise argparse.ArgumentTypeError(
            f"unknown variants {unknown or values}; choose from {', '.join(ALL_VARIANTS)}"
        )
    return values


RENAMED_FLAGS = {"--heads": "--n-heads", "--blocks": "--n-blocks", "--seq": "--max-len"}
"""The flags of `fusedpc bench` before 0.4, spelt as `fusedpc train` spells them now; the old
spellings still work, with a `DeprecationWarning`, until `fusedpc._deprecation.REMOVED_IN`."""


def _flag(setting: str) -> str:
    """The flag of a setting, without its dashes: `max_len` -> `max-len`."""
    return setting.replace("_", "-")


def _setting(flag: str) -> str:
    """The setting of a flag: `--max-len` -> `max_len`."""
    return flag[2:].replace("-", "_")


class _RenamedFlag(argparse.Action):
    """An old spelling of a flag (`RENAMED_FLAGS`): sets the new flag's setting and notes the
    old flag under `_RENAMED_GIVEN`, for `parse_args` to warn about."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        given = getattr(namespace, _RENAMED_GIVEN, [])
        setattr(namespace, _RENAMED_GIVEN, [*given, self.option_strings[0]])


_RENAMED_GIVEN = "_renamed_flags_given"


def build_parser() -> argparse.ArgumentParser:
    """The `fusedpc bench` command line; `parse_args` turns its flags into a `BenchArgs`."""
    d = BenchArgs()
    p = argparse.ArgumentParser(
        prog="fusedpc bench",
        description="Benchmark a GPT part tree: fused step, fused run (K steps per call), "
        "unfused (one jit per part) and the backprop twin, side by side. Prints one JSON "
        "object per line.",
    )
    for add in (_model_flags, _training_flags, _variant_flags, _process_flags, _numeric_flags):
        add(p, d)  # in this order: the order of --help
    return p


def _model_flags(p: argparse.ArgumentParser, d: BenchArgs) -> None:
    """The GPT's sizes and the batch's."""
    p.add_argument("--vocab", type=int, default=d.vocab, help="vocabulary size (default 65)")
    p.add_argument("--width", type=int, default=d.width, help="model width (default 64)")
    p.add_argument("--n-heads", type=int, default=d.n_heads,
                   help="attention heads (default 4)")
    p.add_argument(
        "--n-blocks", type=_int_list, default=list(d.n_blocks),
        help="transformer blocks; a comma-separated list (1,2,4,8,16) runs the depth sweep "
        "(default 2)",
    )
    p.add_argument("--ff-width", type=int, default=None, help="feed-forward width (4 x width)")
    p.add_argument("--max-len", type=int, default=d.max_len,
                   help="tokens per row, the position table's length (default 64)")
    p.add_argument("--batch", type=int, default=d.batch, help="batch size (default 16)")
    for old, new in RENAMED_FLAGS.items():
        p.add_argument(old, dest=_setting(new), type=_int_list if new == "--n-blocks" else int,
                       action=_RenamedFlag, help=argparse.SUPPRESS)


def _training_flags(p: argparse.ArgumentParser, d: BenchArgs) -> None:
    """Steps timed, and what learns with which optimiser."""
    p.add_argument("--steps", type=int, default=d.steps, help="timed steps per variant (>= 1)")
    p.add_argument(
        "--warmup", type=int, default=d.warmup, help="untimed steps after the first call"
    )
    p.add_argument(
        "--learning", choices=("all", "ff_head", "none"), default=d.learning,
        help="which slots learn (default all)",
    )
    p.add_argument("--k", type=int, default=d.k, help="steps per `run` call (default 10)")
    p.add_argument(
        "--optimiser", choices=OPTIMISERS, default=d.optimiser,
        help="optimiser, as fusedpc.training.make_optimiser (default adam)",
    )
    p.add_argument("--lr", type=float, default=d.lr, help="learning rate (default 1e-3)")


def _variant_flags(p: argparse.ArgumentParser, d: BenchArgs) -> None:
    """What is measured: the variants, the probes, the profile."""
    p.add_argument(
        "--variants", type=_variant_list, default=None,
        help="comma-separated variants: fused,fused_run,unfused,backprop (the default), "
        "fused_scan,fused_run_scan (blocks always scanned), fused_unrolled,fused_run_unrolled "
        "(blocks a tuple, unrolled), fused_guards,fused_unguarded (every step guard on, or "
        "none: their cost), fused_iterative,fused_run_iterative (the feed-forwards learn by "
        "iterative inference; fused_iterative_T16 at T = 16, several T side by side), "
        "fused_tree_pc,fused_run_tree_pc (the fully-PC GPT: a latent after every slot, "
        "relaxed for --inference-steps sweeps; fused_tree_pc_T4 at T = 4), infill (not a "
        "step: every 8th token of the batch filled in by relaxation, fusedpc infill, for "
        "--inference-steps sweeps; infill_T64 at T = 64); fused and fused_run use "
        "build_gpt's scan='auto' (the sweep's default is fused_scan,fused_unrolled); the "
        "probes peak and donation may be named too (--variants donation runs the donation "
        "probe alone)",
    )
    p.add_argument(
        "--nonfinite", choices=("skip", "raise", "ignore"), default=d.nonfinite,
        help="FusedPipeline's non-finite policy for the fused variants and the donation probe "
        "(default skip; ignore measures the step without its guard)",
    )
    p.add_argument(
        "--profile", action="store_true",
        help="trace 3 more calls per variant with jax.profiler and add the compiled program's "
        "time per kind of kernel (ms per call, summed over threads) to its row",
    )
    p.add_argument("--compare", action="store_true", help="add ratios to backprop at the end")
    p.add_argument("--peak", action="store_true", help="run the matmul peak probe first")
    p.add_argument(
        "--peak-sizes", type=_int_list, default=list(d.peak_sizes),
        help="matrix sizes n for the n x n x n float32 peak probe (best is reported)",
    )
    p.add_argument(
        "--no-donate-probe", action="store_true",
        help="skip the donation probe (compiled memory with and without donation)",
    )


def _process_flags(p: argparse.ArgumentParser, d: BenchArgs) -> None:
    """Where the measurements run: devices, processes, the host allocator."""
    p.add_argument(
        "--devices", type=int, default=d.devices,
        help="emulated CPU devices (JAX_NUM_CPU_DEVICES for the workers); batch sharded over them",
    )
    p.add_argument(
        "--in-process", action="store_true",
        help="run every measurement in this process (peak_mb is then an RSS growth)",
    )
    p.add_argument(
        "--interleave", action="store_true",
        help="build every variant in this process and time their calls in turn (one call of "
        "each per round): fairer ratios on a shared machine; peak_mb is then an RSS growth",
    )
    p.add_argument(
        "--host-memory", choices=HOST_MEMORY_MODES, default=d.host_memory,
        help="host allocator of every measuring process, as `fusedpc train --host-memory`: "
        "reuse (fusedpc.training.reuse_host_memory(): freed host memory kept for the next step "
        "instead of unmapped and faulted in again), system (the C library's defaults) or auto "
        "(reuse when the step's estimated temporaries reach 128 MiB; the default)",
    )


def _numeric_flags(p: argparse.ArgumentParser, d: BenchArgs) -> None:
    """The seed, the compute dtype, the iterative variants' relaxation, and the hidden flag of
    a measuring process."""
    p.add_argument("--seed", type=int, default=d.seed, help="PRNG seed of weights and batches")
    p.add_argument(
        "--dtype", type=lambda s: "bfloat16" if s == "bf16" else s, default=d.dtype,
        help="compute dtype of the fused step and the twin: float32, or bfloat16 (bf16): "
        "activations and matrix products in bfloat16, weights and optimiser state float32",
    )
    p.add_argument(
        "--inference-steps", type=int, default=d.inference_steps,
        help="relaxation steps of the iterative variants' feed-forwards and sweeps of the "
        "tree-PC variants' latents (default 8)",
    )
    p.add_argument(
        "--inference-rate", type=float, default=d.inference_rate,
        help="step size of the iterative variants' relaxation (default 0.1)",
    )
    p.add_argument(
        "--inference-tolerance", type=float, default=d.inference_tolerance,
        help="tree-PC variants: adaptive inference, the sweeps stop once the energy's relative "
        "change falls below this, at most --inference-steps (default 0: always all)",
    )
    p.add_argument(
        "--incremental-inference", type=parse_bool, default=d.incremental_inference,
        help="tree-PC variants: true for incremental PC, the weights step at every sweep "
        "(default false)",
    )
    p.add_argument(
        "--parameterisation", choices=("standard", "mupc"), default=d.parameterisation,
        help="every variant's GPT: standard, or mupc (each block's residual branches scaled "
        "by 1/sqrt(2 n_blocks), the depth multiplier of muPC; the twin alike)",
    )
    # A measuring process: reads its task and the parent's BenchArgs from stdin (_workers).
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)


def parse_args(
    argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None
) -> tuple[BenchArgs, bool]:
    """Parse and check a command line.

    Args:
        argv: the flags (default `sys.argv[1:]`).
        parser: the parser to use and to report errors through (default `build_parser()`).

    Returns:
        `(args, worker)`: the settings, and whether this process is a measuring worker
        (hidden flag `--worker`; its settings then come from stdin, not from `argv`).

    Raises:
        SystemExit: with code 2 and a message on stderr, for a bad flag.

    Warns:
        DeprecationWarning: for each old spelling given (`RENAMED_FLAGS`), shown unless
            Python's `-W` options say otherwise.
    """
    parser = parser or build_parser()
    namespace = parser.parse_args(argv)
    with warnings.catch_warnings():
        if not sys.warnoptions:  # an old flag's warning is for whoever typed the command
            warnings.simplefilter("default", DeprecationWarning)
        for old in dict.fromkeys(getattr(namespace, _RENAMED_GIVEN, [])):
            warn_deprecated(f"fusedpc bench {old} is now {RENAMED_FLAGS[old]}")
    try:
        return BenchArgs.from_namespace(namespace), namespace.worker
    except ValueError as error:
        parser.error(str(error))
        raise  # unreachable: parser.error exits
