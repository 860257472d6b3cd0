/* tandem up: a whole cluster on one machine (DESIGN.md §11): N
 * tandem-prefill and M tandem-decode instances on loopback behind one
 * tandem-router, started from the binaries next to this one, with a fresh
 * cluster token; ready once the router is ready and sees every instance
 * ready; stopped cleanly on Ctrl-C or SIGTERM.
 *
 * The children run in their own process groups, so a terminal's Ctrl-C
 * reaches only this process, which then stops them in order (router, decode,
 * prefill: a request in flight finishes before the instances it needs go).
 * Their stdout and stderr come through pipes and go to our stderr with the
 * instance's name in front of every line; our stdout carries only the
 * ready line. Signals and child exits are read from a signalfd in the same
 * poll as the pipes, so nothing runs in a signal handler. */
#define _GNU_SOURCE /* pipe2 */
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <limits.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <spawn.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/base/base.h"
#include "common/base/httpc.h"
#include "common/runtime/cli.h"
#include "tools.h"

extern char **environ;

#define UP_MAX_POOL      16 /* per pool: a decode instance takes at most 16 prefill peers */
#define UP_MAX_KIDS      (2 * UP_MAX_POOL + 1)
#define UP_LINE_MAX      4096
#define UP_ADDR_MAX      280
#define UP_STOP_MARGIN_S 10.0 /* beyond the drain timeout, before SIGKILL */
#define UP_POLL_READY_MS 250
#define UP_HTTP_BODY_MAX (4u << 20)

typedef enum { UP_PREFILL, UP_DECODE, UP_ROUTER, UP_COLOCATED } up_role;

/* A colocated instance is `tandem serve`, in the router's decode pool. */
static const char *const k_bins[] = {"tandem-prefill", "tandem-decode", "tandem-router", "tandem"};
static const char *const k_roles[] = {"prefill", "decode", "router", "colocated"};
static const char *const k_pool_roles[] = {"prefill", "decode", "router", "decode"};

#define UP_MAX_ARGS 16 /* --prefill-arg / --decode-arg each */
#define UP_MAX_CPUS 1024

typedef struct {
    int fd; /* -1 once closed */
    size_t len;
    char buf[UP_LINE_MAX];
} up_pipe;

typedef struct {
    up_role role;
    char name[32]; /* "prefill-0", "decode-1", "router" */
    pid_t pid;     /* > 0 once started */
    bool exited;   /* reaped; status valid */
    int status;    /* as waitpid */
    bool stopping; /* sent SIGTERM (or killed) by stop_all */
    bool killed;   /* SIGKILLed by us */
    up_pipe out, err;
    char http[UP_ADDR_MAX], grpc[UP_ADDR_MAX]; /* from the listening line; "" before */
} up_child;

typedef struct {
    long n_prefill, n_decode, n_colocated, port, grpc_port, threads;
    bool pools_given; /* --prefill or --decode */
    const char *prefill_args[UP_MAX_ARGS], *decode_args[UP_MAX_ARGS], *router_args[UP_MAX_ARGS];
    int n_prefill_args, n_decode_args, n_router_args;
    int cpus[UP_MAX_CPUS]; /* --cpus */
    int n_cpus;
    const char *model, *host, *token_file;
    const char *kv_dtype; /* --kv-dtype: every prefill, decode and colocated instance's */
    double ready_timeout, drain_timeout;
    const char *chat; /* --chat: one request through the router, then stop */
    long max_tokens;
} up_args;

typedef struct {
    up_args a;
    char bin_dir[PATH_MAX];
    char token_path[PATH_MAX];
    bool token_owned; /* our temp file: removed at exit */
    char *token;
    int sfd;
    int n_signals; /* SIGINT/SIGTERM received */
    bool ready;    /* the ready line was printed */
    up_child kids[UP_MAX_KIDS];
    int n_kids;
    int n_pinned; /* instances given their --cpus so far */
} up_state;

enum {
    U_PREFILL,
    U_DECODE,
    U_COLOCATED,
    U_MODEL,
    U_HOST,
    U_PORT,
    U_GRPC_PORT,
    U_THREADS,
    U_KV_DTYPE,
    U_TOKEN_FILE,
    U_READY_TIMEOUT,
    U_DRAIN_TIMEOUT,
    U_CHAT,
    U_MAX_TOKENS,
    U_CPUS,
    U_PREFILL_ARG,
    U_DECODE_ARG,
    U_ROUTER_ARG,
    U_N
};
static td_opt k_up_opts[U_N] = {
    /* the --model help names the default: set in parse_args */
    [U_PREFILL] = {"prefill", 0, "N",
                   "prefill instances (default 1, at most " TD_STR(UP_MAX_POOL) ")"},
    [U_DECODE] = {"decode", 0, "M",
                  "decode instances (default 1, at most " TD_STR(UP_MAX_POOL) ")"},
    [U_COLOCATED] = {"colocated", 0, "K",
                     "instead of the two pools: K colocated instances\n"
                     "(tandem serve, prefill and decode in one) behind the\n"
                     "router (at most " TD_STR(UP_MAX_POOL) ")"},
    [U_MODEL] = {"model", 'm', "PATH", "GGUF file or Hugging Face directory"},
    [U_HOST] = {"host", 0, "ADDR",
                "the router's address (default 127.0.0.1; the instances\n"
                "always bind 127.0.0.1)"},
    [U_PORT] = {"port", 0, "N", "the router's HTTP port (default 8000; 0 = ephemeral)"},
    [U_GRPC_PORT] = {"grpc-port", 0, "N",
                     "the router's gRPC port (default 50051; 0 = ephemeral;\n"
                     "-1 = none)"},
    [U_THREADS] = {"threads", 't', "T",
                   "compute threads per instance (default: online cores /\n"
                   "(N + M), at least 1)"},
    [U_KV_DTYPE] = {"kv-dtype", 0, "T",
                    "every instance's KV cache type: f16, bf16, f32 (default:\n"
                    "the instances' own)"},
    [U_TOKEN_FILE] = {"cluster-token-file", 0, "F",
                      "the cluster token (first line of F; default: a random\n"
                      "token in a 0600 temporary file removed at exit)"},
    [U_READY_TIMEOUT] = {"ready-timeout", 0, "S",
                         "seconds to wait for the cluster to be ready (default 300)"},
    [U_DRAIN_TIMEOUT] = {"drain-timeout", 0, "S",
                         "each instance's drain timeout after SIGTERM (default 30)"},
    [U_CHAT] = {"chat", 0, "TEXT",
                "once ready, send TEXT as a chat message through the\n"
                "router (greedy), print the answer on stdout and stop\n"
                "everything (exit 0 when the answer came)"},
    [U_MAX_TOKENS] = {"max-tokens", 0, "N", "the --chat answer's limit (default 128)"},
    [U_CPUS] = {"cpus", 0, "LIST",
                "pin the instances to these cores (e.g. 0,1 or 0-3), T\n"
                "each in start order (prefill, decode, colocated),\n"
                "wrapping round; the router is not pinned"},
    [U_PREFILL_ARG] = {"prefill-arg", 0, "ARG",
                       "one more argument for every prefill instance\n"
                       "(repeatable; a flag and its value as one FLAG=VALUE;\n"
                       "{i} becomes the instance's index)"},
    [U_DECODE_ARG] = {"decode-arg", 0, "ARG", "the same for every decode or colocated instance"},
    [U_ROUTER_ARG] = {"router-arg", 0, "ARG", "the same for the router"},
};

