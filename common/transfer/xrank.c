/* The rank side of KV migration (see xrank.h). */
#include "xrank.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/comm/comm.h"
#include "proto/internal.pb-c.h"

#define WORDS(bytes) (((bytes) + 3u) / 4u)
/* How long a step waits for a finished job's flush before it reports the
 * job busy and moves on (checking it again at every later step). */
#define FLUSH_WAIT_NS 20000000ull

typedef struct {
    bool used, failed;
    int d_world;
    td_xfer_plan dplan;
    int32_t d_blocks;
    td_ucx_ep **ep;        /* (d_world) NULL where this rank sends nothing */
    td_ucx_rkey **rk;      /* (d_world) */
    td_xfer_route *routes; /* this rank's */
    int n_routes;
} xpeer;

typedef struct {
    bool used, failed, complete, sealed, dropping;
    bool waiting; /* finished or dropped, sealed, its puts still in flight: reported busy */
    bool stuck;   /* dropped, its puts still in flight past the deadline */
    int32_t peer;
    int32_t n_prompt, d_cached;
    uint64_t deadline_ns;
    int32_t *dest;
    int32_t n_dest;
    int32_t *pushed;          /* (n_layers_local) positions put so far */
    uint64_t last_layer_unix; /* when this rank computed the model's last layer of the last
                               * chunk (0: not here, or not yet) */
    td_ucx_ops ops;
    atomic_bool done;
    atomic_int status;
} xjob;

struct td_xrank {
    td_xrank_params p;
    td_ucx *ucx;
    bool own_ucx;
    td_ucx_mem *mem;
    uint8_t *addr, *rkey;
    size_t addr_len, rkey_len;
    void *base; /* the engine's KV storage, as the network sees it */
    size_t bytes;
    td_kv_layout lay;         /* its layout */
    int32_t layer0, n_layers; /* this rank's stage */
    int32_t h0, h1;           /* its KV heads (global) */
    int32_t block_size, n_blocks;
    size_t row; /* bytes of one token's K (or V) in one layer on this rank */
    xpeer peers[TD_XRANK_MAX_PEERS];
    td_ucx_link *links[TD_XRANK_MAX_PEERS]; /* decode side: one per prefill instance */
    uint8_t *link_addr[TD_XRANK_MAX_PEERS];
    size_t link_addr_len[TD_XRANK_MAX_PEERS];
    xjob jobs[TD_XRANK_MAX_JOBS];
    const td_seq_chunk *seqs;
    const int32_t *slots;
    int32_t n_seqs;
};

/* ------------------------------------------------------------- geometry */

typedef struct {
    int32_t layer0, layer1, h0, h1;
} rank_geo;

static rank_geo geo_of(const td_xfer_plan *pl, int rank, int32_t n_head_kv) {
    rank_geo g;
    int tp_r = rank % pl->tp, pp_r = rank / (pl->tp * pl->cp);
    g.layer0 = pl->stage_begin[pp_r];
    g.layer1 = pl->stage_begin[pp_r + 1];
    td_xfer_rank_heads(pl->tp, tp_r, n_head_kv, &g.h0, &g.h1);
    return g;
}

/* ------------------------------------------------------------- lifetime */

/* The KV storage hook: the backend's KV allocator takes its memory from
 * UCX; the engine gives it back when it frees the storage. */
static void *kv_mem_alloc(void *ctx, size_t bytes, void **handle) {
    td_xrank *xr = ctx;
    if (xr->mem || td_ucx_mem_alloc(xr->ucx, bytes, &xr->mem)) return NULL;
    *handle = xr->mem;
    return td_ucx_mem_base(xr->mem);
}

static void kv_mem_release(void *ctx, void *handle) {
    td_xrank *xr = ctx;
    TD_ASSERT(handle == xr->mem);
    td_ucx_mem_unmap(xr->mem);
    xr->mem = NULL;
}

