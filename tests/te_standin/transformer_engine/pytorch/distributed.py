from transformer_engine import __getattr__  # noqa: F401


class CudaRNGStatesTracker:
    def __init__(self, *args, **kwargs):
        pass
