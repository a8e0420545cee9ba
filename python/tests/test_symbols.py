"""Every public function the loaded libkvtier.so exports (``kvt_`` names; ``kvt__`` ones are
internal) is bound by the package: declared with its ctypes signature and called from a
Python method or function. A new C function without a binding fails here, named."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

import kvtier
from kvtier import _lib, trace

PACKAGE = Path(kvtier.__file__).resolve().parent


def exported_symbols() -> set[str]:
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm (binutils) is not installed: cannot list the library's exported symbols")
    out = subprocess.run([nm, "-D", "--defined-only", str(_lib.library_path)],
                         capture_output=True, text=True, check=True).stdout
    names = set()
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[1] in "TtWi":  # functions (text, weak, indirect)
            name = parts[2].split("@")[0]
            if name.startswith("kvt_") and not name.startswith("kvt__"):
                names.add(name)
    return names


def declared() -> set[str]:
    return set(_lib._SIGNATURES) | set(trace._SIGNATURES)


def called() -> set[str]:
    """Names the package's modules use as lib.<name> (a call, or a function handed on: a
    handle's destroy, a struct's init), or name in LayerSpec._made_by (getattr on lib)."""
    text = "\n".join(p.read_text() for p in PACKAGE.glob("*.py"))
    return (set(re.findall(r"\blib\.(kvt_[a-z0-9_]+)\b", text)) |
            set(re.findall(r'_made_by\("(kvt_[a-z0-9_]+)"', text)))


# Declared (tests/test_abi.py calls them) but deliberately not used by the package: they return a
# versioned struct by value, which a newer library with a larger struct would overrun; the
# package fills its structs with the *_init functions instead (kvt_config_init, ...).
BY_VALUE_DEFAULTS = {"kvt_config_default", "kvt_ctx_default_params", "kvt_seq_default_params"}


def test_every_exported_function_is_bound():
    exported = exported_symbols()
    assert "kvt_version" in exported, "nm listed none of the library's functions"
    missing = sorted(exported - declared())
    assert not missing, f"exported by {_lib.library_path} but not declared in the package: " \
                        f"{', '.join(missing)}"
    unused = sorted(exported - called() - BY_VALUE_DEFAULTS)
    assert not unused, f"declared but no method or function of the package calls them: " \
                       f"{', '.join(unused)}"


def test_every_declaration_names_an_exported_function():
    stale = sorted(declared() - exported_symbols())
    assert not stale, f"declared in the package, not exported by the library: {', '.join(stale)}"
