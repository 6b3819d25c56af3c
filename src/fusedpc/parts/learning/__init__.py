"""The learning parts: a predictive-coding network (single-sweep, or by iterative inference),
a convolution, embeddings, LayerNorm and RMSNorm that learn locally through optax, and the
local update rules they share."""

from fusedpc.core._part import LayerNormParams as LayerNormParams
from fusedpc.parts.learning._conv import ConvCache as ConvCache
from fusedpc.parts.learning._conv import LearningConv2d as LearningConv2d
from fusedpc.parts.learning._embedding import EmbeddingState as EmbeddingState
from fusedpc.parts.learning._embedding import LearningEmbedding as LearningEmbedding
from fusedpc.parts.learning._iterative import IterativeNetwork as IterativeNetwork
from fusedpc.parts.learning._iterative import RelaxationMetrics as RelaxationMetrics
from fusedpc.parts.learning._layer_norm import LayerNormState as LayerNormState
from fusedpc.parts.learning._layer_norm import LearningLayerNorm as LearningLayerNorm
from fusedpc.parts.learning._learning import LearningNetwork as LearningNetwork
from fusedpc.parts.learning._learning import LearningNetworkState as LearningNetworkState
from fusedpc.parts.learning._learning import NetworkCache as NetworkCache
from fusedpc.parts.learning._learning import NetworkParams as NetworkParams
from fusedpc.parts.learning._local_update import LEARNING_KINDS as LEARNING_KINDS
from fusedpc.parts.learning._local_update import SynapticSettings as SynapticSettings
from fusedpc.parts.learning._network import PCNetwork as PCNetwork
from fusedpc.parts.learning._rms_norm import LearningRMSNorm as LearningRMSNorm
from fusedpc.parts.learning._rms_norm import RMSNormState as RMSNormState
from fusedpc.parts.learning._rules import LearningRule as LearningRule
from fusedpc.parts.learning._rules import PrecisionWeighted as PrecisionWeighted
from fusedpc.parts.learning._rules import Standard as Standard
from fusedpc.parts.learning._rules import SynapticUncertainty as SynapticUncertainty
from fusedpc.parts.learning._rules import learning_rule as learning_rule
