"""Images for the ImageLoader tests (tests/test_image_*.py): photo-like JPEGs written as a folder,
a path list, tar shards and a packed dataset, and the Pillow reference of the loader's output."""
from __future__ import annotations

import io
import os
import tarfile

import numpy as np
from PIL import Image

MEAN = np.array([0.485, 0.456, 0.406])
STD = np.array([0.229, 0.224, 0.225])


def photo(h: int, w: int, seed: int) -> np.ndarray:
    """A smooth RGB image with noise (JPEG-friendly, not flat)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    img = np.stack([128 + 100 * np.sin(x / (7 + c * 3) + y / (11 + c)) for c in range(3)], -1)
    img += rng.normal(0, 8, img.shape)
    return np.clip(img, 0, 255).astype(np.uint8)


def jpeg(arr: np.ndarray, **kw) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="JPEG", quality=kw.pop("quality", 90), **kw)
    return buf.getvalue()


def box_params(rng: np.random.Generator, shapes: list[tuple[int, int]], size: tuple[int, int]) -> np.ndarray:
    """For each (H, W) in ``shapes``, the GPU decoder's parameters of a sample (top, left, h, w,
    rh, rw, oy, ox, flip; Note [image resampling] in src/core/jpeg_cuda.c) for an output of
    ``size``: at random, a training crop (a random box resized to the output, flipped or not) or
    an evaluation one (the shorter side resized, the centre window)."""
    ps = []
    for (H, W) in shapes:
        if rng.random() < 0.5:
            h = int(rng.integers(1, H + 1))
            w = int(rng.integers(1, W + 1))
            ps.append([rng.integers(0, H - h + 1), rng.integers(0, W - w + 1), h, w, size[0], size[1],
                       0, 0, rng.integers(0, 2)])
        else:
            s = max(size)
            rh, rw = (s, max(s, int(s * W / H))) if H <= W else (max(s, int(s * H / W)), s)
            ps.append([0, 0, H, W, rh, rw, (rh - size[0]) // 2, (rw - size[1]) // 2, 0])
    return np.array(ps, np.int32)


def resized_crop(img: np.ndarray, p, size: tuple[int, int], across_first: bool = False) -> np.ndarray:
    """Pillow's path for parameters ``p`` (box_params), as torchvision's resized_crop takes it on
    a PIL image, then the output window and the flip: uint8 (H, W, 3). ``across_first``: Pillow's
    horizontal pass alone, then its vertical pass alone, the image kernels' order (Pillow's own
    resize runs first the pass that shrinks more)."""
    top, left, h, w, rh, rw, oy, ox, flip = (int(v) for v in p)
    im = Image.fromarray(img).crop((left, top, left + w, top + h))
    if across_first:
        im = im.resize((rw, h), Image.BILINEAR)
    im = im.resize((rw, rh), Image.BILINEAR)
    out = np.asarray(im)[oy:oy + size[0], ox:ox + size[1]]
    return out[:, ::-1] if flip else out


def shapes(n: int, seed: int = 0) -> list[tuple[int, int]]:
    rng = np.random.default_rng(seed)
    return [(int(h), int(w)) for h, w in rng.integers(20, 90, size=(n, 2))]


def make_folder(root: str, n_per_class: int = 6, classes=("b_dog", "a_cat", "c_eel")) -> str:
    """An ImageFolder tree of JPEGs; returns root."""
    k = 0
    for c in classes:
        os.makedirs(os.path.join(root, c), exist_ok=True)
        for (h, w) in shapes(n_per_class, seed=len(c) + ord(c[0])):
            with open(os.path.join(root, c, f"img{k:03d}.jpg"), "wb") as f:
                f.write(jpeg(photo(h, w, k)))
            k += 1
    return root


def folder_items(root: str) -> list[tuple[str, int]]:
    """(path, label) in torchvision's ImageFolder order."""
    classes = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
    out = []
    for c, name in enumerate(classes):
        for fname in sorted(os.listdir(os.path.join(root, name))):
            out.append((os.path.join(root, name, fname), c))
    return out


def make_tars(items: list[tuple[str, int]], dest: str, per_shard: int) -> list[str]:
    """WebDataset shards of the items, in order."""
    shards = []
    for s in range(0, len(items), per_shard):
        path = os.path.join(dest, f"shard-{s // per_shard:04d}.tar")
        with tarfile.open(path, "w") as t:
            for k, (p, lab) in enumerate(items[s:s + per_shard]):
                key = f"sample{s + k:06d}"
                t.add(p, arcname=f"{key}.jpg")
                data = str(lab).encode()
                info = tarfile.TarInfo(f"{key}.cls")
                info.size = len(data)
                t.addfile(info, io.BytesIO(data))
        shards.append(path)
    return shards


def make_sources(root: str, per_shard: int, n_per_class: int = 6) -> dict:
    """The same images as every kind of ImageLoader source under ``root``: an ImageFolder tree
    (``folder``, with its ``items``), tar shards of ``per_shard`` members (``tars``) and a packed
    dataset (``packed``)."""
    from pinloader._image_pack import pack
    folder = make_folder(os.path.join(root, "folder"), n_per_class=n_per_class)
    items = folder_items(folder)
    tars = make_tars(items, root, per_shard=per_shard)
    packed = os.path.join(root, "packed")
    pack(folder, packed, quiet=True)
    return {"folder": folder, "items": items, "tars": tars, "packed": packed}


def reference(data: bytes, p, size, dtype="float32", mean=MEAN, std=STD) -> np.ndarray:
    """Pillow's path for one sample, written out independently of pinloader: decode, RGB, crop
    the box, bilinear resize, window, flip, normalize; (3, H, W)."""
    top, left, h, w, rh, rw, oy, ox, flip = (int(v) for v in p)
    im = Image.open(io.BytesIO(data)).convert("RGB")
    im = im.crop((left, top, left + w, top + h))
    if (h, w) != (rh, rw):
        im = im.resize((rw, rh), Image.BILINEAR)
    out = np.asarray(im)[oy:oy + size[0], ox:ox + size[1]]
    if flip:
        out = out[:, ::-1]
    out = out.transpose(2, 0, 1)
    if dtype == "uint8":
        return out
    scale = (1 / (255 * std)).astype(np.float32)[:, None, None]
    bias = (-mean / std).astype(np.float32)[:, None, None]
    return out.astype(np.float32) * scale + bias
