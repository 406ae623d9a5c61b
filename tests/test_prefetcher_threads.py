"""AsyncPrefetcher and threads (host backend): Ctrl-C, hanging sources, several consumers.

A consumer interrupted in next() can retry without losing a batch, and close() returns while the
source hangs; interpreter exit does not wait for a hung source; two threads consuming one
prefetcher see every batch once and both see the end of the epoch; close() from another thread
releases a blocked consumer; a source that overwrites what it yielded still delivers whole
batches; a waiting consumer sleeps; depth bounds how far the producer runs ahead.

Anything that could hang on a bug runs in a subprocess under a timeout, with faulthandler armed
inside it to dump the stacks and exit first, so a bug fails that test instead of the suite.
"""
from __future__ import annotations

import gc
import threading
import time

import numpy as np
import pytest

import pinloader
from helpers import describe, drain, run_py, val, wait_for

DEVICE = "cpu"


# ---- hangs and Ctrl-C (subprocesses) -------------------------------------------------------------

HANG_PRELUDE = """
import faulthandler, os, signal, sys, threading, time
import numpy as np
import pinloader
faulthandler.dump_traceback_later({watchdog}, exit=True)

def hanging_source():
    yield np.zeros(3)
    threading.Event().wait()  # never set: the source hangs forever in next()
    yield np.ones(3)

def interrupt_main_after(delay):
    main = threading.main_thread().ident
    threading.Timer(delay, lambda: signal.pthread_kill(main, signal.SIGINT)).start()
"""


def test_hanging_source_consumer_interrupted_and_close_returns_promptly():
    code = HANG_PRELUDE.format(watchdog=8) + """
pf = pinloader.AsyncPrefetcher(hanging_source(), device="cpu")
first = next(pf)
time.sleep(0.1)  # the producer is now blocked inside the source's next()
interrupt_main_after(0.3)
t0 = time.monotonic()
try:
    next(pf)
    print("NOT INTERRUPTED", flush=True)
except KeyboardInterrupt:
    print("INTERRUPTED %.3f" % (time.monotonic() - t0), flush=True)
t0 = time.monotonic()
pf.close()
print("CLOSED %.3f" % (time.monotonic() - t0), flush=True)
print("FIRST OK", bool((np.from_dlpack(first) == 0).all()), flush=True)
"""
    p = run_py(code, timeout=40)
    assert "INTERRUPTED" in p.stdout, describe(p)
    t_int = float(p.stdout.split("INTERRUPTED ")[1].split()[0])
    assert t_int < 3.0, f"KeyboardInterrupt took {t_int}s\n{describe(p)}"
    assert "CLOSED" in p.stdout, f"close() did not return while the source hangs\n{describe(p)}"
    t_close = float(p.stdout.split("CLOSED ")[1].split()[0])
    assert t_close < 5.0, f"close() took {t_close}s\n{describe(p)}"
    assert "FIRST OK True" in p.stdout, describe(p)
    assert p.returncode == 0, describe(p)


def test_interrupted_next_can_be_retried_without_losing_a_batch():
    code = """
import faulthandler, signal, threading, time
import numpy as np
import pinloader
faulthandler.dump_traceback_later(20, exit=True)

def slow_source():
    for i in range(5):
        if i == 1:
            time.sleep(1.0)
        yield np.full(3, i)

pf = pinloader.AsyncPrefetcher(slow_source(), device="cpu")
got = [int(np.from_dlpack(next(pf))[0])]
main = threading.main_thread().ident
threading.Timer(0.2, lambda: signal.pthread_kill(main, signal.SIGINT)).start()
try:
    next(pf)
    print("NOT INTERRUPTED", flush=True)
except KeyboardInterrupt:
    print("INTERRUPTED", flush=True)
while True:
    try:
        got.append(int(np.from_dlpack(next(pf))[0]))
    except StopIteration:
        break
pf.close()
print("GOT", got, flush=True)
"""
    p = run_py(code, timeout=40)
    assert "INTERRUPTED" in p.stdout, describe(p)
    assert "GOT [0, 1, 2, 3, 4]" in p.stdout, describe(p)
    assert p.returncode == 0, describe(p)


def test_interpreter_exit_while_source_hangs_does_not_hang():
    code = HANG_PRELUDE.format(watchdog=8) + """
pf = pinloader.AsyncPrefetcher(hanging_source(), device="cpu")
first = next(pf)
time.sleep(0.2)  # the producer is blocked inside the source's next()
print("EXITING", flush=True)
"""
    t0 = time.monotonic()
    p = run_py(code, timeout=40)
    elapsed = time.monotonic() - t0
    assert "EXITING" in p.stdout, describe(p)
    assert p.returncode == 0, f"exit with a hung source did not finish cleanly\n{describe(p)}"
    assert elapsed < 8, f"exit took {elapsed:.1f}s\n{describe(p)}"