static void up_usage(FILE *f, void *ctx) {
    TD_UNUSED(ctx);
    fprintf(
        f,
        "usage: tandem up [--prefill N] [--decode M | --colocated K] [--model PATH] [--port 8000]\n"
        "                 [--grpc-port 50051] [--cpus LIST] [options]\n"
        "\n"
        "Runs a whole cluster on this machine: N tandem-prefill and M tandem-decode instances\n"
        "on loopback (ephemeral ports; every decode instance knows every prefill instance)\n"
        "behind one tandem-router on --host:--port, all started from the directory of this\n"
        "binary and sharing a fresh cluster token; with --colocated K, K tandem serve\n"
        "instances (prefill and decode in one process) behind the router instead. Prints\n"
        "  tandem up: ready http=http://HOST:PORT grpc=HOST:PORT (prefill N, decode M)\n"
        "(or (colocated K))\n"
        "on stdout once the router answers /ready and sees every instance ready. The\n"
        "instances' output goes to stderr, each line behind the instance's name.\n"
        "Ctrl-C or SIGTERM stops everything: the router first, then the decode, then the\n"
        "prefill instances, each given --drain-timeout plus %.0f s before it is killed; a\n"
        "second Ctrl-C kills at once. Exits 0 after a clean stop; 1 when an instance exits\n"
        "on its own, fails to start or is not ready in time (everything else is stopped);\n"
        "2 for bad usage.\n"
        "\n",
        UP_STOP_MARGIN_S);
    td_opts_print(f, k_up_opts, U_N);
}

static bool parse_seconds(const char *s, double lo, double *out) {
    float v;
    if (!td_cli_parse_float(s, &v) || v < lo || v > 86400) return false;
    *out = v;
    return true;
}

/* "0,1", "0-3,8": each core once, in the order given. */
static bool parse_cpus(const char *s, up_args *a) {
    a->n_cpus = 0;
    while (*s) {
        char *end;
        long lo = strtol(s, &end, 10), hi = lo;
        if (end == s || lo < 0 || lo >= CPU_SETSIZE) return false;
        s = end;
        if (*s == '-') {
            hi = strtol(s + 1, &end, 10);
            if (end == s + 1 || hi < lo || hi >= CPU_SETSIZE) return false;
            s = end;
        }
        for (long c = lo; c <= hi; c++) {
            if (a->n_cpus == UP_MAX_CPUS) return false;
            a->cpus[a->n_cpus++] = (int)c;
        }
        if (*s == ',' && s[1])
            s++;
        else if (*s)
            return false;
    }
    return a->n_cpus > 0;
}

static bool set_up_opt(void *ctx, int i, const char *val, bool *printed) {
    up_args *a = ctx;
    TD_UNUSED(printed);
    switch (i) {
    case U_PREFILL:
        a->pools_given = true;
        return td_cli_parse_long(val, 1, UP_MAX_POOL, &a->n_prefill);
    case U_DECODE:
        a->pools_given = true;
        return td_cli_parse_long(val, 1, UP_MAX_POOL, &a->n_decode);
    case U_COLOCATED: return td_cli_parse_long(val, 1, UP_MAX_POOL, &a->n_colocated);
    case U_CPUS: return parse_cpus(val, a);
    case U_PREFILL_ARG:
        if (a->n_prefill_args == UP_MAX_ARGS) return false;
        a->prefill_args[a->n_prefill_args++] = val;
        return true;
    case U_DECODE_ARG:
        if (a->n_decode_args == UP_MAX_ARGS) return false;
        a->decode_args[a->n_decode_args++] = val;
        return true;
    case U_ROUTER_ARG:
        if (a->n_router_args == UP_MAX_ARGS) return false;
        a->router_args[a->n_router_args++] = val;
        return true;
    case U_MODEL: return *(a->model = val) != '\0';
    case U_HOST: return *(a->host = val) != '\0' && strlen(val) < 200;
    case U_PORT: return td_cli_parse_long(val, 0, 65535, &a->port);
    case U_GRPC_PORT: return td_cli_parse_long(val, -1, 65535, &a->grpc_port);
    case U_THREADS: return td_cli_parse_long(val, 1, 4096, &a->threads);
    case U_KV_DTYPE: return td_cli_parse_kv_dtype(val, &a->kv_dtype);
    case U_TOKEN_FILE: return *(a->token_file = val) != '\0';
    case U_READY_TIMEOUT: return parse_seconds(val, 0.001, &a->ready_timeout);
    case U_DRAIN_TIMEOUT: return parse_seconds(val, 0, &a->drain_timeout);
    case U_CHAT: return *(a->chat = val) != '\0';
    case U_MAX_TOKENS: return td_cli_parse_long(val, 1, 1 << 20, &a->max_tokens);
    }
    return false;
}

