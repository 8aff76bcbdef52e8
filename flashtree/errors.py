"""The one user-facing error type: its message is printed as a single line, without a traceback."""


class FlashtreeError(Exception):
    """A problem the user can act on: a wrong file, a draft that does not fit, a context that is too long."""
