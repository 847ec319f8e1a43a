class MergeError(Exception):
    """A problem with the user's input, reported as one line: what, where, and what was expected.

    The CLI prints the message and exits non-zero; anything else escaping is a bug in the tool.
    """


class UsageError(MergeError):
    """An argument of the wrong type or out of range, refused before any input is read (catch it to tell a
    caller's mistake from a problem with the checkpoints)."""