/* 0 to go on, -1 after --help, else the exit status. */
static int parse_args(int argc, char **argv, up_args *a) {
    k_up_opts[U_MODEL].help = td_cli_model_help();
    td_optset set = {k_up_opts, U_N, set_up_opt, a};
    int rc = td_opts_parse("tandem up", argc, argv, &set, 1, up_usage, NULL);
    return rc == 1 ? -1 : rc;
}

/* ---- the cluster token ---- */

/* 32 bytes of /dev/urandom as hex, in a fresh 0600 file under $TMPDIR. */
static bool make_token_file(up_state *u) {
    unsigned char raw[32];
    int rfd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    ssize_t got = rfd >= 0 ? read(rfd, raw, sizeof raw) : -1;
    int rerr = errno;
    if (rfd >= 0) close(rfd);
    if (got != (ssize_t)sizeof raw) {
        fprintf(stderr, "tandem up: cannot read /dev/urandom: %s\n",
                got < 0 ? strerror(rerr) : "short read");
        return false;
    }
    char hex[2 * sizeof raw + 2];
    for (size_t i = 0; i < sizeof raw; i++) snprintf(hex + 2 * i, 3, "%02x", raw[i]);
    const char *tmp = getenv("TMPDIR");
    if (!tmp || !*tmp) tmp = "/tmp";
    int n = snprintf(u->token_path, sizeof u->token_path, "%s/tandem-up-token-XXXXXX", tmp);
    if (n < 0 || (size_t)n >= sizeof u->token_path) {
        fprintf(stderr, "tandem up: TMPDIR is too long\n");
        return false;
    }
    int fd = mkstemp(u->token_path); /* mode 0600 */
    if (fd < 0) {
        fprintf(stderr, "tandem up: cannot create a token file in %s: %s\n", tmp, strerror(errno));
        return false;
    }
    u->token_owned = true;
    size_t len = 2 * sizeof raw;
    hex[len] = '\n';
    bool ok = fchmod(fd, 0600) == 0 && write(fd, hex, len + 1) == (ssize_t)(len + 1);
    int werr = errno;
    if (close(fd) != 0) ok = false;
    if (!ok) {
        fprintf(stderr, "tandem up: cannot write %s: %s\n", u->token_path, strerror(werr));
        return false;
    }
    hex[len] = 0;
    u->token = strdup(hex);
    return u->token != NULL;
}

/* ---- children ---- */

static void describe_status(int status, char *out, size_t n) {
    if (WIFEXITED(status))
        snprintf(out, n, "exited with status %d", WEXITSTATUS(status));
    else if (WIFSIGNALED(status))
        snprintf(out, n, "was killed by signal %d (%s)", WTERMSIG(status),
                 strsignal(WTERMSIG(status)));
    else
        snprintf(out, n, "stopped (status 0x%x)", status);
}

/* One line of a child's output to our stderr behind its name (one write). */
static void emit_line(const up_child *c, const char *line, size_t len) {
    char buf[UP_LINE_MAX + 48];
    int h = snprintf(buf, sizeof buf, "[%s] ", c->name);
    if (h < 0) return;
    if (len > sizeof buf - (size_t)h - 1) len = sizeof buf - (size_t)h - 1;
    memcpy(buf + h, line, len);
    buf[(size_t)h + len] = '\n';
    ssize_t w = write(STDERR_FILENO, buf, (size_t)h + len + 1);
    TD_UNUSED(w); /* a closed stderr must not stop the cluster */
}

/* "NAME: listening http=HOST:PORT grpc=HOST:PORT|off" -> c->http, c->grpc. */
static void parse_listening(up_child *c, const char *line) {
    const char *h = strstr(line, ": listening http=");
    if (!h || c->http[0]) return;
    h += strlen(": listening http=");
    size_t hn = strcspn(h, " \t");
    const char *g = strstr(h, " grpc=");
    if (hn == 0 || hn >= UP_ADDR_MAX || !memchr(h, ':', hn) || !g) return;
    g += strlen(" grpc=");
    size_t gn = strcspn(g, " \t");
    if (gn == 0 || gn >= UP_ADDR_MAX) return;
    memcpy(c->grpc, g, gn);
    c->grpc[gn] = 0;
    memcpy(c->http, h, hn);
    c->http[hn] = 0;
}

static void pipe_line(up_child *c, up_pipe *p, const char *line, size_t len) {
    if (p == &c->out && !c->http[0]) {
        char tmp[UP_LINE_MAX + 1];
        memcpy(tmp, line, len);
        tmp[len] = 0;
        parse_listening(c, tmp);
    }
    emit_line(c, line, len);
}

/* Reads what the pipe holds; complete lines go out, EOF closes it. */
static void pipe_read(up_child *c, up_pipe *p) {
    for (;;) {
        ssize_t r = read(p->fd, p->buf + p->len, sizeof p->buf - p->len);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
        if (r <= 0) { /* EOF or error: the rest is a last line */
            if (p->len) pipe_line(c, p, p->buf, p->len);
            p->len = 0;
            close(p->fd);
            p->fd = -1;
            return;
        }
        p->len += (size_t)r;
        size_t start = 0;
        for (size_t i = 0; i < p->len; i++) {
            if (p->buf[i] != '\n') continue;
            pipe_line(c, p, p->buf + start, i - start);
            start = i + 1;
        }
        memmove(p->buf, p->buf + start, p->len - start);
        p->len -= start;
        if (p->len == sizeof p->buf) { /* a line longer than the buffer: cut it */
            pipe_line(c, p, p->buf, p->len);
            p->len = 0;
        }
    }
}

static bool child_running(const up_child *c) { return c->pid > 0 && !c->exited; }

/* Reaps the children that exited. The leader of a process group is a zombie
 * until reaped, so its group id cannot be reused: whatever it left in its
 * group (rank processes) is killed first. */
