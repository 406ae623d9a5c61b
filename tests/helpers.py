"""Helpers shared by the host-backend test modules."""


def drain(pf):
    """next() until StopIteration, without calling iter() (which would start a new epoch)."""
    out = []
    while True:
        try:
            out.append(next(pf))
        except StopIteration:
            return out


class CapsuleWrapper:
    """np.from_dlpack only takes objects with __dlpack__: wrap a raw (CPU) capsule in one."""

    def __init__(self, cap):
        self.cap = cap

    def __dlpack__(self, **kwargs):
        return self.cap

    def __dlpack_device__(self):
        return (1, 0)


def describe(p):
    """A child interpreter's exit status and output, for assertion messages."""
    return f"rc={p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr[-6000:]}"


def run_child(code, env, timeout, cwd=None):
    """Run `code` in a fresh interpreter with `env`; fail the test (not hang) past `timeout`."""
    import subprocess
    import sys
    import textwrap

    import pytest

    try:
        return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                              text=True, timeout=timeout, env=env, cwd=cwd)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        pytest.fail(f"subprocess still running after {timeout}s (hang)\nstdout:\n{out}\n"
                    f"stderr:\n{err[-4000:]}")


# The parent's side of the fork tests: wait for a child, kill it (and say "HANG") past timeout.
WAIT_CHILD = '''
def wait_child(pid, timeout={timeout}):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep({poll})
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    return "HANG"
'''
