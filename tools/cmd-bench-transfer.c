/* tandem bench-transfer: put throughput of the KV migration channel
 * (common/transfer/ucx.h) between two processes, measured the way
 * `ucx_perftest -t ucp_put_bw -s SIZE -n ITERS -e` measures UCX's:
 * the client puts SIZE bytes back to back, at most --window outstanding,
 * from one buffer to one remote address (--spread N: over N slots of
 * SIZE bytes each) of a region the server allocated through the channel
 * (td_ucx_mem_alloc, as KV pools should be), flushes at the end, and reports bytes / time over the
 * timed iterations (after
 * --warmup untimed ones). Endpoints use peer error handling, as the
 * services do.
 *
 * The client starts the server itself (this binary again, role
 * "--role server"; UCX is not fork-safe, so it is spawned, not forked) and
 * learns its worker address, rkey and region over a pipe. At the end the
 * server hashes the region and the client checks it against what it put. */
#define _GNU_SOURCE /* pipe2 */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <jansson.h>
#include <xxhash.h>

#include "common/runtime/cli.h"
#include "common/transfer/ucx.h"
#include "tools.h"

extern char **environ;

#define BT_MAX_WINDOW 1024
#define BT_SERVER_OUT 3 /* fds of the server: to the client, from the client */
#define BT_SERVER_IN  4

enum { T_SIZE, T_ITERS, T_WARMUP, T_WINDOW, T_SPREAD, T_TARGET, T_JSON, T_ROLE, T_BYTES, T_N };
static const td_opt k_bt_opts[T_N] = {
    [T_SIZE] = {"size", 's', "SIZE", "bytes per put (default 1048576)"},
    [T_ITERS] = {"iters", 'n', "N", "timed puts (default 1000)"},
    [T_WARMUP] = {"warmup", 'w', "N", "untimed puts first (default 100)"},
    [T_WINDOW] = {"window", 0, "N", "puts outstanding at most (default 16)"},
    [T_SPREAD] = {"spread", 0, "N",
                  "put i goes from and to slot i % N of SIZE x N-byte regions\n"
                  "(default 1: every put from one buffer to one remote address,\n"
                  "as ucx_perftest does; KV blocks spread over more memory)"},
    [T_TARGET] = {"target", 0, "alloc|map",
                  "the server's region: allocated through the channel\n"
                  "(td_ucx_mem_alloc, default) or plain pages registered with\n"
                  "td_ucx_mem_map (on one host with error handling UCX then\n"
                  "emulates the puts with active messages)"},
    [T_JSON] = {"json", 0, NULL, "one JSON object on stdout instead of the table"},
    /* internal: the server process and its region */
    [T_ROLE] = {"role", 0, "server", NULL},
    [T_BYTES] = {"bytes", 0, "N", NULL},
};

static void bt_usage(FILE *f, void *ctx) {
    TD_UNUSED(ctx);
    fprintf(f,
            "usage: tandem bench-transfer [-s SIZE] [-n ITERS] [-w N] [--window N] [--spread N]\n"
            "                             [--target alloc|map] [--json]\n"
            "\n"
            "Put throughput of the KV transfer channel between this process and a server\n"
            "process it starts, measured like `ucx_perftest -t ucp_put_bw -s SIZE -n ITERS\n"
            "-e`: puts of SIZE bytes back to back, at most N outstanding, one flush at the\n"
            "end; GB/s = SIZE x ITERS / seconds. UCX's own variables apply (UCX_TLS, ...).\n"
            "\n");
    td_opts_print(f, k_bt_opts, T_N);
}

typedef struct {
    long size, iters, warmup, window, spread, server_bytes;
    bool json, server, map;
} bt_args;

static bool bt_set(void *ctx, int i, const char *val, bool *printed) {
    bt_args *a = ctx;
    TD_UNUSED(printed);
    switch (i) {
    case T_SIZE: return td_cli_parse_long(val, 1, 1L << 30, &a->size);
    case T_ITERS: return td_cli_parse_long(val, 1, 1L << 40, &a->iters);
    case T_WARMUP: return td_cli_parse_long(val, 0, 1L << 40, &a->warmup);
    case T_WINDOW: return td_cli_parse_long(val, 1, BT_MAX_WINDOW, &a->window);
    case T_SPREAD: return td_cli_parse_long(val, 1, BT_MAX_WINDOW, &a->spread);
    case T_TARGET: return (a->map = !strcmp(val, "map")) || !strcmp(val, "alloc");
    case T_JSON: a->json = true; return true;
    case T_ROLE: return a->server = !strcmp(val, "server");
    case T_BYTES: return td_cli_parse_long(val, 1, 1L << 40, &a->server_bytes);
    }
    return false;
}

