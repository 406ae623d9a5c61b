"""Every ``.. code-block:: python`` sample of the documentation (docs/**/*.rst) runs as written,
each in a fresh interpreter, on pinloader's default device (the host backend without a GPU).
A sample that imports a framework needs it: it is skipped, with the reason shown, only where
that framework is not installed (CuPy samples also need a CUDA device);
PINLOADER_REQUIRE_MODULES=torch,jax turns a missing framework into a failure."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import pinloader

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def _samples() -> list[tuple[str, str]]:
    out = []
    for page in sorted(DOCS.rglob("*.rst")):
        if "_build" in page.parts or "_generated" in page.parts:
            continue
        text = page.read_text(encoding="utf-8")
        for m in re.finditer(r"^\.\. code-block:: python\n((?:[ \t]*:\w[^\n]*\n)*)\n"
                             r"((?:(?:[ \t]+[^\n]*)?\n)+)", text, flags=re.M):
            out.append((f"{page.relative_to(DOCS)}:{text[:m.start()].count(chr(10)) + 1}",
                        textwrap.dedent(m.group(2))))
    return out


SAMPLES = _samples()


def _needs(code: str) -> set[str]:
    return set(re.findall(r"^\s*(?:import|from) (?:pinloader\.)?(torch|jax|cupy)\b", code,
                          flags=re.M))


def _has(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def test_the_docs_have_samples():
    assert len(SAMPLES) >= 8, SAMPLES
    assert {"torch", "jax", "cupy"} <= set().union(*(_needs(c) for _, c in SAMPLES))


@pytest.mark.parametrize("where,code", [pytest.param(w, c, id=w) for w, c in SAMPLES])
def test_docs_sample_runs(where, code, tmp_path):
    required = set(filter(None, os.environ.get("PINLOADER_REQUIRE_MODULES", "").split(",")))
    for module in sorted(_needs(code)):
        if not _has(module):
            if module in required:
                pytest.fail(f"{where} needs {module}, which is not installed "
                            "(PINLOADER_REQUIRE_MODULES requires it)")
            pytest.skip(f"{where} needs {module}, which is not installed")
    if "cupy" in _needs(code) and not pinloader.cuda_available():
        pytest.skip(f"{where}: CuPy samples need a CUDA device")
    script = tmp_path / "sample.py"
    script.write_text(code, encoding="utf-8")
    env = dict(os.environ)
    pkg_parent = str(Path(pinloader.__file__).resolve().parent.parent)  # the pinloader under test
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_parent, env.get("PYTHONPATH")) if p)
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, f"{where} failed:\n{code}\n--- stderr ---\n{out.stderr[-4000:]}"


def _door_names(module: str) -> list[str]:
    """A door's __all__, read from its source (importing it would need the framework)."""
    import ast

    tree = ast.parse((Path(pinloader.__file__).parent / f"{module}.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return [ast.literal_eval(e) for e in node.value.elts]  # type: ignore[attr-defined]
    raise AssertionError(f"pinloader/{module}.py has no __all__")


def test_every_public_name_is_in_the_api_reference():
    api = (DOCS / "api.rst").read_text(encoding="utf-8")
    documented = set(re.findall(r"^\.\. (?:autoclass|autofunction|autoexception|py:data):: (\S+)",
                                api, flags=re.M))
    for m in re.finditer(r"^\.\. automodule:: (\S+)\n((?:   :[^\n]*\n)*)", api, flags=re.M):
        members = re.search(r":members: ([^\n]*)", m.group(2))
        assert members, f"automodule {m.group(1)} names its members"
        documented |= {f"{m.group(1)}.{n.strip()}" for n in members.group(1).split(",")}
    public = {f"pinloader.{n}" for n in pinloader.__all__}
    for door in ("torch", "jax", "cupy"):
        public |= {f"pinloader.{door}.{n}" for n in _door_names(door)}
    assert public - documented == set(), "public names missing from docs/api.rst"


def test_docs_pages_users_look_for_exist_and_are_in_the_toctree():
    index = (DOCS / "index.rst").read_text(encoding="utf-8")
    for page in ("faq", "changelog", "compatibility", "api", "benchmarks", "getting-started"):
        assert (DOCS / f"{page}.rst").is_file(), page
        assert re.search(rf"^   {page}$", index, flags=re.M), f"{page} is not in the index's toctree"
    assert ".. code-block:: python" in index, "the landing page shows code"


def test_the_api_docstrings_have_no_field_that_napoleon_would_misread():
    """Napoleon reads a property docstring's first line "X: text" as "type: description", so a
    line such as "static=True: the real rows" came out as "TYPE: static=True". No public
    attribute's docstring may start with a word and a colon that is not a type."""
    import inspect

    classes = [getattr(pinloader, n) for n in pinloader.__all__ if inspect.isclass(getattr(pinloader, n))]
    bad = []
    for cls in classes:
        for name, member in vars(cls).items():
            if name.startswith("_") or not isinstance(member, (property, type(pinloader.AsyncPrefetcher.depth))):
                continue
            first = (member.__doc__ or "").strip().splitlines()[:1]
            # napoleon splits the first line at its first colon outside ``code`` (conf.py
            # puts device strings such as 'cuda:N' in code first)
            bare = re.sub(r"``[^`]*``|:[\w:]+:`[^`]*`|'[^'\s]*:[^'\s]*'", "", first[0]) if first else ""
            if ":" in bare:
                bad.append(f"{cls.__name__}.{name}: {first[0]}")
    assert not bad, bad
