from transformer_engine import __getattr__  # noqa: F401  (anything else: a mock)
from . import recipe  # noqa: F401
