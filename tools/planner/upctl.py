"""A `tandem up` cluster run by the planner's tools (the profiler's loads,
the validation's real runs): started in its own session, ready once it
prints its ready line, stopped with SIGTERM and then SIGKILL of its whole
process group, always."""

import os
import re
import signal
import subprocess
import sys
import time

READY_RE = re.compile(r"^tandem up: ready http=(http://\S+) ")


class UpError(Exception):
    pass


def stop_on_sigterm():
    """A SIGTERM to the tool unwinds it like Ctrl-C, so every Up it started
    is stopped by its finally (the default action would leave them)."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


class Up:
    """tandem up with argv (its stderr into err_path) until stop(); .url is
    the router's once ready. Raises UpError (after stopping it) when it
    exits or is not ready within ready_timeout_s."""

    def __init__(self, argv, err_path, ready_timeout_s=330):
        self.argv = argv
        self.err = open(err_path, "wb")
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=self.err,
                                     stdin=subprocess.DEVNULL, start_new_session=True, text=True)
        self.url = None
        deadline = time.monotonic() + ready_timeout_s
        while self.url is None:
            line = self.proc.stdout.readline()
            if not line:
                self.stop()
                tail = open(err_path, errors="replace").read()[-2000:]
                raise UpError(f"tandem up exited before ready:\n{tail}")
            m = READY_RE.match(line)
            if m:
                self.url = m.group(1)
            if time.monotonic() > deadline:
                self.stop()
                raise UpError(f"tandem up not ready after {ready_timeout_s} s")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if not self.err.closed:
            self.err.close()
