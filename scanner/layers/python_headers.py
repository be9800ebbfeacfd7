"""Where an image's Python keeps its C headers, as `sysconfig` says, from the layer's names alone. Pure.

Triton builds its launcher (from 3.7, its driver module `cuda_utils`) with a C compiler and
`-I{sysconfig.get_paths(scheme)["include"]}` (`runtime/build.py`, 3.0 to 3.9: Debian's `posix_local`
scheme read as `posix_prefix`), and that C file includes `Python.h`. CPython's `posix_prefix` scheme puts
it at `{installed_base}/include/python{X.Y}{abiflags}`, where `installed_base` is the base interpreter's
prefix, a virtual environment's too. An image whose interpreter has no headers (Debian's and Ubuntu's
`python3` without `python3-dev`) builds no Triton kernel: "fatal error: Python.h: No such file or
directory" (sgl-project/sglang#1117, theroyallab/tabbyAPI#456).

The interpreter is found from the directory a distribution is installed in:

* `<prefix>/lib/pythonX.Y/site-packages`: that prefix (`/usr/local` in the official Python images,
  `/opt/conda`), unless `<prefix>/pyvenv.cfg` makes it a virtual environment, whose `home` is the base
  interpreter's `bin` directory (`home = /usr/bin`: prefix `/usr`);
* `<prefix>/lib/pythonX.Y/dist-packages` (`/usr/local/...` where pip installs as root on Debian and
  Ubuntu, `/usr/...` for their own packages): Debian's interpreter, prefix `/usr`;
* anything else (a user's `~/.local`, `PYTHONPATH` trees): unknown, and nothing is claimed.
"""

from __future__ import annotations

import posixpath
import re

PYTHON_HEADER = "Python.h"
PYVENV = "pyvenv.cfg"
PYVENV_BYTES = 4096  # a venv's configuration: a few lines
_SITE = re.compile(r"^(?P<prefix>/.*?)/lib/python(?P<version>3\.\d{1,3}t?)/(?P<kind>site|dist)-packages$")
_HOME = re.compile(r"^[ \t]*home[ \t]*=[ \t]*(/[^\s]*)[ \t]*\r?$", re.MULTILINE)


def is_python_header(path: str) -> bool:
    """Whether the file at `path` is a Python interpreter's main C header."""
    return posixpath.basename(path) == PYTHON_HEADER


def is_venv_config(path: str) -> bool:
    """Whether the file at `path` is a virtual environment's `pyvenv.cfg`."""
    return posixpath.basename(path) == PYVENV


def venv_home(text: str) -> str:
    """The `home` a `pyvenv.cfg` names (the base interpreter's directory); "" where it names none this
    reads (the base interpreter is then unknown)."""
    match = _HOME.search(text)
    return (match.group(1).rstrip("/") or "/") if match is not None else ""


def include_dir(site_dir: str, venv_homes: dict[str, str]) -> str | None:
    """The directory `sysconfig` names for the C headers of the interpreter that installed into `site_dir`
    (module docstring), or None where that interpreter is not known from the names."""
    match = _SITE.match(site_dir)
    if match is None:
        return None
    prefix, version = match.group("prefix"), match.group("version")
    if match.group("kind") == "dist":
        if prefix not in ("/usr", "/usr/local"):
            return None
        base = "/usr"
    elif prefix in venv_homes:
        if not venv_homes[prefix]:
            return None
        base = posixpath.dirname(venv_homes[prefix])
    elif prefix.endswith("/.local"):
        return None  # a user's site directory: any interpreter's
    else:
        base = prefix
    return posixpath.join(base, "include", f"python{version}")