# ---- several consumer threads (subprocesses) -----------------------------------------------------

TWO_CONSUMERS_PRELUDE = """
import faulthandler, os, threading, time
import numpy as np
import pinloader
faulthandler.dump_traceback_later(40, exit=True)

def consume(pf, k, seen, ends, errors):
    try:
        while True:
            try:
                b = next(pf)
            except StopIteration:
                ends.append(k)
                return
            except ValueError:          # closed under it
                ends.append(k)
                return
            assert (np.from_dlpack(b["x"]) == b["i"]).all()
            seen[k].append(b["i"])
    except BaseException as e:
        errors.append(repr(e))

def slow_end(n):
    for i in range(n):
        yield {"i": i, "x": np.full(8, i)}
    time.sleep(0.5)  # both consumers are blocked in next() when the end arrives

def start_consumers(pf):
    seen, ends, errors = [[], []], [], []
    threads = [threading.Thread(target=consume, args=(pf, k, seen, ends, errors), daemon=True)
               for k in range(2)]
    for th in threads:
        th.start()
    return threads, seen, ends, errors
"""


def test_one_prefetcher_consumed_from_two_threads_keeps_every_batch_once():
    # Not a recommended pattern, but it must neither crash nor lose or duplicate batches, and
    # when the epoch ends every consumer must see StopIteration, not only the one that happened
    # to take the end-of-epoch marker. In a subprocess: a consumer stuck in next() forever
    # cannot be stopped from Python.
    code = TWO_CONSUMERS_PRELUDE + """
n = 300
pf = pinloader.AsyncPrefetcher(slow_end(n), device="cpu", depth=4)
threads, seen, ends, errors = start_consumers(pf)
for th in threads:
    th.join(timeout=5)
print("ALIVE", [th.is_alive() for th in threads], flush=True)
print("ERRORS", errors, flush=True)
print("ENDS", sorted(ends), flush=True)
print("ALL", sorted(seen[0] + seen[1]) == list(range(n)),
      "ORDERED", all(s == sorted(s) for s in seen), flush=True)
os._exit(0)
"""
    p = run_py(code, timeout=60)
    assert "ERRORS []" in p.stdout, describe(p)
    assert "ALL True ORDERED True" in p.stdout, describe(p)
    assert "ALIVE [False, False]" in p.stdout, f"a consumer is stuck in next() after the epoch ended\n{describe(p)}"
    assert "ENDS [0, 1]" in p.stdout, describe(p)


def test_close_from_another_thread_releases_a_blocked_consumer():
    # close() must wake a consumer blocked in next() on another thread (it should get
    # ValueError("closed") or StopIteration), whatever the producer is doing at that moment.
    # Phase 1 is deterministic: the second of two consumers blocked at the end of an epoch
    # is left waiting (see the test above) and close() must release it. Phase 2 closes while a
    # single consumer waits and the producer is inside the source; whether a batch reaches the
    # consumer before close() empties the queue is a race, so it runs several rounds.
    code = TWO_CONSUMERS_PRELUDE + """
pf = pinloader.AsyncPrefetcher(slow_end(3), device="cpu", depth=2)
threads, seen, ends, errors = start_consumers(pf)
for th in threads:
    th.join(timeout=1.5)
stuck_before = sum(th.is_alive() for th in threads)
t0 = time.monotonic()
pf.close()
close_s = time.monotonic() - t0
for th in threads:
    th.join(timeout=2)
print("PHASE1 stuck_before=%d close_s=%.2f alive_after=%s errors=%s" % (
    stuck_before, close_s, [th.is_alive() for th in threads], errors), flush=True)

stuck = 0
for r in range(6):
    def slow():
        yield {"i": 0, "x": np.full(8, 0)}
        time.sleep(0.3)
        yield {"i": 1, "x": np.full(8, 1)}
        time.sleep(0.3)
        yield {"i": 2, "x": np.full(8, 2)}
    pf = pinloader.AsyncPrefetcher(slow(), device="cpu")
    next(pf)
    seen, ends, errors2 = [[], []], [], []
    th = threading.Thread(target=consume, args=(pf, 0, seen, ends, errors2), daemon=True)
    th.start()
    time.sleep(0.1)  # consumer blocked in next(), producer inside the source
    pf.close()
    th.join(timeout=2)
    stuck += th.is_alive()
    errors += errors2
print("PHASE2 stuck=%d of 6 errors=%s" % (stuck, errors), flush=True)
os._exit(0)
"""
    p = run_py(code, timeout=60)
    assert "PHASE1" in p.stdout and "PHASE2" in p.stdout, describe(p)
    assert "alive_after=[False, False]" in p.stdout, f"close() left a consumer blocked in next()\n{describe(p)}"
    assert "PHASE2 stuck=0 of 6 errors=[]" in p.stdout, f"close() left a consumer blocked in next()\n{describe(p)}"