td_status td_xrank_create(const td_xrank_params *p, td_xrank **xr_p) {
    if (!p || !p->kv || !xr_p || p->rank < 0 || p->rank >= p->plan.tp * p->plan.pp * p->plan.cp) {
        TD_LOG_ERROR("invalid transfer rank parameters");
        return TD_ERR_INVALID;
    }
    td_xrank *xr = calloc(1, sizeof *xr);
    if (!xr) return TD_ERR_NOMEM;
    xr->p = *p;
    rank_geo g = geo_of(&p->plan, p->rank, p->n_head_kv);
    xr->layer0 = g.layer0;
    xr->n_layers = g.layer1 - g.layer0;
    xr->h0 = g.h0;
    xr->h1 = g.h1;
    const td_kv_params *kp = td_kv_pool_params(p->kv);
    xr->block_size = kp->block_size;
    xr->n_blocks = kp->n_blocks;
    td_status st = TD_OK;
    if (kp->n_layers != xr->n_layers || kp->n_kv_heads != g.h1 - g.h0) {
        TD_LOG_ERROR("rank %d: KV pool of %d layers x %d heads, the plan gives %d x %d", p->rank,
                     kp->n_layers, kp->n_kv_heads, xr->n_layers, g.h1 - g.h0);
        st = TD_ERR_INVALID;
        goto fail;
    }
    if (p->ucx) {
        xr->ucx = p->ucx;
    } else {
        td_ucx_params up = {.name = "kv rank"};
        if ((st = td_ucx_create(&up, &xr->ucx))) goto fail;
        xr->own_ucx = true;
    }
    /* The engine's KV storage moves into memory UCX allocates (through the
     * backend's allocator): a peer on this host then puts into it with one
     * memcpy (see ucx.h). The pool must hold no data yet. */
    td_kv_mem_hook hook = {.alloc = kv_mem_alloc, .release = kv_mem_release, .ctx = xr};
    td_kv_storage kvs;
    if (!p->engine) {
        TD_LOG_ERROR("rank %d: KV transfer without an engine", p->rank);
        st = TD_ERR_INVALID;
        goto fail;
    }
    if ((st = td_engine_kv_place(p->engine, &hook)) || (st = td_engine_kv_storage(p->engine, &kvs)))
        goto fail;
    td_kv_layout dense;
    if ((st = td_kv_layout_dense(kp, &dense))) goto fail;
    const td_kv_layout *got = &kvs.layout;
    if (got->dtype != dense.dtype || got->elem_bytes != dense.elem_bytes ||
        got->row_bytes != dense.row_bytes || got->block_bytes != dense.block_bytes ||
        got->layer_bytes != dense.layer_bytes || got->bytes != dense.bytes) {
        TD_LOG_ERROR("rank %d: the backend's KV layout is not the dense one the transfer "
                     "protocol assumes",
                     p->rank);
        st = TD_ERR_UNSUPPORTED;
        goto fail;
    }
    xr->lay = kvs.layout;
    xr->base = kvs.base;
    xr->bytes = kvs.layout.bytes;
    xr->row = kvs.layout.row_bytes;
    if ((st = td_ucx_mem_rkey(xr->mem, &xr->rkey, &xr->rkey_len))) goto fail;
    if ((st = td_ucx_address(xr->ucx, &xr->addr, &xr->addr_len))) goto fail;
    *xr_p = xr;
    return TD_OK;
fail:
    /* the engine keeps KV storage of its own (the pool is still empty) */
    if (xr->mem) td_engine_kv_place(p->engine, NULL);
    td_xrank_destroy(xr);
    return st;
}

static void job_clear(xjob *j) {
    free(j->dest);
    free(j->pushed);
    memset(j, 0, sizeof *j);
}

static void peer_close(xpeer *pe, bool wait) {
    for (int r = 0; r < pe->d_world; r++) {
        if (pe->rk) td_ucx_rkey_destroy(pe->rk[r]);
        if (pe->ep && pe->ep[r]) {
            if (wait)
                td_ucx_ep_close_wait(pe->ep[r], 2000);
            else
                td_ucx_ep_close_flushed(pe->ep[r], TD_UCX_CLOSE_FORCE_MS);
        }
    }
    free(pe->ep);
    free(pe->rk);
    free(pe->routes);
    memset(pe, 0, sizeof *pe);
}

