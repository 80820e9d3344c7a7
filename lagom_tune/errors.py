"""The two kinds of failure the CLI distinguishes: bad input (exit 2) and runtime failure (exit 1)."""


class UserError(Exception):
    """The user's input is wrong (file, flag, value). Rendered as one line, exit code 2."""

    exit_code = 2


class RunError(Exception):
    """Something failed while running (a rank died, a child crashed). Exit code 1, with a hint."""

    exit_code = 1

    def __init__(self, message: str, hint: str = ""):
        super().__init__(message)
        self.hint = hint
