"""Where to look for the CUDA runtime library (libcudart) when it is not already loaded.

pinloader loads libcudart at run time (so that ``import pinloader`` works without CUDA). A
libcudart already in the process (brought by torch, CuPy or JAX) is used first; then
``PINLOADER_CUDART``, the dynamic loader's search path, and finally the paths listed here: the
``nvidia-cuda-runtime`` wheels' library folders, torch's own lib folder, and the toolkit's.
Nothing here imports torch.
"""
from __future__ import annotations

import glob
import importlib.util
import os
import sys

_SONAMES = ("libcudart.so.13", "libcudart.so.12", "libcudart.so")


def _site_dirs() -> list[str]:
    seen: list[str] = []
    for p in sys.path:
        if p and os.path.isdir(p) and p not in seen:
            seen.append(p)
    return seen


def candidates() -> list[str]:
    out: list[str] = []
    for site in _site_dirs():
        for pattern in ("nvidia/cu*/lib", "nvidia/cuda_runtime/lib", "torch/lib"):
            for d in sorted(glob.glob(os.path.join(site, pattern)), reverse=True):
                for name in _SONAMES:
                    f = os.path.join(d, name)
                    if os.path.exists(f):
                        out.append(f)
    roots = [os.environ.get(v) for v in ("CUDA_HOME", "CUDA_PATH")]
    roots += ["/usr/local/cuda"] + sorted(glob.glob("/usr/local/cuda-*"), reverse=True)
    for root in roots:
        if not root:
            continue
        for sub in ("lib64", "lib", "targets/x86_64-linux/lib"):
            for name in _SONAMES:
                f = os.path.join(root, sub, name)
                if os.path.exists(f):
                    out.append(f)
    # de-duplicate, keep order
    return list(dict.fromkeys(out))


_NVJPEG_SONAMES = ("libnvjpeg.so.13", "libnvjpeg.so.12")


def nvjpeg_candidates() -> list[str]:
    """Paths to try for libnvjpeg (the GPU image decoder) after the dynamic loader's search path:
    the ``nvidia-nvjpeg`` wheels' library folders, torchvision's bundled copy, and the toolkit's."""
    out: list[str] = []
    for site in _site_dirs():
        for pattern in ("nvidia/cu*/lib", "nvidia/nvjpeg/lib"):
            for d in sorted(glob.glob(os.path.join(site, pattern)), reverse=True):
                for name in _NVJPEG_SONAMES:
                    f = os.path.join(d, name)
                    if os.path.exists(f):
                        out.append(f)
        out += sorted(glob.glob(os.path.join(site, "torchvision.libs", "libnvjpeg*.so*")), reverse=True)
    roots = [os.environ.get(v) for v in ("CUDA_HOME", "CUDA_PATH")]
    roots += ["/usr/local/cuda"] + sorted(glob.glob("/usr/local/cuda-*"), reverse=True)
    for root in roots:
        if not root:
            continue
        for sub in ("lib64", "lib", "targets/x86_64-linux/lib"):
            for name in _NVJPEG_SONAMES:
                f = os.path.join(root, sub, name)
                if os.path.exists(f):
                    out.append(f)
    return list(dict.fromkeys(out))
