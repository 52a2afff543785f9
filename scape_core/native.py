"""SCAPE's C kernels for the CPU: built with the system's C compiler at their first use, loaded with ctypes.

Each module that has a C kernel registers its source and its functions' signatures here
(:func:`register`); the first call of :func:`library` compiles every registered source into one
shared library, once per machine: keyed by the sources, the compiler, the flags and the machine kind,
kept in a per-user cache (:func:`cache_dir`), written atomically (several ranks may build at once).
Where no C compiler works it says so once and returns ``None``: each caller then runs its torch
reference, which gives the same results (every kernel here is tested bit for bit against it).

Example:
    >>> library() is None or hasattr(library(), "scape_topk_rows")
    True
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Any

# -std=c99 (an ISO mode) keeps every fp32 operation as written: no contraction into FMAs, so the C kernels
# round as the torch operators they stand for; -fno-math-errno and -fno-trapping-math (torch's own) let the
# loops with roots and selects vectorize, with the same results
FLAGS = ("-O3", "-shared", "-fPIC", "-std=c99", "-fno-strict-aliasing", "-fno-math-errno", "-fno-trapping-math")
HEADER = "#include <stdint.h>\n#include <stdlib.h>\n#include <string.h>\n#include <math.h>\n"
_sources: list[str] = []
_signatures: dict[str, tuple[Any, list[Any]]] = {}
_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_unavailable: str | None = None  # why the C kernels are not used (said once)


def register(source: str, signatures: dict[str, tuple[Any, list[Any]]]) -> None:
    """Add ``source`` (C, after :data:`HEADER`) and its exported functions' ``(restype, argtypes)`` to the library
    (at import, before the first :func:`library` call)."""
    if _library is not None:
        raise RuntimeError("the C kernels are already built: register sources at import")
    _sources.append(source)
    _signatures.update(signatures)


def cache_dir() -> Path:
    """Where the built kernels are kept: ``$SCAPE_CACHE``, else ``$XDG_CACHE_HOME/scape_train``, else
    ``~/.cache/scape_train``."""
    if os.environ.get("SCAPE_CACHE"):
        return Path(os.environ["SCAPE_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "scape_train"


def available() -> bool:
    """Whether the C kernels are in use on the CPU (builds them at the first call)."""
    return library() is not None


def library() -> ctypes.CDLL | None:
    """The built kernels, once per machine; ``None``, said once, where no C compiler works."""
    global _library, _unavailable
    if _library is not None or _unavailable is not None:
        return _library
    with _lock:
        if _library is None and _unavailable is None:
            try:
                _library = _build()
            except (OSError, subprocess.SubprocessError) as e:
                _unavailable = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
                warnings.warn(f"SCAPE: the C kernels could not be built ({_unavailable}); on the CPU the top-k pick "
                              "and the update on the mask run as torch operators, with the same results, several "
                              "times slower. Install a C compiler (or set CC) to use them", stacklevel=4)
    return _library


def _build() -> ctypes.CDLL:
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        raise OSError(f"no C compiler found ({os.environ.get('CC', 'cc')!r} or 'gcc')")
    source = HEADER + "\n".join(_sources)
    # per machine kind too: a home directory shared by x86 and ARM nodes keeps one build of each
    digest = hashlib.sha256("\0".join((source, compiler, platform.machine(), *FLAGS)).encode()).hexdigest()[:16]
    target = cache_dir() / f"kernels_{digest}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # several ranks may build at once
            c_file, built = Path(tmp) / "kernels.c", Path(tmp) / "kernels.so"
            c_file.write_text(source)
            done = subprocess.run([compiler, *FLAGS, str(c_file), "-o", str(built), "-lm"], capture_output=True,
                                  text=True, timeout=120)
            if done.returncode:
                errors = [line for line in done.stderr.splitlines() if "error" in line] or [done.stderr.strip()]
                raise OSError(f"{compiler} failed: {errors[0][-300:]}")
            os.replace(built, target)
    loaded = ctypes.CDLL(str(target))
    for name, (restype, argtypes) in _signatures.items():
        function = getattr(loaded, name)
        function.restype, function.argtypes = restype, argtypes
    return loaded
