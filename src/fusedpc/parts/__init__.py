"""The part families: frozen formulas, composition, repeated blocks, attention and the
learning parts (`fusedpc.parts.learning`). Imports only `fusedpc.core`."""

from fusedpc.parts import frozen as frozen
from fusedpc.parts import learning as learning
from fusedpc.parts import transplant as transplant
from fusedpc.parts._attention import AttentionCache as AttentionCache
from fusedpc.parts._attention import AttentionState as AttentionState
from fusedpc.parts._attention import MultiHeadAttention as MultiHeadAttention
from fusedpc.parts._compose import Residual as Residual
from fusedpc.parts._compose import ResidualState as ResidualState
from fusedpc.parts._compose import Sequential as Sequential
from fusedpc.parts._compose import SequentialState as SequentialState
from fusedpc.parts._frozen import Frozen as Frozen
from fusedpc.parts._frozen import FrozenState as FrozenState
from fusedpc.parts._repeat import Repeat as Repeat
from fusedpc.parts._repeat import RepeatState as RepeatState
from fusedpc.parts.learning import EmbeddingState as EmbeddingState
from fusedpc.parts.learning import LayerNormParams as LayerNormParams
from fusedpc.parts.learning import LayerNormState as LayerNormState
from fusedpc.parts.learning import LearningEmbedding as LearningEmbedding
from fusedpc.parts.learning import LearningLayerNorm as LearningLayerNorm
from fusedpc.parts.learning import LearningNetwork as LearningNetwork
from fusedpc.parts.learning import LearningNetworkState as LearningNetworkState
from fusedpc.parts.learning import NetworkParams as NetworkParams
from fusedpc.parts.learning import PCNetwork as PCNetwork
