"""Converters from equinox layers to learning parts; implemented in `fusedpc.parts.transplant`."""

from fusedpc.parts.transplant import from_conv2d as from_conv2d
from fusedpc.parts.transplant import from_embedding as from_embedding
from fusedpc.parts.transplant import from_feedforward as from_feedforward
from fusedpc.parts.transplant import from_feedforward_iterative as from_feedforward_iterative
from fusedpc.parts.transplant import from_layer_norm as from_layer_norm
from fusedpc.parts.transplant import from_linear as from_linear
from fusedpc.parts.transplant import from_linears as from_linears
from fusedpc.parts.transplant import from_rms_norm as from_rms_norm
from fusedpc.parts.transplant import from_swiglu as from_swiglu
