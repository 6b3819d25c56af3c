"""fusedpc: predictive-coding parts and hybrid transformers, one compiled program per step."""

from . import errors as errors
from . import frozen as frozen
from . import models as models
from . import transplant as transplant
from ._attention import AttentionState as AttentionState
from ._attention import MultiHeadAttention as MultiHeadAttention
from ._check import check_backward as check_backward
from ._compose import Residual as Residual
from ._compose import ResidualState as ResidualState
from ._compose import Sequential as Sequential
from ._compose import SequentialState as SequentialState
from ._core import AbstractPart as AbstractPart
from ._core import Core as Core
from ._core import FiniteFlag as FiniteFlag
from ._core import Named as Named
from ._core import PartMetrics as PartMetrics
from ._core import Stacked as Stacked
from ._core import learning_metrics as learning_metrics
from ._core import named as named
from ._embedding import EmbeddingState as EmbeddingState
from ._embedding import LayerNormState as LayerNormState
from ._embedding import LearningEmbedding as LearningEmbedding
from ._embedding import LearningLayerNorm as LearningLayerNorm
from ._executor import FusedPipeline as FusedPipeline
from ._executor import NonFiniteStepError as NonFiniteStepError
from ._executor import StepMetrics as StepMetrics
from ._frozen import Frozen as Frozen
from ._frozen import FrozenState as FrozenState
from ._generate import generate as generate
from ._gpt import GPTPart as GPTPart
from ._gpt import TransformerBlock as TransformerBlock
from ._gpt_build import GPTConfig as GPTConfig
from ._gpt_build import build_gpt as build_gpt
from ._gpt_build import hybrid_from_gpt as hybrid_from_gpt
from ._learning import LearningNetwork as LearningNetwork
from ._learning import LearningNetworkState as LearningNetworkState
from ._learning import NetworkParams as NetworkParams
from ._network import PCNetwork as PCNetwork
from ._repeat import Repeat as Repeat
from ._repeat import RepeatState as RepeatState

__version__ = "0.1.0"
from ._gpt_build import to_reference as to_reference
