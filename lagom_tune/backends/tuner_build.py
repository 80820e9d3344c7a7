"""Build lagom-tune's NCCL tuner plugin (``lagom_tuner.c``) with the system C compiler, once.

The library goes to a cache folder keyed by a hash of the source, the compiler command and the
machine, so an edited source or another architecture gets its own build and an unchanged one is
never rebuilt. It is compiled to a temporary name and renamed into place: concurrent ``apply``
runs (one per node, say) never load a half-written file. No CUDA headers are needed: the plugin
declares the few NCCL types it uses itself.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from lagom_tune.errors import UserError

SOURCE = Path(__file__).resolve().with_name("lagom_tuner.c")
# NCCL's naming convention, so NCCL_TUNER_PLUGIN=lagom-tune also finds it on LD_LIBRARY_PATH.
LIBRARY_NAME = "libnccl-tuner-lagom-tune.so"
CFLAGS = ("-O2", "-std=c99", "-fPIC", "-shared", "-fvisibility=hidden", "-Wall", "-Wextra")
# NCCL copies NCCL_TUNER_PLUGIN into a 255-byte buffer (src/plugin/plugin_open.cc, MAX_STR_LEN):
# a longer path would be cut and not found.
NCCL_MAX_PLUGIN_PATH = 254
COMPILE_TIMEOUT_S = 120
CHECK_SYMBOL = "lagom_tuner_check_file"  # the plugin's rules-file parser, for apply to run before NCCL does


@dataclass(frozen=True)
class PluginBuild:
    """The outcome of :func:`ensure_plugin`.

    ``path`` is the built library (absolute), or None with ``reason`` saying in one line why not.
    ``built`` is False when an earlier build was reused.
    """

    path: Path | None
    reason: str = ""
    built: bool = False
    compiler: str | None = None

    @property
    def ok(self) -> bool:
        return self.path is not None

    def refusal(self, rules_file: Path) -> str:
        """Why the built plugin would refuse ``rules_file`` when NCCL loads it (it then keeps no
        rule at all), as its own parser says; "" when it takes it.

        Args:
            rules_file: a rules file (``TunerRules.text``).
        Returns:
            The parser's one-line error, or "".
        Raises:
            OSError: when the library cannot be loaded (a cached file this version did not build).
        """
        assert self.path is not None, "no plugin was built"
        failure, refusal = _probe(str(self.path), rules_file)
        if failure:
            raise OSError(failure)
        return refusal


# Run in a child: a library that aborts as it loads (an ASan build) must not end apply, and this
# process's loader would answer a second load of one path from the first, not from the file.
_PROBE = f"""
import ctypes, sys
try:
    check = ctypes.CDLL(sys.argv[1]).{CHECK_SYMBOL}
except (OSError, AttributeError) as e:
    sys.exit(str(e))
if len(sys.argv) > 2:
    err = ctypes.create_string_buffer(256)
    check.argtypes = (ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t)
    if check(sys.argv[2].encode(), err, len(err)) < 0:
        print(err.value.decode(errors="replace"))
