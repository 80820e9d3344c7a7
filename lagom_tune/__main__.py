"""The command line's entry point: ``lagom-tune`` and ``python -m lagom_tune``."""

import sys


def run() -> None:
    """Import the CLI and run it. The import (torch, pandas) takes a second or more; a Ctrl-C
    during it gives the one line and exit code 130 that one later gives, not a traceback."""
    try:
        from lagom_tune.cli import main  # here, not at the top: so that the interrupt is caught
    except KeyboardInterrupt:
        print("lagom-tune: interrupted", file=sys.stderr)
        sys.exit(130)
    main()


if __name__ == "__main__":
    run()
