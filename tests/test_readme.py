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
    for needle in PRINTS:
        assert any(needle in c for c in PY_BLOCKS), f"no README example has {needle!r} any more"


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
    # the examples print what their comments say, so that a reader can tell they worked
    for needle, printed in PRINTS.items():
        if needle in code:
            assert printed in out.stdout, (printed, out.stdout)


# A phrase of an example -> what that example prints (its comment says so too).
PRINTS = {
    "torch.arange(1024.0)": "523776.0",          # the sum of 0..1023: every row arrived once
    "rows += batch": "epoch 1: 1000 rows",
    "pj.prefetch(numpy_batches)": " 64.0",
    "pinloader.ImageLoader(root": "12 images decoded on the",
}


def test_readme_commands():
    """Command 1 installs and runs the demo; command 2 installs only the test tools (never a
    torch) and runs the suite."""
    bash = "\n".join(_blocks("bash"))
    lines = [ln.split("#")[0].strip() for ln in bash.splitlines() if ln.strip()]
    assert lines[0] == "pip install -e . && python -m pinloader demo"
    assert lines[1] == 'pip install -e ".[test]" && python -m pytest'
    assert "torch" not in lines[1]


RESULTS = ROOT / "benchmarks" / "results"
_NUMBER = re.compile(r"(?<![\w.])\d{1,3}(?:,\d{3})+(?:\.\d+)?(?![\w])|(?<![\w.,])\d+(?:\.\d+)?(?![\w])")


def _results_section() -> str:
    text = README.read_text(encoding="utf-8")
    m = re.search(r"^## Results\n(.*?)(?=^## )", text, flags=re.S | re.M)
    assert m, "the README's results section (## Results) was not found"
    return m.group(1)


def test_every_number_in_the_readme_results_is_in_the_committed_results():
    """Each number of the README's results section (the ratios, their ranges, the samples/s)
    appears, as written, in a committed result file (benchmarks/results/**/*.md or *.json), so
    that the front page quotes measurements and nothing else."""
    if not RESULTS.is_dir():
        pytest.skip("benchmarks/results/ is not in this tree (the sdist does not carry it)")
    corpus = "\n".join(p.read_text(encoding="utf-8", errors="replace")
                       for p in sorted(RESULTS.rglob("*")) if p.suffix in (".md", ".json"))
    section = _results_section()
    numbers = set(_NUMBER.findall(section.replace("–", " – ")))
    assert {"0.783", "0.895", "1.006"} <= numbers, "the model rows, the DataLoader door's included"
    missing = sorted(n for n in numbers
                     if not re.search(rf"(?<![\d.,]){re.escape(n)}(?![\d])", corpus))
    assert not missing, f"numbers in the README's results that no committed result file has: {missing}"
    # a median with its range, "0.91× (0.91–0.92)", is one measurement: it must be written the
    # same way ("0.91 (0.91–0.92)") in one result file, not pieced together from several
    pairs = re.findall(r"(\d+(?:\.\d+)?)× \((\d+(?:\.\d+)?–\d+(?:\.\d+)?)\)", section)
    assert len(pairs) >= 6, pairs
    unmatched = [f"{m} ({r})" for m, r in pairs if f"{m} ({r})" not in corpus]
    assert not unmatched, f"medians with ranges that no committed result file has as written: {unmatched}"


def test_readme_results_say_that_ratios_above_the_bound_are_noise():
    section = _results_section()
    above = [float(r) for r in re.findall(r"(\d+\.\d+)×", section) if float(r) > 1.0]
    if above:
        assert "above 1.0" in section and "noise" in section
