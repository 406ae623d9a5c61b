"""Packaging: one version, the licence, what the sdist carries, a build that needs no CUDA
header, and setup.py's NVTX choice. (.ci/packaging builds the sdist and wheel with the toolkit
hidden, installs them into fresh venvs and repairs the wheel; these are the quick checks.)"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

import pinloader
from pinloader import _C

ROOT = Path(__file__).resolve().parent.parent
try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = None


def _pyproject() -> dict:
    if tomllib is None:
        pytest.skip("tomllib needs Python 3.11")
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def test_the_version_is_written_once():
    meta = _pyproject()
    assert "version" not in meta["project"]
    assert "version" in meta["project"]["dynamic"]
    assert meta["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "pinloader._version.__version__"}
    from pinloader._version import __version__

    assert pinloader.__version__ == __version__
    assert re.fullmatch(r"\d+\.\d+\.\d+([ab]|rc)?\d*", __version__)
    hits = [p for p in ROOT.glob("**/*.py") if "_version.py" not in p.name and
            re.search(rf"^__version__\s*=", p.read_text(encoding="utf-8", errors="replace"), re.M)]
    assert hits == [], f"a second version literal: {hits}"


def test_licence_file_and_spdx_metadata():
    meta = _pyproject()["project"]
    assert meta["license"] == "Apache-2.0"
    assert meta["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert text.startswith("Copyright ") and "the pinloader authors" in text.splitlines()[0]
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text


def test_test_extra_never_installs_a_framework():
    extras = _pyproject()["project"]["optional-dependencies"]
    for name, reqs in extras.items():
        for r in reqs:
            assert not re.match(r"(torch|jax|cupy|tensorflow)\b", r), (name, r)


def test_werror_only_when_asked():
    text = (ROOT / "setup.py").read_text(encoding="utf-8")
    assert text.count('"-Werror"') == 1
    assert 'if os.environ.get("PINLOADER_WERROR") == "1":\n        extra_compile.append("-Werror")' in text


def test_no_source_includes_a_cuda_header():
    for f in sorted((ROOT / "src").glob("*/*.[ch]")):
        for line in f.read_text(encoding="utf-8").splitlines():
            m = re.match(r'\s*#\s*include\s*[<"]([^>"]+)[>"]', line)
            if m and m.group(1) != "cuda_api.h":  # the project's own declarations
                assert not re.match(r"(cuda|driver_types|crt/|host_defines)", m.group(1)), (f.name, line)


def test_core_never_includes_python():
    """The layers of src/README.md: nothing under src/core/ includes Python.h, a NumPy header,
    or a header of src/py/ (state.h, np.h, dlpack.h, ...), so the core cannot touch Python."""
    py_headers = {h.name for h in (ROOT / "src" / "py").glob("*.h")}
    assert {"state.h", "np.h", "dlpack.h"} <= py_headers
    py_headers.add("module.h")  # the name the Python-facing declarations once shared
    core = sorted((ROOT / "src" / "core").glob("*.[ch]")) + sorted((ROOT / "src" / "core").glob("*.cu"))
    assert len(core) > 10
    bad = []
    for f in core:
        for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
            m = re.match(r'\s*#\s*include\s*[<"]([^>"]+)[>"]', line)
            if m and (m.group(1) in py_headers or m.group(1) in ("Python.h", "structmember.h")
                      or m.group(1).startswith("numpy/")):
                bad.append(f"src/core/{f.name}:{n}: {line.strip()}")
    assert not bad, bad


def test_cuda_api_h_matches_the_toolkit():
    """src/core/cuda_api.h against a toolkit's own headers (CI and the GPU machine have one)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    inc = next((Path(d) / "include" for d in (os.environ.get("CUDA_HOME") or "", "/usr/local/cuda")
                if d and (Path(d) / "include" / "cuda_runtime_api.h").is_file()), None)
    if cc is None or inc is None:
        pytest.skip("no C compiler or no CUDA toolkit headers here")
    out = subprocess.run([cc, "-std=gnu11", "-Wall", "-Wextra", "-Werror", "-fsyntax-only",
                          f"-I{ROOT / 'src' / 'core'}", f"-I{inc}", str(ROOT / "tests" / "cuda_api_check.c")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def _require_setuptools_77() -> None:
    """Running setup.py in this environment (not in pip's isolated build environment, which
    pyproject.toml gives setuptools >= 77) needs a setuptools that reads SPDX license metadata."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        major = int(version("setuptools").split(".")[0])
    except PackageNotFoundError:
        major = 0
    if major < 77:
        pytest.skip("running setup.py here needs setuptools >= 77 (SPDX license metadata)")


def _setup_py(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    _require_setuptools_77()
    e = {k: v for k, v in os.environ.items() if k not in ("PINLOADER_NVTX", "CUDA_HOME", "CUDA_PATH")}
    e.update(env)
    return subprocess.run([sys.executable, "setup.py", "--version"], cwd=ROOT, env=e,
                          capture_output=True, text=True, timeout=120)


def test_setup_py_says_which_nvtx_headers_it_uses(tmp_path):
    out = _setup_py({"PINLOADER_NVTX": "off"})
    assert out.returncode == 0, out.stderr
    assert "NVTX ranges off (PINLOADER_NVTX=off)" in out.stderr
    assert "src/core/cuda_api.h (no CUDA header is used)" in out.stderr
    assert out.stdout.strip().splitlines()[-1] == pinloader.__version__

    fake = tmp_path / "toolkit"
    (fake / "include" / "nvtx3").mkdir(parents=True)
    (fake / "include" / "nvtx3" / "nvToolsExt.h").write_text("/* empty */\n")
    out = _setup_py({"PINLOADER_NVTX": "toolkit", "CUDA_HOME": str(fake)})
    assert out.returncode == 0, out.stderr
    assert f"headers from a CUDA toolkit: {fake / 'include'}" in out.stderr

    out = _setup_py({"PINLOADER_NVTX": str(fake / "include")})
    assert out.returncode == 0, out.stderr
    assert f"headers from PINLOADER_NVTX: {fake / 'include'}" in out.stderr

    out = _setup_py({"PINLOADER_NVTX": str(tmp_path / "nowhere")})
    assert out.returncode != 0
    assert "no nvtx3/nvToolsExt.h there" in out.stderr


def test_nvtx_flag_is_exposed():
    assert _C.NVTX in (0, 1)


def test_sdist_carries_what_the_tests_need(tmp_path):
    pytest.importorskip("build", reason="python -m build (pip install build) makes the sdist")
    _require_setuptools_77()
    out = subprocess.run([sys.executable, "-m", "build", "--sdist", "--no-isolation", "--skip-dependency-check",
                          "--outdir",
                          str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    (sdist,) = tmp_path.glob("pinloader-*.tar.gz")
    with tarfile.open(sdist) as tf:
        names = {n.split("/", 1)[1] for n in tf.getnames() if "/" in n}
    need = {"LICENSE", "README.md", "pyproject.toml", "setup.py", "MANIFEST.in",
            "pinloader/py.typed", "pinloader/_C.pyi", "pinloader/_version.py",
            "tests/conftest.py", "tests/helpers.py", "tests/fuzz_strategies.py", "tests/cuda_api_check.c",
            "tests/image_kernel_emu.cpp", "tests/cuda_shim/cuda_fp16.h",
            "tests/typing/user_script.py", "tests/typing/stubtest_allowlist.txt"}
    need |= {str(p.relative_to(ROOT)) for p in (ROOT / "src").glob("*/*.[ch]")}
    need |= {str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py")}
    assert need <= names, sorted(need - names)
    assert not [n for n in names if n.endswith(".so") or n.startswith("benchmarks/")]
    # the package index shows the README without the repository: no relative link may be left
    with tarfile.open(sdist) as tf:
        info = next(n for n in tf.getnames() if n.count("/") == 1 and n.endswith("/PKG-INFO"))
        meta = tf.extractfile(info).read().decode("utf-8")
    assert "Content-Type: text/markdown" in meta and "# pinloader" in meta
    targets = re.findall(r"\]\(([^)\s]+)\)", meta)
    assert targets and all(re.match(r"https://|#", t) for t in targets), \
        [t for t in targets if not re.match(r"https://|#", t)]
    assert "/blob/main/docs/getting-started.rst)" in meta, "a page link opens the page"


def test_stats_typeddicts_match_what_stats_returns():
    """pinloader.PrefetcherStats / PoolStats / CudaInfo (what a type checker sees) name exactly
    the keys, with the types, that the native stats() and cuda_info() return."""
    import typing

    def check(td: type, got: dict) -> None:
        hints = typing.get_type_hints(td)
        assert set(hints) == set(got), (td.__name__, set(hints) ^ set(got))
        for key, hint in hints.items():
            origin = typing.get_origin(hint)
            want = str if origin is typing.Literal else hint
            assert isinstance(got[key], want), (td.__name__, key, type(got[key]), hint)
            if origin is typing.Literal:
                assert got[key] in typing.get_args(hint), (key, got[key])

    with pinloader.AsyncPrefetcher([[bytearray(100)]] * 3, device="cpu") as pf:
        list(pf)
        check(pinloader.PrefetcherStats, pf.stats())
    with pinloader.PinnedPool(device="cpu") as pool:
        pool.alloc(4096).release()
        check(pinloader.PoolStats, pool.stats())
    check(pinloader.CudaInfo, pinloader.cuda_info())


def test_the_advertised_pythons_agree_and_ci_tests_each():
    """requires-python, the classifiers and the wheels built name the same Pythons, and
    .ci/pythons (run by .ci/run) installs and tests every classifier's version it finds."""
    meta = _pyproject()
    classifiers = [c.rsplit(":: ", 1)[1] for c in meta["project"]["classifiers"]
                   if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)]
    minors = sorted(int(v.split(".")[1]) for v in classifiers)
    assert minors == list(range(minors[0], minors[-1] + 1)), classifiers
    assert meta["project"]["requires-python"] == f">=3.{minors[0]}"
    wheels = sorted(int(m) for m in re.findall(r"cp3(\d+)-\*", meta["tool"]["cibuildwheel"]["build"]))
    assert wheels == minors
    ci = (ROOT / ".ci" / "pythons")
    if not ci.is_file():
        pytest.skip(".ci/ is not in this tree (the sdist does not carry it)")
    assert "Programming Language :: Python :: 3" in ci.read_text(encoding="utf-8")
    assert ".ci/pythons" in (ROOT / ".ci" / "run").read_text(encoding="utf-8")
