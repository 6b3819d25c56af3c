"""Ready-made frozen parts (linear, activations, LayerNorm, RMSNorm, SwiGLU, softmax,
embedding, convolution, pooling, flatten) and any
function or equinox module as a frozen part (`from_function`, `from_module`); their
implementation lives in `fusedpc.parts.frozen` and `fusedpc.parts._autodiff`."""

from fusedpc.parts._autodiff import from_function as from_function
from fusedpc.parts._autodiff import from_module as from_module
from fusedpc.parts.conv import avg_pool as avg_pool
from fusedpc.parts.conv import conv2d as conv2d
from fusedpc.parts.conv import flatten as flatten
from fusedpc.parts.conv import max_pool as max_pool
from fusedpc.parts.frozen import activation as activation
from fusedpc.parts.frozen import embedding as embedding
from fusedpc.parts.frozen import gelu as gelu
from fusedpc.parts.frozen import layer_norm as layer_norm
from fusedpc.parts.frozen import linear as linear
from fusedpc.parts.frozen import relu as relu
from fusedpc.parts.frozen import rms_norm as rms_norm
from fusedpc.parts.frozen import scale as scale
from fusedpc.parts.frozen import softmax as softmax
from fusedpc.parts.frozen import swiglu as swiglu
from fusedpc.parts.frozen import tanh as tanh