static void reap(up_state *u) {
    for (int i = 0; i < u->n_kids; i++) {
        up_child *c = &u->kids[i];
        if (!child_running(c)) continue;
        siginfo_t si = {0};
        if (waitid(P_PID, (id_t)c->pid, &si, WEXITED | WNOHANG | WNOWAIT) != 0 ||
            si.si_pid != c->pid)
            continue;
        kill(-c->pid, SIGKILL);
        int st = 0;
        if (waitpid(c->pid, &st, 0) == c->pid) {
            c->exited = true;
            c->status = st;
        }
    }
}

/* Waits up to timeout_ms for output, a signal or a child's exit, and
 * handles what came. */
static void pump(up_state *u, int timeout_ms) {
    struct pollfd fds[1 + 2 * UP_MAX_KIDS];
    up_pipe *pipes[1 + 2 * UP_MAX_KIDS];
    up_child *owners[1 + 2 * UP_MAX_KIDS];
    nfds_t n = 0;
    fds[n++] = (struct pollfd){.fd = u->sfd, .events = POLLIN};
    for (int i = 0; i < u->n_kids; i++) {
        up_pipe *ps[2] = {&u->kids[i].out, &u->kids[i].err};
        for (int k = 0; k < 2; k++) {
            if (ps[k]->fd < 0) continue;
            pipes[n] = ps[k];
            owners[n] = &u->kids[i];
            fds[n++] = (struct pollfd){.fd = ps[k]->fd, .events = POLLIN};
        }
    }
    int r = poll(fds, n, timeout_ms);
    if (r > 0) {
        for (nfds_t i = 1; i < n; i++)
            if (fds[i].revents) pipe_read(owners[i], pipes[i]);
        if (fds[0].revents & POLLIN) {
            struct signalfd_siginfo si;
            while (read(u->sfd, &si, sizeof si) == (ssize_t)sizeof si)
                if (si.ssi_signo == SIGINT || si.ssi_signo == SIGTERM) {
                    u->n_signals++;
                    fprintf(stderr, "tandem up: %s: stopping the cluster%s\n",
                            si.ssi_signo == SIGINT ? "SIGINT" : "SIGTERM",
                            u->n_signals > 1 ? " at once (second signal)" : "");
                }
        }
    }
    reap(u); /* SIGCHLDs coalesce: look at every child each time */
}

/* The first child that exited, or NULL. */
static up_child *first_exited(up_state *u) {
    for (int i = 0; i < u->n_kids; i++)
        if (u->kids[i].exited) return &u->kids[i];
    return NULL;
}

static void report_exit(const up_child *c, const char *when) {
    char how[96];
    describe_status(c->status, how, sizeof how);
    fprintf(stderr, "tandem up: %s (%s, pid %ld) %s %s\n", c->name, k_bins[c->role], (long)c->pid,
            how, when);
}

static bool spawn_child(up_state *u, up_child *c, char *const argv[]) {
    char path[PATH_MAX + 32];
    snprintf(path, sizeof path, "%s/%s", u->bin_dir, k_bins[c->role]);
    int po[2] = {-1, -1}, pe[2] = {-1, -1};
    if (pipe2(po, O_CLOEXEC) != 0 || pipe2(pe, O_CLOEXEC) != 0) {
        fprintf(stderr, "tandem up: pipe: %s\n", strerror(errno));
        goto close_pipes;
    }
    posix_spawn_file_actions_t fa;
    posix_spawnattr_t at;
    if (posix_spawn_file_actions_init(&fa) != 0) {
        fprintf(stderr, "tandem up: cannot start %s: out of memory\n", c->name);
        goto close_pipes;
    }
    if (posix_spawnattr_init(&at) != 0) {
        fprintf(stderr, "tandem up: cannot start %s: out of memory\n", c->name);
        posix_spawn_file_actions_destroy(&fa);
        goto close_pipes;
    }
    sigset_t none, dfl;
    sigemptyset(&none);
    sigemptyset(&dfl);
    sigaddset(&dfl, SIGINT);
    sigaddset(&dfl, SIGTERM);
    sigaddset(&dfl, SIGCHLD);
    sigaddset(&dfl, SIGPIPE);
    sigaddset(&dfl, SIGHUP);
    int err = posix_spawn_file_actions_addopen(&fa, STDIN_FILENO, "/dev/null", O_RDONLY, 0);
    if (!err) err = posix_spawn_file_actions_adddup2(&fa, po[1], STDOUT_FILENO);
    if (!err) err = posix_spawn_file_actions_adddup2(&fa, pe[1], STDERR_FILENO);
    if (!err) err = posix_spawnattr_setsigmask(&at, &none);
    if (!err) err = posix_spawnattr_setsigdefault(&at, &dfl);
    if (!err) err = posix_spawnattr_setpgroup(&at, 0); /* its own group: Ctrl-C is ours */
    if (!err)
        err = posix_spawnattr_setflags(&at, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF |
                                                POSIX_SPAWN_SETPGROUP);
    pid_t pid = 0;
    if (!err) err = posix_spawn(&pid, path, &fa, &at, argv, environ);
    posix_spawnattr_destroy(&at);
    posix_spawn_file_actions_destroy(&fa);
    if (err) {
        fprintf(stderr, "tandem up: cannot start %s (%s): %s\n", c->name, path, strerror(err));
        goto close_pipes;
    }
    close(po[1]);
    close(pe[1]);
    fcntl(po[0], F_SETFL, O_NONBLOCK);
    fcntl(pe[0], F_SETFL, O_NONBLOCK);
    c->out.fd = po[0];
    c->err.fd = pe[0];
    c->pid = pid;
    char cmd[2048];
    size_t at_ = 0;
    for (int i = 0; argv[i] && at_ < sizeof cmd; i++) {
        int w = snprintf(cmd + at_, sizeof cmd - at_, "%s%s", i ? " " : "", i ? argv[i] : path);
        if (w < 0) break;
        at_ += (size_t)w;
    }
    fprintf(stderr, "tandem up: %s (pid %ld): %s\n", c->name, (long)pid, cmd);
    return true;

close_pipes:
    for (int i = 0; i < 2; i++) {
        if (po[i] >= 0) close(po[i]);
        if (pe[i] >= 0) close(pe[i]);
    }
    return false;
}

