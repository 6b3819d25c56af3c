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
from fusedpc.core._error_scale import error_scale as error_scale
from fusedpc.core._error_scale import error_scaled_by as error_scaled_by
from fusedpc.core._metrics import AbstractMetrics as AbstractMetrics
from fusedpc.core._metrics import FiniteFlag as FiniteFlag
from fusedpc.core._metrics import Measured as Measured
from fusedpc.core._metrics import Named as Named
from fusedpc.core._metrics import PartMetrics as PartMetrics
from fusedpc.core._metrics import PendingFinite as PendingFinite
from fusedpc.core._metrics import PendingNorm as PendingNorm
from fusedpc.core._metrics import Stacked as Stacked
from fusedpc.core._metrics import all_finite as all_finite
from fusedpc.core._metrics import iter_metrics as iter_metrics
from fusedpc.core._metrics import learning_metrics as learning_metrics
from fusedpc.core._metrics import measured_together as measured_together
from fusedpc.core._metrics import measuring as measuring
from fusedpc.core._metrics import named as named
from fusedpc.core._metrics import report_rows as report_rows
from fusedpc.core._metrics import resolve_pending as resolve_pending
from fusedpc.core._metrics import stack_metrics as stack_metrics
from fusedpc.core._metrics import tree_norm as tree_norm
from fusedpc.core._module import PartModule as PartModule
from fusedpc.core._module import as_module as as_module
from fusedpc.core._module import state_drawn_from_key as state_drawn_from_key
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
from fusedpc.core._precision import compute_dtype as compute_dtype
from fusedpc.core._precision import computing_in as computing_in
from fusedpc.core._precision import einsum as einsum
from fusedpc.core._precision import matmul as matmul
from fusedpc.core._precision import matmul_accumulate as matmul_accumulate
from fusedpc.core._precision import to_compute as to_compute
from fusedpc.core._precision import weight_gradient as weight_gradient
from fusedpc.core._precision import widened as widened
