/* The shared-memory engine behind the shm backend (rank processes mapping
 * one POSIX shared-memory object) and the local backend (threads sharing
 * the same layout in heap memory).
 *
 * Layout: a header, a table of group slots (slot 0 the world, the others
 * handed out by td_comm_split), one point-to-point channel per ordered pair
 * of ranks, one metadata record per rank (what collective it is in, with
 * which arguments), and per rank a staging buffer of chunk bytes for the
 * collectives and one for its sends.
 *
 * Collectives run in rounds: every rank writes its part of the round into
 * its own staging buffer, meets the others at the group's barrier, and
 * reads what it needs from theirs. Rounds alternate between the two halves
 * of the staging buffers, so a rank may stage round i+1 while slower ranks
 * still read round i; round i+2 reuses the half only after the barrier of
 * round i+1, which nobody reaches before finishing round i. One barrier at
 * the end keeps everyone inside until the last reader is done. Reductions
 * split each round into per-rank slices: rank r combines slice r over the
 * ranks in rank order into the second half of its buffer, and every rank
 * copies the slices, so all get the same bits. The metadata published with
 * round 0 lets every rank check, after the first barrier, that all ranks
 * called the same collective with the same arguments; since each rank
 * compares everyone with itself, a disagreement is seen by every rank.
 *
 * Barriers: a counter and a generation word per group; the last arrival
 * bumps the generation. Waiters spin briefly, then sleep on the generation
 * with FUTEX_WAIT (not _PRIVATE: the words are shared between processes),
 * in slices, so a broken world or a deadline is noticed. */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <math.h>
#include <stdatomic.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "comm-impl.h"
#include "kernels/types.h"

#define SEG_MAGIC  0x3130484d53435444ull /* "TDCSHM01" */
#define MAX_GROUPS 256
#define SPIN_ITERS 256
#define SLICE_NS   50000000ull /* futex sleep slice: how soon a broken world is seen */
#define MAX_CHUNK  ((size_t)1 << 30)

typedef struct {
    _Atomic uint64_t ready; /* SEG_MAGIC once initialised */
    uint64_t n;
    uint64_t chunk;
    uint64_t total;
    _Atomic uint32_t broken;   /* a wait failed: every later call fails */
    _Atomic uint32_t n_groups; /* group slots handed out; slot 0 is the world */
} seg_hdr;

typedef struct {
    _Atomic uint32_t count;
    _Atomic uint32_t gen;
    _Atomic uint32_t waiters;
    uint32_t pad;
    _Atomic uint32_t arrivals[TD_COMM_MAX_RANKS]; /* barriers entered, per member */
} seg_group;

typedef struct {
    _Atomic uint32_t seq; /* chunks posted by the sender */
    _Atomic uint32_t ack; /* chunks taken by the receiver */
    _Atomic uint32_t waiters;
    _Atomic uint32_t err; /* the receiver rejected the message */
    uint64_t len;         /* bytes of the posted chunk */
    uint64_t total;       /* bytes of the whole message */
    uint8_t pad[32];
} seg_chan;

enum {
    K_BARRIER = 1,
    K_BCAST,
    K_SCATTER,
    K_GATHER,
    K_ALLGATHER,
    K_REDUCE,
    K_ALLREDUCE,
    K_RSCATTER,
    K_A2AV,
};

typedef struct {
    uint32_t kind, op;
    int32_t root;
    uint32_t pad;
    uint64_t count;
    uint64_t vsend[TD_COMM_MAX_RANKS]; /* all-to-all-v: bytes to each member */
    uint64_t vrecv[TD_COMM_MAX_RANKS]; /* all-to-all-v: bytes from each member */
} seg_meta;

/* A segment as mapped by this process; reference-counted by the
 * communicators (and the local group) that use it. */
typedef struct td_comm_seg {
    _Atomic int refs;
    uint8_t *base;
    size_t bytes;
    bool heap;
    int n;
    size_t chunk;
    double timeout_s;
    const _Atomic int *cancel; /* td_comm_params.cancel */
    seg_hdr *hdr;
    seg_group *groups; /* (MAX_GROUPS) */
    seg_chan *chans;   /* (n, n) [src][dst] */
    seg_meta *meta;    /* (n) */
    uint8_t *stage;    /* (n, chunk) */
    uint8_t *p2p;      /* (n, chunk) */
} td_comm_seg;

/* A communicator of a segment: a group of its ranks. */
typedef struct {
    td_comm b; /* ops, rank and size in the group */
    td_comm_seg *seg;
    int gid;        /* group slot in the segment */
    int *members;   /* (size) world ranks of this communicator's ranks */
    uint32_t epoch; /* barriers this rank has passed in its group */
} seg_comm;

static const td_comm_ops k_seg_ops;

static size_t align64(size_t x) { return (x + 63) & ~(size_t)63; }

/* Offsets of the areas; returns the total size. */
static size_t layout(int n, size_t chunk, size_t off[5]) {
    size_t o = align64(sizeof(seg_hdr)), un = (size_t)n;
    off[0] = o;
    o += align64(MAX_GROUPS * sizeof(seg_group));
    off[1] = o;
    o += align64(un * un * sizeof(seg_chan));
    off[2] = o;
    o += align64(un * sizeof(seg_meta));
    off[3] = o;
    o += un * chunk;
    off[4] = o;
    o += un * chunk;
    return o;
}

