#!/usr/bin/env python3
"""List the files one batch enters: the C files of pinloader._C (and the headers whose inline
functions it runs) and the package's Python files, for a DataLoader batch through
``pinloader.torch.prefetch`` and for an ArrayLoader batch, on the host backend.

    python tools/batch_walk.py            # both walks (the DataLoader's needs torch)
    python tools/batch_walk.py --keep DIR # keep the instrumented build in DIR
    python tools/batch_walk.py --json     # the lists as JSON (tests/test_batch_walk.py)

How: a copy of the extension is built with ``-finstrument-functions`` into a scratch folder, and
a small library of its own, preloaded, counts every function entered (its
``__cyg_profile_func_enter``). Each walk runs 100 and then 200 batches after a warm-up, in fresh
processes; a function entered at least 90 more times in the second run is entered once a batch
or more, and ``addr2line`` names its file. Python files are counted the same way with
``sys.setprofile`` on the consumer's thread (the producer thread runs no package Python in these
two walks: the DataLoader's own code, or none). The walks are the library's as shipped:
PINLOADER_DEBUG and PINLOADER_SANITIZE are left out of the build's and the runs' environment.
Needs a C compiler and binutils; no GPU.
"""
import argparse
import collections
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#define N 65536
static void *_Atomic keys[N];
static _Atomic long counts[N];
__attribute__((no_instrument_function)) void __cyg_profile_func_enter(void *fn, void *site)
{
    (void)site;
    uintptr_t h = ((uintptr_t)fn >> 4) * 2654435761u;
    for (unsigned i = 0; i < N; i++) {
        unsigned k = (unsigned)((h + i) & (N - 1));
        void *cur = atomic_load(&keys[k]);
        if (!cur) {
            void *expected = NULL;
            if (!atomic_compare_exchange_strong(&keys[k], &expected, fn) && expected != fn)
                continue;
            cur = fn;
        }
        if (cur == fn) {
            atomic_fetch_add(&counts[k], 1);
            return;
        }
    }
}
__attribute__((no_instrument_function)) void __cyg_profile_func_exit(void *fn, void *site)
{
    (void)fn;
    (void)site;
}
__attribute__((no_instrument_function, destructor)) static void dump(void)
{
    const char *out = getenv("PL_WALK_OUT");
    FILE *f = out ? fopen(out, "w") : NULL;
    if (!f)
        return;
    for (unsigned k = 0; k < N; k++) {
        void *fn = atomic_load(&keys[k]);
        Dl_info d;
        if (fn && dladdr(fn, &d) && d.dli_fname)
            fprintf(f, "%s 0x%lx %ld\n", d.dli_fname, (unsigned long)((uintptr_t)fn - (uintptr_t)d.dli_fbase),
                    atomic_load(&counts[k]));
    }
    fclose(f);
}
"""

DRIVER = r"""
import collections, os, sys
kind, n, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
import numpy as np
import pinloader
files = collections.Counter()
def prof(frame, event, arg):
    if event == "call" and os.sep + "pinloader" + os.sep in frame.f_code.co_filename:
        files[os.path.basename(frame.f_code.co_filename)] += 1
rows = np.arange(64 * 400 * 16, dtype=np.float32).reshape(-1, 16)
if kind == "dataloader":
    import torch
    import pinloader.torch
    ds = torch.utils.data.TensorDataset(torch.from_numpy(rows))
    it = iter(pinloader.torch.prefetch(torch.utils.data.DataLoader(ds, batch_size=64), device="cpu"))
else:
    it = iter(pinloader.ArrayLoader(rows, 64, device="cpu"))
for _ in range(5):
    next(it)
sys.setprofile(prof)
for _ in range(n):
    next(it)
sys.setprofile(None)
with open(out, "w") as f:
    for name, c in files.items():
        f.write(f"{name} {c}\n")
