"""Execution: the pure step program, the host-side pipeline that wraps it, validation,
reports, sharding over meshes and checkpoints."""

from fusedpc.execution._checkpoint import CheckpointError as CheckpointError
from fusedpc.execution._checkpoint import load_checkpoint as load_checkpoint
from fusedpc.execution._checkpoint import read_checkpoint_manifest as read_checkpoint_manifest
from fusedpc.execution._checkpoint import save_checkpoint as save_checkpoint
from fusedpc.execution._pipeline import FusedPipeline as FusedPipeline
from fusedpc.execution._pipeline import InputRangeError as InputRangeError
from fusedpc.execution._pipeline import NonFiniteStepError as NonFiniteStepError
from fusedpc.execution._program import SKIP_REASONS as SKIP_REASONS
from fusedpc.execution._program import Counters as Counters
from fusedpc.execution._program import MaskCheck as MaskCheck
from fusedpc.execution._program import StepCarry as StepCarry
from fusedpc.execution._program import StepMetrics as StepMetrics
from fusedpc.execution._program import StepOutput as StepOutput
from fusedpc.execution._program import StepProgram as StepProgram
from fusedpc.execution._program import make_step as make_step
from fusedpc.execution._program import pad_rows as pad_rows
from fusedpc.execution._report import SkipReason as SkipReason
from fusedpc.execution._sharding import data_mesh as data_mesh
from fusedpc.execution._sharding import initialize_distributed as initialize_distributed
from fusedpc.execution._sharding import make_global_batch as make_global_batch
from fusedpc.execution._sharding import process_batch_slice as process_batch_slice
from fusedpc.execution._sharding import shard_batch as shard_batch
from fusedpc.execution._sharding import shard_widest as shard_widest
from fusedpc.execution._sharding import state_shardings as state_shardings
from fusedpc.execution._unfused import UnfusedPipeline as UnfusedPipeline