static bool bt_write(int fd, const void *p, size_t n) {
    const uint8_t *b = p;
    while (n) {
        ssize_t w = write(fd, b, n);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return false;
        b += w;
        n -= (size_t)w;
    }
    return true;
}

static bool bt_read(int fd, void *p, size_t n) {
    uint8_t *b = p;
    while (n) {
        ssize_t r = read(fd, b, n);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return false;
        b += r;
        n -= (size_t)r;
    }
    return true;
}

/* ---- server ---- */

/* Allocates `bytes` through the channel (map: plain pages registered with
 * td_ucx_mem_map instead), sends {address length, rkey length, base, bytes, address,
 * rkey}, then answers each u64 n from the client with XXH3-64 of the
 * region's first n bytes until the client closes its end. */
static int bt_server(size_t bytes, bool map) {
    td_ucx_params prm = {.name = "bench-transfer server"};
    td_ucx *u = NULL;
    td_ucx_mem *m = NULL;
    uint8_t *addr = NULL, *rkey = NULL;
    size_t alen = 0, rlen = 0;
    int rc = 1;
    uint8_t *buf = NULL, *plain = NULL;
    if (map && posix_memalign((void **)&plain, 4096, bytes) != 0) return 1;
    if (td_ucx_create(&prm, &u) != TD_OK ||
        (map ? td_ucx_mem_map(u, plain, bytes, &m) : td_ucx_mem_alloc(u, bytes, &m)) != TD_OK ||
        td_ucx_address(u, &addr, &alen) != TD_OK || td_ucx_mem_rkey(m, &rkey, &rlen) != TD_OK)
        goto out;
    buf = map ? plain : td_ucx_mem_base(m);
    memset(buf, 0, bytes);
    uint64_t hdr[4] = {alen, rlen, (uint64_t)(uintptr_t)buf, bytes};
    if (!bt_write(BT_SERVER_OUT, hdr, sizeof hdr) || !bt_write(BT_SERVER_OUT, addr, alen) ||
        !bt_write(BT_SERVER_OUT, rkey, rlen))
        goto out;
    uint64_t n;
    while (bt_read(BT_SERVER_IN, &n, sizeof n)) {
        uint64_t h = XXH3_64bits(buf, TD_MIN(n, (uint64_t)bytes));
        if (!bt_write(BT_SERVER_OUT, &h, sizeof h)) break;
    }
    rc = 0;
out:
    free(addr);
    free(rkey);
    td_ucx_mem_unmap(m);
    td_ucx_destroy(u);
    free(plain);
    return rc;
}

/* ---- client ---- */

typedef struct {
    td_ucx_ops ops;
    atomic_bool busy;
} bt_slot;

static atomic_int g_bt_error = TD_OK;

static void bt_slot_done(td_ucx_ops *ops, td_status st) {
    bt_slot *s = ops->ctx;
    if (st != TD_OK) {
        int expected = TD_OK;
        atomic_compare_exchange_strong(&g_bt_error, &expected, st);
    }
    atomic_store_explicit(&s->busy, false, memory_order_release);
}

static void bt_wait_free(bt_slot *s) {
    while (atomic_load_explicit(&s->busy, memory_order_acquire)) sched_yield();
}

/* n puts of size bytes, put i from src + (i % spread) * size to the same
 * offset of the remote region, at most window outstanding, then a flush;
 * false on an error. */
static bool bt_run(td_ucx_ep *ep, td_ucx_rkey *rk, const uint8_t *src, size_t size, long n,
                   int window, int spread, bt_slot *slots) {
    for (long i = 0; i < n; i++) {
        bt_slot *s = &slots[i % window];
        size_t off = (size_t)(i % spread) * size;
        bt_wait_free(s);
        if (atomic_load(&g_bt_error) != TD_OK) return false;
        atomic_store(&s->busy, true);
        td_ucx_ops_init(&s->ops, bt_slot_done, s);
        td_status st = td_ucx_put(ep, rk, src + off, size, off, &s->ops);
        td_ucx_ops_seal(&s->ops);
        if (st != TD_OK) {
            fprintf(stderr, "tandem bench-transfer: put: %s\n", td_status_str(st));
            return false;
        }
    }
    bt_slot fl = {0};
    atomic_store(&fl.busy, true);
    td_ucx_ops_init(&fl.ops, bt_slot_done, &fl);
    td_status st = td_ucx_flush(ep, &fl.ops);
    td_ucx_ops_seal(&fl.ops);
    bt_wait_free(&fl);
    for (int k = 0; k < window; k++) bt_wait_free(&slots[k]);
    if (st != TD_OK || atomic_load(&g_bt_error) != TD_OK) {
        fprintf(stderr, "tandem bench-transfer: transfer failed: %s\n",
                td_status_str(st != TD_OK ? st : atomic_load(&g_bt_error)));
        return false;
    }
    return true;
}