static td_status normalize(int n, const td_comm_params *in, td_comm_params *out) {
    td_comm_params p = in ? *in : td_comm_default_params();
    size_t min = TD_MAX((size_t)4096, (size_t)256 * (size_t)n);
    p.chunk_bytes &= ~(size_t)63;
    if (p.chunk_bytes < min) p.chunk_bytes = min;
    if (p.chunk_bytes > MAX_CHUNK || !(p.timeout_s > 0) || p.timeout_s > 1e7) {
        TD_LOG_ERROR("chunk_bytes %zu (at most %zu) or timeout_s %g (positive) out of range",
                     p.chunk_bytes, MAX_CHUNK, p.timeout_s);
        return TD_ERR_INVALID;
    }
    *out = p;
    return TD_OK;
}

static void seg_bind(td_comm_seg *s, uint8_t *base, size_t bytes, int n, const td_comm_params *p) {
    size_t off[5];
    layout(n, p->chunk_bytes, off);
    atomic_init(&s->refs, 1);
    s->base = base;
    s->bytes = bytes;
    s->n = n;
    s->chunk = p->chunk_bytes;
    s->timeout_s = p->timeout_s;
    s->cancel = p->cancel;
    s->hdr = (seg_hdr *)base;
    s->groups = (seg_group *)(base + off[0]);
    s->chans = (seg_chan *)(base + off[1]);
    s->meta = (seg_meta *)(base + off[2]);
    s->stage = base + off[3];
    s->p2p = base + off[4];
}

static void hdr_init(td_comm_seg *s) {
    s->hdr->n = (uint64_t)s->n;
    s->hdr->chunk = s->chunk;
    s->hdr->total = s->bytes;
    atomic_store(&s->hdr->n_groups, 1);
    atomic_store(&s->hdr->ready, SEG_MAGIC);
}

static td_status seg_create_heap(int n, const td_comm_params *params, td_comm_seg **seg_p) {
    td_comm_params p;
    td_status st = normalize(n, params, &p);
    if (st) return st;
    size_t off[5], bytes = layout(n, p.chunk_bytes, off);
    td_comm_seg *s = calloc(1, sizeof *s);
    uint8_t *base = s ? aligned_alloc(64, bytes) : NULL;
    if (!base) {
        free(s);
        TD_LOG_ERROR("out of memory for a %zu-byte communicator segment", bytes);
        return TD_ERR_NOMEM;
    }
    memset(base, 0, bytes);
    seg_bind(s, base, bytes, n, &p);
    s->heap = true;
    hdr_init(s);
    *seg_p = s;
    return TD_OK;
}

static void seg_ref(td_comm_seg *seg) { atomic_fetch_add(&seg->refs, 1); }

static void seg_unref(td_comm_seg *seg) {
    if (!seg || atomic_fetch_sub(&seg->refs, 1) != 1) return;
    if (seg->heap)
        free(seg->base);
    else
        munmap(seg->base, seg->bytes);
    free(seg);
}

static td_status seg_comm_create(td_comm_seg *seg, int rank, seg_comm **comm_p) {
    seg_comm *c = calloc(1, sizeof *c);
    int *m = c ? calloc((size_t)seg->n, sizeof *m) : NULL;
    if (!m) {
        free(c);
        TD_LOG_ERROR("out of memory");
        return TD_ERR_NOMEM;
    }
    for (int k = 0; k < seg->n; k++) m[k] = k;
    c->b.ops = &k_seg_ops;
    c->b.rank = rank;
    c->b.size = seg->n;
    c->seg = seg;
    c->gid = 0;
    c->members = m;
    seg_ref(seg);
    *comm_p = c;
    return TD_OK;
}

