/* td-xfer-peer: a test harness that plays a KV-transfer peer (possibly a
 * lying one) on the real UCX channel (common/transfer/ucx.h), for the
 * bad-peer integration tests (tests/integration/test_disagg_bad_peer.py).
 *
 *   td-xfer-peer [--region-bytes N]
 *
 * It creates a td_ucx, allocates a region of N bytes (default 1 MiB) with
 * td_ucx_mem_alloc, fills it with a guard pattern (byte i holds guard(i))
 * and prints one JSON line on stdout:
 *   {"address": HEX, "rkey": HEX, "base": N, "bytes": N}
 * (address and rkey are the framed blobs td_ucx returns). Then it reads
 * commands from stdin, one per line, and answers each with one JSON line
 * ({"ok": true, ...} or {"ok": false, "error": "..."}):
 *   connect HEX_WORKER_ADDRESS   endpoint to that worker (replaces the last)
 *   send HEX_BYTES               one active message on the endpoint
 *   sendfile PATH                the same with the bytes of a file
 *   allow OFFSET LEN             adds a window of the region that may change
 *   allow clear                  no window
 *   reset                        the guard pattern again over the whole region
 *   check                        {"guard_ok", "bad_bytes", "first_bad",
 *                                 "window_bytes", "window_changed", "window_hash"}:
 *                                 whether every byte outside the windows still
 *                                 holds the guard, and the windows' XXH3-64
 *   recv TIMEOUT_MS              waits up to TIMEOUT_MS for a first message,
 *                                then {"msgs": [HEX, ...], "ep_errors": N}: every
 *                                control message received since the last recv
 *   quit
 * Bad input is an error line, never a crash. Logs go to stderr. */
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <xxhash.h>

#include "common/base/base.h"
#include "common/transfer/ucx.h"

#define MAX_LINE    ((size_t)96 << 20) /* hex of a message a little over 32 MiB */
#define MAX_WINDOWS 4096

typedef struct {
    uint8_t *data;
    size_t len;
} blob;

typedef struct {
    uint64_t off, len;
} window;

typedef struct {
    td_ucx *u;
    td_ucx_mem *mem;
    uint8_t *base;
    size_t bytes;
    td_ucx_ep *ep;
    window win[MAX_WINDOWS];
    int n_win;
    pthread_mutex_t mu; /* the inbox */
    pthread_cond_t cv;
    blob *inbox;
    size_t n_inbox, cap_inbox;
    uint64_t ep_errors;
} peer;

static uint8_t guard(size_t i) {
    uint64_t v = (uint64_t)i * 0x9e3779b97f4a7c15ull;
    return (uint8_t)((v >> 56) ^ 0xa5);
}

static void fill_guard(peer *p) {
    for (size_t i = 0; i < p->bytes; i++) p->base[i] = guard(i);
}

/* ------------------------------------------------------------ callbacks */

static void on_msg(void *ctx, const uint8_t *data, size_t len) {
    peer *p = ctx;
    uint8_t *copy = malloc(len ? len : 1);
    if (!copy) return;
    if (len) memcpy(copy, data, len);
    pthread_mutex_lock(&p->mu);
    if (p->n_inbox == p->cap_inbox) {
        size_t cap = p->cap_inbox ? 2 * p->cap_inbox : 16;
        blob *v = realloc(p->inbox, cap * sizeof *v);
        if (!v) {
            pthread_mutex_unlock(&p->mu);
            free(copy);
            return;
        }
        p->inbox = v;
        p->cap_inbox = cap;
    }
    p->inbox[p->n_inbox++] = (blob){copy, len};
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
}

static void on_error(void *ctx, td_ucx_ep *ep, td_status why) {
    peer *p = ctx;
    TD_UNUSED(ep);
    TD_UNUSED(why);
    pthread_mutex_lock(&p->mu);
    p->ep_errors++;
    pthread_mutex_unlock(&p->mu);
}

