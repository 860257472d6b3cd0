#include "base.h"

#include <stdatomic.h>
#include <string.h>
#include <strings.h>
#include <sys/random.h>
#include <time.h>

const char *td_status_str(td_status st) {
    switch (st) {
    case TD_OK: return "ok";
    case TD_ERR_INVALID: return "invalid argument";
    case TD_ERR_NOMEM: return "out of memory";
    case TD_ERR_IO: return "I/O error";
    case TD_ERR_FORMAT: return "malformed input";
    case TD_ERR_UNSUPPORTED: return "unsupported";
    case TD_ERR_NOT_FOUND: return "not found";
    case TD_ERR_RANGE: return "out of range";
    case TD_ERR_INTERNAL: return "internal error";
    case TD_ERR_UNAVAILABLE: return "unavailable";
    case TD_ERR_CANCELLED: return "cancelled";
    case TD_ERR_TIMEOUT: return "timed out";
    case TD_AGAIN: return "try again";
    case TD_NO_KV_BLOCK: return "no free KV block";
    default: return "unknown status";
    }
}

static _Atomic int g_log_level = -1;

static td_log_level level_from_env(void) {
    const char *s = getenv("TD_LOG_LEVEL");
    if (!s) return TD_LOG_INFO;
    static const char *names[] = {"debug", "info", "warn", "error", "none"};
    for (int i = 0; i < (int)TD_ARRAY_SIZE(names); i++)
        if (strcasecmp(s, names[i]) == 0) return (td_log_level)i;
    return TD_LOG_INFO;
}

void td_log_set_level(td_log_level level) { atomic_store(&g_log_level, (int)level); }

td_log_level td_log_get_level(void) {
    int l = atomic_load(&g_log_level);
    if (l < 0) {
        l = (int)level_from_env();
        atomic_store(&g_log_level, l);
    }
    return (td_log_level)l;
}

void td_log(td_log_level level, const char *func, const char *fmt, ...) {
    if (level < td_log_get_level()) return;
    static const char tags[] = "DIWE";
    char small[1024], *msg = small;
    va_list ap, again;
    va_start(ap, fmt);
    va_copy(again, ap);
    int need = vsnprintf(small, sizeof small, fmt, ap);
    va_end(ap);
    /* a longer message (a JSON record) whole, in one write, where memory allows */
    if (need >= (int)sizeof small && (msg = malloc((size_t)need + 1)))
        vsnprintf(msg, (size_t)need + 1, fmt, again);
    else
        msg = small;
    va_end(again);
    size_t n = strlen(msg);
    while (n > 0 && msg[n - 1] == '\n') msg[--n] = '\0';
    fprintf(stderr, "%c %s: %s\n", tags[level < 4 ? level : 3], func, msg);
    if (msg != small) free(msg);
}

void td_abort(const char *file, int line, const char *msg) {
    fprintf(stderr, "%s:%d: TD_ASSERT(%s) failed\n", file, line, msg);
    fflush(stderr);
    abort();
}

uint64_t td_time_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

double td_time_s(void) { return (double)td_time_ns() * 1e-9; }

uint64_t td_mem_available(void) {
    FILE *f = fopen("/proc/meminfo", "r");
    if (!f) return 0;
    char line[256];
    unsigned long long kib = 0;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "MemAvailable: %llu kB", &kib) == 1) break;
    fclose(f);
    return (uint64_t)kib * 1024u;
}

void td_cond_init_monotonic(pthread_cond_t *cv) {
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(cv, &ca);
    pthread_condattr_destroy(&ca);
}

struct timespec td_deadline_after(double seconds) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    int64_t ns = ts.tv_nsec + (seconds > 0 ? (int64_t)(seconds * 1e9) : 0);
    ts.tv_sec += (time_t)(ns / 1000000000);
    ts.tv_nsec = (long)(ns % 1000000000);
    return ts;
}

uint64_t td_random_u64(void) {
    uint64_t x = 0;
    if (getrandom(&x, sizeof x, GRND_NONBLOCK) != (ssize_t)sizeof x) {
        static atomic_uint_fast64_t calls;
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        x = (uint64_t)ts.tv_sec * 1000000007ull ^ (uint64_t)ts.tv_nsec ^
            (atomic_fetch_add(&calls, 1) << 32);
        /* splitmix64 finaliser */
        x += 0x9E3779B97F4A7C15ull;
        x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
        x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
        x ^= x >> 31;
    }
    return x ? x : 1;
}

bool td_secret_eq(const void *secret, size_t sn, const void *got, size_t gn) {
    const unsigned char *a = secret, *b = got;
    size_t m = TD_MAX(sn, gn);
    unsigned diff = sn != gn;
    for (size_t i = 0; i < m; i++) diff |= (unsigned)((i < sn ? a[i] : 0) ^ (i < gn ? b[i] : 0));
    return diff == 0;
}
