from transformer_engine import __getattr__  # noqa: F401
from transformer_engine.pytorch.tensor import QuantizedTensor


class MXFP8Tensor(QuantizedTensor):
    pass
