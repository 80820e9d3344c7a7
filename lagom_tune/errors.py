"""The two kinds of failure the CLI distinguishes: bad input (exit 2) and runtime failure (exit 1)."""


def one_line(text: str) -> str:
    """``text`` with its line breaks written as ``\\n`` (a name read from a file may hold one, and
    an error must stay one line)."""
    return text.replace("\r\n", "\\n").replace("\n", "\\n").replace("\r", "\\r")


class UserError(Exception):
    """The user's input is wrong (file, flag, value). Rendered as one line, exit code 2."""

    exit_code = 2

    def __init__(self, message: str):
        super().__init__(one_line(str(message)))


class RunError(Exception):
    """Something failed while running (a rank died, a child crashed). Exit code 1, with a hint."""

    exit_code = 1

    def __init__(self, message: str, hint: str = ""):
        super().__init__(one_line(str(message)))
        self.hint = hint
