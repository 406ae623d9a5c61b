"""The image transforms of :class:`pinloader.ImageLoader` that do not depend on where images are
decoded: the crop sampler, the evaluation resize, the normalization constants, the JPEG header
reader, and the host decoder (Pillow, libjpeg-turbo).

Note [image parameters]
Every sample is described by nine integers (Note [image resampling] in src/core/jpeg_cuda.c):
the box (top, left, height, width) in the decoded image, the size (rh, rw) the box is resized
to, the corner (oy, ox) of the output window in the resized box, and a horizontal flip. The GPU
decoder and the host decoder take the same nine, so the two backends crop alike:

* ``train=True``: torchvision's ``RandomResizedCrop.get_params`` (ten tries of an area drawn in
  ``scale`` and a log-uniform aspect ratio in ``ratio``, rounded with Python's round, accepted
  if it fits, its corner drawn uniformly; else the central fallback), the box resized to the
  output size, and a flip with probability 1/2.
* ``train=False``: torchvision's ``Resize(resize)`` (the shorter side to ``resize``, the longer
  to ``int(resize * long / short)``) then ``CenterCrop(size)`` (the corner
  ``int(round((resized - size) / 2))``): the whole image is the box. With ``flip=True`` the
  window is flipped as a training crop is, by the same draw.

Note [counter-based draws]
The random numbers come from SplitMix64 keyed by (seed, epoch, sample index): the key is mixed
from the three, and draw ``k`` of a sample is the mix of ``key + (k + 1) * golden``. No state
is carried from one sample to the next, so any sample's crop can be made alone, in any order,
on any rank, after any resume, with the same result; NumPy computes a whole batch at once.
Uniform floats are the top 53 bits over 2**53; an integer below ``n`` is ``floor(u * n)``
(bias below 2**-22 for the image sizes here). Each sample has 41 draws: four per try (area,
ratio, top, left), then the flip.

Note [host decode]
The host decoder is Pillow: ``Image.open`` on the encoded bytes, ``convert("RGB")`` (grayscale,
CMYK, palette and alpha images become RGB as Pillow converts them), then the box cropped and
resized with Pillow's bilinear filter (antialiased when shrinking), which is torchvision's
``resized_crop`` on PIL images and the arithmetic the GPU kernel reproduces (Note [resampling
like Pillow] in src/core/image_kernel.cu). EXIF orientation is ignored, on both backends, as
torchvision.io's ``decode_jpeg`` and DALI do by default and as ``ImageFolder``'s PIL loader
does: pixels are used in the order they are stored. Normalization is
``float32(pixel) * scale + bias`` with ``scale = 1 / (255 * std)`` and ``bias = -mean / std``,
the GPU kernel's constants, then a cast to the output dtype.
"""
from __future__ import annotations

import io
import math
from typing import Any, Sequence

import numpy as np

_M64 = (1 << 64) - 1
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
TRIES = 10
DRAWS = 4 * TRIES + 1


