"""The image kernels' source (src/core/image_kernel.cu) run on the host by
tests/image_kernel_emu.cpp, against Pillow: the resampling, the output window, the flip, the
affine, the four dtypes and both layouts, with the GPU decoder's launch grids and with grids
far smaller than the work (the kernels loop). Built with ASan and UBSan where the compiler has
them: a kernel that touched memory outside a sample's image, rows or weight table (sized by
src/core/image_rows.h, as the GPU decoder sizes them) fails here. The kernels round every float
operation on its own (round-to-nearest intrinsics), so the device's floats are these; its
scheduling is the GPU tests' business (tests/test_jpeg_decoder_gpu.py)."""
from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("PIL.Image")  # image_helpers needs Pillow
from image_helpers import box_params, photo, resized_crop  # noqa: E402  (needs Pillow)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DTYPES = {"uint8": 0, "float32": 1, "float16": 2, "bfloat16": 3}


# Pillow's C, compiled where the compiler may fuse a multiply and an add (aarch64), can move a
# weight across a fixed-point step: bit-equality is asserted where it rounds every operation.
EXACT_PILLOW = platform.machine().lower() in ("x86_64", "amd64")
SANITIZERS = ["-fsanitize=address,undefined,float-cast-overflow,float-divide-by-zero",
              "-fno-sanitize-recover=all"]


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    if sys.byteorder != "little":
        pytest.skip("the emulation's files are little-endian")
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no C++ compiler to build the image kernels' host emulation")
    exe = str(tmp_path_factory.mktemp("emu") / "image_kernel_emu")
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)  # the sanitizer jobs preload their runtime into Python only
    env["ASAN_OPTIONS"] = "detect_leaks=0"  # LeakSanitizer cannot run under ptrace
    base = [cxx, "-std=c++17", "-O1", "-ffp-contract=off", "-Wno-unknown-pragmas",
            "-I", os.path.join(ROOT, "src", "core"), "-I", os.path.join(ROOT, "tests", "cuda_shim"),
            os.path.join(ROOT, "tests", "image_kernel_emu.cpp"), "-o", exe]
    # with the sanitizers where the compiler has them and the binary runs (it answers a missing
    # argument with status 2); else without, said on the test's output
    built = subprocess.run(base[:1] + SANITIZERS + base[1:], capture_output=True, env=env).returncode == 0
    if built:
        try:
            built = subprocess.run([exe], capture_output=True, env=env, timeout=30).returncode == 2
        except subprocess.TimeoutExpired:
            built = False
    if not built:
        print("image kernel emulation: built without the sanitizers")
        r = subprocess.run(base, capture_output=True, text=True, env=env)
        assert r.returncode == 0, r.stderr
    return exe, env


def run(emu, tmp_path, imgs, params, size, dtype="uint8", channels_last=True, scale=(1, 1, 1),
        bias=(0, 0, 0), live=None, grid=None):
    """The batch the kernels make: (n, oh, ow, 3) when channels_last, else (n, 3, oh, ow)."""
    exe, env = emu
    n, (oh, ow) = len(imgs), size
    parts = [np.array([n, oh, ow, DTYPES[dtype], int(channels_last)], "<i4").tobytes(),
             np.array([*scale, *bias], "<f4").tobytes()]
    for i, (img, p) in enumerate(zip(imgs, params)):
        alive = live is None or live[i]
        H, W = img.shape[:2]
        parts.append(np.array([int(alive), H, W, *(int(v) for v in p)], "<i4").tobytes())
        if alive:
            parts.append(np.ascontiguousarray(img, np.uint8).tobytes())
    src, out = tmp_path / "in.bin", tmp_path / "out.bin"
    src.write_bytes(b"".join(parts))
    cmd = [exe, str(src), str(out)] + ([str(grid)] if grid else [])
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr[-4000:]
    raw = np.fromfile(out, {"uint8": np.uint8, "float32": "<f4", "float16": "<u2", "bfloat16": "<u2"}[dtype])
    return raw.reshape((n, oh, ow, 3) if channels_last else (n, 3, oh, ow))


def _batch(rng, n, size, max_side=160):
    shapes = [(int(rng.integers(1, max_side)), int(rng.integers(1, max_side))) for _ in range(n)]
    imgs = [photo(h, w, int(rng.integers(0, 1 << 30))) for h, w in shapes]
    return imgs, box_params(rng, shapes, size)


def _equal_to_pillow(got, img, p, size, where):
    """Pillow's two passes in the kernels' order, to the bit (within a level where Pillow's C may
    fuse operations); within a level of Pillow's own resize."""
    want = resized_crop(img, p, size, across_first=True).astype(int)
    d = np.abs(got.astype(int) - want)
    assert d.max() <= (0 if EXACT_PILLOW else 1), f"{where}: {int((d > 0).sum())} values differ"
    assert np.abs(got.astype(int) - resized_crop(img, p, size).astype(int)).max() <= 1, where


@pytest.mark.parametrize("size", [(24, 32), (1, 1), (7, 5)])
def test_the_kernels_resample_as_pillow_does(emu, tmp_path, size):
    """Equal to Pillow's two passes taken in the kernels' order, to the bit; within one level of
    Pillow's own resize (the GPU test's bound, tests/test_jpeg_decoder_gpu.py)."""
    rng = np.random.default_rng(sum(size))
    imgs, params = _batch(rng, 12, size)
    out = run(emu, tmp_path, imgs, params, size)
    for i in range(len(imgs)):
        _equal_to_pillow(out[i], imgs[i], params[i], size,
                         f"sample {i}, image {imgs[i].shape[:2]}, params {params[i].tolist()}")