/* ---- waiting ---- */

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static void futex_wake_all(_Atomic uint32_t *w) {
    syscall(SYS_futex, (uint32_t *)w, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

static void wake(_Atomic uint32_t *w, _Atomic uint32_t *waiters) {
    if (atomic_load(waiters)) futex_wake_all(w);
}

/* Waits until *w != val. TD_ERR_IO when the world is broken (*timed_out
 * false) or the deadline passes (*timed_out true). The waiter count and the
 * word are both seq_cst, so a waker that saw no waiter stored its new value
 * before the waiter's futex call compares it. */
static td_status wait_change(td_comm_seg *s, _Atomic uint32_t *w, _Atomic uint32_t *waiters,
                             uint32_t val, bool *timed_out) {
    for (int i = 0; i < SPIN_ITERS; i++) {
        if (atomic_load(w) != val) return TD_OK;
        cpu_relax();
    }
    uint64_t t0 = td_time_ns(), limit = (uint64_t)(s->timeout_s * 1e9);
    for (;;) {
        if (atomic_load(w) != val) return TD_OK;
        if (atomic_load(&s->hdr->broken) || (s->cancel && atomic_load(s->cancel))) {
            *timed_out = false;
            return TD_ERR_IO;
        }
        uint64_t el = td_time_ns() - t0;
        if (el >= limit) {
            *timed_out = true;
            return TD_ERR_IO;
        }
        uint64_t ns = TD_MIN(limit - el, SLICE_NS);
        struct timespec ts = {.tv_sec = (time_t)(ns / 1000000000u),
                              .tv_nsec = (long)(ns % 1000000000u)};
        atomic_fetch_add(waiters, 1);
        syscall(SYS_futex, (uint32_t *)w, FUTEX_WAIT, val, &ts, NULL, 0);
        atomic_fetch_sub(waiters, 1);
    }
}

static int world_of(const seg_comm *c, int r) { return c->members[r]; }

/* A wait failed: the world is broken from now on. Only the rank whose own
 * deadline passed logs (with the missing ranks); the others fail quietly. */
static void fail_wait(seg_comm *c, bool timed_out, const char *what, const int *missing,
                      int n_missing) {
    atomic_store(&c->seg->hdr->broken, 1);
    if (!timed_out) {
        TD_LOG_DEBUG("world rank %d: %s failed: a peer's wait failed first", world_of(c, c->b.rank),
                     what);
        return;
    }
    char list[TD_COMM_MAX_RANKS * 4 + 1] = "";
    size_t len = 0;
    for (int i = 0; i < n_missing && len + 5 < sizeof list; i++)
        len += (size_t)snprintf(list + len, sizeof list - len, " %d", missing[i]);
    TD_LOG_ERROR("world rank %d (rank %d of %d): %s timed out after %.3g s; missing world ranks:%s",
                 world_of(c, c->b.rank), c->b.rank, c->b.size, what, c->seg->timeout_s, list);
}

static void seg_abort_all(td_comm_seg *seg) {
    if (atomic_exchange(&seg->hdr->broken, 1) == 0)
        TD_LOG_ERROR("communicator world of %d ranks aborted", seg->n);
}

static td_status barrier(seg_comm *c) {
    td_comm_seg *s = c->seg;
    if (atomic_load(&s->hdr->broken)) return TD_ERR_IO;
    seg_group *g = &s->groups[c->gid];
    uint32_t gen = atomic_load(&g->gen);
    c->epoch++;
    atomic_store(&g->arrivals[c->b.rank], c->epoch);
    if (atomic_fetch_add(&g->count, 1) == (uint32_t)c->b.size - 1) {
        atomic_store(&g->count, 0); /* before the generation: the next barrier may start */
        atomic_store(&g->gen, gen + 1);
        wake(&g->gen, &g->waiters);
        return TD_OK;
    }
    bool timed_out = false;
    td_status st = wait_change(s, &g->gen, &g->waiters, gen, &timed_out);
    if (st) {
        int missing[TD_COMM_MAX_RANKS], nm = 0;
        for (int k = 0; k < c->b.size; k++)
            if ((int32_t)(atomic_load(&g->arrivals[k]) - c->epoch) < 0)
                missing[nm++] = world_of(c, k);
        fail_wait(c, timed_out, "a barrier", missing, nm);
    }
    return st;
}

/* ---- collectives ---- */

static uint8_t *stage(const seg_comm *c, int r, int half) {
    td_comm_seg *s = c->seg;
    return s->stage + (size_t)world_of(c, r) * s->chunk + (size_t)half * (s->chunk / 2);
}

static seg_meta *meta(const seg_comm *c, int r) { return &c->seg->meta[world_of(c, r)]; }

static size_t half_bytes(const seg_comm *c) { return c->seg->chunk / 2; }

/* Per-member share of a half, for collectives that stage one piece per rank. */
static size_t sub_bytes(const seg_comm *c) {
    return (half_bytes(c) / (size_t)c->b.size) & ~(size_t)63;
}

static size_t n_rounds(size_t total, size_t piece) { return total ? (total - 1) / piece + 1 : 1; }

static size_t piece_len(size_t total, size_t piece, size_t round) {
    size_t off = round * piece;
    return off >= total ? 0 : TD_MIN(piece, total - off);
}

static void publish(seg_comm *c, uint32_t kind, uint32_t op, int root, uint64_t count) {
    seg_meta *m = meta(c, c->b.rank);
    m->kind = kind;
    m->op = op;
    m->root = root;
    m->count = count;
}

/* A reduction's op and element type in the metadata's op word, so that
 * ranks that disagree on either are told. */
static uint32_t meta_op(td_comm_op op, td_comm_dtype dt) {
    return (uint32_t)op | (uint32_t)dt << 8;
}

/* After the first barrier: did every member call the same collective? */
static td_status check_meta(const seg_comm *c) {
    const seg_meta *me = meta(c, c->b.rank);
    for (int k = 0; k < c->b.size; k++) {
        const seg_meta *m = meta(c, k);
        if (m->kind != me->kind || m->op != me->op || m->root != me->root ||
            m->count != me->count) {
            if (c->b.rank == 0)
                TD_LOG_ERROR("ranks 0 and %d disagree on a collective (kind %u/%u, op %u/%u, root "
                             "%d/%d, count %llu/%llu)",
                             k, me->kind, m->kind, me->op, m->op, me->root, m->root,
                             (unsigned long long)me->count, (unsigned long long)m->count);
            return TD_ERR_INVALID;
        }
    }
    return TD_OK;
}

/* The closing barrier; a failed check still meets there, so every rank
 * leaves the collective together. */
static td_status finish(seg_comm *c, td_status st) {
    if (st == TD_ERR_IO) return st;
    td_status b = barrier(c);
    return b ? b : st;
}

static td_status seg_barrier(seg_comm *c) {
    publish(c, K_BARRIER, 0, 0, 0);
    td_status st = barrier(c);
    if (!st) st = check_meta(c);
    return finish(c, st);
}

static td_status seg_broadcast(seg_comm *c, void *buf, size_t bytes, int root) {
    size_t piece = half_bytes(c), R = n_rounds(bytes, piece);
    publish(c, K_BCAST, 0, root, bytes);
    td_status st = TD_OK;
    for (size_t i = 0; i < R && !st; i++) {
        size_t m = piece_len(bytes, piece, i), off = i * piece;
        int h = (int)(i & 1);
        if (c->b.rank == root && m) memcpy(stage(c, root, h), (uint8_t *)buf + off, m);
        if ((st = barrier(c))) break;
        if (i == 0 && (st = check_meta(c))) break;
        if (c->b.rank != root && m) memcpy((uint8_t *)buf + off, stage(c, root, h), m);
    }
    return finish(c, st);
}

static td_status seg_scatter(seg_comm *c, const void *send, void *recv, size_t bpr, int root) {
    size_t piece = sub_bytes(c), R = n_rounds(bpr, piece);
    publish(c, K_SCATTER, 0, root, bpr);
    td_status st = TD_OK;
    for (size_t i = 0; i < R && !st; i++) {
        size_t m = piece_len(bpr, piece, i), off = i * piece;
        int h = (int)(i & 1);
        if (c->b.rank == root && m)
            for (int k = 0; k < c->b.size; k++)
                memcpy(stage(c, root, h) + (size_t)k * piece,
                       (const uint8_t *)send + (size_t)k * bpr + off, m);
        if ((st = barrier(c))) break;
        if (i == 0 && (st = check_meta(c))) break;
        if (m) memcpy((uint8_t *)recv + off, stage(c, root, h) + (size_t)c->b.rank * piece, m);
    }
    return finish(c, st);
}

/* gather (to root) and all-gather share their rounds. */
static td_status gather(seg_comm *c, const void *send, void *recv, size_t bpr, int root, bool all) {
    size_t piece = half_bytes(c), R = n_rounds(bpr, piece);
    publish(c, all ? K_ALLGATHER : K_GATHER, 0, root, bpr);
    td_status st = TD_OK;
    for (size_t i = 0; i < R && !st; i++) {
        size_t m = piece_len(bpr, piece, i), off = i * piece;
        int h = (int)(i & 1);
        if (m) memcpy(stage(c, c->b.rank, h), (const uint8_t *)send + off, m);
        if ((st = barrier(c))) break;
        if (i == 0 && (st = check_meta(c))) break;
        if ((all || c->b.rank == root) && m)
            for (int k = 0; k < c->b.size; k++)
                memcpy((uint8_t *)recv + (size_t)k * bpr + off, stage(c, k, h), m);
    }
    return finish(c, st);
}

static td_status seg_gather(seg_comm *c, const void *send, void *recv, size_t bpr, int root) {
    return gather(c, send, recv, bpr, root, false);
}

static td_status seg_all_gather(seg_comm *c, const void *send, void *recv, size_t bpr) {
    return gather(c, send, recv, bpr, 0, true);
}

/* A float16 or bfloat16 element widened, and a float32 rounded back. */
static float half_to_f32(td_comm_dtype dt, uint16_t h) {
    return dt == TD_COMM_F16 ? td_fp16_to_f32(h) : td_bf16_to_f32(h);
}
static uint16_t f32_to_half(td_comm_dtype dt, float f) {
    return dt == TD_COMM_F16 ? td_f32_to_fp16(f) : td_f32_to_bf16(f);
}

#define HALF_BLOCK 256 /* float32 accumulators on the stack per pass */

/* Combines elements j0..j1 of area p of every member, in rank order:
 * out = ((x0 op x1) op x2) ..., one pass per member over the elements so
 * the sum loop vectorises (the same operations on each element as an
 * element-by-element loop, so the same bits). float16 and bfloat16 combine
 * in float32 accumulators, rounded once into out. */
static void combine(const seg_comm *c, int h, size_t p_off, size_t j0, size_t j1, td_comm_dtype dt,
                    td_comm_op op, void *restrict out_v) {
    if (dt == TD_COMM_F32) {
        float *restrict out = out_v;
        size_t n = j1 - j0;
        memcpy(out, (const float *)(stage(c, 0, h) + p_off) + j0, n * sizeof(float));
        for (int k = 1; k < c->b.size; k++) {
            const float *restrict x = (const float *)(stage(c, k, h) + p_off) + j0;
            if (op == TD_COMM_SUM)
                for (size_t j = 0; j < n; j++) out[j] += x[j];
            else
                for (size_t j = 0; j < n; j++) out[j] = fmaxf(out[j], x[j]);
        }
        return;
    }
    uint16_t *restrict out = out_v;
    float acc[HALF_BLOCK];
    for (size_t b0 = j0; b0 < j1; b0 += HALF_BLOCK) {
        size_t n = TD_MIN((size_t)HALF_BLOCK, j1 - b0);
        const uint16_t *x0 = (const uint16_t *)(stage(c, 0, h) + p_off) + b0;
        for (size_t j = 0; j < n; j++) acc[j] = half_to_f32(dt, x0[j]);
        for (int k = 1; k < c->b.size; k++) {
            const uint16_t *x = (const uint16_t *)(stage(c, k, h) + p_off) + b0;
            if (op == TD_COMM_SUM)
                for (size_t j = 0; j < n; j++) acc[j] += half_to_f32(dt, x[j]);
            else
                for (size_t j = 0; j < n; j++) acc[j] = fmaxf(acc[j], half_to_f32(dt, x[j]));
        }
        for (size_t j = 0; j < n; j++) out[b0 - j0 + j] = f32_to_half(dt, acc[j]);
    }
}

/* Slice r of m elements split evenly over the members. */
static void slice(const seg_comm *c, int r, size_t m, size_t *b, size_t *e) {
    size_t n = (size_t)c->b.size, per = m / n, rem = m % n, ur = (size_t)r;
    *b = ur * per + TD_MIN(ur, rem);
    *e = *b + per + (ur < rem ? 1 : 0);
}

/* reduce (to root) and all-reduce: half 0 holds the round's input, half 1
 * the slice this rank combined. */
static td_status seg_reduce(seg_comm *c, const void *send_v, void *recv_v, size_t n,
                            td_comm_dtype dt, td_comm_op op, int root, bool all) {
    const uint8_t *send = send_v;
    uint8_t *recv = recv_v;
    size_t esz = td_comm_dtype_size(dt), piece = half_bytes(c) / esz, R = n_rounds(n, piece);
    publish(c, all ? K_ALLREDUCE : K_REDUCE, meta_op(op, dt), root, n);
    td_status st = TD_OK;
    for (size_t i = 0; i < R && !st; i++) {
        size_t m = piece_len(n, piece, i), off = i * piece, b, e;
        if (m) memcpy(stage(c, c->b.rank, 0), send + off * esz, m * esz);
        if ((st = barrier(c))) break;
        if (i == 0 && (st = check_meta(c))) break;
        slice(c, c->b.rank, m, &b, &e);
        combine(c, 0, 0, b, e, dt, op, stage(c, c->b.rank, 1) + b * esz);
        if ((st = barrier(c))) break;
        if (all || c->b.rank == root)
            for (int k = 0; k < c->b.size; k++) {
                slice(c, k, m, &b, &e);
                if (e > b) memcpy(recv + (off + b) * esz, stage(c, k, 1) + b * esz, (e - b) * esz);
            }
    }
    return finish(c, st);
}

static td_status seg_reduce_scatter(seg_comm *c, const void *send_v, void *recv_v, size_t n,
                                    td_comm_dtype dt, td_comm_op op) {
    const uint8_t *send = send_v;
    uint8_t *recv = recv_v;
    size_t esz = td_comm_dtype_size(dt), piece_b = sub_bytes(c), piece = piece_b / esz,
           R = n_rounds(n, piece);
    publish(c, K_RSCATTER, meta_op(op, dt), 0, n);
    td_status st = TD_OK;
    for (size_t i = 0; i < R && !st; i++) {
        size_t m = piece_len(n, piece, i), off = i * piece;
        int h = (int)(i & 1);
        if (m)
            for (int k = 0; k < c->b.size; k++)
                memcpy(stage(c, c->b.rank, h) + (size_t)k * piece_b,
                       send + ((size_t)k * n + off) * esz, m * esz);
        if ((st = barrier(c))) break;
        if (i == 0 && (st = check_meta(c))) break;
        if (m) combine(c, h, (size_t)c->b.rank * piece_b, 0, m, dt, op, recv + off * esz);
    }
    return finish(c, st);
}

static td_status seg_all_to_all_v(seg_comm *c, const void *send, const size_t *send_bytes,
                                  const size_t *send_displs, void *recv, const size_t *recv_bytes,
                                  const size_t *recv_displs) {
    size_t piece = sub_bytes(c), R = 1;
    publish(c, K_A2AV, 0, 0, 0);
    seg_meta *mine = meta(c, c->b.rank);
    for (int k = 0; k < c->b.size; k++) {
        mine->vsend[k] = send_bytes[k];
        mine->vrecv[k] = recv_bytes[k];
    }
    td_status st = TD_OK;
    for (size_t i = 0; i < R && !st; i++) {
        int h = (int)(i & 1);
        for (int j = 0; j < c->b.size; j++) {
            size_t m = piece_len(send_bytes[j], piece, i);
            if (m)
                memcpy(stage(c, c->b.rank, h) + (size_t)j * piece,
                       (const uint8_t *)send + send_displs[j] + i * piece, m);
        }
        if ((st = barrier(c))) break;
        if (i == 0) {
            if ((st = check_meta(c))) break;
            size_t most = 0;
            for (int k = 0; k < c->b.size && !st; k++)
                for (int j = 0; j < c->b.size; j++) {
                    if (meta(c, k)->vsend[j] != meta(c, j)->vrecv[k]) {
                        if (c->b.rank == 0)
                            TD_LOG_ERROR("all-to-all-v: rank %d sends %llu bytes to rank %d, which "
                                         "expects %llu",
                                         k, (unsigned long long)meta(c, k)->vsend[j], j,
                                         (unsigned long long)meta(c, j)->vrecv[k]);
                        st = TD_ERR_INVALID;
                        break;
                    }
                    most = TD_MAX(most, (size_t)meta(c, k)->vsend[j]);
                }
            if (st) break;
            R = n_rounds(most, piece);
        }
        for (int k = 0; k < c->b.size; k++) {
            size_t m = piece_len(recv_bytes[k], piece, i);
            if (m)
                memcpy((uint8_t *)recv + recv_displs[k] + i * piece,
                       stage(c, k, h) + (size_t)c->b.rank * piece, m);
        }
    }
    return finish(c, st);
}

/* ---- point to point ---- */

static seg_chan *chan(const seg_comm *c, int src, int dst) {
    return &c->seg->chans[(size_t)world_of(c, src) * (size_t)c->seg->n + (size_t)world_of(c, dst)];
}

static td_status seg_send(seg_comm *c, const void *buf, size_t bytes, int peer) {
    td_comm_seg *s = c->seg;
    if (atomic_load(&s->hdr->broken)) return TD_ERR_IO;
    seg_chan *ch = chan(c, c->b.rank, peer);
    uint8_t *out = s->p2p + (size_t)world_of(c, c->b.rank) * s->chunk;
    size_t R = n_rounds(bytes, s->chunk);
    for (size_t i = 0; i < R; i++) {
        size_t m = piece_len(bytes, s->chunk, i);
        if (m) memcpy(out, (const uint8_t *)buf + i * s->chunk, m);
        ch->len = m;
        ch->total = bytes;
        uint32_t seq = atomic_load(&ch->seq);
        atomic_store(&ch->seq, seq + 1);
        wake(&ch->seq, &ch->waiters);
        bool timed_out = false;
        if (wait_change(s, &ch->ack, &ch->waiters, seq, &timed_out)) {
            int w = world_of(c, peer);
            fail_wait(c, timed_out, "a send", &w, 1);
            return TD_ERR_IO;
        }
        if (atomic_load(&ch->err)) {
            atomic_store(&ch->err, 0);
            TD_LOG_ERROR("rank %d refused a %zu-byte message from rank %d", peer, bytes, c->b.rank);
            return TD_ERR_INVALID;
        }
    }
    return TD_OK;
}

static td_status seg_recv(seg_comm *c, void *buf, size_t bytes, int peer) {
    td_comm_seg *s = c->seg;
    if (atomic_load(&s->hdr->broken)) return TD_ERR_IO;
    seg_chan *ch = chan(c, peer, c->b.rank);
    const uint8_t *in = s->p2p + (size_t)world_of(c, peer) * s->chunk;
    size_t R = n_rounds(bytes, s->chunk);
    for (size_t i = 0; i < R; i++) {
        uint32_t ack = atomic_load(&ch->ack);
        bool timed_out = false;
        if (wait_change(s, &ch->seq, &ch->waiters, ack, &timed_out)) {
            int w = world_of(c, peer);
            fail_wait(c, timed_out, "a receive", &w, 1);
            return TD_ERR_IO;
        }
        size_t m = piece_len(bytes, s->chunk, i);
        if (ch->total != bytes || ch->len != m) {
            TD_LOG_ERROR("rank %d expected %zu bytes from rank %d, which sent %llu", c->b.rank,
                         bytes, peer, (unsigned long long)ch->total);
            atomic_store(&ch->err, 1);
            atomic_store(&ch->ack, ack + 1);
            wake(&ch->ack, &ch->waiters);
            return TD_ERR_INVALID;
        }
        if (m) memcpy((uint8_t *)buf + i * s->chunk, in, m);
        atomic_store(&ch->ack, ack + 1);
        wake(&ch->ack, &ch->waiters);
    }
    return TD_OK;
}

/* ---- sub-groups ---- */

static td_status seg_split(seg_comm *c, int color, int key, seg_comm **sub_p) {
    int64_t mine[2] = {color, key}, all[2 * TD_COMM_MAX_RANKS];
    td_status st = gather(c, mine, all, sizeof mine, 0, true);
    if (st) return st;
    int n_colors = 0;
    for (int k = 0; k < c->b.size; k++) {
        bool first = all[2 * k] >= 0;
        for (int j = 0; j < k && first; j++) first = all[2 * j] != all[2 * k];
        n_colors += first;
    }
    int32_t base = 0;
    if (c->b.rank == 0) {
        uint32_t b = atomic_fetch_add(&c->seg->hdr->n_groups, (uint32_t)n_colors);
        base = b + (uint32_t)n_colors > MAX_GROUPS ? -1 : (int32_t)b;
    }
    if ((st = seg_broadcast(c, &base, sizeof base, 0))) return st;
    if (base < 0 || base + n_colors > MAX_GROUPS) { /* every rank checks the shared value */
        if (c->b.rank == 0)
            TD_LOG_ERROR("no group slot left (%d sub-groups per world)", MAX_GROUPS - 1);
        return TD_ERR_RANGE;
    }
    if (color < 0) {
        *sub_p = NULL;
        return TD_OK;
    }
    int ordinal = 0, size = 0, order[TD_COMM_MAX_RANKS];
    for (int k = 0; k < c->b.size; k++) {
        bool first = all[2 * k] >= 0 && all[2 * k] < color;
        for (int j = 0; j < k && first; j++) first = all[2 * j] != all[2 * k];
        ordinal += first;
        if (all[2 * k] != color) continue;
        /* insertion by (key, rank) */
        int p = size++;
        while (p > 0 && all[2 * order[p - 1] + 1] > all[2 * k + 1]) {
            order[p] = order[p - 1];
            p--;
        }
        order[p] = k;
    }
    seg_comm *sub = calloc(1, sizeof *sub);
    int *m = sub ? calloc((size_t)size, sizeof *m) : NULL;
    if (!m) {
        free(sub);
        TD_LOG_ERROR("out of memory");
        return TD_ERR_NOMEM;
    }
    for (int i = 0; i < size; i++) {
        m[i] = world_of(c, order[i]);
        if (order[i] == c->b.rank) sub->b.rank = i;
    }
    sub->b.ops = &k_seg_ops;
    sub->b.size = size;
    sub->seg = c->seg;
    sub->gid = base + ordinal;
    sub->members = m;
    seg_ref(c->seg);
    *sub_p = sub;
    return TD_OK;
}

/* ---- the shm backend ---- */

static void sleep_ms(int ms) {
    struct timespec ts = {.tv_sec = 0, .tv_nsec = (long)ms * 1000000L};
    nanosleep(&ts, NULL);
}

/* Rank 0: a fresh object of `bytes`, initialised. */
static td_status shm_make(const char *path, size_t bytes, uint8_t **base_p) {
    if (shm_unlink(path) == 0) TD_LOG_WARN("removed a stale shared-memory object %s", path);
    int fd = shm_open(path, O_RDWR | O_CREAT | O_EXCL, 0600);
    if (fd < 0) {
        TD_LOG_ERROR("shm_open(%s): %s", path, strerror(errno));
        return TD_ERR_IO;
    }
    void *p = MAP_FAILED;
    if (ftruncate(fd, (off_t)bytes) != 0)
        TD_LOG_ERROR("ftruncate(%s, %zu): %s", path, bytes, strerror(errno));
    else if ((p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)) == MAP_FAILED)
        TD_LOG_ERROR("mmap(%s, %zu): %s", path, bytes, strerror(errno));
    close(fd);
    if (p == MAP_FAILED) {
        shm_unlink(path);
        return TD_ERR_IO;
    }
    *base_p = p;
    return TD_OK;
}

/* Other ranks: wait for rank 0's object to exist, have its size and be
 * initialised. */
static td_status shm_attach(const char *path, size_t bytes, int n, size_t chunk, double timeout_s,
                            uint8_t **base_p) {
    double t0 = td_time_s();
    int fd = -1;
    for (;;) {
        fd = shm_open(path, O_RDWR, 0);
        if (fd < 0 && errno != ENOENT) {
            TD_LOG_ERROR("shm_open(%s): %s", path, strerror(errno));
            return TD_ERR_IO;
        }
        if (fd >= 0) {
            struct stat sb;
            if (fstat(fd, &sb) != 0) {
                TD_LOG_ERROR("fstat(%s): %s", path, strerror(errno));
                close(fd);
                return TD_ERR_IO;
            }
            if ((size_t)sb.st_size == bytes) break;
            close(fd);
            if (sb.st_size != 0) {
                TD_LOG_ERROR("%s has %lld bytes, expected %zu: the ranks disagree on the world "
                             "size or chunk_bytes",
                             path, (long long)sb.st_size, bytes);
                return TD_ERR_IO;
            }
        }
        if (td_time_s() - t0 > timeout_s) {
            TD_LOG_ERROR("rank 0 did not create %s within %.3g s", path, timeout_s);
            return TD_ERR_IO;
        }
        sleep_ms(1);
    }
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) {
        TD_LOG_ERROR("mmap(%s, %zu): %s", path, bytes, strerror(errno));
        return TD_ERR_IO;
    }
    seg_hdr *h = p;
    while (atomic_load(&h->ready) != SEG_MAGIC) {
        if (td_time_s() - t0 > timeout_s) {
            TD_LOG_ERROR("rank 0 did not initialise %s within %.3g s", path, timeout_s);
            munmap(p, bytes);
            return TD_ERR_IO;
        }
        sleep_ms(1);
    }
    if (h->n != (uint64_t)n || h->chunk != chunk || h->total != bytes) {
        TD_LOG_ERROR("%s was made for %llu ranks and %llu-byte chunks, not %d and %zu", path,
                     (unsigned long long)h->n, (unsigned long long)h->chunk, n, chunk);
        munmap(p, bytes);
        return TD_ERR_IO;
    }
    *base_p = p;
    return TD_OK;
}