static pid_t bt_spawn_server(size_t bytes, bool map, int *to_server, int *from_server) {
    int a[2], b[2]; /* a: server -> client, b: client -> server */
    if (pipe2(a, O_CLOEXEC) != 0) return -1;
    if (pipe2(b, O_CLOEXEC) != 0) {
        close(a[0]);
        close(a[1]);
        return -1;
    }
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, a[1], BT_SERVER_OUT);
    posix_spawn_file_actions_adddup2(&fa, b[0], BT_SERVER_IN);
    char bytes_s[32];
    snprintf(bytes_s, sizeof bytes_s, "%zu", bytes);
    char *argv[] = {"tandem",   "bench-transfer",      "--role", "server", "--bytes", bytes_s,
                    "--target", map ? "map" : "alloc", NULL};
    pid_t pid;
    int e = posix_spawn(&pid, "/proc/self/exe", &fa, NULL, argv, environ);
    posix_spawn_file_actions_destroy(&fa);
    close(a[1]);
    close(b[0]);
    if (e != 0) {
        fprintf(stderr, "tandem bench-transfer: spawning the server: %s\n", strerror(e));
        close(a[0]);
        close(b[1]);
        return -1;
    }
    *from_server = a[0];
    *to_server = b[1];
    return pid;
}

/* Waits for the server to exit after its input closed (killed after 10 s);
 * whether it exited with status 0. */
static bool bt_reap(pid_t pid) {
    double t0 = td_time_s();
    int wst = 0;
    while (waitpid(pid, &wst, WNOHANG) == 0) {
        if (td_time_s() - t0 > 10) {
            fprintf(stderr, "tandem bench-transfer: the server did not exit; killing it\n");
            kill(pid, SIGKILL);
            waitpid(pid, &wst, 0);
            return false;
        }
        usleep(2000);
    }
    if (WIFEXITED(wst) && WEXITSTATUS(wst) == 0) return true;
    fprintf(stderr, "tandem bench-transfer: the server failed (wait status %#x)\n", wst);
    return false;
}

