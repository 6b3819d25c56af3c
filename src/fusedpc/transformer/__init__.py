"""The transformer: blocks, the GPT part, its builders, export to the equinox reference model
(`fusedpc.transformer.reference`, with its backprop step) and generation."""

from fusedpc.transformer import reference as reference
from fusedpc.transformer._build import GPTConfig as GPTConfig
from fusedpc.transformer._build import build_gpt as build_gpt
from fusedpc.transformer._export import to_reference as to_reference
from fusedpc.transformer._generate import generate as generate
from fusedpc.transformer._gpt import TOKEN_INPUTS as TOKEN_INPUTS
from fusedpc.transformer._gpt import BlockCache as BlockCache
from fusedpc.transformer._gpt import Blocks as Blocks
from fusedpc.transformer._gpt import BlockState as BlockState
from fusedpc.transformer._gpt import GPTCache as GPTCache
from fusedpc.transformer._gpt import GPTPart as GPTPart
from fusedpc.transformer._gpt import GPTState as GPTState
from fusedpc.transformer._gpt import TransformerBlock as TransformerBlock
from fusedpc.transformer._hybrid import hybrid_from_gpt as hybrid_from_gpt
from fusedpc.transformer._infill import Infill as Infill
from fusedpc.transformer._infill import distributions_gpt as distributions_gpt
from fusedpc.transformer._infill import infill as infill
from fusedpc.transformer._latents import LATENT_PLACES as LATENT_PLACES
from fusedpc.transformer._latents import with_latents as with_latents
from fusedpc.transformer._slots import LEARNING_PRESETS as LEARNING_PRESETS
from fusedpc.transformer._slots import SLOTS as SLOTS
from fusedpc.transformer._stacking import AUTO_UNROLL_BLOCKS as AUTO_UNROLL_BLOCKS
from fusedpc.transformer._stacking import blocks_form as blocks_form
