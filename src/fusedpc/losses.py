"""Error functions: the descent error at a tree's output and the loss it is the gradient of.
Implemented in `fusedpc.core.losses`."""

from fusedpc.core.losses import BY_NAME as BY_NAME
from fusedpc.core.losses import ErrorFunction as ErrorFunction
from fusedpc.core.losses import cross_entropy as cross_entropy
from fusedpc.core.losses import observed_squared as observed_squared
from fusedpc.core.losses import resolve as resolve
from fusedpc.core.losses import sigmoid_cross_entropy as sigmoid_cross_entropy
from fusedpc.core.losses import softmax_cross_entropy as softmax_cross_entropy
from fusedpc.core.losses import squared as squared

__all__ = [
    "BY_NAME",
    "ErrorFunction",
    "cross_entropy",
    "observed_squared",
    "resolve",
    "sigmoid_cross_entropy",
    "softmax_cross_entropy",
    "squared",
]