def test_a_box_inside_the_image_and_a_window_inside_the_resize(emu, tmp_path):
    """Box corners and output windows away from zero together (training crops have the one,
    evaluation crops the other): the rows read start past the box's first."""
    imgs = [photo(300, 280, 1), photo(90, 120, 2)]
    params = np.array([[37, 23, 200, 180, 60, 64, 20, 17, 1],
                       [11, 29, 70, 80, 40, 90, 9, 55, 0]], np.int32)
    out = run(emu, tmp_path, imgs, params, (24, 30))
    for i in range(2):
        _equal_to_pillow(out[i], imgs[i], params[i], (24, 30), f"sample {i}")


def test_boxes_scaled_far_up_and_far_down(emu, tmp_path):
    """A 1x1 box made 40x40, and 400-pixel boxes made 6x6 (the filter then spans ~130 taps)."""
    imgs = [photo(1, 1, 1), photo(3, 2, 2), photo(400, 420, 3), photo(430, 400, 4)]
    size = (6, 6)
    params = np.array([[0, 0, 1, 1, 40, 40, 17, 30, 0],
                       [1, 0, 2, 2, 40, 40, 0, 34, 1],
                       [0, 10, 400, 400, 6, 6, 0, 0, 1],
                       [15, 0, 400, 400, 6, 9, 0, 3, 0]], np.int32)
    out = run(emu, tmp_path, imgs, params, size)
    for i in range(len(imgs)):
        _equal_to_pillow(out[i], imgs[i], params[i], size, f"sample {i}")


def test_any_grid_gives_the_same_batch(emu, tmp_path):
    """The kernels loop over their work: a grid of one block, or of three, makes what the GPU
    decoder's grid makes."""
    rng = np.random.default_rng(11)
    imgs, params = _batch(rng, 5, (20, 30))
    want = run(emu, tmp_path, imgs, params, (20, 30))
    for grid in (1, 3):
        np.testing.assert_array_equal(run(emu, tmp_path, imgs, params, (20, 30), grid=grid), want)


def _bf16_bits(x):
    """float32 to bfloat16 bits, round to nearest even (the kernel's cast)."""
    u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("channels_last", [True, False])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "uint8"])
def test_affine_cast_and_layout(emu, tmp_path, dtype, channels_last, ties):
    """Each dtype is the uint8 batch's values times scale plus bias (one float32 multiply and one
    add), cast as the kernel casts; channels-first is the same batch transposed. ``ties``: an
    affine whose values fall halfway between two of the dtype's (bfloat16: 2v + 1 past 256;
    float16: 16v + 1 past 2048; uint8: v / 2), which round to even."""
    rng = np.random.default_rng(3)
    imgs, params = _batch(rng, 6, (16, 12))
    scale, bias = (0.017, 0.0175, 0.0174), (-2.1, -2.03, -1.8)
    if dtype == "uint8":
        scale, bias = (0.5, 1.0, 2.0), (10.0, 0.0, -20.0)
    if ties:
        scale, bias = {"bfloat16": ((2, 2, 2), (1, 1, 1)), "float16": ((16, 16, 16), (1, 1, 1)),
                       "uint8": ((0.5, 0.5, 0.5), (0, 0.5, 0))}.get(dtype, (scale, bias))
    base = run(emu, tmp_path, imgs, params, (16, 12))
    got = run(emu, tmp_path, imgs, params, (16, 12), dtype=dtype, channels_last=channels_last,
              scale=scale, bias=bias)
    if not channels_last:
        got = got.transpose(0, 2, 3, 1)
    v = base.astype(np.float32) * np.array(scale, np.float32) + np.array(bias, np.float32)
    if dtype == "float32":
        np.testing.assert_array_equal(got, v)
    elif dtype == "float16":
        np.testing.assert_array_equal(got, v.astype(np.float16).view(np.uint16))
    elif dtype == "bfloat16":
        np.testing.assert_array_equal(got, _bf16_bits(v))
    else:
        np.testing.assert_array_equal(got, np.clip(np.rint(v), 0, 255).astype(np.uint8))


@pytest.mark.parametrize("channels_last", [True, False])
def test_a_dead_sample_is_zeros_and_leaves_the_others_alone(emu, tmp_path, channels_last):
    """A sample the decoder could not decode (its descriptor all zero) comes out as zeros in
    every dtype, even with a bias; the live ones are what they are alone."""
    rng = np.random.default_rng(8)
    imgs, params = _batch(rng, 4, (9, 9))
    live = [True, False, True, False]
    for dtype in DTYPES:
        got = run(emu, tmp_path, imgs, params, (9, 9), dtype=dtype, channels_last=channels_last,
                  bias=(1, 2, 3), live=live)
        assert not got[1].any() and not got[3].any(), dtype
        for i in (0, 2):
            alone = run(emu, tmp_path, imgs[i:i + 1], params[i:i + 1], (9, 9), dtype=dtype,
                        channels_last=channels_last, bias=(1, 2, 3))
            np.testing.assert_array_equal(got[i], alone[0], f"{dtype}, sample {i}")