/* Adds a child of `role` and starts it with the flags every instance takes
 * plus `extra` (NULL-terminated). */
static up_child *start_child(up_state *u, up_role role, int index, const char *const *extra) {
    TD_ASSERT(u->n_kids < UP_MAX_KIDS);
    up_child *c = &u->kids[u->n_kids++];
    memset(c, 0, sizeof *c);
    c->role = role;
    c->out.fd = c->err.fd = -1;
    if (role == UP_ROUTER)
        snprintf(c->name, sizeof c->name, "router");
    else
        snprintf(c->name, sizeof c->name, "%s-%d", k_roles[role], index);
    char threads[32], port[16], grpc_port[16];
    snprintf(threads, sizeof threads, "%ld", u->a.threads);
    snprintf(port, sizeof port, "%ld", role == UP_ROUTER ? u->a.port : 0L);
    snprintf(grpc_port, sizeof grpc_port, "%ld", role == UP_ROUTER ? u->a.grpc_port : 0L);
    char drain[32];
    snprintf(drain, sizeof drain, "%g", u->a.drain_timeout);
    const char *argv[48 + UP_MAX_ARGS];
    char subst[UP_MAX_ARGS][512];
    int n = 0;
    argv[n++] = k_bins[role];
    if (role == UP_COLOCATED) argv[n++] = "serve";
    argv[n++] = "--cluster-token-file";
    argv[n++] = u->token_path;
    argv[n++] = "--host";
    argv[n++] = role == UP_ROUTER ? u->a.host : "127.0.0.1";
    argv[n++] = "--port";
    argv[n++] = port;
    if (role != UP_PREFILL) { /* prefill instances have no gRPC port */
        argv[n++] = "--grpc-port";
        argv[n++] = grpc_port;
    }
    if (role != UP_ROUTER) {
        argv[n++] = "--threads";
        argv[n++] = threads;
    }
    argv[n++] = "--drain-timeout";
    argv[n++] = drain;
    if (u->a.model) {
        argv[n++] = "--model";
        argv[n++] = u->a.model;
    }
    if (role != UP_ROUTER && u->a.kv_dtype) {
        argv[n++] = "--kv-dtype";
        argv[n++] = u->a.kv_dtype;
    }
    for (int i = 0; extra && extra[i]; i++) {
        TD_ASSERT(n < (int)TD_ARRAY_SIZE(argv) - 1);
        argv[n++] = extra[i];
    }
    /* --prefill-arg / --decode-arg / --router-arg, {i} the index */
    const char *const *more = role == UP_PREFILL  ? u->a.prefill_args
                              : role == UP_ROUTER ? u->a.router_args
                                                  : u->a.decode_args;
    int n_more = role == UP_PREFILL  ? u->a.n_prefill_args
                 : role == UP_ROUTER ? u->a.n_router_args
                                     : u->a.n_decode_args;
    for (int i = 0; i < n_more; i++) {
        const char *at = strstr(more[i], "{i}");
        if (at)
            snprintf(subst[i], sizeof subst[i], "%.*s%d%s", (int)(at - more[i]), more[i], index,
                     at + 3);
        argv[n++] = at ? subst[i] : more[i];
    }
    argv[n] = NULL;
    /* --cpus: the instance's T cores (inherited through the spawn) */
    cpu_set_t old_set;
    bool pinned = false;
    if (role != UP_ROUTER && u->a.n_cpus > 0) {
        cpu_set_t set;
        CPU_ZERO(&set);
        for (long j = 0; j < u->a.threads; j++)
            CPU_SET(u->a.cpus[(u->n_pinned * u->a.threads + j) % u->a.n_cpus], &set);
        u->n_pinned++;
        pinned = sched_getaffinity(0, sizeof old_set, &old_set) == 0;
        if (!pinned || sched_setaffinity(0, sizeof set, &set) != 0) {
            fprintf(stderr, "tandem up: cannot pin %s to --cpus: %s\n", c->name, strerror(errno));
            if (pinned) sched_setaffinity(0, sizeof old_set, &old_set);
            u->n_kids--;
            return NULL;
        }
    }
    bool ok = spawn_child(u, c, (char *const *)argv);
    if (pinned) sched_setaffinity(0, sizeof old_set, &old_set);
    if (!ok) {
        u->n_kids--;
        return NULL;
    }
    return c;
}

/* "a:1,b:2" of the listening addresses of every child of `role`. */
static void join_addrs(const up_state *u, up_role role, char *out, size_t n) {
    size_t at = 0;
    out[0] = 0;
    for (int i = 0; i < u->n_kids; i++) {
        if (u->kids[i].role != role) continue;
        int w = snprintf(out + at, n - at, "%s%s", at ? "," : "", u->kids[i].http);
        TD_ASSERT(w > 0 && (size_t)w < n - at);
        at += (size_t)w;
    }
}

typedef enum { UP_GO_ON, UP_STOP_SIGNAL, UP_STOP_FAILED, UP_STOP_DONE } up_outcome;

/* Whether to go on: no signal came and no child exited (reported). */
static up_outcome check_going(up_state *u) {
    up_child *dead = first_exited(u);
    if (dead) {
        report_exit(dead, !dead->http[0] ? "before it was listening"
                          : !u->ready    ? "before the cluster was ready"
                                         : "while the cluster was serving");
        return UP_STOP_FAILED;
    }
    return u->n_signals ? UP_STOP_SIGNAL : UP_GO_ON;
}

/* Waits until every child from index `from` on printed its listening line. */
static up_outcome wait_listening(up_state *u, int from, double deadline) {
    for (;;) {
        up_outcome o = check_going(u);
        if (o != UP_GO_ON) return o;
        int missing = -1;
        for (int i = from; i < u->n_kids && missing < 0; i++)
            if (!u->kids[i].http[0]) missing = i;
        if (missing < 0) return UP_GO_ON;
        if (td_time_s() > deadline) {
            fprintf(stderr,
                    "tandem up: %s did not print its listening line within %g s "
                    "(--ready-timeout)\n",
                    u->kids[missing].name, u->a.ready_timeout);
            return UP_STOP_FAILED;
        }
        pump(u, 100);
    }
}

