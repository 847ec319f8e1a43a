class MergeError(Exception):
    """A problem with the user's input, reported as one line: what, where, and what was expected.

    The CLI prints the message and exits non-zero; anything else escaping is a bug in the tool.
    """
