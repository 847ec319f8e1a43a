import contextlib

from transformer_engine import __getattr__  # noqa: F401


class FP8GlobalStateManager:
    @staticmethod
    def is_fp8_enabled():
        return False

    @staticmethod
    def get_fp8_recipe():
        return None


def fp8_autocast(*args, **kwargs):
    return contextlib.nullcontext()