/* ---- readiness over HTTP ---- */

/* GET http://addr/path: the HTTP code (0 when no answer) and the body in
 * *reply (free it with td_httpc_reply_free). */
static long http_get(const char *addr, const char *path, const char *token, td_httpc_reply *reply) {
    char url[UP_ADDR_MAX + 64];
    snprintf(url, sizeof url, "http://%s%s", addr, path);
    td_httpc_req rq = {.url = url,
                       .cluster_token = token,
                       .timeout_ms = 2000,
                       .connect_timeout_ms = 500,
                       .max_body = UP_HTTP_BODY_MAX};
    td_httpc_do(&rq, reply);
    return reply->code;
}

/* The router's address to connect to: a wildcard bind is reached on loopback. */
static void router_connect_addr(const up_child *r, char *out, size_t n) {
    const char *colon = strrchr(r->http, ':');
    TD_ASSERT(colon);
    size_t hn = (size_t)(colon - r->http);
    if (hn == 7 && !strncmp(r->http, "0.0.0.0", 7))
        snprintf(out, n, "127.0.0.1%s", colon);
    else if ((hn == 4 && !strncmp(r->http, "[::]", 4)) || (hn == 2 && !strncmp(r->http, "::", 2)))
        snprintf(out, n, "[::1]%s", colon);
    else
        snprintf(out, n, "%s", r->http);
}

/* Whether the router is ready and lists every instance as ready; otherwise
 * what is missing, in why. */
static bool cluster_ready(up_state *u, const up_child *router, char *why, size_t wn) {
    char addr[UP_ADDR_MAX + 16];
    router_connect_addr(router, addr, sizeof addr);
    td_httpc_reply b;
    long code = http_get(addr, "/ready", NULL, &b);
    td_httpc_reply_free(&b);
    if (code != 200) {
        snprintf(why, wn, "the router's /ready answers %ld", code);
        return false;
    }
    code = http_get(addr, "/internal/v1/cluster", u->token, &b);
    if (code != 200 || !b.body) {
        snprintf(why, wn, "the router's /internal/v1/cluster answers %ld", code);
        td_httpc_reply_free(&b);
        return false;
    }
    json_error_t jerr;
    json_t *root = json_loadb(b.body, b.len, 0, &jerr);
    td_httpc_reply_free(&b);
    json_t *insts = root ? json_object_get(root, "instances") : NULL;
    if (!json_is_array(insts)) {
        snprintf(why, wn, "the router's /internal/v1/cluster has no instances array");
        json_decref(root);
        return false;
    }
    bool ok = true;
    for (int i = 0; i < u->n_kids && ok; i++) {
        const up_child *c = &u->kids[i];
        if (c->role == UP_ROUTER) continue;
        int state = 0; /* 0 absent, 1 listed not ready, 2 ready */
        size_t k;
        json_t *e;
        json_array_foreach(insts, k, e) {
            const char *role = json_string_value(json_object_get(e, "role"));
            const char *a = json_string_value(json_object_get(e, "address"));
            if (!role || !a || strcmp(role, k_pool_roles[c->role]) || strcmp(a, c->http)) continue;
            state = json_is_true(json_object_get(e, "ready")) ? 2 : 1;
            break;
        }
        if (state < 2) {
            snprintf(why, wn, "%s (%s) is %s in the router's cluster view", c->name, c->http,
                     state ? "not ready" : "missing");
            ok = false;
        }
    }
    json_decref(root);
    return ok;
}

static up_outcome wait_ready(up_state *u, const up_child *router, double deadline) {
    char why[UP_ADDR_MAX * 2] = "not checked yet";
    for (;;) {
        up_outcome o = check_going(u);
        if (o != UP_GO_ON) return o;
        if (cluster_ready(u, router, why, sizeof why)) return UP_GO_ON;
        if (td_time_s() > deadline) {
            fprintf(stderr,
                    "tandem up: the cluster is not ready after %g s (--ready-timeout): %s\n",
                    u->a.ready_timeout, why);
            return UP_STOP_FAILED;
        }
        pump(u, UP_POLL_READY_MS);
    }
}

/* ---- stopping ---- */

static void kill_child(up_child *c, const char *why) {
    if (!child_running(c)) return;
    fprintf(stderr, "tandem up: killing %s (pid %ld): %s\n", c->name, (long)c->pid, why);
    kill(-c->pid, SIGKILL); /* its whole group: rank processes too */
    c->killed = true;
}

/* Stops the children role by role (router, decode, prefill): SIGTERM, then
 * SIGKILL after the drain timeout and a margin; a signal that comes while
 * stopping kills everything at once. Returns whether every child it stopped
 * exited 0 on its own (those that exited before are reported by the caller). */
static bool stop_all(up_state *u) {
    static const up_role k_order[] = {UP_ROUTER, UP_DECODE, UP_COLOCATED, UP_PREFILL};
    int signals_at_start = u->n_signals;
    bool forced = false;
    for (size_t s = 0; s < TD_ARRAY_SIZE(k_order); s++) {
        for (int i = 0; i < u->n_kids; i++) {
            up_child *c = &u->kids[i];
            if (c->role != k_order[s] || !child_running(c) || c->stopping) continue;
            c->stopping = true;
            kill(c->pid, SIGTERM);
        }
        double deadline = td_time_s() + u->a.drain_timeout + UP_STOP_MARGIN_S;
        for (;;) {
            bool waiting = false;
            for (int i = 0; i < u->n_kids; i++)
                waiting |= u->kids[i].role == k_order[s] && child_running(&u->kids[i]);
            if (!waiting) break;
            if (!forced && u->n_signals > signals_at_start) {
                forced = true;
                for (int i = 0; i < u->n_kids; i++) {
                    u->kids[i].stopping |= child_running(&u->kids[i]);
                    kill_child(&u->kids[i], "stopping at once");
                }
            } else if (td_time_s() > deadline) {
                for (int i = 0; i < u->n_kids; i++)
                    if (u->kids[i].role == k_order[s] && !u->kids[i].killed)
                        kill_child(&u->kids[i], "did not stop within the drain timeout");
            }
            pump(u, 100);
        }
    }
    bool clean = !forced;
    for (int i = 0; i < u->n_kids; i++) {
        up_child *c = &u->kids[i];
        TD_ASSERT(!child_running(c));
        if (!c->stopping || (!c->killed && WIFEXITED(c->status) && WEXITSTATUS(c->status) == 0))
            continue;
        char how[96];
        describe_status(c->status, how, sizeof how);
        fprintf(stderr, "tandem up: %s (pid %ld) %s while stopping\n", c->name, (long)c->pid, how);
        clean = false;
    }
    return clean;
}