"""


def _probe(library: str, rules_file: Path | None = None) -> tuple[str, str]:
    """Load ``library`` as the plugin in a child process and, given ``rules_file``, parse it there.

    Args:
        library: the built file.
        rules_file: a rules file to check, or None.
    Returns:
        Why it cannot be loaded ("" when it can: the loader's last line), and the parser's refusal
        of ``rules_file`` ("" when it takes it).
    """
    try:
        proc = subprocess.run([sys.executable, "-c", _PROBE, library, *([str(rules_file)] if rules_file else [])],
                              capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        return str(e), ""
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines()
        return (lines[-1] if lines else f"exit code {proc.returncode}")[:200], ""
    return "", proc.stdout.strip()


def cache_root(env: dict[str, str] | None = None) -> Path:
    """``$XDG_CACHE_HOME/lagom-tune`` (default ``~/.cache/lagom-tune``; a relative
    ``XDG_CACHE_HOME`` is ignored, as the XDG spec says: the paths exported to every rank must not
    depend on the folder it starts in).

    Args:
        env: the environment (default: this process's).
    Returns:
        The folder, an absolute path.
    """
    env = os.environ if env is None else env
    base = env.get("XDG_CACHE_HOME", "")
    return (Path(base) if os.path.isabs(base) else Path.home() / ".cache") / "lagom-tune"


def find_compiler(env: dict[str, str] | None = None) -> list[str] | None:
    """The C compiler command: ``$CC`` when set, else ``cc``; None when neither is on PATH.

    Args:
        env: the environment (default: this process's).
    Returns:
        The command and its arguments, or None.
    Raises:
        UserError: for a ``CC`` that is no command line (an unclosed quote).
    """
    env = os.environ if env is None else env
    try:
        cmd = shlex.split(env.get("CC", "")) or ["cc"]
    except ValueError as e:
        raise UserError(f"CC={env['CC']!r} is not a command line: {e}") from None
    found = shutil.which(cmd[0], path=env.get("PATH"))
    return [found, *cmd[1:]] if found else None


def build_key(source: bytes, compiler: list[str]) -> str:
    """Hash of what determines the library: the source, the compile command and the machine.

    Args:
        source: the plugin's C source.
        compiler: the compile command.
    Returns:
        16 hex digits.
    """
    h = hashlib.sha256(source)
    h.update("\0".join([*compiler, *CFLAGS, platform.system(), platform.machine()]).encode())
    return h.hexdigest()[:16]


def ensure_plugin(cache: Path | None = None, env: dict[str, str] | None = None) -> PluginBuild:
    """Return the plugin library, building it on first use.

    Args:
        cache: the cache root (default :func:`cache_root`).
        env: the environment to read ``CC``, ``PATH`` and ``XDG_CACHE_HOME`` from (default: this process's).
    Returns:
        A :class:`PluginBuild`; never raises for a missing or failing compiler (the caller falls back).
    """
    compiler = find_compiler(env)
    if compiler is None:
        given = (os.environ if env is None else env).get("CC", "").strip()
        where = f"CC={given} is not a command on PATH" if given else "no `cc` on PATH; or set CC"
        return PluginBuild(None, f"no C compiler found ({where}) to build lagom-tune's NCCL tuner plugin")
    source = SOURCE.read_bytes()
    folder = (cache or cache_root(env)) / f"nccl-tuner-{build_key(source, compiler)}"
    target = folder / LIBRARY_NAME
    if len(str(target)) > NCCL_MAX_PLUGIN_PATH:
        return PluginBuild(None, f"plugin path longer than NCCL accepts ({NCCL_MAX_PLUGIN_PATH} characters): "
                                 f"{target}; set XDG_CACHE_HOME to a shorter folder", compiler=compiler[0])
    if target.is_file():
        return PluginBuild(target, built=False, compiler=compiler[0])
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{LIBRARY_NAME}.", suffix=".tmp")
        os.close(fd)
    except OSError as e:
        return PluginBuild(None, f"cannot write to the plugin cache folder {folder}: {e.strerror}", compiler=compiler[0])
    failure = ""
    try:
        proc = subprocess.run([*compiler, *CFLAGS, "-o", tmp, str(SOURCE)], capture_output=True, text=True,
                              timeout=COMPILE_TIMEOUT_S)
        if proc.returncode != 0:
            failure = (f"{compiler[0]} could not build the NCCL tuner plugin: "
                       f"{compile_error(proc.stderr) or f'exit code {proc.returncode}'}")
        else:
            os.chmod(tmp, 0o755)
            unloadable, _ = _probe(tmp)
            if unloadable:  # a wrapper CC that wrote no library, a sanitizer runtime: never cached
                failure = f"{compiler[0]} built an NCCL tuner plugin that cannot be loaded: {unloadable}"
            else:
                os.replace(tmp, target)  # atomic: readers see the old state or the whole library
    except (OSError, subprocess.TimeoutExpired) as e:
        failure = f"building the NCCL tuner plugin failed: {e}"
    finally:
        Path(tmp).unlink(missing_ok=True)
    if failure:
        with contextlib.suppress(OSError):  # a broken CC left an empty folder per try; another build may be in it
            folder.rmdir()
        return PluginBuild(None, failure, compiler=compiler[0])
    return PluginBuild(target, built=True, compiler=compiler[0])


def compile_error(stderr: str) -> str:
    """The line of a failed build's output that says why: the first that says "error" or "failed"
    (the linker's own reason, "final link failed: No space left on device", comes before its
    driver's "collect2: error: ld returned 1 exit status"); else the first line.

    Args:
        stderr: the compiler's error output.
    Returns:
        One line (at most 200 characters), or "" for no output.
    """
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    said = [ln for ln in lines if "error" in ln or "failed" in ln]
    return (said or lines or [""])[0][:200]


def rules_path(text: str, cache: Path | None = None, env: dict[str, str] | None = None) -> Path:
    """Where a rules text lives in the cache: named by its hash, so a path always means one content.

    Args:
        text: the rules file's content.
        cache: the cache folder (default: ``cache_root``).
        env: the environment for ``cache_root``.
    Returns:
        The path (not written).
    """
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    return (cache or cache_root(env)) / "tuner-rules" / f"{digest}.rules"