void td_xrank_destroy(td_xrank *xr) {
    if (!xr) return;
    for (int i = 0; i < TD_XRANK_MAX_PEERS; i++)
        if (xr->peers[i].used) peer_close(&xr->peers[i], true);
    for (int i = 0; i < TD_XRANK_MAX_JOBS; i++) job_clear(&xr->jobs[i]);
    for (int i = 0; i < TD_XRANK_MAX_PEERS; i++) td_xrank_link(xr, i, false);
    free(xr->addr);
    free(xr->rkey);
    if (xr->mem) td_engine_kv_release(xr->p.engine); /* runs kv_mem_release */
    TD_ASSERT(!xr->mem);
    if (xr->own_ucx) td_ucx_destroy(xr->ucx);
    free(xr);
}

/* ------------------------------------------------------------------ blob */

td_status td_xrank_link(td_xrank *xr, int slot, bool open) {
    if (!xr || slot < 0 || slot >= TD_XRANK_MAX_PEERS) return TD_ERR_INVALID;
    td_ucx_link_destroy(xr->links[slot]);
    xr->links[slot] = NULL;
    free(xr->link_addr[slot]);
    xr->link_addr[slot] = NULL;
    xr->link_addr_len[slot] = 0;
    if (!open) return TD_OK;
    td_status st = td_ucx_link_create(xr->ucx, &xr->links[slot]);
    if (!st)
        st = td_ucx_link_address(xr->links[slot], &xr->link_addr[slot], &xr->link_addr_len[slot]);
    if (st) {
        td_ucx_link_destroy(xr->links[slot]);
        xr->links[slot] = NULL;
    }
    return st;
}

td_status td_xrank_blob(td_xrank *xr, int link, uint8_t *buf, size_t cap, size_t *len) {
    const uint8_t *addr = xr->addr;
    size_t addr_len = xr->addr_len;
    if (link >= 0) {
        if (link >= TD_XRANK_MAX_PEERS || !xr->links[link]) return TD_ERR_INVALID;
        addr = xr->link_addr[link];
        addr_len = xr->link_addr_len[link];
    }
    size_t n = 24 + addr_len + xr->rkey_len;
    if (n > cap || addr_len > UINT32_MAX || xr->rkey_len > UINT32_MAX) return TD_ERR_RANGE;
    uint32_t al = (uint32_t)addr_len, rl = (uint32_t)xr->rkey_len;
    uint64_t base = (uint64_t)(uintptr_t)xr->base, bytes = (uint64_t)xr->bytes;
    memcpy(buf, &al, 4);
    memcpy(buf + 4, &rl, 4);
    memcpy(buf + 8, &base, 8);
    memcpy(buf + 16, &bytes, 8);
    memcpy(buf + 24, addr, addr_len);
    memcpy(buf + 24 + addr_len, xr->rkey, xr->rkey_len);
    *len = n;
    return TD_OK;
}

td_status td_xrank_blob_parse(const uint8_t *buf, size_t len, const uint8_t **addr,
                              size_t *addr_len, const uint8_t **rkey, size_t *rkey_len,
                              uint64_t *base, uint64_t *bytes) {
    if (len < 24) return TD_ERR_INVALID;
    uint32_t al, rl;
    memcpy(&al, buf, 4);
    memcpy(&rl, buf + 4, 4);
    memcpy(base, buf + 8, 8);
    memcpy(bytes, buf + 16, 8);
    if (al == 0 || rl == 0 || (uint64_t)al + rl + 24 > len) return TD_ERR_INVALID;
    *addr = buf + 24;
    *addr_len = al;
    *rkey = buf + 24 + al;
    *rkey_len = rl;
    return TD_OK;
}

/* ------------------------------------------------------------ directives */

static void dir_put(td_xdir_buf *b, const int32_t *w, size_t n) {
    if (b->oom) return;
    if (b->n + n > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->n + n) cap *= 2;
        int32_t *nw = realloc(b->w, cap * sizeof *nw);
        if (!nw) {
            b->oom = true;
            return;
        }
        b->w = nw;
        b->cap = cap;
    }
    memcpy(b->w + b->n, w, n * sizeof *w);
    b->n += n;
}

static void dir_head(td_xdir_buf *b, int32_t type, size_t words) {
    int32_t h[2] = {type, (int32_t)words};
    dir_put(b, h, 2);
}

