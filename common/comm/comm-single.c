/* The world of one (comm-impl.h's single backend): every collective is the
 * identity, or a copy where send and receive buffers differ; there is no
 * peer to send to (comm.c refuses it). */
#include <string.h>

#include "comm-impl.h"

static void copy_if_apart(void *dst, const void *src, size_t bytes) {
    if (dst != src && bytes) memmove(dst, src, bytes);
}

static void single_destroy(td_comm *c) { free(c); }

static void single_abort(td_comm *c) { TD_UNUSED(c); }

static td_status single_split(td_comm *c, int color, int key, td_comm **sub_p) {
    TD_UNUSED(c);
    TD_UNUSED(key);
    if (color < 0) {
        *sub_p = NULL;
        return TD_OK;
    }
    return td_comm_create_single(sub_p);
}

static td_status single_barrier(td_comm *c) {
    TD_UNUSED(c);
    return TD_OK;
}

static td_status single_broadcast(td_comm *c, void *buf, size_t bytes, int root, td_comm_stream s) {
    TD_UNUSED(c);
    TD_UNUSED(buf);
    TD_UNUSED(bytes);
    TD_UNUSED(root);
    TD_UNUSED(s);
    return TD_OK;
}

static td_status single_copy(td_comm *c, const void *send, void *recv, size_t bpr, int root,
                             td_comm_stream s) {
    TD_UNUSED(c);
    TD_UNUSED(root);
    TD_UNUSED(s);
    copy_if_apart(recv, send, bpr);
    return TD_OK;
}

static td_status single_all_gather(td_comm *c, const void *send, void *recv, size_t bpr,
                                   td_comm_stream s) {
    return single_copy(c, send, recv, bpr, 0, s);
}

static td_status single_reduce(td_comm *c, const void *send, void *recv, size_t n, td_comm_dtype dt,
                               td_comm_op op, int root, bool all, td_comm_stream s) {
    TD_UNUSED(op);
    TD_UNUSED(all);
    return single_copy(c, send, recv, n * td_comm_dtype_size(dt), root, s);
}

static td_status single_reduce_scatter(td_comm *c, const void *send, void *recv, size_t n,
                                       td_comm_dtype dt, td_comm_op op, td_comm_stream s) {
    TD_UNUSED(op);
    return single_copy(c, send, recv, n * td_comm_dtype_size(dt), 0, s);
}

static td_status single_all_to_all_v(td_comm *c, const void *send, const size_t *send_bytes,
                                     const size_t *send_displs, void *recv,
                                     const size_t *recv_bytes, const size_t *recv_displs,
                                     td_comm_stream s) {
    TD_UNUSED(c);
    TD_UNUSED(s);
    if (send_bytes[0] != recv_bytes[0]) return TD_ERR_INVALID;
    if (send_bytes[0])
        memmove((uint8_t *)recv + recv_displs[0], (const uint8_t *)send + send_displs[0],
                send_bytes[0]);
    return TD_OK;
}

/* (comm.c refuses every peer of a world of one: never called) */
static td_status single_send(td_comm *c, const void *buf, size_t bytes, int peer,
                             td_comm_stream s) {
    TD_UNUSED(c);
    TD_UNUSED(buf);
    TD_UNUSED(bytes);
    TD_UNUSED(peer);
    TD_UNUSED(s);
    return TD_ERR_INVALID;
}

static td_status single_recv(td_comm *c, void *buf, size_t bytes, int peer, td_comm_stream s) {
    return single_send(c, buf, bytes, peer, s);
}

static const td_comm_ops k_single_ops = {.name = "single",
                                         .destroy = single_destroy,
                                         .abort = single_abort,
                                         .split = single_split,
                                         .barrier = single_barrier,
                                         .broadcast = single_broadcast,
                                         .scatter = single_copy,
                                         .gather = single_copy,
                                         .all_gather = single_all_gather,
                                         .reduce = single_reduce,
                                         .reduce_scatter = single_reduce_scatter,
                                         .all_to_all_v = single_all_to_all_v,
                                         .send = single_send,
                                         .recv = single_recv};

td_status td_comm_create_single(td_comm **comm_p) {
    if (!comm_p) return TD_ERR_INVALID;
    td_comm *c = calloc(1, sizeof *c);
    if (!c) {
        TD_LOG_ERROR("out of memory");
        return TD_ERR_NOMEM;
    }
    c->ops = &k_single_ops;
    c->rank = 0;
    c->size = 1;
    *comm_p = c;
    return TD_OK;
}
