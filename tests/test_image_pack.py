"""python -m pinloader pack (pinloader/_image_pack.py): the packed format opens with NumPy
alone, matches its source, and a stopped pack resumes (Note [resumable pack])."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from pinloader import _image_pack
from pinloader._image_pack import pack

from image_helpers import folder_items, make_folder, make_tars
from helpers import child_env


@pytest.fixture()
def folder(tmp_path):
    return make_folder(str(tmp_path / "folder"), n_per_class=5)


def check_packed(dest, items):
    offsets = np.load(os.path.join(dest, "offsets.npy"))
    labels = np.load(os.path.join(dest, "labels.npy"))
    sizes = np.load(os.path.join(dest, "sizes.npy"))
    data = np.fromfile(os.path.join(dest, "data.bin"), np.uint8)
    assert offsets.dtype == labels.dtype == np.int64 and sizes.dtype == np.int32
    assert offsets.shape == (len(items) + 1,) and offsets[-1] == len(data)
    from PIL import Image
    for i, (path, lab) in enumerate(items):
        with open(path, "rb") as f:
            blob = f.read()
        assert data[offsets[i]:offsets[i + 1]].tobytes() == blob
        assert labels[i] == lab
        with Image.open(path) as im:
            assert tuple(sizes[i]) == (im.size[1], im.size[0], 3)
    meta = json.load(open(os.path.join(dest, "meta.json")))
    assert meta["format"] == "pinloader.packed" and meta["count"] == len(items)
    assert not os.path.exists(os.path.join(dest, "progress.txt"))


def test_pack_a_folder_from_the_command_line(folder, tmp_path):
    dest = str(tmp_path / "packed")
    r = subprocess.run([sys.executable, "-m", "pinloader", "pack", folder, dest, "--workers", "2"],
                       capture_output=True, text=True, env=child_env(), timeout=120)
    assert r.returncode == 0, r.stderr
    assert "15/15 images" in r.stderr and "packed 15 images" in r.stderr
    check_packed(dest, folder_items(folder))
    assert json.load(open(os.path.join(dest, "meta.json")))["classes"] == ["a_cat", "b_dog", "c_eel"]
    names = open(os.path.join(dest, "names.txt")).read().split("\n")
    assert names[0] == os.path.relpath(folder_items(folder)[0][0], folder)
    # packing over a finished pack is refused
    r = subprocess.run([sys.executable, "-m", "pinloader", "pack", folder, dest],
                       capture_output=True, text=True, env=child_env(), timeout=120)
    assert r.returncode == 1 and "already holds a packed dataset" in r.stderr


def test_pack_tar_shards(folder, tmp_path):
    items = folder_items(folder)
    tars = make_tars(items, str(tmp_path), per_shard=4)
    dest = str(tmp_path / "packed")
    assert pack(tars, dest, quiet=True) == len(items)
    check_packed(dest, items)


def test_a_stopped_pack_resumes(folder, tmp_path, monkeypatch):
    items = folder_items(folder)
    dest = str(tmp_path / "packed")
    monkeypatch.setattr(_image_pack, "CHUNK", 4)
    real = _image_pack._read
    calls = {"n": 0}

    def dies(src, i):
        calls["n"] += 1
        if i == 9:
            raise KeyboardInterrupt
        return real(src, i)

    monkeypatch.setattr(_image_pack, "_read", dies)
    with pytest.raises(KeyboardInterrupt):
        pack(folder, dest, quiet=True, workers=1)
    assert not os.path.exists(os.path.join(dest, "meta.json"))
    lines = open(os.path.join(dest, "progress.txt")).read().split("\n")
    assert len(lines) - 1 == 8  # two chunks of 4 were written
    # a torn write: a half line and stray bytes after the last complete sample
    with open(os.path.join(dest, "progress.txt"), "a") as f:
        f.write("123 45")
    with open(os.path.join(dest, "data.bin"), "ab") as f:
        f.write(b"garbage")
    monkeypatch.setattr(_image_pack, "_read", real)
    seen = []
    monkeypatch.setattr(_image_pack, "_read", lambda src, i: (seen.append(i), real(src, i))[1])
    assert pack(folder, dest, quiet=True) == len(items)
    assert min(seen) == 8
    check_packed(dest, items)


def test_resume_refuses_a_changed_source(folder, tmp_path, monkeypatch):
    dest = str(tmp_path / "packed")
    monkeypatch.setattr(_image_pack, "CHUNK", 4)
    real = _image_pack._read

    def dies(src, i):
        if i == 5:
            raise KeyboardInterrupt
        return real(src, i)

    monkeypatch.setattr(_image_pack, "_read", dies)
    with pytest.raises(KeyboardInterrupt):
        pack(folder, dest, quiet=True, workers=1)
    monkeypatch.setattr(_image_pack, "_read", real)
    # a file added before the ones packed: the order no longer matches
    first = folder_items(folder)[0][0]
    with open(first, "rb") as f:
        blob = f.read()
    with open(os.path.join(os.path.dirname(first), "000_new.jpg"), "wb") as f:
        f.write(blob)
    with pytest.raises(ValueError, match="another source"):
        pack(folder, dest, quiet=True)


def test_resume_refuses_another_source(folder, tmp_path, monkeypatch):
    dest = str(tmp_path / "packed")
    os.makedirs(dest)
    with open(os.path.join(dest, "progress.txt"), "w") as f:
        f.write("0 10 2 5 5 3\n")  # label 2 for the first sample: not this folder's
    with open(os.path.join(dest, "data.bin"), "wb") as f:
        f.write(b"x" * 10)
    with pytest.raises(ValueError, match="another source"):
        pack(folder, dest, quiet=True)