void td_xdir_peer(td_xdir_buf *b, int32_t slot, const uint8_t *exchange, size_t len) {
    size_t words = 2 + WORDS(len);
    dir_head(b, TD_XDIR_PEER, words);
    int32_t h[2] = {slot, (int32_t)len};
    dir_put(b, h, 2);
    size_t start = b->n;
    int32_t zero = 0;
    for (size_t i = 0; i < WORDS(len); i++) dir_put(b, &zero, 1);
    if (!b->oom) memcpy(b->w + start, exchange, len);
}

void td_xdir_job(td_xdir_buf *b, int32_t slot, int32_t peer, int32_t n_prompt, int32_t d_cached,
                 uint64_t deadline_ns, const int32_t *dest, int32_t n_dest) {
    dir_head(b, TD_XDIR_JOB, 7 + (size_t)n_dest);
    int32_t h[7] = {slot,
                    peer,
                    n_prompt,
                    d_cached,
                    (int32_t)(uint32_t)(deadline_ns & 0xffffffffu),
                    (int32_t)(uint32_t)(deadline_ns >> 32),
                    n_dest};
    dir_put(b, h, 7);
    dir_put(b, dest, (size_t)n_dest);
}

void td_xdir_extend(td_xdir_buf *b, int32_t slot, uint64_t deadline_ns) {
    dir_head(b, TD_XDIR_EXTEND, 3);
    int32_t h[3] = {slot, (int32_t)(uint32_t)(deadline_ns & 0xffffffffu),
                    (int32_t)(uint32_t)(deadline_ns >> 32)};
    dir_put(b, h, 3);
}

void td_xdir_drop(td_xdir_buf *b, int32_t slot) {
    dir_head(b, TD_XDIR_DROP, 1);
    dir_put(b, &slot, 1);
}

void td_xdir_unpeer(td_xdir_buf *b, int32_t slot) {
    dir_head(b, TD_XDIR_UNPEER, 1);
    dir_put(b, &slot, 1);
}

void td_xdir_free(td_xdir_buf *b) {
    free(b->w);
    memset(b, 0, sizeof *b);
}

static void on_job_done(td_ucx_ops *ops, td_status st) {
    xjob *j = ops->ctx;
    atomic_store(&j->status, (int)st);
    atomic_store(&j->done, true);
}

