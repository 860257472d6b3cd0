/* In-process backend: ranks are threads of one process sharing a group.
 * Every collective publishes each rank's buffer in a slot, meets at a
 * barrier, works on the published buffers, and meets again before anyone
 * may reuse them. all_reduce_sum: rank r adds segment r of every rank's
 * buffer in rank order into the group's result buffer, then every rank
 * copies the result, so all ranks get the same bits. */
#include <pthread.h>
#include <stdbool.h>
#include <string.h>

#include "comm-impl.h"

struct td_comm_group {
    int n;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int arrived;
    uint64_t phase;
    const void **slots; /* (n) buffers published by the ranks */
    float *result;      /* (cap) all-reduce result */
    size_t cap;
    bool failed; /* a rank could not grow the result buffer */
};

td_status td_comm_group_create(int n_ranks, td_comm_group **group_p) {
    if (n_ranks < 1 || n_ranks > 4096 || !group_p) return TD_ERR_INVALID;
    td_comm_group *g = calloc(1, sizeof *g);
    if (!g || !(g->slots = calloc((size_t)n_ranks, sizeof *g->slots))) {
        free(g);
        TD_LOG_ERROR("out of memory");
        return TD_ERR_NOMEM;
    }
    g->n = n_ranks;
    pthread_mutex_init(&g->mu, NULL);
    pthread_cond_init(&g->cv, NULL);
    *group_p = g;
    return TD_OK;
}

void td_comm_group_destroy(td_comm_group *g) {
    if (!g) return;
    pthread_cond_destroy(&g->cv);
    pthread_mutex_destroy(&g->mu);
    free(g->result);
    free(g->slots);
    free(g);
}

td_status td_comm_create_local(td_comm_group *group, int rank, td_comm **comm_p) {
    if (!group || rank < 0 || rank >= group->n || !comm_p) return TD_ERR_INVALID;
    td_comm *c = calloc(1, sizeof *c);
    if (!c) {
        TD_LOG_ERROR("out of memory");
        return TD_ERR_NOMEM;
    }
    c->rank = rank;
    c->size = group->n;
    c->group = group;
    *comm_p = c;
    return TD_OK;
}

/* Publishes `slot` for this rank and waits for all ranks. need: result
 * floats this collective needs (grown by whichever rank gets here first). */
static td_status meet(td_comm *comm, const void *slot, size_t need) {
    td_comm_group *g = comm->group;
    pthread_mutex_lock(&g->mu);
    g->slots[comm->rank] = slot;
    if (need > g->cap) {
        float *r = realloc(g->result, need * sizeof(float));
        if (r) {
            g->result = r;
            g->cap = need;
        } else {
            g->failed = true;
        }
    }
    uint64_t phase = g->phase;
    if (++g->arrived == g->n) {
        g->arrived = 0;
        g->phase++;
        pthread_cond_broadcast(&g->cv);
    } else {
        while (g->phase == phase) pthread_cond_wait(&g->cv, &g->mu);
    }
    bool failed = g->failed;
    pthread_mutex_unlock(&g->mu);
    return failed ? TD_ERR_NOMEM : TD_OK;
}

/* Second meeting: nobody leaves until every rank is done with the slots.
 * Clears the failure flag for the next collective. */
static void leave(td_comm *comm) {
    td_comm_group *g = comm->group;
    pthread_mutex_lock(&g->mu);
    uint64_t phase = g->phase;
    if (++g->arrived == g->n) {
        g->arrived = 0;
        g->phase++;
        g->failed = false;
        pthread_cond_broadcast(&g->cv);
    } else {
        while (g->phase == phase) pthread_cond_wait(&g->cv, &g->mu);
    }
    pthread_mutex_unlock(&g->mu);
}

td_status td_comm_local_all_reduce_sum(td_comm *comm, float *buf, size_t n) {
    td_comm_group *g = comm->group;
    td_status st = meet(comm, buf, n);
    if (st == TD_OK) {
        size_t per = n / (size_t)g->n, rem = n % (size_t)g->n, r = (size_t)comm->rank;
        size_t b = r * per + (r < rem ? r : rem), e = b + per + (r < rem ? 1 : 0);
        for (size_t i = b; i < e; i++) {
            float s = ((const float *)g->slots[0])[i];
            for (int k = 1; k < g->n; k++) s += ((const float *)g->slots[k])[i];
            g->result[i] = s;
        }
    }
    leave(comm); /* every segment summed before anyone overwrites its input */
    if (st == TD_OK) {
        memcpy(buf, g->result, n * sizeof(float));
        leave(comm); /* the result stays until every rank has copied it */
    } else {
        leave(comm);
        TD_LOG_ERROR("out of memory for an all-reduce of %zu floats", n);
    }
    return st;
}

td_status td_comm_local_all_gather(td_comm *comm, const void *send, void *recv,
                                   size_t bytes_per_rank) {
    td_comm_group *g = comm->group;
    td_status st = meet(comm, send, 0);
    for (int k = 0; k < g->n && st == TD_OK; k++)
        memcpy((uint8_t *)recv + (size_t)k * bytes_per_rank, g->slots[k], bytes_per_rank);
    leave(comm);
    return st;
}

td_status td_comm_local_broadcast(td_comm *comm, void *buf, size_t bytes, int root) {
    td_comm_group *g = comm->group;
    td_status st = meet(comm, buf, 0);
    if (st == TD_OK && comm->rank != root) memcpy(buf, g->slots[root], bytes);
    leave(comm);
    return st;
}

td_status td_comm_local_barrier(td_comm *comm) {
    td_status st = meet(comm, NULL, 0);
    leave(comm);
    return st;
}