# ---- sources that overwrite what they yielded ----------------------------------------------------

def test_source_mutating_yielded_array_after_yield():
    # Observed behaviour (host backend, ordinary pageable memory): the producer stages an item's
    # leaves into pinned memory before it calls next() on the source again, so a source that
    # yields one array object and overwrites it in place on its next step delivers, for every
    # batch, the values the array had when it was yielded (the "old" values). The test accepts
    # old or new, as promised, and checks nothing tears or crashes.
    n = 300
    buf = np.zeros(1024, dtype=np.int64)

    def mutating():
        for i in range(n):
            buf[:] = i
            yield {"x": buf, "i": i}
            buf[:] = -1 - i  # overwrite right after the yield (next step)

    with pinloader.AsyncPrefetcher(mutating(), device=DEVICE, depth=4) as pf:
        out = drain(pf)
    assert len(out) == n
    old_count = 0
    for b in out:
        i = b["i"]
        x = val(b["x"])
        u = np.unique(x)
        assert len(u) == 1, f"batch {i} is torn: {u[:10]}"
        assert u[0] in (i, -1 - i, i + 1), f"batch {i} holds {u[0]}"
        old_count += int(u[0] == i)
    assert old_count == n  # the behaviour described above


def test_source_mutating_yielded_pinned_buffer_after_yield():
    # Same as above, but the yielded array lives in a PinnedBuffer: large contiguous pinned
    # leaves are DMA'd straight from the source's memory (no staging), so the copy can still be
    # pending when the producer advances the source, which then overwrites the buffer. Each
    # batch must still hold either the values yielded (old) or the overwrite (new), not a mix
    # of later items' values.
    n = 100
    pool = pinloader.PinnedPool(max_bytes=8 << 20, device=DEVICE)
    pbuf = pool.alloc(128 << 10)
    arr = np.frombuffer(pbuf, dtype=np.int64)

    def mutating():
        for i in range(n):
            arr[:] = i
            yield {"x": arr, "i": i}
            arr[:] = -1 - i

    with pinloader.AsyncPrefetcher(mutating(), device=DEVICE, depth=4) as pf:
        out = drain(pf)
    assert len(out) == n
    bad = []
    for b in out:
        i = b["i"]
        u = np.unique(val(b["x"]))
        if not (len(u) == 1 and u[0] in (i, -1 - i)):
            bad.append((i, u[:6].tolist()))
    del out, arr
    gc.collect()
    assert not bad, f"{len(bad)} of {n} batches hold neither the yielded nor the overwritten values, e.g. {bad[:5]}"


# ---- waiting and running ahead -------------------------------------------------------------------

def test_consumer_wait_does_not_spin():
    # A consumer blocked in next() sleeps on a condition variable; a wait that returned at once
    # (wrong clock) would spin, burning a core and taking the GIL from the producer.
    def slow():
        for _ in range(2):
            time.sleep(0.5)
            yield np.zeros(4)

    c0 = time.process_time()
    with pinloader.AsyncPrefetcher(slow(), device=DEVICE) as pf:
        assert len(list(pf)) == 2
    assert time.process_time() - c0 < 0.4, "the consumer spun while waiting ~1 s for the source"


class PullCounter:
    def __init__(self, n):
        self.n = n
        self.pulled = 0
        self.lock = threading.Lock()

    def __iter__(self):
        for i in range(self.n):
            with self.lock:
                self.pulled += 1
            yield {"i": i, "x": np.full(16, i)}


@pytest.mark.parametrize("depth", [1, 2, 5])
def test_depth_bounds_how_far_the_producer_runs_ahead(depth):
    src = PullCounter(200)
    pf = pinloader.AsyncPrefetcher(src, device=DEVICE, depth=depth)
    try:
        b = next(pf)
        assert b["i"] == 0
        # the producer does run ahead (it is a prefetcher) ...
        assert wait_for(lambda: src.pulled >= depth), src.pulled
        time.sleep(0.2)
        # ... but no further than depth batches (plus the one being built, plus slack of one)
        assert src.pulled <= depth + 2, f"depth={depth} but {src.pulled} items pulled"
        assert pf.stats()["queued"] <= depth
        # consuming one more lets it pull one more, not more
        next(pf)
        time.sleep(0.1)
        assert src.pulled <= depth + 3
    finally:
        pf.close()
