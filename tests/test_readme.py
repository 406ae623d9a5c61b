"""Every ```python block of README.md runs as written, each in a fresh interpreter.

The examples use pinloader's default device (the current GPU when CUDA is usable, else the host
backend), so on a machine without a GPU they run on the host backend and on the GPU machine on
the GPU, unchanged. A block that imports a framework needs it: JAX blocks run where jax is
installed (.ci/packaging installs the CPU build for them), CuPy blocks need CuPy and a GPU
(marked `gpu`). PINLOADER_REQUIRE_MODULES=torch,jax turns a missing framework from a skip into a
failure, so that CI cannot silently skip an example."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import pinloader

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def _blocks(lang: str) -> list[str]:
    text = README.read_text(encoding="utf-8")
    return re.findall(rf"^```{lang}\n(.*?)^```", text, flags=re.S | re.M)


def _has_module(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def _needs(code: str) -> set[str]:
    return set(re.findall(r"^\s*(?:import|from) (?:pinloader\.)?(torch|jax|cupy)\b", code,
                          flags=re.M))


PY_BLOCKS = _blocks("python")


def _params() -> list[object]:
    out = []
    for i, code in enumerate(PY_BLOCKS):
        first = code.strip().splitlines()[0] if code.strip() else ""
        marks = [pytest.mark.gpu] if "cupy" in _needs(code) else []
        out.append(pytest.param(code, id=f"block{i}-{first[:30]}", marks=marks))
    return out


def test_readme_has_the_examples():
    assert len(PY_BLOCKS) >= 4, "the README's python examples were not found"
    needs = set().union(*(_needs(c) for c in PY_BLOCKS))
    assert {"torch", "jax", "cupy"} <= needs


@pytest.mark.parametrize("code", _params())
def test_readme_python_block_runs(code, tmp_path):
    required = set(filter(None, os.environ.get("PINLOADER_REQUIRE_MODULES", "").split(",")))
    for module in sorted(_needs(code)):
        if not _has_module(module):
            if module in required:
                pytest.fail(f"this README example needs {module}, which is not installed "
                            "(PINLOADER_REQUIRE_MODULES requires it)")
            pytest.skip(f"this README example needs {module}, which is not installed")
    if "cupy" in _needs(code) and not pinloader.cuda_available():
        pytest.skip("CuPy examples need a CUDA device")
    script = tmp_path / "example.py"
    script.write_text(code, encoding="utf-8")
    env = dict(os.environ)
    # the pinloader under test, not another installed copy
    pkg_parent = str(Path(pinloader.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_parent, env.get("PYTHONPATH")) if p)
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, f"README example failed:\n{code}\n--- stderr ---\n{out.stderr[-4000:]}"


def test_readme_commands():
    """Command 1 installs and runs the demo; command 2 installs only the test tools (never a
    torch) and runs the suite."""
    bash = "\n".join(_blocks("bash"))
    lines = [ln.split("#")[0].strip() for ln in bash.splitlines() if ln.strip()]
    assert lines[0] == "pip install -e . && python -m pinloader demo"
    assert lines[1] == 'pip install -e ".[test]" && python -m pytest'
    assert "torch" not in lines[1]