td_status td_comm_shm_create(const char *name, int n_ranks, int rank, const td_comm_params *params,
                             td_comm **comm_p) {
    if (!name || n_ranks < 1 || n_ranks > TD_COMM_MAX_RANKS || rank < 0 || rank >= n_ranks ||
        !comm_p)
        return TD_ERR_INVALID;
    const char *bare = name[0] == '/' ? name + 1 : name;
    size_t len = strlen(bare);
    if (len == 0 || len > 200 || strchr(bare, '/')) {
        TD_LOG_ERROR("bad shared-memory name '%s'", name);
        return TD_ERR_INVALID;
    }
    td_comm_params p;
    td_status st = normalize(n_ranks, params, &p);
    if (st) return st;
    char path[256];
    snprintf(path, sizeof path, "/%s", bare);
    size_t off[5], bytes = layout(n_ranks, p.chunk_bytes, off);
    td_comm_seg *s = calloc(1, sizeof *s);
    if (!s) {
        TD_LOG_ERROR("out of memory");
        return TD_ERR_NOMEM;
    }
    uint8_t *base = NULL;
    st = rank == 0 ? shm_make(path, bytes, &base)
                   : shm_attach(path, bytes, n_ranks, p.chunk_bytes, p.timeout_s, &base);
    if (st) {
        free(s);
        return st;
    }
    seg_bind(s, base, bytes, n_ranks, &p);
    if (rank == 0) hdr_init(s);
    seg_comm *c = NULL;
    st = seg_comm_create(s, rank, &c);
    seg_unref(s); /* the communicator holds it now (or it is unmapped) */
    if (!st && (st = barrier(c))) {
        td_comm_destroy(&c->b);
        c = NULL;
    }
    if (rank == 0) shm_unlink(path); /* everyone has it mapped, or we gave up */
    if (st) return st;
    *comm_p = &c->b;
    return TD_OK;
}

