"""The one exception type that reaches the user as a message instead of a traceback."""


class UserError(Exception):
    """Bad input: the message names the field and says how to fix it. The CLI prints it and exits 2."""

    exit_code = 2
