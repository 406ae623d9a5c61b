"""Build the native module pinloader._C.

Building needs a C compiler, Python's headers and NumPy: no CUDA toolkit. The CUDA runtime is
loaded at run time, and src/core/cuda_api.h declares the part of its API that pinloader uses.

Environment toggles:
  PINLOADER_NVTX=auto     where the NVTX3 headers (header-only profiler ranges) come from:
                          auto (default): the nvidia-nvtx wheel (a build requirement), else a
                          CUDA toolkit (CUDA_HOME, CUDA_PATH, nvcc's, /usr/local/cuda), else off;
                          wheel: only the wheel; toolkit: only a toolkit; off: no NVTX ranges;
                          or a directory that holds nvtx3/nvToolsExt.h.
                          The build prints which one it used.
  PINLOADER_WERROR=1      treat compiler warnings as errors (CI sets it)
  PINLOADER_SANITIZE=1    AddressSanitizer + UndefinedBehaviorSanitizer build (-O1 -g)
  PINLOADER_SANITIZE=thread  ThreadSanitizer build
  PINLOADER_DEBUG_BUILD=1 -O0 -g3
"""
import glob
import os
import re
import shutil
import sys

import numpy
from setuptools import Extension, setup

NVTX_HEADER = os.path.join("nvtx3", "nvToolsExt.h")


def _say(msg):
    print(f"pinloader build: {msg}", file=sys.stderr, flush=True)


def _nvtx_from_wheel():
    """The include folder of the nvidia-nvtx wheel (nvidia/cu13/include) or of the older
    nvidia-nvtx-cu12 wheel (nvidia/nvtx/include), if one is installed in the build environment."""
    roots = []
    try:
        import nvidia  # a namespace package shared by NVIDIA's wheels

        roots += list(nvidia.__path__)
    except ImportError:
        pass
    roots += [os.path.join(p, "nvidia") for p in sys.path if p]
    for root in dict.fromkeys(roots):
        for inc in sorted(glob.glob(os.path.join(root, "cu*", "include")), reverse=True) + [
            os.path.join(root, "nvtx", "include")
        ]:
            if os.path.isfile(os.path.join(inc, NVTX_HEADER)):
                return inc
    return None


def _nvtx_from_toolkit():
    roots = [os.environ.get(v) for v in ("CUDA_HOME", "CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        roots.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    roots += ["/usr/local/cuda"] + sorted(glob.glob("/usr/local/cuda-*"), reverse=True)
    for root in roots:
        if not root:
            continue
        for inc in (os.path.join(root, "include"), os.path.join(root, "targets", "x86_64-linux", "include")):
            if os.path.isfile(os.path.join(inc, NVTX_HEADER)):
                return inc
    return None


def find_nvtx():
    """(include dir or None, what it is). Never looks somewhere it was told not to."""
    mode = os.environ.get("PINLOADER_NVTX", "auto").strip() or "auto"
    if mode in ("off", "none", "0"):
        return None, "off (PINLOADER_NVTX=off)"
    if mode not in ("auto", "wheel", "toolkit"):
        if not os.path.isfile(os.path.join(mode, NVTX_HEADER)):
            sys.exit(f"pinloader build: PINLOADER_NVTX={mode!r}: no {NVTX_HEADER} there")
        return mode, "PINLOADER_NVTX"
    if mode in ("auto", "wheel"):
        inc = _nvtx_from_wheel()
        if inc:
            return inc, "the nvidia-nvtx wheel"
        if mode == "wheel":
            sys.exit("pinloader build: PINLOADER_NVTX=wheel but the nvidia-nvtx wheel is not "
                     "installed in the build environment (pip install nvidia-nvtx)")
    inc = _nvtx_from_toolkit()
    if inc:
        return inc, "a CUDA toolkit"
    if mode == "toolkit":
        sys.exit("pinloader build: PINLOADER_NVTX=toolkit but no CUDA toolkit with nvtx3 headers "
                 "was found (set CUDA_HOME)")
    return None, ("off: no nvtx3 headers found (neither the nvidia-nvtx wheel nor a CUDA "
                  "toolkit); pinloader works, but shows no NVTX ranges in a profiler")


def extension():
    extra_compile = ["-std=gnu11", "-Wall", "-Wextra", "-Wno-missing-field-initializers",
                     "-fvisibility=hidden", "-pthread"]
    if os.environ.get("PINLOADER_WERROR") == "1":
        extra_compile.append("-Werror")
    extra_link = ["-pthread", "-ldl"]
    define_macros = [("NPY_NO_DEPRECATED_API", "NPY_1_25_API_VERSION"), ("_GNU_SOURCE", "1")]
    include_dirs = ["src/core", "src/py", numpy.get_include()]
    nvtx_inc, nvtx_what = find_nvtx()
    if nvtx_inc:
        define_macros.append(("PL_HAVE_NVTX", "1"))
        include_dirs.append(nvtx_inc)
        _say(f"NVTX ranges on, headers from {nvtx_what}: {nvtx_inc}")
    else:
        _say(f"NVTX ranges {nvtx_what}")
    _say("CUDA runtime API declarations: src/core/cuda_api.h (no CUDA header is used)")
    sanitize = os.environ.get("PINLOADER_SANITIZE", "")
    if sanitize in ("1", "address", "asan"):
        extra_compile += ["-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined",
                          "-fno-sanitize-recover=undefined"]
        extra_link += ["-fsanitize=address,undefined"]
        define_macros.append(("PL_SANITIZE", "1"))
    elif sanitize in ("thread", "tsan"):
        extra_compile += ["-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=thread"]
        extra_link += ["-fsanitize=thread"]
        define_macros.append(("PL_SANITIZE", "1"))
    elif os.environ.get("PINLOADER_DEBUG_BUILD"):
        extra_compile += ["-O0", "-g3"]
    else:
        extra_compile += ["-O2"]
    return Extension(
        "pinloader._C",
        sources=sorted(glob.glob("src/core/*.c") + glob.glob("src/py/*.c")),
        depends=sorted(glob.glob("src/core/*.h") + glob.glob("src/py/*.h")),
        include_dirs=include_dirs,
        define_macros=define_macros,
        extra_compile_args=extra_compile,
        extra_link_args=extra_link,
    )


def long_description():
    """The README for the package index's page. Its links are relative to the repository, which
    that page does not have, so each becomes an absolute link to the file in the repository
    (images to the raw file); links to anchors and absolute links stay as they are."""
    with open("README.md", encoding="utf-8") as f:
        text = f.read()
    with open("pyproject.toml", encoding="utf-8") as f:
        source = re.search(r'^Source = "([^"]+)"', f.read(), flags=re.M).group(1).rstrip("/")

    def absolute(m):
        image, target = m.group(1), m.group(2)
        if re.match(r"[a-z]+://|#|mailto:", target):
            return m.group(0)
        kind = "raw" if image.startswith("!") else "blob"
        return f"{image}]({source}/{kind}/main/{target})"

    return re.sub(r"(!?\[[^\]]*)\]\(([^)\s]+)\)", absolute, text)


setup(ext_modules=[extension()], long_description=long_description(),
      long_description_content_type="text/markdown")
