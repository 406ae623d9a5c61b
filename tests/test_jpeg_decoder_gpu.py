"""The GPU image decoder (pinloader._C.JpegDecoder; src/core/jpeg_cuda.c, image_kernel.cu).

GPU-only (marked ``gpu``): the resampling kernels against Pillow's own resize (bit-exact on the
same decoded pixels), nvJPEG's decode against Pillow's (libjpeg-turbo) within the tolerance the
docs state, every sample kind (hardware, CUDA decoder, host-decoded), bad data as statuses, the
output dtypes and layouts, and memory that stays flat.
"""
from __future__ import annotations

import gc
import io
import os
import threading

import numpy as np
import pytest

import pinloader
from pinloader import _C, _cudart

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not pinloader.cuda_available(),
                       reason=f"no CUDA device: {pinloader.cuda_info()['error']}"),
]

Image = pytest.importorskip("PIL.Image")
from image_helpers import box_params, jpeg, photo, resized_crop  # noqa: E402  (needs Pillow)


@pytest.fixture(scope="module")
def torch():
    return pytest.importorskip("torch")


@pytest.fixture(scope="module")
def dec():
    d = _C.JpegDecoder(0, libraries=_cudart.nvjpeg_candidates())
    yield d
    d.close()


def _pack(blobs):
    lengths = np.array([len(b) for b in blobs], np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    return np.frombuffer(b"".join(blobs), np.uint8), offsets, lengths


def _run(dec, torch, base, offsets, lengths, params, size, dtype="uint8", channels_last=True, raw=None,
         scale=(1, 1, 1), bias=(0, 0, 0)):
    arr, status = dec.decode(base, offsets, lengths, params, size, scale, bias, dtype, channels_last, raw)
    return torch.from_dlpack(arr).cpu(), status


def test_resampling_is_pillows(dec, torch):
    """Host-decoded images (the raw path) isolate the kernels. They compute Pillow's horizontal
    pass and then its vertical pass, each rounded to 8 bits; newer Pillow releases sometimes run
    the vertical pass first, which moves an occasional pixel by one level. So: no pixel more
    than one level away, and nearly all of them equal."""
    rng = np.random.default_rng(0)
    shapes = [(37, 53), (224, 224), (500, 375), (96, 700), (1, 1), (3, 900), (1200, 1500)]
    imgs = [photo(h, w, i) for i, (h, w) in enumerate(shapes)]
    for size in [(224, 224), (32, 48), (1, 1)]:
        params = box_params(rng, shapes, size)
        raw = dict(enumerate(imgs))
        n = len(imgs)
        out, status = _run(dec, torch, np.zeros(1, np.uint8), np.zeros(n, np.int64), np.zeros(n, np.int64),
                           params, size, raw=raw)
        assert status.tolist() == [0] * n
        for i in range(n):
            d = np.abs(out[i].numpy().astype(int) - resized_crop(imgs[i], params[i], size).astype(int))
            where = f"sample {i}, size {size}, params {params[i].tolist()}"
            assert d.max() <= 1, where
            assert (d == 0).mean() >= 0.99, where


def test_jpeg_decode_within_tolerance_of_pillow(dec, torch):
    rng = np.random.default_rng(1)
    shapes = [(375, 500), (500, 333), (224, 224), (480, 640), (64, 48)]
    imgs = [photo(h, w, 10 + i) for i, (h, w) in enumerate(shapes)]
    blobs = [jpeg(a) for a in imgs]
    base, offsets, lengths = _pack(blobs)
    size = (224, 224)
    params = box_params(rng, shapes, size)
    before = dec.info()
    out, status = _run(dec, torch, base, offsets, lengths, params, size)
    after = dec.info()
    assert status.tolist() == [0] * len(blobs)
    assert after["hardware"] + after["cuda"] - before["hardware"] - before["cuda"] == len(blobs)
    if after["engines"]:
        assert after["hardware"] > before["hardware"]
    # the call's host time by step: the headers', the block's and the kernels' grow with every
    # call; the engines' step is timed only when they decode something (and then takes more
    # than a microsecond), and the CUDA decoder's takes that long where it decoded
    assert after["batches"] == before["batches"] + 1
    for k in ("headers_ns", "block_ns", "kernels_ns"):
        assert after[k] > before[k], k
    assert (after["engines_ns"] - before["engines_ns"] > 1000) == (after["hardware"] > before["hardware"])
    if after["cuda"] > before["cuda"]:
        assert after["cuda_ns"] - before["cuda_ns"] > 1000
    diffs = []
    for i, b in enumerate(blobs):
        ref = resized_crop(np.asarray(Image.open(io.BytesIO(b)).convert("RGB")), params[i], size)
        d = np.abs(out[i].numpy().astype(int) - ref.astype(int))
        diffs.append((d.max(), d.mean()))
    print("max/mean abs difference to Pillow, per image:", diffs, "interpolated:", after["chroma_interpolated"])
    # nvJPEG and libjpeg-turbo (Pillow's decoder) differ in IDCT rounding, and in chroma
    # upsampling unless the engines interpolate (Note [interpolated chroma] in nvjpeg_load.c):
    # measured on the H200 without it (hardware decoder), max 3-18 and mean 0.41-1.98 levels per
    # image; with it, on an H100, the whole decoded images a mean of 0.000 and at most 1.
    if after["chroma_interpolated"] and after["hardware"] - before["hardware"] == len(blobs):
        assert max(m for m, _ in diffs) <= 3
        assert max(a for _, a in diffs) <= 0.1
    else:
        assert max(m for m, _ in diffs) <= 32
        assert max(a for _, a in diffs) <= 3.0


def _pillow_diffs(d, torch, n=6, seed=11):
    """The mean absolute difference to Pillow of n whole 4:2:0 JPEGs decoded by d (identity
    resize, so only the decoders differ), per image."""
    shapes = [(240 + 16 * i, 320 - 8 * i) for i in range(n)]
    imgs = [photo(h, w, seed + i) for i, (h, w) in enumerate(shapes)]
    blobs = [jpeg(a) for a in imgs]  # Pillow's default at quality 90: 4:2:0
    out = []
    for b, (H, W) in zip(blobs, shapes):
        base, offsets, lengths = _pack([b])
        got, st = _run(d, torch, base, offsets, lengths, np.array([[0, 0, H, W, H, W, 0, 0, 0]], np.int32), (H, W))
        assert st.tolist() == [0]
        ref = np.asarray(Image.open(io.BytesIO(b)).convert("RGB")).astype(int)
        out.append(float(np.abs(got[0].numpy().astype(int) - ref).mean()))
    return out


def test_interpolated_chroma_is_on_by_default_and_can_be_turned_off(torch):
    """Note [interpolated chroma]: the engines made with the flag decode as libjpeg-turbo does;
    interpolate=False (ImageLoader: PINLOADER_JPEG_INTERPOLATE=0) makes a decoder without it,
    whose 4:2:0 images are further from Pillow's."""
    on = _C.JpegDecoder(0, libraries=_cudart.nvjpeg_candidates())
    off = _C.JpegDecoder(0, libraries=_cudart.nvjpeg_candidates(), interpolate=False)
    try:
        assert off.info()["chroma_interpolated"] is False
        if on.info()["engines"] == 0:
            pytest.skip("no hardware JPEG engines on this GPU")
        if not on.info()["chroma_interpolated"]:
            pytest.skip("this nvJPEG refuses NVJPEG_FLAGS_UPSAMPLING_WITH_INTERPOLATION")
        with_flag, without = _pillow_diffs(on, torch), _pillow_diffs(off, torch)
        print("mean levels from Pillow, with the flag:", with_flag, "without:", without)
        assert max(with_flag) <= 0.1
        assert sum(without) > sum(with_flag) + 0.05 * len(without)
    finally:
        on.close()
        off.close()


_NO_WAIT_SCRIPT = r"""
import os
import sys
import numpy as np
import pinloader
from pinloader import _C, _cudart

if len(sys.argv) > 3:  # an ImageLoader made before CUDA is used asks for the queues itself
    assert _C.cuda_driver_state() == "uninitialized", "the driver was initialized before the loader"
    loader = pinloader.ImageLoader([(sys.argv[3], 0)], 1, device="cuda:0")
    # making a loader never initializes CUDA (a fork, or CUDA_VISIBLE_DEVICES set, after it works)
    assert _C.cuda_driver_state() == "uninitialized", "making the loader initialized the driver"
    print("loader", os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"), loader.stats()["cuda_connections"])
    loader.close()
import cupy
_C._testing.debug_jpeg_pipelined(sys.argv[1] == "pipelined")
dec = _C.JpegDecoder(0, libraries=_cudart.nvjpeg_candidates())
if not dec.info()["engines"]:
    print("no engines")
    sys.exit(0)
with np.load(sys.argv[2]) as f:  # 32 photo-like 375x500 JPEGs, packed by the test
    base, offsets, lengths = f["base"], f["offsets"], f["lengths"]
params = np.array([[0, 0, 375, 500, 224, 224, 0, 0, 0]] * 32, np.int32)
args = (base, offsets, lengths, params, (224, 224), (1, 1, 1), (0, 0, 0), "uint8", True)
# every descriptor slot of the decoder's ring, its workspace and the batch's block made first:
# the measured call allocates nothing
for _ in range(6):
    arr, status = dec.decode(*args)
    assert set(status.tolist()) == {0}, status
    del arr
cupy.cuda.Device(0).synchronize()
a = cupy.ones((8192, 8192), cupy.float16)
c = cupy.empty_like(a)
side = cupy.cuda.Stream(non_blocking=True)
cupy.cuda.Device(0).synchronize()
with side:
    for _ in range(600):
        cupy.matmul(a, a, out=c)
    products = side.record()
before = dec.info()["hardware"]
arr, status = dec.decode(*args)
pending = not products.done
cupy.cuda.Device(0).synchronize()
print("statuses", sorted(set(status.tolist())), "engines", dec.info()["hardware"] - before, "pending", pending)
"""


def _under_compute_sanitizer() -> bool:
    """Is this process run by compute-sanitizer (its launcher's and its tools' libraries mapped,
    or preloaded)?"""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            maps = f.read()
    except OSError:
        maps = ""
    text = (maps + os.environ.get("LD_PRELOAD", "")).lower()
    return "sanitizer" in text or "treelauncher" in text


@pytest.mark.parametrize("mode,connections,waits", [("without_pipeline", None, False), ("without_pipeline", "32", False),
                                                    ("pipelined", None, True), ("pipelined", "loader", False)])
def test_the_engines_call_does_not_wait_for_other_streams(mode, connections, waits, tmp_path):
    # Note [the engines' call beside training] in src/core/jpeg_cuda.c: a batch decoded while
    # about a second of matrix products fills the GPU from another stream (a training step queued
    # ahead) comes back before they have run, with the driver's default number of hardware work
    # queues (CUDA_DEVICE_MAX_CONNECTIONS unset: 8) and with 32. Made pipelined (the test switch),
    # with 8 queues, nvJPEG's hardware call waits for them: the control, which shows that the
    # test can see the wait. Causal, not timed: is the products' event still pending when the
    # decode returns? In a process of its own, without torch (whose pool of streams would take
    # queues of its own). "loader": the variable unset, and an ImageLoader made first, which sets
    # it to 32 before the driver is initialized (Note [hardware work queues] in
    # src/core/backend_cuda.c); the pipelined call then does not wait, so the setting reached the
    # driver.
    pytest.importorskip("cupy")
    if _under_compute_sanitizer():
        pytest.skip("under compute-sanitizer, whose child process would run 600 instrumented matrix products")
    from helpers import describe, run_py
    base, offsets, lengths = _pack([jpeg(photo(375, 500, 40 + i)) for i in range(32)])
    batch = tmp_path / "batch.npz"
    np.savez(batch, base=base, offsets=offsets, lengths=lengths)
    argv: tuple[str, ...] = (mode, str(batch))
    expect = []
    unset = ("CUDA_LAUNCH_BLOCKING", "CUDA_DEVICE_MAX_CONNECTIONS")
    if connections == "loader":
        # the control first: where the pipelined call does not wait with 8 queues either, the
        # loader's 32 cannot be seen
        c = run_py(_NO_WAIT_SCRIPT, timeout=240, argv=argv, env_remove=unset)
        assert c.returncode == 0, describe(c)
        if c.stdout.split()[-1] == "True":
            pytest.skip("the pipelined control did not wait with 8 hardware queues on this GPU and driver")
        one = tmp_path / "one.jpg"
        one.write_bytes(jpeg(photo(64, 64, 1)))
        argv += (str(one),)
        expect = ["loader", "32", "32"]
    given = connections not in (None, "loader")
    p = run_py(_NO_WAIT_SCRIPT, timeout=240, argv=argv,
               env_extra={"CUDA_DEVICE_MAX_CONNECTIONS": connections} if given else None,
               env_remove=("CUDA_LAUNCH_BLOCKING",) + (() if given else ("CUDA_DEVICE_MAX_CONNECTIONS",)))
    assert p.returncode == 0, describe(p)
    if p.stdout.split()[-2:] == ["no", "engines"]:
        pytest.skip("this GPU has no JPEG engines: the CUDA decoder keeps stream order")
    if mode == "pipelined" and connections is None and p.stdout.split()[-1] == "True":
        # the control: how the driver hands its queues to streams is its own; where the pipelined
        # call does not wait with 8 queues either, this test cannot see a wait here
        pytest.skip("the pipelined control did not wait with 8 hardware queues on this GPU and driver")
    assert p.stdout.split() == expect + ["statuses", "[0]", "engines", "32", "pending", str(not waits)], describe(p)


def test_a_loader_made_once_cuda_is_in_use_leaves_the_queues_alone(tmp_path):
    # Note [hardware work queues]: once the driver is initialized, a new value could no longer
    # take effect; the loader leaves the variable unset and says so in stats()
    pytest.importorskip("cupy")
    from helpers import describe, run_py
    one = tmp_path / "one.jpg"
    one.write_bytes(jpeg(photo(64, 64, 1)))
    code = r"""
import os, sys
import cupy
import pinloader
from pinloader import _C
cupy.zeros(1)  # the user's framework used CUDA first
before = _C.cuda_driver_state()
loader = pinloader.ImageLoader([(sys.argv[1], 0)], 1, device="cuda:0")
st = loader.stats()
print(before, os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"), st["cuda_connections"], "|", st["cuda_connections_reason"])
loader.close()
"""
    p = run_py(code, timeout=120, argv=(str(one),), env_remove=("CUDA_DEVICE_MAX_CONNECTIONS",))
    assert p.returncode == 0, describe(p)
    head, reason = p.stdout.split("|", 1)
    assert head.split() == ["initialized", "None", "8"], describe(p)
    assert "before CUDA is first used" in reason, describe(p)


def test_every_kind_of_sample_in_one_batch(dec, torch):
    rng = np.random.default_rng(2)
    a = photo(120, 160, 3)
    gray = photo(90, 70, 4)[..., 0]
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, format="PNG")
    png = buf.getvalue()
    cmyk = io.BytesIO()
    Image.fromarray(a).convert("CMYK").save(cmyk, format="JPEG", quality=90)
    good = jpeg(a)
    blobs = [good, jpeg(a, progressive=True), jpeg(gray), png, good[: len(good) // 3],
             b"not an image at all", cmyk.getvalue(), b"", good]
    shapes = [(120, 160), (120, 160), (90, 70), (120, 160), (120, 160), (10, 10), (120, 160), (10, 10),
              (120, 160)]
    base, offsets, lengths = _pack(blobs)
    size = (32, 32)
    params = box_params(rng, shapes, size)
    raw = {3: a}  # the PNG, decoded by the host
    out, status = _run(dec, torch, base, offsets, lengths, params, size, raw=raw)
    st = status.tolist()
    assert st[0] == 0 and st[1] == 0 and st[2] == 0 and st[3] == 0 and st[8] == 0
    assert st[5] == 1 and st[7] == 1  # not a JPEG; empty
    assert st[4] in (1, 5)            # truncated: bad header, or no end marker (host judges)
    assert st[6] in (0, 3)            # CMYK: decoded, or refused as unsupported
    assert np.abs(out[3].numpy().astype(int) - resized_crop(a, params[3], size).astype(int)).max() <= 1
    for i in (4, 5, 7):
        assert not out[i].numpy().any(), f"failed sample {i} must be zero-filled"
    g = out[2].numpy().astype(int)
    assert np.abs(g[..., 0] - g[..., 1]).max() <= 1  # grayscale comes out as equal channels


def test_box_outside_the_image_is_a_status(dec, torch):
    a = photo(50, 60, 5)
    base, offsets, lengths = _pack([jpeg(a), jpeg(a)])
    params = np.array([[0, 0, 51, 60, 8, 8, 0, 0, 0], [0, 0, 50, 60, 8, 8, 0, 0, 0]], np.int32)
    _, status = _run(dec, torch, base, offsets, lengths, params, (8, 8))
    assert status.tolist() == [4, 0]


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("channels_last", [False, True])
def test_dtypes_and_layouts_scale_the_uint8_result(dec, torch, dtype, channels_last):
    rng = np.random.default_rng(3)
    shapes = [(100, 130), (77, 64), (300, 200)]
    blobs = [jpeg(photo(h, w, 20 + i)) for i, (h, w) in enumerate(shapes)]
    base, offsets, lengths = _pack(blobs)
    size = (40, 56)
    params = box_params(rng, shapes, size)
    u8, st0 = _run(dec, torch, base, offsets, lengths, params, size, "uint8", True)
    mean, std = np.array([0.485, 0.456, 0.406]), np.array([0.229, 0.224, 0.225])
    scale, bias = 1 / (255 * std), -mean / std
    out, st1 = _run(dec, torch, base, offsets, lengths, params, size, dtype, channels_last,
                    scale=tuple(scale), bias=tuple(bias))
    assert st0.tolist() == st1.tolist() == [0, 0, 0]
    want = (u8.numpy().astype(np.float32) * scale.astype(np.float32) + bias.astype(np.float32))
    got = out.float().numpy()
    if not channels_last:
        assert tuple(out.shape) == (3, 3, 40, 56)
        got = got.transpose(0, 2, 3, 1)
    else:
        assert tuple(out.shape) == (3, 40, 56, 3)
    # the kernel rounds the product and the sum to float32 as NumPy does (no fused multiply-add),
    # then to the output type to nearest even, as NumPy's float16 and torch's bfloat16 casts do
    if dtype == "float16":
        want = want.astype(np.float16).astype(np.float32)
    elif dtype == "bfloat16":
        want = torch.from_numpy(want).to(torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(got, want)


def test_memory_stays_flat_and_blocks_come_back(dec, torch):
    rng = np.random.default_rng(4)
    shapes = [(int(h), int(w)) for h, w in rng.integers(50, 400, size=(32, 2))]
    blobs = [jpeg(photo(h, w, i)) for i, (h, w) in enumerate(shapes)]
    base, offsets, lengths = _pack(blobs)
    blocks0 = _C._testing.live_device_blocks("cuda")
    ws = []
    for r in range(30):
        params = box_params(rng, shapes, (64, 64))
        arr, status = dec.decode(base, offsets, lengths, params, (64, 64), (1, 1, 1), (0, 0, 0), "uint8", False)
        t = torch.from_dlpack(arr)
        t.float().mean().item()
        del arr, t
        ws.append(dec.info()["workspace_bytes"])
    torch.cuda.synchronize()
    gc.collect()
    assert ws[5:] == [ws[5]] * len(ws[5:])
    assert _C._testing.live_device_blocks("cuda") == blocks0


def test_hostile_arguments_are_clean_errors(dec):
    base, offsets, lengths = _pack([jpeg(photo(20, 20, 0))])
    p = np.array([[0, 0, 20, 20, 8, 8, 0, 0, 0]], np.int32)
    with pytest.raises(ValueError, match="outside"):
        dec.decode(base, offsets + 5, lengths, p, (8, 8), (1, 1, 1), (0, 0, 0), "uint8", False)
    with pytest.raises(ValueError, match="shape"):
        dec.decode(base, offsets, lengths, p[:, :8], (8, 8), (1, 1, 1), (0, 0, 0), "uint8", False)
    with pytest.raises(ValueError, match="dtype"):
        dec.decode(base, offsets, lengths, p, (8, 8), (1, 1, 1), (0, 0, 0), "int7", False)
    with pytest.raises(ValueError, match="flip"):
        dec.decode(base, offsets, lengths, np.array([[0, 0, 20, 20, 8, 8, 0, 0, 7]], np.int32), (8, 8),
                   (1, 1, 1), (0, 0, 0), "uint8", False)
    with pytest.raises(ValueError, match="raw"):
        dec.decode(base, offsets, lengths, p, (8, 8), (1, 1, 1), (0, 0, 0), "uint8", False, {3: None})
    d2 = _C.JpegDecoder(0)
    d2.close()
    d2.close()
    with pytest.raises(ValueError, match="closed"):
        d2.decode(base, offsets, lengths, p, (8, 8), (1, 1, 1), (0, 0, 0), "uint8", False)


def test_a_file_without_an_end_marker_goes_to_the_host(dec, torch):
    """Note [truncated JPEGs]: nvJPEG decodes a cut file without complaint, so a sample whose
    last bytes hold no end-of-image marker gets status 5 (the host decoder judges it); a few
    bytes of padding after the marker are still decoded on the GPU."""
    a = photo(200, 260, 6)
    good = jpeg(a)
    assert good[-2:] == b"\xff\xd9"
    blobs = [good, good[:-2], good[: len(good) * 2 // 3], good + b"\0" * 100, good + b"\0" * 5000, good]
    shapes = [(200, 260)] * len(blobs)
    base, offsets, lengths = _pack(blobs)
    size = (24, 24)
    params = box_params(np.random.default_rng(7), shapes, size)
    out, status = _run(dec, torch, base, offsets, lengths, params, size)
    assert status.tolist() == [0, 5, 5, 0, 5, 0]
    for i in (1, 2, 4):
        assert not out[i].numpy().any(), f"sample {i} must be zero-filled"
    assert out[3].numpy().any() and out[5].numpy().any()


def test_a_region_decode_equals_the_crop_of_a_whole_decode(dec, torch):
    """Note [region decode] (with PINLOADER_JPEG_REGION=1; without it, both are whole decodes):
    crops decoded as a region by the engines against the same crops of the whole image decoded
    by the same decoder (an identity resize of the whole image, handed back through raw=)."""
    shapes = [(480, 640), (500, 375), (333, 500), (720, 1280)]
    imgs = [photo(h, w, 30 + i) for i, (h, w) in enumerate(shapes)]
    blobs = [jpeg(a) for a in imgs]
    whole = []
    for b, (H, W) in zip(blobs, shapes):
        base, offsets, lengths = _pack([b])
        out, st = _run(dec, torch, base, offsets, lengths, np.array([[0, 0, H, W, H, W, 0, 0, 0]], np.int32),
                       (H, W))
        assert st.tolist() == [0]
        whole.append(np.ascontiguousarray(out[0].numpy()))
    rng = np.random.default_rng(8)
    size = (96, 96)
    crops = []
    for H, W in shapes:  # boxes of 5-40% of the image: a region decode where the engines take one
        h, w = int(H * rng.uniform(0.2, 0.6)), int(W * rng.uniform(0.25, 0.6))
        crops.append([rng.integers(0, H - h + 1), rng.integers(0, W - w + 1), h, w, size[0], size[1], 0, 0,
                      rng.integers(0, 2)])
    params = np.array(crops, np.int32)
    base, offsets, lengths = _pack(blobs)
    before = dec.info()
    got, st = _run(dec, torch, base, offsets, lengths, params, size)
    after = dec.info()
    assert st.tolist() == [0] * len(blobs)
    if after["engines"] and os.environ.get("PINLOADER_JPEG_REGION") == "1":
        assert after["roi"] - before["roi"] == len(blobs)
    n = len(blobs)
    want, st2 = _run(dec, torch, np.zeros(1, np.uint8), np.zeros(n, np.int64), np.zeros(n, np.int64), params, size,
                     raw=dict(enumerate(whole)))
    assert st2.tolist() == [0] * n
    d = np.abs(got.numpy().astype(int) - want.numpy().astype(int))
    print("region vs whole decode: max", d.max(), "share equal", (d == 0).mean())
    assert d.max() <= 4
    assert (d == 0).mean() >= 0.99


def test_the_engines_order_changes_no_pixel(dec, torch, monkeypatch):
    """Note [the engines' order]: a decoder hands the engines the batch's images largest first;
    every sample comes out where it was, equal to a decoder made with PINLOADER_JPEG_SORT=0,
    which keeps the batch's order (sizes in no order, some repeated, so the sort moves most of
    them)."""
    shapes = [(120, 160), (480, 640), (64, 64), (333, 500), (480, 640), (200, 90), (720, 1280), (64, 64)]
    blobs = [jpeg(photo(h, w, 60 + i)) for i, (h, w) in enumerate(shapes)]
    size = (48, 40)
    params = box_params(np.random.default_rng(9), shapes, size)
    base, offsets, lengths = _pack(blobs)
    want, st = _run(dec, torch, base, offsets, lengths, params, size)
    assert st.tolist() == [0] * len(blobs)
    monkeypatch.setenv("PINLOADER_JPEG_SORT", "0")
    d2 = _C.JpegDecoder(0, libraries=_cudart.nvjpeg_candidates())
    try:
        got, st2 = _run(d2, torch, base, offsets, lengths, params, size)
        if d2.info()["engines"]:  # several images on the engines, so that there was an order
            assert d2.info()["hardware"] >= 4
    finally:
        d2.close()
    assert st2.tolist() == [0] * len(blobs)
    assert np.array_equal(got.numpy(), want.numpy())


def _overlap_a_and_b(dec, torch):
    """Batch A's kernels held back on the decoder's stream (a stream hold), batch B of the same
    sizes (so the same workspace) decoded meanwhile, then the hold opened: (A as it came out,
    A alone, B as it came out, B alone)."""
    if dec.info()["engines"] == 0:
        pytest.skip("this GPU has no JPEG engines: its CUDA decoder keeps stream order")
    size = (64, 64)
    blobs_a = [jpeg(photo(128, 160, s)) for s in range(8)]
    blobs_b = [jpeg(photo(128, 160, 100 + s)) for s in range(8)]
    p = np.array([[0, 0, 128, 160, 64, 64, 0, 0, 0]] * 8, np.int32)
    a, b = _pack(blobs_a), _pack(blobs_b)
    want_a, st = _run(dec, torch, *a, p, size)
    want_b, st_b = _run(dec, torch, *b, p, size)
    assert (st == 0).all() and (st_b == 0).all()
    assert not np.array_equal(want_a.numpy(), want_b.numpy())
    hardware = dec.info()["hardware"]
    prim = _C._testing.Prim("cuda:0")
    gate = prim.hold(_C._testing.jpeg_decoder_stream(dec))
    opened = threading.Event()

    def open_gate():
        opened.set()
        prim.open_gate(gate)

    # B's call waits for A's kernels, so for the hold: another thread opens it (started first,
    # so that no call here can wait for it forever)
    opener = threading.Timer(5.0, open_gate)
    opener.start()
    try:
        arr_a, st = dec.decode(*a, p, size, (1, 1, 1), (0, 0, 0), "uint8", True, None)
        # A's call returned with its kernels still held: otherwise nothing below is tested
        assert not opened.is_set()
        arr_b, st_b = dec.decode(*b, p, size, (1, 1, 1), (0, 0, 0), "uint8", True, None)
    finally:
        opener.cancel()
        prim.open_gate(gate)
        opener.join()
    assert (st == 0).all() and (st_b == 0).all()
    assert dec.info()["hardware"] == hardware + 16  # both batches went to the engines
    return (torch.from_dlpack(arr_a).cpu().numpy(), want_a.numpy(),
            torch.from_dlpack(arr_b).cpu().numpy(), want_b.numpy())


def test_the_engines_never_write_over_a_batch_still_being_resampled(dec, torch):
    """Note [engines write at once] in src/core/jpeg_cuda.c: nvJPEG's hardware decode writes when
    it is called, whatever is queued before it on the decoder's stream; the decoder waits for the
    previous batch's kernels first, so A and B both come out as decoded alone."""
    got_a, want_a, got_b, want_b = _overlap_a_and_b(dec, torch)
    assert np.array_equal(got_a, want_a)
    assert np.array_equal(got_b, want_b)


def test_without_the_wait_the_engines_overwrite_the_held_batch(dec, torch):
    """The premise of the test above, so that it can fail: with the decoder's wait switched off,
    the engines write B into the workspace while A's kernels are held, and A comes out wrong."""
    _C._testing.debug_jpeg_engine_waits(False)
    try:
        got_a, want_a, got_b, want_b = _overlap_a_and_b(dec, torch)
    finally:
        _C._testing.debug_jpeg_engine_waits(True)
    assert not np.array_equal(got_a, want_a)
    assert np.array_equal(got_b, want_b)