static td_status apply_peer(td_xrank *xr, int32_t slot, const uint8_t *bytes, size_t len) {
    if (slot < 0 || slot >= TD_XRANK_MAX_PEERS) return TD_ERR_INVALID;
    xpeer *pe = &xr->peers[slot];
    if (pe->used) peer_close(pe, false);
    Tandem__Internal__V1__Exchange *ex = tandem__internal__v1__exchange__unpack(NULL, len, bytes);
    if (!ex) return TD_ERR_INVALID;
    td_status st = TD_ERR_INVALID;
    const Tandem__Internal__V1__Plan *pl = ex->plan;
    if (!pl || !ex->kv || pl->tp < 1 || pl->pp < 1 || pl->cp < 1 || pl->pp > TD_PLAN_MAX_PP ||
        pl->n_stage_begin != pl->pp + 1 || (uint64_t)pl->tp * pl->pp * pl->cp != ex->n_ranks ||
        ex->n_ranks > TD_COMM_MAX_RANKS)
        goto out;
    td_xfer_plan dp = {.tp = (int)pl->tp, .pp = (int)pl->pp, .cp = (int)pl->cp};
    for (uint32_t s = 0; s <= pl->pp; s++) dp.stage_begin[s] = (int32_t)pl->stage_begin[s];
    int n = 0;
    if ((st = td_xfer_map(&xr->p.plan, &dp, xr->p.n_layer, xr->p.n_head_kv, NULL, 0, &n)) &&
        st != TD_ERR_RANGE)
        goto out;
    td_xfer_route *all = malloc((size_t)TD_MAX(n, 1) * sizeof *all);
    pe->d_world = (int)ex->n_ranks;
    pe->ep = calloc((size_t)pe->d_world, sizeof *pe->ep);
    pe->rk = calloc((size_t)pe->d_world, sizeof *pe->rk);
    pe->routes = malloc((size_t)TD_MAX(n, 1) * sizeof *pe->routes);
    if (!all || !pe->ep || !pe->rk || !pe->routes) {
        free(all);
        st = TD_ERR_NOMEM;
        goto out_pe;
    }
    if ((st = td_xfer_map(&xr->p.plan, &dp, xr->p.n_layer, xr->p.n_head_kv, all, n, &n))) {
        free(all);
        goto out_pe;
    }
    for (int i = 0; i < n; i++)
        if (all[i].p_rank == xr->p.rank) pe->routes[pe->n_routes++] = all[i];
    free(all);
    pe->dplan = dp;
    pe->d_blocks = (int32_t)ex->kv->n_blocks;
    for (int i = 0; i < pe->n_routes; i++) {
        int d = pe->routes[i].d_rank;
        if (pe->ep[d]) continue;
        const Tandem__Internal__V1__RankEndpoint *re = NULL;
        for (size_t k = 0; k < ex->n_ranks; k++)
            if (ex->ranks[k]->rank == (uint32_t)d) re = ex->ranks[k];
        st = TD_ERR_INVALID;
        if (!re) goto out_pe;
        if ((st = td_ucx_ep_create(xr->ucx, re->worker_address.data, re->worker_address.len, NULL,
                                   &pe->ep[d])))
            goto out_pe;
        if ((st = td_ucx_rkey_create(pe->ep[d], re->kv_rkey.data, re->kv_rkey.len, re->kv_base,
                                     re->kv_bytes, &pe->rk[d])))
            goto out_pe;
    }
    pe->used = true;
    st = TD_OK;
    goto out;
out_pe:
    peer_close(pe, false);
    pe->used = true; /* known, but failed: its jobs fail */
    pe->failed = true;
out:
    tandem__internal__v1__exchange__free_unpacked(ex, NULL);
    if (st)
        TD_LOG_WARN("rank %d: decode instance slot %d unusable (%s)", xr->p.rank, slot,
                    td_status_str(st));
    return TD_OK; /* a bad peer fails its jobs, not the rank */
}

td_status td_xrank_apply(td_xrank *xr, const int32_t *w, size_t n) {
    size_t i = 0;
    while (i < n) {
        if (n - i < 2) goto bad;
        int32_t type = w[i], words = w[i + 1];
        i += 2;
        if (words < 1 || (size_t)words > n - i) goto bad;
        const int32_t *a = w + i;
        i += (size_t)words;
        switch (type) {
        case TD_XDIR_PEER:
            if (words < 2 || a[1] < 0 || WORDS((size_t)a[1]) + 2 != (size_t)words) goto bad;
            apply_peer(xr, a[0], (const uint8_t *)(a + 2), (size_t)a[1]);
            break;
        case TD_XDIR_JOB: {
            if (words >= 1 && a[0] >= 0 && a[0] < TD_XRANK_MAX_JOBS &&
                (xr->jobs[a[0]].stuck || xr->jobs[a[0]].waiting)) {
                /* the driver never reuses a busy slot */
                TD_LOG_ERROR("rank %d: job slot %d reused while its puts are in flight", xr->p.rank,
                             a[0]);
                goto bad;
            }
            if (words < 7 || a[0] < 0 || a[0] >= TD_XRANK_MAX_JOBS || a[1] < 0 ||
                a[1] >= TD_XRANK_MAX_PEERS || a[2] < 1 || a[3] < 0 || a[3] >= a[2] || a[6] < 1 ||
                (size_t)a[6] + 7 != (size_t)words)
                goto bad;
            xjob *j = &xr->jobs[a[0]];
            job_clear(j);
            j->used = true;
            j->peer = a[1];
            j->n_prompt = a[2];
            j->d_cached = a[3];
            j->deadline_ns = (uint64_t)(uint32_t)a[4] | ((uint64_t)(uint32_t)a[5] << 32);
            j->n_dest = a[6];
            j->dest = malloc((size_t)j->n_dest * sizeof *j->dest);
            j->pushed = malloc((size_t)TD_MAX(xr->n_layers, 1) * sizeof *j->pushed);
            if (!j->dest || !j->pushed) {
                j->failed = true;
                break;
            }
            memcpy(j->dest, a + 7, (size_t)j->n_dest * sizeof *j->dest);
            for (int32_t l = 0; l < xr->n_layers; l++) j->pushed[l] = j->d_cached;
            td_ucx_ops_init(&j->ops, on_job_done, j);
            const xpeer *pe = &xr->peers[j->peer];
            if (!pe->used || pe->failed) j->failed = true;
            for (int32_t b = 0; b < j->n_dest && !j->failed; b++)
                if (j->dest[b] < 0 || j->dest[b] >= pe->d_blocks) j->failed = true;
            break;
        }
        case TD_XDIR_EXTEND: {
            if (words != 3 || a[0] < 0 || a[0] >= TD_XRANK_MAX_JOBS) goto bad;
            xjob *j = &xr->jobs[a[0]];
            uint64_t ns = (uint64_t)(uint32_t)a[1] | ((uint64_t)(uint32_t)a[2] << 32);
            /* a dropped job keeps the deadline its flush runs against */
            if (j->used && !j->dropping && ns > j->deadline_ns) j->deadline_ns = ns;
            break;
        }
        case TD_XDIR_DROP:
            if (a[0] < 0 || a[0] >= TD_XRANK_MAX_JOBS) goto bad;
            if (xr->jobs[a[0]].used) xr->jobs[a[0]].dropping = true;
            break;
        case TD_XDIR_UNPEER:
            if (a[0] < 0 || a[0] >= TD_XRANK_MAX_PEERS) goto bad;
            if (xr->peers[a[0]].used) peer_close(&xr->peers[a[0]], false);
            break;
        default: goto bad;
        }
    }
    return TD_OK;
bad:
    TD_LOG_ERROR("rank %d: malformed transfer directives", xr->p.rank);
    return TD_ERR_INVALID;
}

