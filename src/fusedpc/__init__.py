"""fusedpc: predictive-coding parts and hybrid transformers, one compiled program per step.

The top level is what model builders use. Part authors' helpers are in `fusedpc.core`;
runtime settings (host memory, device emulation) in `fusedpc.training`; the layers below are
`fusedpc.parts`, `fusedpc.transformer` and `fusedpc.execution`.
"""

import sys as _sys

from fusedpc import frozen as frozen
from fusedpc import losses as losses
from fusedpc import transplant as transplant
from fusedpc._version import __version__ as __version__
from fusedpc.core import AbstractPart as AbstractPart
from fusedpc.core import Core as Core
from fusedpc.core import PartModule as PartModule
from fusedpc.core import as_module as as_module
from fusedpc.core import check_backward as check_backward
from fusedpc.execution import CheckpointError as CheckpointError
from fusedpc.execution import FusedPipeline as FusedPipeline
from fusedpc.execution import Inference as Inference
from fusedpc.execution import InputRangeError as InputRangeError
from fusedpc.execution import NonFiniteStepError as NonFiniteStepError
from fusedpc.execution import Relaxation as Relaxation
from fusedpc.execution import RelaxationReport as RelaxationReport
from fusedpc.execution import SkipReason as SkipReason
from fusedpc.execution import StepCarry as StepCarry
from fusedpc.execution import StepMetrics as StepMetrics
from fusedpc.execution import StepOutput as StepOutput
from fusedpc.execution import StepProgram as StepProgram
from fusedpc.execution import StepSettings as StepSettings
from fusedpc.execution import data_mesh as data_mesh
from fusedpc.execution import initialize_distributed as initialize_distributed
from fusedpc.execution import load_checkpoint as load_checkpoint
from fusedpc.execution import make_global_batch as make_global_batch
from fusedpc.execution import make_step as make_step
from fusedpc.execution import pad_rows as pad_rows
from fusedpc.execution import process_batch_slice as process_batch_slice
from fusedpc.execution import read_checkpoint_manifest as read_checkpoint_manifest
from fusedpc.execution import save_checkpoint as save_checkpoint
from fusedpc.execution import shard_widest as shard_widest
from fusedpc.execution import state_shardings as state_shardings
from fusedpc.parts import AttentionState as AttentionState
from fusedpc.parts import ConvParams as ConvParams
from fusedpc.parts import EmbeddingState as EmbeddingState
from fusedpc.parts import Frozen as Frozen
from fusedpc.parts import FrozenState as FrozenState
from fusedpc.parts import GatedFeedForward as GatedFeedForward
from fusedpc.parts import GatedState as GatedState
from fusedpc.parts import IterativeNetwork as IterativeNetwork
from fusedpc.parts import Latent as Latent
from fusedpc.parts import LatentState as LatentState
from fusedpc.parts import LayerNormParams as LayerNormParams
from fusedpc.parts import LayerNormState as LayerNormState
from fusedpc.parts import LearningConv2d as LearningConv2d
from fusedpc.parts import LearningEmbedding as LearningEmbedding
from fusedpc.parts import LearningLayerNorm as LearningLayerNorm
from fusedpc.parts import LearningNetwork as LearningNetwork
from fusedpc.parts import LearningNetworkState as LearningNetworkState
from fusedpc.parts import LearningRMSNorm as LearningRMSNorm
from fusedpc.parts import LinearParams as LinearParams
from fusedpc.parts import MultiHeadAttention as MultiHeadAttention
from fusedpc.parts import NetworkParams as NetworkParams
from fusedpc.parts import PCNetwork as PCNetwork
from fusedpc.parts import Repeat as Repeat
from fusedpc.parts import RepeatState as RepeatState
from fusedpc.parts import Residual as Residual
from fusedpc.parts import ResidualState as ResidualState
from fusedpc.parts import Sequential as Sequential
from fusedpc.parts import SequentialState as SequentialState
from fusedpc.parts import TableParams as TableParams
from fusedpc.parts import residual_pc_network as residual_pc_network
from fusedpc.training import PartCalibration as PartCalibration
from fusedpc.training import TrainConfig as TrainConfig
from fusedpc.training import calibrate as calibrate
from fusedpc.training import format_table as format_table
from fusedpc.training import load_run as load_run
from fusedpc.training import train as train
from fusedpc.transformer import Blocks as Blocks
from fusedpc.transformer import BlockState as BlockState
from fusedpc.transformer import GPTConfig as GPTConfig
from fusedpc.transformer import GPTPart as GPTPart
from fusedpc.transformer import GPTState as GPTState
from fusedpc.transformer import TransformerBlock as TransformerBlock
from fusedpc.transformer import build_gpt as build_gpt
from fusedpc.transformer import generate as generate
from fusedpc.transformer import hybrid_from_gpt as hybrid_from_gpt
from fusedpc.transformer import to_reference as to_reference

# Names that moved in 0.2, were deprecated through 0.3 and were removed in 0.4.0: old name ->
# where it lives now. Only for the message of the AttributeError that asking for one raises.
_REMOVED = {
    "errors": "fusedpc.losses",
    "models": "fusedpc.transformer.reference",
    "data": "fusedpc.training.data",
    "FiniteFlag": "fusedpc.core.FiniteFlag",
    "Named": "fusedpc.core.Named",
    "PartMetrics": "fusedpc.core.PartMetrics",
    "Stacked": "fusedpc.core.Stacked",
    "display_path": "fusedpc.core.display_path",
    "expect_last_axis": "fusedpc.core.expect_last_axis",
    "expect_rank": "fusedpc.core.expect_rank",
    "join_path": "fusedpc.core.join_path",
    "learning_metrics": "fusedpc.core.learning_metrics",
    "named": "fusedpc.core.named",
    "replace_fields": "fusedpc.core.replace_fields",
    "host_memory_env": "fusedpc.training.host_memory_env",
    "host_memory_reused": "fusedpc.training.host_memory_reused",
    "reuse_host_memory": "fusedpc.training.reuse_host_memory",
    "emulate_cpu_devices": "fusedpc.training.emulate_cpu_devices",
}


def __getattr__(name: str) -> object:
    if name in _REMOVED:
        message = f"fusedpc.{name} was removed in 0.4.0; use {_REMOVED[name]}"
    else:
        message = f"module 'fusedpc' has no attribute {name!r}"
    raise AttributeError(message, name=name, obj=_sys.modules[__name__])