/* What the children wrote last, once they are gone. */
static void drain_pipes(up_state *u) {
    for (int i = 0; i < u->n_kids; i++) {
        up_child *c = &u->kids[i];
        if (c->out.fd >= 0) pipe_read(c, &c->out);
        if (c->err.fd >= 0) pipe_read(c, &c->err);
        if (c->out.len) pipe_line(c, &c->out, c->out.buf, c->out.len);
        if (c->err.len) pipe_line(c, &c->err, c->err.buf, c->err.len);
        if (c->out.fd >= 0) close(c->out.fd);
        if (c->err.fd >= 0) close(c->err.fd);
        c->out.fd = c->err.fd = -1;
    }
}

/* ---- the command ---- */

/* Directory of the running binary, where the services are installed too. */
static bool find_bin_dir(up_state *u) {
    char exe[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n <= 0) {
        fprintf(stderr, "tandem up: cannot read /proc/self/exe: %s\n", strerror(errno));
        return false;
    }
    exe[n] = 0;
    char *slash = strrchr(exe, '/');
    TD_ASSERT(slash);
    *slash = 0;
    snprintf(u->bin_dir, sizeof u->bin_dir, "%s", slash == exe ? "/" : exe);
    for (size_t i = 0; i < TD_ARRAY_SIZE(k_bins); i++) {
        char path[PATH_MAX + 32];
        snprintf(path, sizeof path, "%s/%s", u->bin_dir, k_bins[i]);
        if (access(path, X_OK) != 0) {
            fprintf(stderr, "tandem up: %s not found next to tandem (%s: %s)\n", k_bins[i], path,
                    strerror(errno));
            return false;
        }
    }
    return true;
}

/* Stdin, stdout and stderr open, so a pipe never lands on them. */
static void ensure_std_fds(void) {
    for (int fd = 0; fd < 3; fd++)
        if (fcntl(fd, F_GETFD) < 0) {
            int nfd = open("/dev/null", fd ? O_WRONLY : O_RDONLY);
            if (nfd >= 0 && nfd != fd) close(nfd);
        }
}

/* --chat: one chat completion through the router, the answer on stdout. */
static up_outcome chat_once(up_state *u, const up_child *router) {
    char addr[UP_ADDR_MAX + 16], url[UP_ADDR_MAX + 64];
    router_connect_addr(router, addr, sizeof addr);
    snprintf(url, sizeof url, "http://%s/v1/chat/completions", addr);
    json_t *req =
        json_pack("{s:[{s:s,s:s}],s:I,s:f}", "messages", "role", "user", "content", u->a.chat,
                  "max_tokens", (json_int_t)u->a.max_tokens, "temperature", 0.0);
    char *body = req ? json_dumps(req, JSON_COMPACT) : NULL;
    json_decref(req);
    td_httpc_req rq = {
        .url = url, .json_body = body, .timeout_ms = 600000, .max_body = UP_HTTP_BODY_MAX};
    td_httpc_reply reply = {0};
    bool have_body = body != NULL;
    td_status hst = have_body ? td_httpc_do(&rq, &reply) : TD_ERR_NOMEM;
    long code = reply.code;
    free(body);
    json_t *js = reply.body ? json_loads(reply.body, 0, NULL) : NULL;
    const char *answer = json_string_value(json_object_get(
        json_object_get(json_array_get(json_object_get(js, "choices"), 0), "message"), "content"));
    up_outcome o = UP_STOP_DONE;
    if (hst != TD_OK) {
        fprintf(stderr, "tandem up: the chat request failed: %s\n",
                have_body ? reply.err : "out of memory");
        o = UP_STOP_FAILED;
    } else if (code != 200 || !answer) {
        fprintf(stderr, "tandem up: the chat request got HTTP %ld: %.500s\n", code,
                reply.body ? reply.body : "");
        o = UP_STOP_FAILED;
    } else {
        json_t *usage = json_object_get(js, "usage");
        printf("%s\n", answer);
        fflush(stdout);
        fprintf(stderr,
                "tandem up: answered through the router (%lld prompt, %lld output tokens)\n",
                (long long)json_integer_value(json_object_get(usage, "prompt_tokens")),
                (long long)json_integer_value(json_object_get(usage, "completion_tokens")));
    }
    json_decref(js);
    td_httpc_reply_free(&reply);
    return o;
}

/* Ready: the --chat request, or serving until a signal or a child's exit. */
static up_outcome serve_until_stopped(up_state *u, up_child *router) {
    u->ready = true;
    if (u->a.chat) return chat_once(u, router);
    for (;;) {
        up_outcome o = check_going(u);
        if (o != UP_GO_ON) return o;
        pump(u, 1000);
    }
}

static up_outcome run_colocated(up_state *u) {
    double deadline = td_time_s() + u->a.ready_timeout;
    for (int i = 0; i < u->a.n_colocated; i++)
        if (!start_child(u, UP_COLOCATED, i, NULL)) return UP_STOP_FAILED;
    up_outcome o = wait_listening(u, 0, deadline);
    if (o != UP_GO_ON) return o;
    char decodes[UP_MAX_POOL * (UP_ADDR_MAX + 1)];
    join_addrs(u, UP_COLOCATED, decodes, sizeof decodes);
    const char *extra[] = {"--decode", decodes, NULL};
    up_child *router = start_child(u, UP_ROUTER, 0, extra);
    if (!router) return UP_STOP_FAILED;
    if ((o = wait_listening(u, u->n_kids - 1, deadline)) != UP_GO_ON) return o;
    if ((o = wait_ready(u, router, deadline)) != UP_GO_ON) return o;
    printf("tandem up: ready http=http://%s grpc=%s (colocated %ld)\n", router->http, router->grpc,
           u->a.n_colocated);
    fflush(stdout);
    return serve_until_stopped(u, router);
}