def _mix(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer over a uint64 array (wrapping arithmetic)."""
    z = z ^ (z >> np.uint64(30))
    z = z * np.uint64(0xBF58476D1CE4E5B9)
    z = z ^ (z >> np.uint64(27))
    z = z * np.uint64(0x94D049BB133111EB)
    out: np.ndarray = z ^ (z >> np.uint64(31))
    return out


def draws(seed: int, epoch: int, index: np.ndarray, count: int = DRAWS) -> np.ndarray:
    """Uniform floats in [0, 1), shape (len(index), count): Note [counter-based draws]."""
    with np.errstate(over="ignore"):
        k = _mix(np.array([seed & _M64], np.uint64) ^ np.uint64(0x5851F42D4C957F2D))
        k = _mix(k + np.array([epoch & _M64], np.uint64) * _GOLDEN)
        idx = np.asarray(index, dtype=np.int64).astype(np.uint64)
        key = _mix(k + (idx + np.uint64(1)) * np.uint64(0xD1B54A32D192ED03))
        steps = (np.arange(1, count + 1, dtype=np.uint64) * _GOLDEN)[None, :]
        z = _mix(key[:, None] + steps)
    return (z >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def crop_boxes(hw: np.ndarray, u: np.ndarray, scale: Sequence[float], ratio: Sequence[float]) -> np.ndarray:
    """torchvision's RandomResizedCrop.get_params for each image (Note [image parameters]):
    ``hw`` (B, 2) image heights and widths, ``u`` (B, >= 40) uniform draws. Returns int64
    (B, 4): top, left, height, width."""
    hw = np.asarray(hw, dtype=np.int64)
    H = hw[:, 0:1].astype(np.float64)
    W = hw[:, 1:2].astype(np.float64)
    area = H * W
    s0, s1 = float(scale[0]), float(scale[1])
    lr0, lr1 = math.log(ratio[0]), math.log(ratio[1])
    us = u[:, 0:4 * TRIES:4]
    ur = u[:, 1:4 * TRIES:4]
    ui = u[:, 2:4 * TRIES:4]
    uj = u[:, 3:4 * TRIES:4]
    target = area * (s0 + us * (s1 - s0))
    aspect = np.exp(lr0 + ur * (lr1 - lr0))
    w = np.rint(np.sqrt(target * aspect))
    h = np.rint(np.sqrt(target / aspect))
    ok = (w > 0) & (w <= W) & (h > 0) & (h <= H)
    top = np.floor(ui * (H - h + 1))
    left = np.floor(uj * (W - w + 1))
    first = np.argmax(ok, axis=1)
    rows = np.arange(len(hw))
    found = ok[rows, first]
    out = np.empty((len(hw), 4), np.int64)
    out[:, 0] = top[rows, first]
    out[:, 1] = left[rows, first]
    out[:, 2] = h[rows, first]
    out[:, 3] = w[rows, first]
    # the central fallback, for the images none of the tries fitted
    if not found.all():
        for r in np.flatnonzero(~found):
            out[r] = central_fallback(int(hw[r, 0]), int(hw[r, 1]), ratio)
    return out


def central_fallback(height: int, width: int, ratio: Sequence[float]) -> tuple[int, int, int, int]:
    """torchvision's fallback when no try fits: the largest central box within ``ratio``."""
    in_ratio = float(width) / float(height)
    if in_ratio < min(ratio):
        w = width
        h = int(round(w / min(ratio)))
    elif in_ratio > max(ratio):
        h = height
        w = int(round(h * max(ratio)))
    else:
        w, h = width, height
    # at least one pixel (torchvision would give an empty box for a 1-pixel-wide image whose
    # ratio rounds the other side to 0)
    w, h = max(1, w), max(1, h)
    return (height - h) // 2, (width - w) // 2, h, w


def train_params(hw: np.ndarray, u: np.ndarray, size: tuple[int, int], scale: Sequence[float],
                 ratio: Sequence[float], flip: bool) -> np.ndarray:
    """int32 (B, 9) parameters of training crops (Note [image parameters])."""
    n = len(hw)
    p = np.zeros((n, 9), np.int64)
    if n:
        p[:, 0:4] = crop_boxes(hw, u, scale, ratio)
        p[:, 4], p[:, 5] = size
        if flip:
            p[:, 8] = u[:, 4 * TRIES] < 0.5
    return p.astype(np.int32)


_I32 = 2**31 - 1


def eval_params(hw: np.ndarray, size: tuple[int, int], resize: int) -> np.ndarray:
    """int32 (B, 9) parameters of evaluation crops: Resize(resize) then CenterCrop(size)."""
    hw = np.asarray(hw, dtype=np.int64).reshape(-1, 2)
    h, w = hw[:, 0], hw[:, 1]
    n = len(hw)
    p = np.zeros((n, 9), np.int64)
    if not n:
        return p.astype(np.int32)
    # torchvision's int(resize * long / short), in float64 as Python computes it
    tall = np.floor(resize * h.astype(np.float64) / w).astype(np.int64)
    wide = np.floor(resize * w.astype(np.float64) / h).astype(np.int64)
    rh = np.where(h <= w, resize, tall)
    rw = np.where(h <= w, wide, resize)
    # never smaller than the window: ImageLoader refuses a resize below the window's sides (where
    # torchvision would pad), and any other caller still gets parameters the resampling takes
    rh, rw = np.maximum(rh, size[0]), np.maximum(rw, size[1])
    # at most int32's largest, never wrapped: only an image too large to resize anyway (a
    # non-JPEG thousands of times wider than tall) gets there, and resample() refuses it
    rh, rw = np.minimum(rh, _I32), np.minimum(rw, _I32)
    p[:, 2], p[:, 3], p[:, 4], p[:, 5] = h, w, rh, rw
    # int(round((resized - size) / 2.0)): Python's round halves to even, as np.rint does
    p[:, 6] = np.rint((rh - size[0]) / 2.0)
    p[:, 7] = np.rint((rw - size[1]) / 2.0)
    return p.astype(np.int32)


def norm_constants(mean: Sequence[float] | None, std: Sequence[float] | None, dtype: str) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(scale, bias) per channel: value = pixel * scale + bias (Note [host decode]). uint8
    output is the pixels themselves."""
    if dtype == "uint8" or mean is None:
        if dtype != "uint8" and mean is None:
            return (1 / 255.0,) * 3, (0.0,) * 3
        return (1.0,) * 3, (0.0,) * 3
    m = np.asarray(mean, np.float64)
    s = np.asarray(std, np.float64)
    return tuple(float(x) for x in 1.0 / (255.0 * s)), tuple(float(x) for x in -m / s)


# ---- headers ----

_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}


def jpeg_info(data: Any) -> tuple[int, int, int] | None:
    """(height, width, components) from a JPEG's frame header, or None when ``data`` is not a
    JPEG whose frame header could be found (then the host decoder takes it)."""
    b = memoryview(data).cast("B") if not isinstance(data, (bytes, bytearray)) else data
    n = len(b)
    if n < 4 or b[0] != 0xFF or b[1] != 0xD8:
        return None
    i = 2
    while i + 4 <= n:
        if b[i] != 0xFF:
            return None
        m = b[i + 1]
        if m == 0xFF:  # fill byte
            i += 1
            continue
        if m == 0x01 or 0xD0 <= m <= 0xD7:  # markers without a length
            i += 2
            continue
        if m in (0xD9, 0xDA):  # the end, or the scan before any frame header
            return None
        seg = (b[i + 2] << 8) | b[i + 3]
        if m in _SOF:
            if i + 10 > n or seg < 8:
                return None
            h = (b[i + 5] << 8) | b[i + 6]
            w = (b[i + 7] << 8) | b[i + 8]
            c = b[i + 9]
            if h == 0 or w == 0:
                return None
            return h, w, c
        if seg < 2:
            return None
        i += 2 + seg
    return None


def image_info(data: Any) -> tuple[int, int, int]:
    """(height, width, components) of any image: the JPEG header, else Pillow's header read
    (components 0 for a non-JPEG). Raises ValueError when the bytes are not an image."""
    info = jpeg_info(data)
    if info is not None:
        return info
    Image = _pil()
    from PIL import UnidentifiedImageError
    try:
        with Image.open(io.BytesIO(bytes(data))) as im:
            w, h = im.size
    except UnidentifiedImageError:
        # Pillow's text names the BytesIO object it was given (an address): say what it means
        raise ValueError("not an image Pillow recognizes (no image format's header matches its "
                         f"first bytes, {_lead(data)})") from None
    except MemoryError:
        raise
    except Exception as e:  # noqa: BLE001 -- see Note [Pillow's exceptions]
        raise ValueError(f"not an image Pillow recognizes ({type(e).__name__}: {e})") from None
    return h, w, 0


def _lead(data: Any) -> str:
    """The first bytes of ``data`` for a message: "starting b'GIF8'", or "empty"."""
    head = bytes(memoryview(data)[:8])
    return f"starting {head!r}" if head else "empty"


# ---- the host decoder ----

def _pil() -> Any:
    """Pillow, or an ImportError that says how to get it."""
    try:
        from PIL import Image
    except ImportError:
        raise ImportError("ImageLoader decodes on the host with Pillow, which is not installed: "
                          "pip install Pillow (or pip install 'pinloader[images]')") from None
    return Image


# Note [Pillow's exceptions]
# Pillow's format readers raise more than OSError, ValueError and SyntaxError on damaged bytes
# (the DDS reader NotImplementedError, others TypeError, AttributeError, EOFError, struct.error):
# any exception but MemoryError from opening or decoding one sample's bytes is that sample's
# error (its ImageDecodeError, or a counted skip), never an exception of the whole loader
# without the sample's name. A MemoryError is the process's, not the sample's.

def decode_rgb(data: Any) -> np.ndarray:
    """The whole image as (h, w, 3) uint8 (Note [host decode], Note [Pillow's exceptions])."""
    Image = _pil()
    try:
        with Image.open(io.BytesIO(bytes(data))) as im:
            im.load()
            rgb = im.convert("RGB") if im.mode != "RGB" else im
            arr = np.asarray(rgb)
    except MemoryError:
        raise
    except Exception as e:  # noqa: BLE001 -- see Note [Pillow's exceptions]
        raise ValueError(f"cannot decode ({type(e).__name__}: {e})") from None
    return arr


def resample(img: np.ndarray, p: Sequence[int] | np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """The box of ``img`` (h, w, 3 uint8) resized and windowed as ``p`` says: (H, W, 3) uint8."""
    Image = _pil()
    top, left, h, w, rh, rw, oy, ox, flip = (int(v) for v in p)
    H, W = img.shape[:2]
    if top < 0 or left < 0 or h < 1 or w < 1 or top + h > H or left + w > W:
        raise ValueError(f"the box (top {top}, left {left}, {h} x {w}) is outside the "
                         f"{H} x {W} image")
    limit = Image.MAX_IMAGE_PIXELS
    if limit is not None and rh * rw > 2 * limit:  # an image hundreds of times wider than tall
        more = " or more" if max(rh, rw) >= _I32 else ""  # (eval_params' bound)
        raise ValueError(f"resizing the {H} x {W} image to {rh} x {rw}{more} is past Pillow's image "
                         f"size limit ({2 * limit} pixels)")
    box = np.ascontiguousarray(img[top:top + h, left:left + w])
    if (h, w) == (rh, rw):
        out = box
    else:
        out = np.asarray(Image.fromarray(box, "RGB").resize((rw, rh), Image.Resampling.BILINEAR))
    out = out[oy:oy + size[0], ox:ox + size[1]]
    return out[:, ::-1] if flip else out


def host_decode(data: Any, p: Sequence[int] | np.ndarray, size: tuple[int, int], expect: tuple[int, int] | None = None) -> np.ndarray:
    """Decode one sample and resample it: (H, W, 3) uint8. ``expect``: the (h, w) the crop was
    drawn for (the loader's size cache: a packed sizes.npy, or the header when first read)."""
    img = decode_rgb(data)
    if expect is not None and tuple(img.shape[:2]) != tuple(expect):
        raise ValueError(size_mismatch(img.shape[:2], expect))
    return resample(img, p, size)


def size_mismatch(got: Sequence[int] | np.ndarray, expect: Sequence[int] | np.ndarray) -> str:
    """Why a sample fails whose image is not the size its crop was drawn for: one text for the
    host and the GPU paths (a size recorded in sizes.npy, or read when the file was first met
    and the file replaced since)."""
    return (f"decoded to {int(got[0])} x {int(got[1])}, not the {int(expect[0])} x {int(expect[1])} "
            "its crop was drawn for (the packed sizes.npy's, or its header's when the file was "
            "first read)")
