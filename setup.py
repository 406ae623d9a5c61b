"""Build the native module pinloader._C.

Environment toggles:
  CUDA_HOME / CUDA_PATH   where the CUDA toolkit lives (headers only are needed: the
                          runtime library is loaded at run time)
  PINLOADER_SANITIZE=1    AddressSanitizer + UndefinedBehaviorSanitizer build (-O1 -g)
  PINLOADER_SANITIZE=thread  ThreadSanitizer build
  PINLOADER_DEBUG_BUILD=1 -O0 -g3
"""
import glob
import os
import shutil
import sys
import sysconfig

import numpy
from setuptools import Extension, setup

CUDA_HEADER = "cuda_runtime_api.h"


def _cuda_include_candidates():
    for var in ("CUDA_HOME", "CUDA_PATH", "CUDA_ROOT"):
        root = os.environ.get(var)
        if root:
            yield os.path.join(root, "include")
            yield os.path.join(root, "targets", "x86_64-linux", "include")
    nvcc = shutil.which("nvcc")
    if nvcc:
        root = os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
        yield os.path.join(root, "include")
    yield "/usr/local/cuda/include"
    yield from sorted(glob.glob("/usr/local/cuda-*/include"), reverse=True)
    yield "/usr/include"
    # Headers installed by the nvidia-cuda-runtime wheels.
    for site in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]} | set(sys.path):
        if not site or not os.path.isdir(os.path.join(site, "nvidia")):
            continue
        yield from sorted(glob.glob(os.path.join(site, "nvidia", "cu*", "include")), reverse=True)
        yield os.path.join(site, "nvidia", "cuda_runtime", "include")


def find_cuda_include():
    for inc in _cuda_include_candidates():
        if os.path.isfile(os.path.join(inc, CUDA_HEADER)):
            return inc
    sys.exit(
        "pinloader: CUDA runtime headers (cuda_runtime_api.h) not found: set CUDA_HOME, install "
        "the CUDA toolkit, or `pip install nvidia-cuda-runtime` (headers only are needed)."
    )


def extension():
    cuda_inc = find_cuda_include()
    extra_compile = ["-std=gnu11", "-Wall", "-Wextra", "-Werror", "-Wno-missing-field-initializers",
                     "-fvisibility=hidden", "-pthread"]
    extra_link = ["-pthread", "-ldl"]
    define_macros = [("NPY_NO_DEPRECATED_API", "NPY_1_25_API_VERSION"), ("_GNU_SOURCE", "1")]
    nvtx = os.path.isfile(os.path.join(cuda_inc, "nvtx3", "nvToolsExt.h"))
    if nvtx:
        define_macros.append(("PL_HAVE_NVTX", "1"))
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
        sources=sorted(glob.glob("src/*.c")),
        depends=sorted(glob.glob("src/*.h")),
        include_dirs=["src", numpy.get_include(), cuda_inc],
        define_macros=define_macros,
        extra_compile_args=extra_compile,
        extra_link_args=extra_link,
    )


setup(ext_modules=[extension()])