int td_cmd_bench_transfer(int argc, char **argv) {
    bt_args ba = {.size = 1 << 20, .iters = 1000, .warmup = 100, .window = 16, .spread = 1};
    td_optset set = {k_bt_opts, T_N, bt_set, &ba};
    int orc = td_opts_parse("tandem bench-transfer", argc, argv, &set, 1, bt_usage, NULL);
    if (orc) return orc == 1 ? 0 : 2;
    long size = ba.size, iters = ba.iters, warmup = ba.warmup, window = ba.window,
         spread = ba.spread, server_bytes = ba.server_bytes;
    bool json = ba.json, server = ba.server, map = ba.map;
    if (server) return server_bytes > 0 ? bt_server((size_t)server_bytes, map) : 2;
    if ((unsigned long)size * (unsigned long)spread > (8UL << 30)) {
        fprintf(stderr, "tandem bench-transfer: SIZE x spread over 8 GiB\n");
        return 2;
    }
    signal(SIGPIPE, SIG_IGN);

    size_t region = (size_t)size * (size_t)spread;
    int to_server = -1, from_server = -1, rc = 1;
    td_ucx *u = NULL;
    td_ucx_mem *m = NULL;
    td_ucx_ep *ep = NULL;
    td_ucx_rkey *rk = NULL;
    uint8_t *raddr = NULL, *rrkey = NULL, *src = NULL;
    bt_slot *slots = calloc((size_t)window, sizeof *slots);
    pid_t pid = bt_spawn_server(region, map, &to_server, &from_server);
    if (pid < 0 || !slots) goto out;

    uint64_t hdr[4];
    if (!bt_read(from_server, hdr, sizeof hdr) || hdr[0] == 0 || hdr[0] > 65536 || hdr[1] == 0 ||
        hdr[1] > 65536 || hdr[3] != region) {
        fprintf(stderr, "tandem bench-transfer: the server did not start\n");
        goto out;
    }
    raddr = malloc(hdr[0]);
    rrkey = malloc(hdr[1]);
    if (!raddr || !rrkey || !bt_read(from_server, raddr, hdr[0]) ||
        !bt_read(from_server, rrkey, hdr[1])) {
        fprintf(stderr, "tandem bench-transfer: the server's address did not arrive\n");
        goto out;
    }
    if (posix_memalign((void **)&src, 4096, region) != 0) {
        src = NULL;
        goto out;
    }
    uint64_t x = 0x243f6a8885a308d3ull;
    for (size_t i = 0; i < region; i++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        src[i] = (uint8_t)x;
    }
    td_ucx_params prm = {.name = "bench-transfer client"};
    if (td_ucx_create(&prm, &u) != TD_OK || td_ucx_mem_map(u, src, region, &m) != TD_OK ||
        td_ucx_ep_create(u, raddr, hdr[0], NULL, &ep) != TD_OK ||
        td_ucx_rkey_create(ep, rrkey, hdr[1], hdr[2], hdr[3], &rk) != TD_OK)
        goto out;
    char transports[256];
    td_ucx_ep_transports(ep, transports, sizeof transports);

    if (warmup > 0 && !bt_run(ep, rk, src, (size_t)size, warmup, (int)window, (int)spread, slots))
        goto out;
    double t0 = td_time_s();
    if (!bt_run(ep, rk, src, (size_t)size, iters, (int)window, (int)spread, slots)) goto out;
    double secs = td_time_s() - t0;

    /* what the server holds must be what was put */
    uint64_t puts = (uint64_t)warmup + (uint64_t)iters;
    uint64_t checked = (uint64_t)TD_MIN(puts, (uint64_t)spread) * (uint64_t)size, got;
    bool verified = bt_write(to_server, &checked, sizeof checked) &&
                    bt_read(from_server, &got, sizeof got) && got == XXH3_64bits(src, checked);
    if (!verified) fprintf(stderr, "tandem bench-transfer: the server's bytes differ\n");

    double bytes = (double)size * (double)iters;
    double gbps = bytes / secs / 1e9;
    double mibps = bytes / secs / (1024.0 * 1024.0);
    if (json) {
        json_t *o = json_object();
        json_object_set_new(o, "size", json_integer(size));
        json_object_set_new(o, "iters", json_integer(iters));
        json_object_set_new(o, "warmup", json_integer(warmup));
        json_object_set_new(o, "window", json_integer(window));
        json_object_set_new(o, "spread", json_integer(spread));
        json_object_set_new(o, "target", json_string(map ? "map" : "alloc"));
        json_object_set_new(o, "bytes", json_integer((json_int_t)size * (json_int_t)iters));
        json_object_set_new(o, "seconds", json_real(secs));
        json_object_set_new(o, "gbps", json_real(gbps));
        json_object_set_new(o, "mib_per_s", json_real(mibps));
        json_object_set_new(o, "transports", json_string(transports));
        json_object_set_new(o, "verified", json_boolean(verified));
        char *txt = json_dumps(o, JSON_INDENT(2));
        json_decref(o);
        if (txt) printf("%s\n", txt);
        free(txt);
    } else {
        printf("transports: %s\n", transports);
        printf("| %12s | %10s | %6s | %6s | %10s | %8s | %10s | %8s |\n", "size (B)", "iters",
               "window", "spread", "seconds", "GB/s", "MiB/s", "verified");
        printf(
            "|--------------|------------|--------|--------|------------|----------|------------|"
            "----------|\n");
        printf("| %12ld | %10ld | %6ld | %6ld | %10.4f | %8.3f | %10.1f | %8s |\n", size, iters,
               window, spread, secs, gbps, mibps, verified ? "yes" : "NO");
    }
    rc = verified ? 0 : 1;

out:
    td_ucx_rkey_destroy(rk);
    if (ep) td_ucx_ep_close_wait(ep, 5000);
    td_ucx_mem_unmap(m);
    td_ucx_destroy(u);
    if (to_server >= 0) close(to_server);
    if (from_server >= 0) close(from_server);
    if (pid > 0 && !bt_reap(pid)) rc = 1;
    free(raddr);
    free(rrkey);
    free(src);
    free(slots);
    return rc;
}