/* ------------------------------------------------------------------ puts */

void td_xrank_batch(td_xrank *xr, const td_seq_chunk *seqs, const int32_t *slots, int32_t n) {
    xr->seqs = seqs;
    xr->slots = slots;
    xr->n_seqs = n;
}

static void put(xjob *j, xpeer *pe, int d, const char *src, size_t len, uint64_t off) {
    if (j->failed) return;
    /* Checked at every put: a rank that was stopped (or starved) past the
     * deadline writes nothing more into blocks the decode side may have
     * given to another sequence by now. */
    if (td_time_ns() > j->deadline_ns) {
        j->failed = true;
        return;
    }
    if (td_ucx_put(pe->ep[d], pe->rk[d], src, len, off, &j->ops) != TD_OK) j->failed = true;
}

/* Rows [a, upto) of global layer l of job j, through every route of this
 * rank that carries layer l. */
static void push(td_xrank *xr, xjob *j, const int32_t *blocks, int32_t l, int32_t a, int32_t upto) {
    xpeer *pe = &xr->peers[j->peer];
    const int32_t bs = xr->block_size;
    const int32_t hd = xr->p.head_dim;
    const int32_t lp = l - xr->layer0;
    const size_t elem = xr->lay.elem_bytes; /* the peer's: its Exchange gave our dtype */
    const char *kp = (const char *)xr->base + (size_t)lp * 2u * xr->lay.layer_bytes;
    const char *vp = kp + xr->lay.layer_bytes;
    for (int ri = 0; ri < pe->n_routes && !j->failed; ri++) {
        const td_xfer_route *rt = &pe->routes[ri];
        if (l < rt->layer_begin || l >= rt->layer_end) continue;
        int d = rt->d_rank;
        rank_geo dg = geo_of(&pe->dplan, d, xr->p.n_head_kv);
        size_t d_row = (size_t)(dg.h1 - dg.h0) * (size_t)hd * elem;
        uint64_t d_layer = (uint64_t)pe->d_blocks * (uint64_t)bs * d_row;
        uint64_t k_base = (uint64_t)(l - dg.layer0) * 2u * d_layer, v_base = k_base + d_layer;
        size_t seg = (size_t)(rt->head_end - rt->head_begin) * (size_t)hd * elem;
        size_t p_head = (size_t)(rt->head_begin - xr->h0) * (size_t)hd * elem;
        size_t d_head = (size_t)(rt->head_begin - dg.h0) * (size_t)hd * elem;
        bool whole = seg == xr->row && seg == d_row;
        for (int32_t b = a / bs; b * bs < upto && !j->failed; b++) {
            if (b % rt->block_mod != rt->block_res) continue;
            int32_t t0 = TD_MAX(a, b * bs), t1 = TD_MIN(upto, (b + 1) * bs);
            if (whole) {
                /* extend over following blocks consecutive on both sides */
                int32_t b1 = b;
                while (rt->block_mod == 1 && t1 < upto && blocks[b1 + 1] == blocks[b1] + 1 &&
                       j->dest[b1 + 1] == j->dest[b1] + 1) {
                    b1++;
                    t1 = TD_MIN(upto, (b1 + 1) * bs);
                }
                size_t len = (size_t)(t1 - t0) * xr->row;
                size_t lo = ((size_t)blocks[b] * (size_t)bs + (size_t)(t0 % bs)) * xr->row;
                uint64_t ro = ((uint64_t)j->dest[b] * (uint64_t)bs + (uint64_t)(t0 % bs)) * d_row;
                put(j, pe, d, kp + lo, len, k_base + ro);
                put(j, pe, d, vp + lo, len, v_base + ro);
                b = b1;
                continue;
            }
            for (int32_t t = t0; t < t1; t++) {
                size_t lo = ((size_t)blocks[b] * (size_t)bs + (size_t)(t % bs)) * xr->row + p_head;
                uint64_t ro =
                    ((uint64_t)j->dest[b] * (uint64_t)bs + (uint64_t)(t % bs)) * d_row + d_head;
                put(j, pe, d, kp + lo, seg, k_base + ro);
                put(j, pe, d, vp + lo, seg, v_base + ro);
            }
        }
    }
}

