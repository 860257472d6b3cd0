"""Reading a scheduler's step trace (`--step-trace PATH`, JSON Lines; its
format is in common/sched/sched.h) into what the profile fits.

A step's features are the simulator's (planner/sim.h): N tokens in the
batch (a decode counts 1), A attention pairs (the sum over the new tokens
of their positions pos0 + 1 .. pos0 + chunk), A2 the sum of the squared
positions, C the context the entries read (sum of pos0 + chunk), B
sequences. The step model is
    forward = c0 + c_tok N + c_tok2 N^2 + c_attn A + c_attn2 A2 + c_ctx C + c_seq B
              + sum over k in (2, 4, 8, 16) of c_nk max(0, N - k)
fitted to each step's forward time; the scheduler's own time per step is
the gap from a step's end to the next one's start while it is busy (the
next step continues a sequence of this one).
"""

import json

FEATURES = ("c0", "c_tok", "c_tok2", "c_attn", "c_attn2", "c_ctx", "c_seq",
            "c_n2", "c_n4", "c_n8", "c_n16")
HINGES = (2, 4, 8, 16)  # max(0, N - k): the cost per token piecewise linear in N
SIGNED = ("c_n2", "c_n4", "c_n8", "c_n16")  # a hinge may lower the slope


def attn(pos0, chunk):
    """A and A2 of chunk new tokens after pos0 (planner/sim.c td_step_attn)."""
    lo, hi = pos0, pos0 + chunk
    return (hi * (hi + 1) - lo * (lo + 1)) / 2.0, (
        hi * (hi + 1) * (2 * hi + 1) - lo * (lo + 1) * (2 * lo + 1)) / 6.0


class TraceError(Exception):
    pass


class Step:
    __slots__ = ("t", "dt", "entries", "period", "gap")

    def __init__(self, t, dt, entries):
        self.t, self.dt, self.entries = t, dt, entries
        self.period = None  # to the next step's start, when it continues this one
        self.gap = None  # the scheduler's time between this step's end and the next's start

    def features(self):
        n = sum(e[2] for e in self.entries)
        a = a2 = c = 0.0
        for _, pos0, chunk in self.entries:
            x, x2 = attn(pos0, chunk)
            a += x
            a2 += x2
            c += pos0 + chunk
        return (1.0, float(n), float(n) * n, a, a2, c, float(len(self.entries)),
                *(float(max(0, n - k)) for k in HINGES))

    def kind(self):
        if all(e[2] == 1 for e in self.entries):
            return "decode"
        if all(e[2] > 1 for e in self.entries):
            return "prefill"
        return "mixed"


class Trace:
    """header: the first line's parameters; steps: [Step] in order;
    arrivals: {ticket: (t_arrival, n_prompt, max_tokens)} in arrival order;
    remote_done: {ticket: t}; admitted_remote: [ticket] in admission order;
    t0: the process's monotonic clock at the trace's start (shared by
    every process on the machine)."""

    def __init__(self, path):
        self.path = str(path)
        self.steps, self.arrivals, self.remote_done, self.admitted_remote = [], {}, {}, []
        self.chunks = {}  # ticket -> [step index] of the batches with its prompt's chunks
        try:
            f = open(path, encoding="utf-8")
        except OSError as e:
            raise TraceError(f"{path}: {e.strerror}")
        with f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    o = json.loads(line)
                except ValueError:
                    raise TraceError(f"{path}:{lineno}: not JSON (a truncated trace?)")
                if lineno == 1:
                    if not isinstance(o, dict) or o.get("tandem_step_trace") != 1:
                        raise TraceError(f"{path}:1: not a step trace (tandem serve --step-trace)")
                    self.header = o
                    continue
                try:
                    self._events(o["ev"])
                except (KeyError, TypeError, IndexError, ValueError) as e:
                    raise TraceError(f"{path}:{lineno}: malformed step ({e!r})")
        if not hasattr(self, "header"):
            raise TraceError(f"{path}: empty")
        self.t0 = float(self.header["t0"])
        self._periods()

    def _events(self, evs):
        for e in evs:
            k = e[0]
            if k == "in":
                self.arrivals[int(e[1])] = (float(e[4]), len(e[3]), int(e[2]))
            elif k == "b":
                entries = [(int(x[0]), int(x[1]), int(x[2])) for x in e[3]]
                self.steps.append(Step(float(e[1]), float(e[2]), entries))
                for tk, pos0, n in entries:
                    if pos0 < self.arrivals.get(tk, (0, 0, 0))[1]:
                        self.chunks.setdefault(tk, []).append(len(self.steps) - 1)
            elif k == "rdone":
                self.remote_done[int(e[1])] = float(e[2])
            elif k == "adm" and int(e[2]) == 1:
                self.admitted_remote.append(int(e[1]))

    def _periods(self):
        for a, b in zip(self.steps, self.steps[1:]):
            if {e[0] for e in a.entries} & {e[0] for e in b.entries}:
                a.period = b.t - a.t
                a.gap = b.t - (a.t + a.dt)

    def prompt_steps(self, ticket):
        """The steps that computed the ticket's prompt (its prefill chunks,
        the first computation only: a preempted sequence's recompute too)."""
        return self.chunks.get(ticket, [])


def predict(coef, features):
    """The step model {name: coefficient} at a step's features."""
    return sum(coef[k] * x for k, x in zip(FEATURES, features))
