"""The part contract and the helpers for writing parts: the extension API.

Everything a part author needs to write a part that runs fused lives here: the base class and
the `Core` of pure functions it compiles to, paths for error messages and reports, the shape
and id checks, the metrics a backward returns, and `check_backward` (the local backward
against `jax.vjp`). This layer imports nothing else of fusedpc but its one helper for
deprecation warnings (`fusedpc._deprecation`, below every layer).
"""

from fusedpc.core import losses as losses
from fusedpc.core._check_backward import BackwardCheck as BackwardCheck
from fusedpc.core._check_backward import check_backward as check_backward
from fusedpc.core._checks import IdRangeCheck as IdRangeCheck
from fusedpc.core._checks import check_ids as check_ids
from fusedpc.core._checks import check_part as check_part
from fusedpc.core._checks import expect_last_axis as expect_last_axis
from fusedpc.core._checks import expect_rank as expect_rank
from fusedpc.core._checks import id_range_check as id_range_check
from fusedpc.core._checks import lookup_rows as lookup_rows
from fusedpc.core._context import StepContext as StepContext
from fusedpc.core._context import learning_metrics as learning_metrics
from fusedpc.core._context import row_mask_scale as row_mask_scale
from fusedpc.core._gradients import DeferredUpdate as DeferredUpdate
from fusedpc.core._gradients import GradientHook as GradientHook
from fusedpc.core._measured import Measured as Measured
from fusedpc.core._measured import PendingFinite as PendingFinite
from fusedpc.core._measured import PendingNorm as PendingNorm
from fusedpc.core._measured import resolve_pending as resolve_pending
from fusedpc.core._metrics import AbstractMetrics as AbstractMetrics
from fusedpc.core._metrics import FiniteFlag as FiniteFlag
from fusedpc.core._metrics import Named as Named
from fusedpc.core._metrics import PartMetrics as PartMetrics
from fusedpc.core._metrics import Stacked as Stacked
from fusedpc.core._metrics import iter_metrics as iter_metrics
from fusedpc.core._metrics import named as named
from fusedpc.core._metrics import report_rows as report_rows
from fusedpc.core._metrics import stack_metrics as stack_metrics
from fusedpc.core._module import PartModule as PartModule
from fusedpc.core._module import as_module as as_module
from fusedpc.core._module import state_drawn_from_key as state_drawn_from_key
from fusedpc.core._norms import all_finite as all_finite
from fusedpc.core._norms import tree_norm as tree_norm
from fusedpc.core._packed import Packed as Packed
from fusedpc.core._part import AbstractPart as AbstractPart
from fusedpc.core._part import Core as Core
from fusedpc.core._part import ExportRecord as ExportRecord
from fusedpc.core._part import LayerNormParams as LayerNormParams
from fusedpc.core._part import LinearParams as LinearParams
from fusedpc.core._part import PyTree as PyTree
from fusedpc.core._part import TableParams as TableParams
from fusedpc.core._part import display_path as display_path
from fusedpc.core._part import join_path as join_path
from fusedpc.core._part import replace_fields as replace_fields
from fusedpc.core._precision import COMPUTE_DTYPES as COMPUTE_DTYPES
from fusedpc.core._precision import einsum as einsum
from fusedpc.core._precision import matmul as matmul
from fusedpc.core._precision import matmul_accumulate as matmul_accumulate
from fusedpc.core._precision import to_compute as to_compute
from fusedpc.core._precision import weight_gradient as weight_gradient
from fusedpc.core._precision import widened as widened

# Removed in 0.4.0: the trace-time settings are fields of the step context now, which every
# core receives as an argument (no global state can be set or forgotten).
_REMOVED = {
    "computing_in": "StepContext(compute_dtype=...) handed to the core",
    "compute_dtype": "ctx.compute_dtype",
    "error_scale": "ctx.error_scale",
    "error_scaled_by": "StepContext(error_scale=...) handed to the core",
    "measured_together": "StepContext(measured=Measured()) handed to the core",
    "measuring": "ctx.measured",
}


def __getattr__(name: str):
    if name in _REMOVED:
        raise AttributeError(
            f"fusedpc.core.{name} was removed in 0.4.0: the step context carries it; use "
            f"{_REMOVED[name]} (see fusedpc.core.StepContext)."
        )
    raise AttributeError(f"module 'fusedpc.core' has no attribute {name!r}")
