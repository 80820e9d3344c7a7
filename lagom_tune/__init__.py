"""lagom-tune: give each collective just enough of the machine while it overlaps computation."""

__version__ = "0.1.0"