void td_xrank_layer(void *ctx, int32_t layer) {
    td_xrank *xr = ctx;
    if (!xr->slots) return;
    uint64_t now = td_time_ns();
    for (int32_t i = 0; i < xr->n_seqs; i++) {
        int32_t s = xr->slots[i];
        if (s < 0 || s >= TD_XRANK_MAX_JOBS || !xr->jobs[s].used) continue;
        xjob *j = &xr->jobs[s];
        if (j->failed || j->dropping || j->sealed) continue;
        if (now > j->deadline_ns) { /* no new writes into D's blocks after the deadline */
            j->failed = true;
            continue;
        }
        const td_seq_chunk *c = &xr->seqs[i];
        int32_t upto = TD_MIN(c->pos0 + c->n_tokens, j->n_prompt);
        if (upto > j->n_dest * xr->block_size) {
            j->failed = true;
            continue;
        }
        /* the hook runs once the layer is computed: before its puts */
        if (layer == xr->n_layers - 1 && xr->layer0 + layer == xr->p.n_layer - 1 &&
            upto == j->n_prompt) {
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            j->last_layer_unix = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
        }
        if (xr->p.layerwise) {
            if (j->pushed[layer] < upto) {
                push(xr, j, c->block_table, xr->layer0 + layer, j->pushed[layer], upto);
                j->pushed[layer] = upto;
            }
        } else if (layer == xr->n_layers - 1 && upto == j->n_prompt) {
            for (int32_t l = 0; l < xr->n_layers; l++) {
                push(xr, j, c->block_table, xr->layer0 + l, j->pushed[l], upto);
                j->pushed[l] = upto;
            }
        }
        if (layer == xr->n_layers - 1) {
            bool all = true;
            for (int32_t l = 0; l < xr->n_layers; l++) all &= j->pushed[l] >= j->n_prompt;
            j->complete = all;
        }
    }
}

/* Flushes j's endpoints and seals its group (once). */
static void seal(td_xrank *xr, xjob *j) {
    if (j->sealed) return;
    j->sealed = true;
    xpeer *pe = &xr->peers[j->peer];
    if (pe->ep && !j->failed)
        for (int d = 0; d < pe->d_world; d++)
            if (pe->ep[d] && td_ucx_flush(pe->ep[d], &j->ops) != TD_OK) j->failed = true;
    td_ucx_ops_seal(&j->ops);
}

