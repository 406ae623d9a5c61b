"""Comments that point somewhere point at something that exists: every ``Note [x]`` cited in the
code and the tests is defined, once, as a heading line ``Note [x]`` (in the file it names, where
it names one: "Note [x] in handout.c"), and every repository path cited in src/, pinloader/ and
tests/ exists."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _package_dir() -> Path:
    """pinloader/ of the repository, else (the sdist's tests run against the installed package,
    from a tree without pinloader/) the installed package's."""
    if (ROOT / "pinloader").is_dir():
        return ROOT / "pinloader"
    import pinloader
    return Path(pinloader.__file__).resolve().parent


PKG = _package_dir()


def _dir(top: str) -> Path:
    return PKG if top == "pinloader" else ROOT / top


def _rel(path: Path) -> str:
    for base in (ROOT, PKG.parent):
        try:
            return str(path.relative_to(base))
        except ValueError:
            pass
    return str(path)


def _at(cited: str) -> Path:
    """Where a path cited from the repository's root is."""
    top, _, rest = cited.partition("/")
    return _dir(top) / rest


SCANNED = ("src", "pinloader", "tests")
SUFFIXES = {".c", ".h", ".cu", ".py", ".pyi", ".md"}
# a line break inside a comment, with the next line's comment marker: read as one space
CONTINUATION = re.compile(r"\s*\n\s*(?:\*(?!/)|#|//)?\s*")
REFERENCE = re.compile(r"Note \[([^\[\]]{1,100})\](?: in ([\w./-]+\.(?:cu|c|h|py))(?!\w))?")
HEADING = re.compile(r"^\s*(?:/\*+|\*|#|//)?\s*Note \[([^\[\]]+)\]\s*$")
PATH = re.compile(r"(?<![\w./-])((?:src|pinloader|tests|benchmarks|docs|tools|examples)/"
                  r"[\w./-]*\w\.(?:c|h|cu|py|pyi|md|rst|sh|json|toml|txt))(?![\w/])")


def _files():
    for top in SCANNED:
        for path in sorted(_dir(top).rglob("*")):
            if path.suffix in SUFFIXES and path.is_file() and "__pycache__" not in path.parts:
                yield path


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def _definitions() -> dict[str, set[Path]]:
    defined: dict[str, set[Path]] = {}
    for path in _files():
        for line in _read(path).splitlines():
            m = HEADING.match(line)
            if m:
                defined.setdefault(m.group(1), set()).add(path)
    return defined


def _named_file(name: str) -> list[Path]:
    """The files a comment's "in X" names: a path from the root, or a file name under src/ and
    pinloader/."""
    if "/" in name:
        return [_at(name)]
    return [p for top in ("src", "pinloader") for p in _dir(top).rglob(name)]


def test_every_cited_note_is_defined_where_it_is_said_to_be():
    defined = _definitions()
    assert len(defined) > 40, "Notes not found: has their heading format changed?"
    twice = {n: sorted(_rel(p) for p in ps) for n, ps in defined.items() if len(ps) > 1}
    assert not twice, f"Notes defined in more than one file: {twice}"
    this = Path(__file__).resolve()
    bad = []
    for path in _files():
        if path == this:
            continue
        text = CONTINUATION.sub(" ", _read(path))
        for m in REFERENCE.finditer(text):
            note, where = m.group(1), m.group(2)
            note = re.sub(r"\s+", " ", note)
            if "x" == note or "..." in note:  # a placeholder in prose about Notes
                continue
            rel = _rel(path)
            if note not in defined:
                bad.append(f"{rel}: Note [{note}] is not defined anywhere")
            elif where and not any(p.resolve() in defined[note] for p in _named_file(where)):
                homes = ", ".join(sorted(_rel(p) for p in defined[note]))
                bad.append(f"{rel}: Note [{note}] in {where}, but it is in {homes}")
    assert not bad, "\n".join(sorted(set(bad)))


def _shipped_in_sdist(cited: str) -> bool:
    """What MANIFEST.in puts in the sdist for certain: the code and the tests' sources."""
    return cited.split("/", 1)[0] in ("src", "pinloader", "tests") and \
        Path(cited).suffix in (".c", ".h", ".cu", ".py", ".pyi")


def test_every_cited_path_exists():
    # an sdist (no benchmarks/ in it) holds only part of the repository: there, only the paths
    # it is sure to hold are checked
    in_sdist = not (ROOT / "benchmarks").is_dir()
    bad = []
    for path in _files():
        for m in PATH.finditer(_read(path)):
            cited = m.group(1).rstrip(".")
            if in_sdist and not _shipped_in_sdist(cited):
                continue
            if not _at(cited).exists():
                bad.append(f"{_rel(path)}: {cited} does not exist")
    assert not bad, "\n".join(sorted(set(bad)))


@pytest.mark.parametrize("text,notes", [
    ("see Note [a b] in x.c", [("a b", "x.c")]),
    ("(Note\n * [closed during\n * a handout] in handout.c)", [("closed during a handout", "handout.c")]),
    ("# Note [lazy\n# paths]", [("lazy paths", None)]),
])
def test_references_are_read_across_comment_lines(text, notes):
    got = [(re.sub(r"\s+", " ", m.group(1)), m.group(2))
           for m in REFERENCE.finditer(CONTINUATION.sub(" ", text))]
    assert got == notes