/* ---- the local backend: the same engine over heap memory ---- */

struct td_comm_group {
    td_comm_seg *seg;
    int n;
};

td_status td_comm_group_create(int n_ranks, td_comm_group **group_p) {
    return td_comm_group_create_params(n_ranks, NULL, group_p);
}

td_status td_comm_group_create_params(int n_ranks, const td_comm_params *params,
                                      td_comm_group **group_p) {
    if (n_ranks < 1 || n_ranks > TD_COMM_MAX_RANKS || !group_p) return TD_ERR_INVALID;
    td_comm_params p = params ? *params : td_comm_default_params();
    td_comm_group *g = calloc(1, sizeof *g);
    if (!g) {
        TD_LOG_ERROR("out of memory");
        return TD_ERR_NOMEM;
    }
    td_status st = seg_create_heap(n_ranks, &p, &g->seg);
    if (st) {
        free(g);
        return st;
    }
    g->n = n_ranks;
    *group_p = g;
    return TD_OK;
}

void td_comm_group_destroy(td_comm_group *group) {
    if (!group) return;
    seg_unref(group->seg);
    free(group);
}

td_status td_comm_create_local(td_comm_group *group, int rank, td_comm **comm_p) {
    if (!group || rank < 0 || rank >= group->n || !comm_p) return TD_ERR_INVALID;
    seg_comm *c = NULL;
    td_status st = seg_comm_create(group->seg, rank, &c);
    if (st) return st;
    *comm_p = &c->b;
    return TD_OK;
}

