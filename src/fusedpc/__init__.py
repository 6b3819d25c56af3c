"""fusedpc: predictive-coding parts and hybrid transformers, one compiled program per step."""

from . import errors as errors
from . import frozen as frozen
from ._check import check_backward as check_backward
from ._compose import Residual as Residual
from ._compose import ResidualState as ResidualState
from ._compose import Sequential as Sequential
from ._compose import SequentialState as SequentialState
from ._core import AbstractPart as AbstractPart
from ._core import Core as Core
from ._core import FiniteFlag as FiniteFlag
from ._core import PartMetrics as PartMetrics
from ._core import Stacked as Stacked
from ._core import learning_metrics as learning_metrics
from ._executor import FusedPipeline as FusedPipeline
from ._executor import NonFiniteStepError as NonFiniteStepError
from ._executor import StepMetrics as StepMetrics
from ._frozen import Frozen as Frozen
from ._frozen import FrozenState as FrozenState

__version__ = "0.1.0"
from . import transplant as transplant
from ._embedding import EmbeddingState as EmbeddingState
from ._embedding import LayerNormState as LayerNormState
from ._embedding import LearningEmbedding as LearningEmbedding
from ._embedding import LearningLayerNorm as LearningLayerNorm
from ._learning import LearningNetwork as LearningNetwork
from ._learning import LearningNetworkState as LearningNetworkState
from ._learning import NetworkParams as NetworkParams
from ._network import PCNetwork as PCNetwork