static void sleep_us(long us) {
    struct timespec ts = {0, us * 1000L};
    nanosleep(&ts, NULL);
}

void td_xrank_finish(td_xrank *xr, td_xrank_report *rep) {
    xr->seqs = NULL;
    xr->slots = NULL;
    xr->n_seqs = 0;
    /* The jobs this step finished or dropped: sealed (their flushes
     * posted) together, then waited for together, a little. */
    uint64_t fresh[TD_XRANK_MAX_JOBS / 64] = {0};
    bool any = false;
    for (int s = 0; s < TD_XRANK_MAX_JOBS; s++) {
        xjob *j = &xr->jobs[s];
        if (!j->used || j->stuck || j->waiting || (!j->complete && !j->dropping && !j->failed))
            continue;
        seal(xr, j);
        fresh[s / 64] |= 1ull << (s % 64);
        any = true;
        if (j->complete && j->last_layer_unix && rep->n_ended < TD_XRANK_MAX_ENDED) {
            rep->ended[rep->n_ended].slot = s;
            rep->ended[rep->n_ended].unix_ns = j->last_layer_unix;
            rep->n_ended++;
        }
    }
    uint64_t until = td_time_ns() + FLUSH_WAIT_NS;
    for (long spin = 0; any && td_time_ns() < until; spin++) {
        bool all = true;
        for (int s = 0; s < TD_XRANK_MAX_JOBS && all; s++)
            if ((fresh[s / 64] >> (s % 64)) & 1u) all = atomic_load(&xr->jobs[s].done);
        if (all) break;
        sleep_us(spin < 100 ? 20 : 200);
    }
    for (int s = 0; s < TD_XRANK_MAX_JOBS; s++) {
        xjob *j = &xr->jobs[s];
        uint64_t bit = 1ull << (s % 64);
        if (j->stuck) { /* not waited for again: checked once per step */
            if (atomic_load(&j->done)) {
                TD_LOG_INFO("rank %d: job %d: its last puts completed", xr->p.rank, s);
                job_clear(j);
            } else {
                rep->busy[s / 64] |= bit;
                rep->failed[s / 64] |= bit;
            }
            continue;
        }
        if (!j->used || (!j->waiting && !((fresh[s / 64] >> (s % 64)) & 1u))) continue;
        /* Still in flight: busy (its sources stay, the driver answers D
         * later) and checked again at the next step, so that one slow or
         * unreachable decode instance does not hold up the others' jobs.
         * At the deadline the endpoints to that instance are closed once
         * flushed (td_ucx_ep_close_flushed): the puts end when the
         * transport is done with them, delivered or failed, and the job
         * keeps its sources until then. */
        if (!atomic_load(&j->done) && td_time_ns() < j->deadline_ns) {
            j->waiting = true;
            rep->busy[s / 64] |= bit;
            continue;
        }
        j->waiting = false;
        if (!atomic_load(&j->done)) {
            xpeer *pe = &xr->peers[j->peer];
            if (pe->ep) {
                TD_LOG_WARN("rank %d: job %d still has puts in flight at its deadline: closing "
                            "the endpoints to that decode instance",
                            xr->p.rank, s);
                peer_close(pe, false);
            }
            pe->used = pe->failed = true;
            j->failed = true;
        }
        if (atomic_load(&j->status) != TD_OK) j->failed = true;
        if (j->failed) rep->failed[s / 64] |= bit;
        if (xr->peers[j->peer].failed) rep->peer_failed |= 1ull << j->peer;
        if (j->dropping) {
            if (!atomic_load(&j->done)) {
                /* the group's requests still point into j: it stays, and the
                 * driver keeps the source blocks and the slot */
                TD_LOG_WARN("rank %d: job %d: puts still in flight; its sources stay until they "
                            "end",
                            xr->p.rank, s);
                j->stuck = true;
                rep->busy[s / 64] |= bit;
                continue;
            }
            job_clear(j);
        } else {
            j->complete = false; /* reported; dropped later by the driver */
        }
    }
    for (int p = 0; p < TD_XRANK_MAX_PEERS; p++)
        if (xr->peers[p].used && xr->peers[p].failed) rep->peer_failed |= 1ull << p;
}