"""


def run(cmd, **kw):
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd[:3])}... failed:\n{r.stdout[-2000:]}{r.stderr[-4000:]}")
    return r.stdout


def clean_env(**extra):
    """This environment without what would change the walk or the build (debug mode, a
    sanitizer build, a preloaded runtime), with extra set."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PINLOADER_DEBUG", "PINLOADER_SANITIZE", "LD_PRELOAD")}
    env.update(extra)
    return env


def build(work):
    for name in ("src", "pinloader"):
        shutil.copytree(os.path.join(ROOT, name), os.path.join(work, name),
                        ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    for name in ("setup.py", "pyproject.toml", "README.md", "LICENSE", "MANIFEST.in"):
        shutil.copy(os.path.join(ROOT, name), work)
    env = clean_env(CFLAGS="-finstrument-functions -g -O1")
    run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=work, env=env)
    with open(os.path.join(work, "shim.c"), "w") as f:
        f.write(SHIM)
    cc = sysconfig.get_config_var("CC").split()[0] if sysconfig.get_config_var("CC") else "cc"
    run([cc, "-O1", "-shared", "-fPIC", "shim.c", "-o", "shim.so", "-ldl"], cwd=work)
    with open(os.path.join(work, "driver.py"), "w") as f:
        f.write(DRIVER)


def counts(work, kind, n):
    out_c, out_py = os.path.join(work, f"{kind}{n}.c.txt"), os.path.join(work, f"{kind}{n}.py.txt")
    env = clean_env(PL_WALK_OUT=out_c, LD_PRELOAD=os.path.join(work, "shim.so"), PYTHONPATH=work)
    run([sys.executable, os.path.join(work, "driver.py"), kind, str(n), out_py], cwd=work, env=env)
    c = {}
    lib = None
    with open(out_c) as f:
        for line in f:
            path, off, k = line.split()
            if os.path.basename(path).startswith("_C."):
                c[off], lib = int(k), path
    with open(out_py) as f:
        py = {name: int(k) for name, k in (line.split() for line in f)}
    return lib, c, py


def walk(work, kind, as_json=False):
    lib, c1, py1 = counts(work, kind, 100)
    _, c2, py2 = counts(work, kind, 200)
    per_batch = [off for off, k in c2.items() if k - c1.get(off, 0) >= 90]
    lines = run(["addr2line", "-f", "-e", lib, *per_batch]).splitlines() if per_batch else []
    files = collections.defaultdict(set)
    for fn, loc in zip(lines[0::2], lines[1::2]):
        path = loc.split(":")[0]
        if f"{os.sep}src{os.sep}" in path:  # the tree's src/ (the last: the scratch folder may hold one)
            files[path.rsplit(f"{os.sep}src{os.sep}", 1)[1]].add(fn)
    pyfiles = sorted(name for name, k in py2.items() if k - py1.get(name, 0) >= 90)
    cfiles = sorted(f for f in files if f.endswith(".c"))
    headers = sorted(f for f in files if not f.endswith(".c"))
    if as_json:
        return {"c": cfiles, "python": pyfiles, "headers": headers}
    print(f"== {kind}: {len(cfiles)} C files + {len(pyfiles)} Python = {len(cfiles) + len(pyfiles)} files ==")
    for name in pyfiles:
        print(f"  pinloader/{name}")
    for name in cfiles:
        print(f"  src/{name:24} {' '.join(sorted(files[name]))[:120]}")
    print(f"  (inline functions of {', '.join(headers) or 'no header'})")
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keep", metavar="DIR", help="build in DIR and keep it")
    ap.add_argument("--json", action="store_true", help="print the lists as one JSON object")
    args = ap.parse_args()
    if shutil.which("addr2line") is None:
        sys.exit("addr2line (binutils) is needed")
    work = args.keep or tempfile.mkdtemp(prefix="pl_walk_")
    os.makedirs(work, exist_ok=True)
    try:
        build(work)
        kinds = ["arrayloader"]
        if importlib.util.find_spec("torch") is not None:
            kinds.insert(0, "dataloader")
        elif not args.json:
            print("torch is not installed: the DataLoader walk is left out")
        found = {kind: walk(work, kind, args.json) for kind in kinds}
        if args.json:
            print(json.dumps(found))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
