"""When does the CUDA driver read CUDA_DEVICE_MAX_CONNECTIONS? (Note [hardware work queues] in
src/core/backend_cuda.c.) With the driver's default of 8 hardware work queues, nvJPEG's pipelined
hardware decode waits for another stream's queued matrix products; with 32 it does not
(tests/test_jpeg_decoder_gpu.py). So: set the variable to 32 at one point of the process's life
(MODE), then decode while 600 matrix products are queued on another stream, and print whether
they were still pending when the decode returned (32 queues took effect) or not.

    for m in none before after_load after_init after_pinloader_import after_cupy_import; do
        env -u CUDA_DEVICE_MAX_CONNECTIONS python3 benchmarks/cuda_queues_probe.py $m; done

MODE: none (never set); before (at the start); after_load (libcuda loaded, not initialized);
after_init (after cuInit); after_pinloader_import, after_cupy_import (after those imports, which
print whether the driver was initialized by them). Needs a GPU with JPEG engines and CuPy.
"""
import ctypes
import importlib
import io
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # pinloader built in place
mode = sys.argv[1]
V = "CUDA_DEVICE_MAX_CONNECTIONS"
os.environ.pop(V, None)
if mode == "before":
    os.environ[V] = "32"
elif mode in ("after_load", "after_init"):
    lib = ctypes.CDLL("libcuda.so.1")
    if mode == "after_init":
        assert lib.cuInit(0) == 0
    os.environ[V] = "32"
elif mode == "after_pinloader_import":
    importlib.import_module("pinloader")
    from pinloader import _C
    print("driver after import:", _C.cuda_driver_state(), end=" ")
    os.environ[V] = "32"
elif mode == "after_cupy_import":
    importlib.import_module("cupy")
    from pinloader import _C
    print("driver after cupy import:", _C.cuda_driver_state(), end=" ")
    os.environ[V] = "32"
import numpy as np
from PIL import Image
from pinloader import _C, _cudart
import cupy
rng = np.random.default_rng(0)
blobs = []
for i in range(32):
    small = rng.integers(0, 255, (24, 32, 3), dtype=np.uint8)
    img = Image.fromarray(small).resize((500, 375), Image.BILINEAR)
    b = io.BytesIO(); img.save(b, "JPEG", quality=90); blobs.append(b.getvalue())
lengths = np.array([len(b) for b in blobs], np.int64)
offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
base = np.frombuffer(b"".join(blobs), np.uint8)
_C._testing.debug_jpeg_pipelined(True)
dec = _C.JpegDecoder(0, libraries=_cudart.nvjpeg_candidates())
params = np.array([[0, 0, 375, 500, 224, 224, 0, 0, 0]] * 32, np.int32)
args = (base, offsets, lengths, params, (224, 224), (1, 1, 1), (0, 0, 0), "uint8", True)
for _ in range(6):
    arr, status = dec.decode(*args); del arr
cupy.cuda.Device(0).synchronize()
a = cupy.ones((8192, 8192), cupy.float16); c = cupy.empty_like(a)
side = cupy.cuda.Stream(non_blocking=True)
cupy.cuda.Device(0).synchronize()
with side:
    for _ in range(600):
        cupy.matmul(a, a, out=c)
    products = side.record()
arr, status = dec.decode(*args)
print(mode, "pending (32 queues took effect):", not products.done)
cupy.cuda.Device(0).synchronize()