/* ---------------------------------------------------------------- output */

static void put_hex(const uint8_t *b, size_t n) {
    static const char d[] = "0123456789abcdef";
    for (size_t i = 0; i < n; i++) {
        putchar(d[b[i] >> 4]);
        putchar(d[b[i] & 15]);
    }
}

/* An error line; msg must not need JSON escaping beyond what is done here. */
static void reply_err(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void reply_err(const char *fmt, ...) {
    char buf[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    fputs("{\"ok\":false,\"error\":\"", stdout);
    for (const char *s = buf; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\')
            printf("\\%c", c);
        else if (c < 0x20 || c > 0x7e)
            printf("\\u%04x", c);
        else
            putchar(c);
    }
    fputs("\"}\n", stdout);
    fflush(stdout);
}

static void reply_ok(void) {
    fputs("{\"ok\":true}\n", stdout);
    fflush(stdout);
}

/* --------------------------------------------------------------- parsing */

static int hexval(int c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* Decodes hex (even length, nothing else) into a malloc'd buffer. */
static bool parse_hex(const char *s, blob *out) {
    size_t n = strlen(s);
    if (n % 2) return false;
    uint8_t *b = malloc(n / 2 ? n / 2 : 1);
    if (!b) return false;
    for (size_t i = 0; i < n / 2; i++) {
        int hi = hexval((unsigned char)s[2 * i]), lo = hexval((unsigned char)s[2 * i + 1]);
        if (hi < 0 || lo < 0) {
            free(b);
            return false;
        }
        b[i] = (uint8_t)(hi << 4 | lo);
    }
    out->data = b;
    out->len = n / 2;
    return true;
}

static bool parse_u64(const char *s, uint64_t *v) {
    if (!s || !*s || *s == '-') return false;
    char *end;
    errno = 0;
    unsigned long long x = strtoull(s, &end, 0);
    if (errno || *end) return false;
    *v = x;
    return true;
}

static bool read_file(const char *path, blob *out) {
    FILE *f = fopen(path, "rb");
    if (!f) return false;
    size_t cap = 1 << 16, n = 0;
    uint8_t *b = malloc(cap);
    while (b) {
        if (n == cap) {
            uint8_t *nb = cap < ((size_t)1 << 30) ? realloc(b, 2 * cap) : NULL;
            if (!nb) {
                free(b);
                b = NULL;
                break;
            }
            b = nb;
            cap *= 2;
        }
        size_t r = fread(b + n, 1, cap - n, f);
        n += r;
        if (r == 0) break;
    }
    bool ok = b && !ferror(f);
    fclose(f);
    if (!ok) {
        free(b);
        return false;
    }
    out->data = b;
    out->len = n;
    return true;
}

/* -------------------------------------------------------------- commands */

static void cmd_connect(peer *p, const char *arg) {
    blob a;
    if (!arg || !parse_hex(arg, &a)) {
        reply_err("connect: expected the worker address in hex");
        return;
    }
    if (p->ep) td_ucx_ep_close_wait(p->ep, 2000);
    p->ep = NULL;
    td_status st = td_ucx_ep_create(p->u, a.data, a.len, p, &p->ep);
    free(a.data);
    if (st != TD_OK) {
        reply_err("connect: %s", td_status_str(st));
        return;
    }
    char tl[256];
    td_ucx_ep_transports(p->ep, tl, sizeof tl);
    printf("{\"ok\":true,\"transports\":\"");
    for (const char *s = tl; *s; s++)
        if (*s != '"' && *s != '\\' && (unsigned char)*s >= 0x20) putchar(*s);
    printf("\"}\n");
    fflush(stdout);
}

static void send_blob(peer *p, blob b) {
    if (!p->ep) {
        reply_err("send: not connected");
    } else {
        td_status st = td_ucx_send(p->ep, b.data, b.len);
        if (st != TD_OK)
            reply_err("send: %s", td_status_str(st));
        else
            reply_ok();
    }
    free(b.data);
}

static void cmd_allow(peer *p, char *arg) {
    if (arg && strcmp(arg, "clear") == 0) {
        p->n_win = 0;
        reply_ok();
        return;
    }
    char *len_s = arg ? strchr(arg, ' ') : NULL;
    if (len_s) *len_s++ = '\0';
    uint64_t off, len;
    if (!len_s || !parse_u64(arg, &off) || !parse_u64(len_s, &len)) {
        reply_err("allow: expected OFFSET LEN or clear");
        return;
    }
    if (off > p->bytes || len > p->bytes - off) {
        reply_err("allow: window [%" PRIu64 ", +%" PRIu64 ") outside the %zu-byte region", off, len,
                  p->bytes);
        return;
    }
    if (p->n_win == MAX_WINDOWS) {
        reply_err("allow: more than %d windows", MAX_WINDOWS);
        return;
    }
    p->win[p->n_win++] = (window){off, len};
    reply_ok();
}

static void cmd_check(peer *p) {
    /* Mark the windows, then walk the region once. */
    uint8_t *in = calloc(p->bytes ? p->bytes : 1, 1);
    if (!in) {
        reply_err("check: out of memory");
        return;
    }
    for (int w = 0; w < p->n_win; w++) memset(in + p->win[w].off, 1, p->win[w].len);
    uint64_t bad = 0, wbytes = 0, changed = 0;
    int64_t first_bad = -1;
    XXH3_state_t *h = XXH3_createState();
    if (!h) {
        free(in);
        reply_err("check: out of memory");
        return;
    }
    XXH3_64bits_reset(h);
    for (size_t i = 0; i < p->bytes; i++) {
        bool same = p->base[i] == guard(i);
        if (in[i]) {
            wbytes++;
            changed += !same;
        } else if (!same) {
            if (first_bad < 0) first_bad = (int64_t)i;
            bad++;
        }
    }
    for (int w = 0; w < p->n_win; w++)
        XXH3_64bits_update(h, p->base + p->win[w].off, (size_t)p->win[w].len);
    uint64_t hash = XXH3_64bits_digest(h);
    XXH3_freeState(h);
    free(in);
    printf("{\"ok\":true,\"guard_ok\":%s,\"bad_bytes\":%" PRIu64 ",\"first_bad\":%" PRId64
           ",\"window_bytes\":%" PRIu64 ",\"window_changed\":%" PRIu64
           ",\"window_hash\":\"%016" PRIx64 "\"}\n",
           bad ? "false" : "true", bad, first_bad, wbytes, changed, hash);
    fflush(stdout);
}

static void cmd_recv(peer *p, const char *arg) {
    uint64_t ms;
    if (!parse_u64(arg, &ms) || ms > 600000) {
        reply_err("recv: expected a timeout in ms (0 .. 600000)");
        return;
    }
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += (time_t)(ms / 1000);
    until.tv_nsec += (long)(ms % 1000) * 1000000L;
    if (until.tv_nsec >= 1000000000L) {
        until.tv_sec++;
        until.tv_nsec -= 1000000000L;
    }
    pthread_mutex_lock(&p->mu);
    while (p->n_inbox == 0)
        if (pthread_cond_timedwait(&p->cv, &p->mu, &until) == ETIMEDOUT) break;
    blob *in = p->inbox;
    size_t n = p->n_inbox;
    uint64_t errs = p->ep_errors;
    p->inbox = NULL;
    p->n_inbox = p->cap_inbox = 0;
    pthread_mutex_unlock(&p->mu);
    fputs("{\"ok\":true,\"msgs\":[", stdout);
    for (size_t i = 0; i < n; i++) {
        printf("%s\"", i ? "," : "");
        put_hex(in[i].data, in[i].len);
        putchar('"');
        free(in[i].data);
    }
    printf("],\"ep_errors\":%" PRIu64 "}\n", errs);
    fflush(stdout);
    free(in);
}

/* One command; false at quit. */
static bool command(peer *p, char *line) {
    char *arg = strchr(line, ' ');
    if (arg) *arg++ = '\0';
    if (strcmp(line, "quit") == 0) return false;
    if (strcmp(line, "connect") == 0) {
        cmd_connect(p, arg);
    } else if (strcmp(line, "send") == 0) {
        blob b;
        if (!arg || !parse_hex(arg, &b))
            reply_err("send: expected the message in hex");
        else
            send_blob(p, b);
    } else if (strcmp(line, "sendfile") == 0) {
        blob b;
        if (!arg || !read_file(arg, &b))
            reply_err("sendfile: cannot read %.200s", arg ? arg : "(no path)");
        else
            send_blob(p, b);
    } else if (strcmp(line, "allow") == 0) {
        cmd_allow(p, arg);
    } else if (strcmp(line, "reset") == 0) {
        fill_guard(p);
        reply_ok();
    } else if (strcmp(line, "check") == 0) {
        cmd_check(p);
    } else if (strcmp(line, "recv") == 0) {
        cmd_recv(p, arg);
    } else {
        reply_err("unknown command %.64s", line);
    }
    return true;
}

static void usage(void) { fprintf(stderr, "usage: td-xfer-peer [--region-bytes N]\n"); }

int main(int argc, char **argv) {
    td_ucx_env_init();
    uint64_t region = (uint64_t)1 << 20;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--region-bytes") == 0 && i + 1 < argc &&
            parse_u64(argv[i + 1], &region) && region >= 1 && region <= ((uint64_t)1 << 32)) {
            i++;
        } else {
            usage();
            return 2;
        }
    }
    static peer p;
    pthread_mutex_init(&p.mu, NULL);
    pthread_cond_init(&p.cv, NULL);
    td_ucx_params up = {.name = "xfer-peer", .on_msg = on_msg, .on_error = on_error, .ctx = &p};
    uint8_t *addr = NULL, *rkey = NULL;
    size_t addr_len = 0, rkey_len = 0;
    int rc = 1;
    if (td_ucx_create(&up, &p.u) != TD_OK) goto done;
    if (td_ucx_mem_alloc(p.u, (size_t)region, &p.mem) != TD_OK) goto done;
    p.base = td_ucx_mem_base(p.mem);
    p.bytes = (size_t)region;
    fill_guard(&p);
    if (td_ucx_mem_rkey(p.mem, &rkey, &rkey_len) != TD_OK ||
        td_ucx_address(p.u, &addr, &addr_len) != TD_OK)
        goto done;
    fputs("{\"address\":\"", stdout);
    put_hex(addr, addr_len);
    fputs("\",\"rkey\":\"", stdout);
    put_hex(rkey, rkey_len);
    printf("\",\"base\":%" PRIu64 ",\"bytes\":%zu}\n", (uint64_t)(uintptr_t)p.base, p.bytes);
    fflush(stdout);

    char *line = NULL;
    size_t cap = 0;
    ssize_t n;
    rc = 0;
    while ((n = getline(&line, &cap, stdin)) >= 0) {
        if ((size_t)n > MAX_LINE) {
            reply_err("line of %zd bytes (at most %zu)", n, MAX_LINE);
            continue;
        }
        while (n > 0 && (line[n - 1] == '\n' || line[n - 1] == '\r')) line[--n] = '\0';
        if (n == 0) continue;
        if (!command(&p, line)) break;
    }
    free(line);
done:
    if (rc) fprintf(stderr, "td-xfer-peer: UCX set-up failed\n");
    if (p.ep) td_ucx_ep_close_wait(p.ep, 2000);
    free(addr);
    free(rkey);
    td_ucx_mem_unmap(p.mem);
    td_ucx_destroy(p.u);
    for (size_t i = 0; i < p.n_inbox; i++) free(p.inbox[i].data);
    free(p.inbox);
    return rc;
}