static up_outcome run_cluster(up_state *u) {
    if (u->a.n_colocated > 0) return run_colocated(u);
    double deadline = td_time_s() + u->a.ready_timeout;
    for (int i = 0; i < u->a.n_prefill; i++)
        if (!start_child(u, UP_PREFILL, i, NULL)) return UP_STOP_FAILED;
    up_outcome o = wait_listening(u, 0, deadline);
    if (o != UP_GO_ON) return o;

    char prefills[UP_MAX_POOL * (UP_ADDR_MAX + 1)], decodes[UP_MAX_POOL * (UP_ADDR_MAX + 1)];
    join_addrs(u, UP_PREFILL, prefills, sizeof prefills);
    int first_decode = u->n_kids;
    for (int i = 0; i < u->a.n_decode; i++) {
        const char *extra[] = {"--prefill", prefills, NULL};
        if (!start_child(u, UP_DECODE, i, extra)) return UP_STOP_FAILED;
    }
    if ((o = wait_listening(u, first_decode, deadline)) != UP_GO_ON) return o;

    join_addrs(u, UP_DECODE, decodes, sizeof decodes);
    const char *extra[] = {"--prefill", prefills, "--decode", decodes, NULL};
    up_child *router = start_child(u, UP_ROUTER, 0, extra);
    if (!router) return UP_STOP_FAILED;
    if ((o = wait_listening(u, u->n_kids - 1, deadline)) != UP_GO_ON) return o;
    if ((o = wait_ready(u, router, deadline)) != UP_GO_ON) return o;

    printf("tandem up: ready http=http://%s grpc=%s (prefill %ld, decode %ld)\n", router->http,
           router->grpc, u->a.n_prefill, u->a.n_decode);
    fflush(stdout);
    return serve_until_stopped(u, router);
}

int td_cmd_up(int argc, char **argv) {
    up_state *u = calloc(1, sizeof *u);
    if (!u) {
        fprintf(stderr, "tandem up: out of memory\n");
        return 1;
    }
    u->sfd = -1;
    u->a = (up_args){.n_prefill = 1,
                     .n_decode = 1,
                     .port = 8000,
                     .grpc_port = 50051,
                     .host = "127.0.0.1",
                     .ready_timeout = 300,
                     .drain_timeout = 30,
                     .max_tokens = 128};
    int rc = parse_args(argc, argv, &u->a);
    if (rc) {
        free(u);
        return rc < 0 ? 0 : rc;
    }
    if (u->a.n_colocated > 0 && u->a.pools_given) {
        fprintf(stderr, "tandem up: --colocated runs no prefill or decode pool: give it alone\n");
        free(u);
        return 2;
    }
    long n_inst = u->a.n_colocated > 0 ? u->a.n_colocated : u->a.n_prefill + u->a.n_decode;
    if (!u->a.threads) {
        long cores = u->a.n_cpus > 0 ? u->a.n_cpus : sysconf(_SC_NPROCESSORS_ONLN);
        u->a.threads = TD_MAX(1L, cores / n_inst);
    }
    const char *model = u->a.model ? u->a.model : td_default_model_path();
    if (access(model, R_OK) != 0) {
        fprintf(stderr, "tandem up: cannot read the model %s: %s%s\n", model, strerror(errno),
                u->a.model ? "" : " (run scripts/setup.sh, or give --model PATH)");
        free(u);
        return 2;
    }
    if (u->a.token_file) {
        snprintf(u->token_path, sizeof u->token_path, "%s", u->a.token_file);
        if (!(u->token = td_cli_read_secret(u->token_path))) {
            rc = 2;
            goto free_state;
        }
    }
    rc = 1;
    if (!find_bin_dir(u)) goto free_state;
    ensure_std_fds();
    if (!u->a.token_file && !make_token_file(u)) goto remove_token;

    /* Signals arrive on the signalfd; the children get a clean mask and
     * default dispositions (posix_spawn attributes). */
    sigset_t sigs, old;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGINT);
    sigaddset(&sigs, SIGTERM);
    sigaddset(&sigs, SIGCHLD);
    pthread_sigmask(SIG_BLOCK, &sigs, &old);
    struct sigaction ign = {.sa_handler = SIG_IGN}, old_pipe;
    sigaction(SIGPIPE, &ign, &old_pipe);
    u->sfd = signalfd(-1, &sigs, SFD_NONBLOCK | SFD_CLOEXEC);
    if (u->sfd < 0) {
        fprintf(stderr, "tandem up: signalfd: %s\n", strerror(errno));
        goto restore_signals;
    }
    if (u->a.n_colocated > 0)
        fprintf(stderr,
                "tandem up: starting %ld colocated instance(s), %ld thread(s) each, and the "
                "router (binaries in %s)\n",
                u->a.n_colocated, u->a.threads, u->bin_dir);
    else
        fprintf(stderr,
                "tandem up: starting %ld prefill and %ld decode instance(s), %ld thread(s) "
                "each, and the router (binaries in %s)\n",
                u->a.n_prefill, u->a.n_decode, u->a.threads, u->bin_dir);

    up_outcome o = run_cluster(u);
    bool clean = stop_all(u);
    rc = (o == UP_STOP_SIGNAL || o == UP_STOP_DONE) && clean ? 0 : 1;
    drain_pipes(u);
    fprintf(stderr, "tandem up: stopped%s\n", rc ? " (with errors)" : "");
restore_signals:
    if (u->sfd >= 0) close(u->sfd);
    sigaction(SIGPIPE, &old_pipe, NULL);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
remove_token:
    if (u->token_owned && unlink(u->token_path) != 0)
        fprintf(stderr, "tandem up: cannot remove %s: %s\n", u->token_path, strerror(errno));
free_state:
    free(u->token);
    free(u);
    return rc;
}