/* ---- the table (comm-impl.h) ---- */

#define SC(c) ((seg_comm *)(c))

static void op_destroy(td_comm *base) {
    seg_comm *c = SC(base);
    seg_unref(c->seg);
    free(c->members);
    free(c);
}

static void op_abort(td_comm *c) { seg_abort_all(SC(c)->seg); }

static td_status op_split(td_comm *c, int color, int key, td_comm **sub_p) {
    seg_comm *sub = NULL;
    td_status st = seg_split(SC(c), color, key, &sub);
    if (st == TD_OK) *sub_p = sub ? &sub->b : NULL;
    return st;
}

static td_status op_barrier(td_comm *c) { return seg_barrier(SC(c)); }

static td_status op_broadcast(td_comm *c, void *buf, size_t bytes, int root, td_comm_stream s) {
    TD_UNUSED(s);
    return seg_broadcast(SC(c), buf, bytes, root);
}

static td_status op_scatter(td_comm *c, const void *send, void *recv, size_t bpr, int root,
                            td_comm_stream s) {
    TD_UNUSED(s);
    return seg_scatter(SC(c), send, recv, bpr, root);
}

static td_status op_gather(td_comm *c, const void *send, void *recv, size_t bpr, int root,
                           td_comm_stream s) {
    TD_UNUSED(s);
    return seg_gather(SC(c), send, recv, bpr, root);
}

