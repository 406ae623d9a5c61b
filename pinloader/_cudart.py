"""Where to look for the CUDA runtime library (libcudart) when it is not already loaded.

pinloader loads libcudart at run time (so that ``import pinloader`` works without CUDA). A
libcudart already in the process (brought by torch, CuPy or JAX) is used first; then
``PINLOADER_CUDART``, the dynamic loader's search path, and finally the paths listed here: the
``nvidia-cuda-runtime`` wheels' library folders, torch's own lib folder, and the toolkit's.
Nothing here imports torch.
"""
from __future__ import annotations

import glob
import os
import sys

_SONAMES = ("libcudart.so.13", "libcudart.so.12", "libcudart.so")


def _site_dirs() -> list[str]:
    seen: list[str] = []
    for p in sys.path:
        if p and os.path.isdir(p) and p not in seen:
            seen.append(p)
    return seen


def _search(sonames: tuple[str, ...], site_patterns: tuple[str, ...], site_globs: tuple[str, ...] = ()) -> list[str]:
    """The files named `sonames` that exist in each site folder's `site_patterns` folders (the
    newest first), the files of each site folder's `site_globs`, then in the toolkit's library
    folders (CUDA_HOME, CUDA_PATH, /usr/local/cuda, /usr/local/cuda-*); each path once, in order."""
    out: list[str] = []
    for site in _site_dirs():
        for pattern in site_patterns:
            for d in sorted(glob.glob(os.path.join(site, pattern)), reverse=True):
                out += [f for f in (os.path.join(d, n) for n in sonames) if os.path.exists(f)]
        for pattern in site_globs:
            out += sorted(glob.glob(os.path.join(site, pattern)), reverse=True)
    roots = [os.environ.get(v) for v in ("CUDA_HOME", "CUDA_PATH")]
    roots += ["/usr/local/cuda"] + sorted(glob.glob("/usr/local/cuda-*"), reverse=True)
    for root in roots:
        if not root:
            continue
        for sub in ("lib64", "lib", "targets/x86_64-linux/lib"):
            out += [f for f in (os.path.join(root, sub, n) for n in sonames) if os.path.exists(f)]
    return list(dict.fromkeys(out))


def candidates() -> list[str]:
    """Paths to try for libcudart after the dynamic loader's search path (the module's docstring)."""
    return _search(_SONAMES, ("nvidia/cu*/lib", "nvidia/cuda_runtime/lib", "torch/lib"))


_NVJPEG_SONAMES = ("libnvjpeg.so.13", "libnvjpeg.so.12")


def nvjpeg_candidates() -> list[str]:
    """Paths to try for libnvjpeg (the GPU image decoder) after the dynamic loader's search path:
    the ``nvidia-nvjpeg`` wheels' library folders, torchvision's bundled copy, and the toolkit's."""
    return _search(_NVJPEG_SONAMES, ("nvidia/cu*/lib", "nvidia/nvjpeg/lib"), ("torchvision.libs/libnvjpeg*.so*",))
