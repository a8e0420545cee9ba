"""Version, library location and loading with and without jemalloc preloaded."""

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

import kvtier

try:
    import tomllib
except ImportError:  # Python < 3.11
    tomllib = None

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def test_version_is_the_loaded_librarys():
    major, minor, patch = kvtier.version_info()
    assert kvtier.__version__ == kvtier.version() == f"{major}.{minor}.{patch}"
    assert kvtier.version_number() == major * 10000 + minor * 100 + patch


def test_pyproject_version_matches_the_library():
    text = PYPROJECT.read_text()
    if tomllib is not None:
        version = tomllib.loads(text)["project"]["version"]
    else:
        version = next(l.split("=")[1].strip().strip('"') for l in text.splitlines()
                       if l.startswith("version ="))
    assert version == kvtier.__version__


def test_installed_metadata_and_pkgconfig_match():
    """When run against the installed wheel: its metadata and the pkg-config file CMake wrote
    (whose version once said 0.1.0 while the library said 0.2.0) agree with kvt_version()."""
    from importlib import metadata
    lib_dir = Path(kvtier.library_path).parent
    if not str(lib_dir).startswith(str(Path(kvtier.__file__).parent)):
        pytest.skip("kvtier loaded from a build tree ($KVTIER_LIBRARY), not from a wheel")
    assert metadata.version("kvtier") == kvtier.__version__
    pc = (lib_dir / "pkgconfig" / "kvtier.pc").read_text()
    assert f"Version: {kvtier.__version__}" in pc
    assert (lib_dir / f"libkvtier.so.{kvtier.__version__}").is_file()


def _run(code, **env):
    e = dict(os.environ)
    e.update(env)
    return subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True,
                          timeout=120)


def _jemalloc():
    for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64",
              "/usr/lib", sysconfig.get_config_var("LIBDIR") or "/nonexistent"):
        p = Path(d) / "libjemalloc.so.2"
        if p.is_file():
            return str(p)
    return None


ALLOC = ("import kvtier; m = kvtier.Model([kvtier.LayerSpec.mla()]); "
         "c = kvtier.Context(m); print(kvtier.__version__, c.allocator_name)")


def test_import_without_jemalloc_uses_libc():
    r = _run(ALLOC, LD_PRELOAD="")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [kvtier.__version__, "libc"]


def test_import_with_jemalloc_preloaded_uses_its_arena():
    so = _jemalloc()
    if so is None:
        pytest.fail("libjemalloc.so.2 not found (scripts/deps.sh installs libjemalloc-dev)")
    r = _run(ALLOC, LD_PRELOAD=so)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [kvtier.__version__, "jemalloc"]


def test_kvtier_library_env_names_the_library():
    r = _run("import kvtier; print(kvtier.library_path)", KVTIER_LIBRARY=kvtier.library_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == kvtier.library_path
    # a folder holding libkvtier.so
    r = _run("import kvtier; print(kvtier.library_path)",
             KVTIER_LIBRARY=str(Path(kvtier.library_path).parent))
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.strip()).name == "libkvtier.so"


def test_kvtier_library_env_wrong_path_is_a_clear_import_error(tmp_path):
    r = _run("import kvtier", KVTIER_LIBRARY=str(tmp_path / "nope.so"))
    assert r.returncode != 0
    assert "ImportError" in r.stderr and "KVTIER_LIBRARY" in r.stderr and "nope.so" in r.stderr
    bad = tmp_path / "libkvtier.so"
    bad.write_bytes(b"not an ELF file")
    r = _run("import kvtier", KVTIER_LIBRARY=str(bad))
    assert r.returncode != 0 and "cannot load libkvtier.so" in r.stderr