static td_status op_all_gather(td_comm *c, const void *send, void *recv, size_t bpr,
                               td_comm_stream s) {
    TD_UNUSED(s);
    return seg_all_gather(SC(c), send, recv, bpr);
}

static td_status op_reduce(td_comm *c, const void *send, void *recv, size_t n, td_comm_dtype dt,
                           td_comm_op op, int root, bool all, td_comm_stream s) {
    TD_UNUSED(s);
    return seg_reduce(SC(c), send, recv, n, dt, op, root, all);
}

static td_status op_reduce_scatter(td_comm *c, const void *send, void *recv, size_t n,
                                   td_comm_dtype dt, td_comm_op op, td_comm_stream s) {
    TD_UNUSED(s);
    return seg_reduce_scatter(SC(c), send, recv, n, dt, op);
}

static td_status op_all_to_all_v(td_comm *c, const void *send, const size_t *send_bytes,
                                 const size_t *send_displs, void *recv, const size_t *recv_bytes,
                                 const size_t *recv_displs, td_comm_stream s) {
    TD_UNUSED(s);
    return seg_all_to_all_v(SC(c), send, send_bytes, send_displs, recv, recv_bytes, recv_displs);
}

static td_status op_send(td_comm *c, const void *buf, size_t bytes, int peer, td_comm_stream s) {
    TD_UNUSED(s);
    return seg_send(SC(c), buf, bytes, peer);
}

static td_status op_recv(td_comm *c, void *buf, size_t bytes, int peer, td_comm_stream s) {
    TD_UNUSED(s);
    return seg_recv(SC(c), buf, bytes, peer);
}

static const td_comm_ops k_seg_ops = {.name = "shm",
                                      .destroy = op_destroy,
                                      .abort = op_abort,
                                      .split = op_split,
                                      .barrier = op_barrier,
                                      .broadcast = op_broadcast,
                                      .scatter = op_scatter,
                                      .gather = op_gather,
                                      .all_gather = op_all_gather,
                                      .reduce = op_reduce,
                                      .reduce_scatter = op_reduce_scatter,
                                      .all_to_all_v = op_all_to_all_v,
                                      .send = op_send,
                                      .recv = op_recv};
