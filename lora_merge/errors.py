class MergeError(Exception):
    """A problem with the user's input, reported as one line: what, where, and what was expected.

    The CLI prints the message and exits non-zero; anything else escaping is a bug in the tool.
    """


class UsageError(MergeError):
    """An argument of the wrong type or out of range, refused before any input is read (catch it to tell a
    caller's mistake from a problem with the checkpoints)."""


class UnsupportedInput(MergeError):
    """A model, format or adapter feature this tool does not handle (a model type, partial RoPE, DoRA, a
    quantization other than block-FP8): refused by name, never approximated."""


class DamagedInput(MergeError):
    """An input whose bytes are not what its format promises (a CRC32 mismatch, a truncated or garbled file):
    copy it again from the original."""


class OutputConflict(MergeError):
    """Where the output (or the report) would go is not free for it: it exists and is not ours to replace, it
    lies inside an input, it appeared while the run was writing, its directory is missing or not writable."""
