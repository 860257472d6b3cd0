/* Tandem base: status codes, logging, assertions.
 *
 * Three error tiers (CONVENTIONS.md): TD_ASSERT for internal invariants
 * (always on, aborts), TD_*_CHECK for fatal library failures, and td_status
 * for everything an input, a peer or the environment can cause. */
#ifndef TD_BASE_H
#define TD_BASE_H

#include <pthread.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#ifdef __cplusplus
extern "C" {
#endif

/* 0 is success, negative values are errors, positive values are "try again"
 * conditions that the caller is expected to handle. */
typedef int td_status;

enum {
    TD_OK = 0,
    TD_ERR_INVALID = -1,     /* bad argument or request */
    TD_ERR_NOMEM = -2,       /* allocation failed */
    TD_ERR_IO = -3,          /* open/read/mmap failed */
    TD_ERR_FORMAT = -4,      /* malformed or lying file / message */
    TD_ERR_UNSUPPORTED = -5, /* valid but not supported (type, arch, ...) */
    TD_ERR_NOT_FOUND = -6,   /* missing key, tensor, file */
    TD_ERR_RANGE = -7,       /* value out of range (context overflow, ...) */
    TD_ERR_INTERNAL = -8,
    TD_ERR_UNAVAILABLE = -9, /* not ready, draining or shutting down */
    TD_ERR_CANCELLED = -10,  /* the request was cancelled */
    TD_ERR_TIMEOUT = -11,    /* a bounded wait ran out */
    TD_AGAIN = 1,            /* transient: retry later */
    TD_NO_KV_BLOCK = 2,      /* no free KV block right now */
};

/* Static string for a status code; never NULL. */
const char *td_status_str(td_status st);

typedef enum {
    TD_LOG_DEBUG = 0,
    TD_LOG_INFO = 1,
    TD_LOG_WARN = 2,
    TD_LOG_ERROR = 3,
    TD_LOG_NONE = 4,
} td_log_level;

/* Messages below `level` are dropped. Default TD_LOG_INFO, or the
 * TD_LOG_LEVEL environment variable (debug|info|warn|error|none).
 * Thread-safe: one line is written with a single stdio call. */
void td_log_set_level(td_log_level level);
td_log_level td_log_get_level(void);
void td_log(td_log_level level, const char *func, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

#define TD_LOG_DEBUG(...) td_log(TD_LOG_DEBUG, __func__, __VA_ARGS__)
#define TD_LOG_INFO(...)  td_log(TD_LOG_INFO, __func__, __VA_ARGS__)
#define TD_LOG_WARN(...)  td_log(TD_LOG_WARN, __func__, __VA_ARGS__)
#define TD_LOG_ERROR(...) td_log(TD_LOG_ERROR, __func__, __VA_ARGS__)

_Noreturn void td_abort(const char *file, int line, const char *msg);

/* Internal invariant; always on. Never for input a client, peer or file controls. */
#define TD_ASSERT(cond)                                                                            \
    do {                                                                                           \
        if (__builtin_expect(!(cond), 0)) td_abort(__FILE__, __LINE__, #cond);                     \
    } while (0)

#define TD_MIN(a, b)     ((a) < (b) ? (a) : (b))
#define TD_MAX(a, b)     ((a) > (b) ? (a) : (b))
#define TD_ARRAY_SIZE(a) (sizeof(a) / sizeof((a)[0]))
#define TD_UNUSED(x)     (void)(x)
/* A macro's value as a string literal: TD_STR(16) is "16". */
#define TD_STR_(x) #x
#define TD_STR(x)  TD_STR_(x)

/* Overflow-checked size arithmetic: return 0 on success, 1 on overflow. */
static inline int td_mul_overflow(size_t a, size_t b, size_t *out) {
    return __builtin_mul_overflow(a, b, out);
}
static inline int td_add_overflow(size_t a, size_t b, size_t *out) {
    return __builtin_add_overflow(a, b, out);
}

/* Whether secret (sn bytes) equals got (gn bytes), in time that depends
 * only on the lengths, never on where the contents differ (API keys, the
 * cluster token). */
bool td_secret_eq(const void *secret, size_t sn, const void *got, size_t gn);

/* A random non-zero 64-bit value (the OS's entropy; the clock mixed by
 * splitmix64 where none is available): instance epochs, exchange ids. */
uint64_t td_random_u64(void);

/* Monotonic clock in seconds / nanoseconds. */
double td_time_s(void);
uint64_t td_time_ns(void);
/* Bytes of MemAvailable in /proc/meminfo; 0 when unknown. */
uint64_t td_mem_available(void);

/* A condition variable whose timed waits are on the monotonic clock (a
 * step of the wall clock does not move them), and the deadline `seconds`
 * from now for its pthread_cond_timedwait (<= 0: now). */
void td_cond_init_monotonic(pthread_cond_t *cv);
struct timespec td_deadline_after(double seconds);

#ifdef __cplusplus
}
#endif
#endif /* TD_BASE_H */
