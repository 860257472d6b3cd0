/* Communicator entry points: argument checks, then either the world of one
 * (every collective is the identity, or a copy where send and receive
 * buffers differ) or the shared-memory engine (comm-shm.c) that serves the
 * local and shm backends. */
#include <string.h>

#include "comm-impl.h"

td_comm_params td_comm_default_params(void) {
    return (td_comm_params){.chunk_bytes = (size_t)1 << 20, .timeout_s = 60.0};
}

td_status td_comm_create_single(td_comm **comm_p) {
    if (!comm_p) return TD_ERR_INVALID;
    td_comm *c = calloc(1, sizeof *c);
    if (!c) {
        TD_LOG_ERROR("out of memory");
        return TD_ERR_NOMEM;
    }
    c->rank = 0;
    c->size = 1;
    *comm_p = c;
    return TD_OK;
}

void td_comm_destroy(td_comm *comm) {
    if (!comm) return;
    td_comm_seg_unref(comm->seg);
    free(comm->members);
    free(comm);
}

void td_comm_abort(td_comm *comm) {
    if (comm && comm->seg) td_comm_seg_abort(comm->seg);
}

int td_comm_rank(const td_comm *comm) { return comm->rank; }
int td_comm_size(const td_comm *comm) { return comm->size; }

static void copy_if_apart(void *dst, const void *src, size_t bytes) {
    if (dst != src && bytes) memmove(dst, src, bytes);
}

static bool root_ok(const td_comm *c, int root) { return root >= 0 && root < c->size; }

td_status td_comm_split(td_comm *comm, int color, int key, td_comm **sub_p) {
    if (!comm || !sub_p) return TD_ERR_INVALID;
    if (comm->seg) return td_comm_seg_split(comm, color, key, sub_p);
    if (color < 0) {
        *sub_p = NULL;
        return TD_OK;
    }
    return td_comm_create_single(sub_p);
}

td_status td_comm_barrier(td_comm *comm) {
    if (!comm) return TD_ERR_INVALID;
    return comm->seg ? td_comm_seg_barrier(comm) : TD_OK;
}

td_status td_comm_broadcast(td_comm *comm, void *buf, size_t bytes, int root) {
    if (!comm || (!buf && bytes) || !root_ok(comm, root)) return TD_ERR_INVALID;
    return comm->seg ? td_comm_seg_broadcast(comm, buf, bytes, root) : TD_OK;
}

td_status td_comm_scatter(td_comm *comm, const void *send, void *recv, size_t bytes_per_rank,
                          int root) {
    if (!comm || !root_ok(comm, root) || (!recv && bytes_per_rank) ||
        (!send && bytes_per_rank && comm->rank == root))
        return TD_ERR_INVALID;
    if (comm->seg) return td_comm_seg_scatter(comm, send, recv, bytes_per_rank, root);
    copy_if_apart(recv, send, bytes_per_rank);
    return TD_OK;
}

td_status td_comm_gather(td_comm *comm, const void *send, void *recv, size_t bytes_per_rank,
                         int root) {
    if (!comm || !root_ok(comm, root) || (!send && bytes_per_rank) ||
        (!recv && bytes_per_rank && comm->rank == root))
        return TD_ERR_INVALID;
    if (comm->seg) return td_comm_seg_gather(comm, send, recv, bytes_per_rank, root);
    copy_if_apart(recv, send, bytes_per_rank);
    return TD_OK;
}

td_status td_comm_all_gather(td_comm *comm, const void *send, void *recv, size_t bytes_per_rank) {
    if (!comm || ((!send || !recv) && bytes_per_rank)) return TD_ERR_INVALID;
    if (comm->seg) return td_comm_seg_all_gather(comm, send, recv, bytes_per_rank);
    copy_if_apart(recv, send, bytes_per_rank);
    return TD_OK;
}

static bool op_ok(td_comm_op op) { return op == TD_COMM_SUM || op == TD_COMM_MAX; }

td_status td_comm_reduce(td_comm *comm, const float *send, float *recv, size_t n, td_comm_op op,
                         int root) {
    if (!comm || !op_ok(op) || !root_ok(comm, root) || (!send && n) ||
        (!recv && n && comm->rank == root) || n > SIZE_MAX / sizeof(float))
        return TD_ERR_INVALID;
    if (comm->seg) return td_comm_seg_reduce(comm, send, recv, n, op, root, false);
    copy_if_apart(recv, send, n * sizeof(float));
    return TD_OK;
}

td_status td_comm_all_reduce(td_comm *comm, float *buf, size_t n, td_comm_op op) {
    if (!comm || !op_ok(op) || (!buf && n) || n > SIZE_MAX / sizeof(float)) return TD_ERR_INVALID;
    return comm->seg ? td_comm_seg_reduce(comm, buf, buf, n, op, 0, true) : TD_OK;
}

td_status td_comm_all_reduce_sum(td_comm *comm, float *buf, size_t n) {
    return td_comm_all_reduce(comm, buf, n, TD_COMM_SUM);
}

td_status td_comm_reduce_scatter(td_comm *comm, const float *send, float *recv, size_t n_per_rank,
                                 td_comm_op op) {
    size_t total;
    if (!comm || !op_ok(op) || ((!send || !recv) && n_per_rank) ||
        td_mul_overflow(n_per_rank, (size_t)comm->size * sizeof(float), &total))
        return TD_ERR_INVALID;
    if (comm->seg) return td_comm_seg_reduce_scatter(comm, send, recv, n_per_rank, op);
    copy_if_apart(recv, send, n_per_rank * sizeof(float));
    return TD_OK;
}

td_status td_comm_all_to_all(td_comm *comm, const void *send, void *recv, size_t bytes_per_rank) {
    size_t total;
    if (!comm || ((!send || !recv) && bytes_per_rank) ||
        td_mul_overflow(bytes_per_rank, (size_t)comm->size, &total))
        return TD_ERR_INVALID;
    if (!comm->seg) {
        copy_if_apart(recv, send, bytes_per_rank);
        return TD_OK;
    }
    size_t counts[TD_COMM_MAX_RANKS], displs[TD_COMM_MAX_RANKS];
    for (int k = 0; k < comm->size; k++) {
        counts[k] = bytes_per_rank;
        displs[k] = (size_t)k * bytes_per_rank;
    }
    return td_comm_seg_all_to_all_v(comm, send, counts, displs, recv, counts, displs);
}

td_status td_comm_all_to_all_v(td_comm *comm, const void *send, const size_t *send_bytes,
                               const size_t *send_displs, void *recv, const size_t *recv_bytes,
                               const size_t *recv_displs) {
    if (!comm || !send_bytes || !send_displs || !recv_bytes || !recv_displs) return TD_ERR_INVALID;
    for (int k = 0; k < comm->size; k++) {
        size_t end;
        if ((send_bytes[k] && !send) || (recv_bytes[k] && !recv) ||
            td_add_overflow(send_displs[k], send_bytes[k], &end) ||
            td_add_overflow(recv_displs[k], recv_bytes[k], &end))
            return TD_ERR_INVALID;
    }
    if (comm->seg)
        return td_comm_seg_all_to_all_v(comm, send, send_bytes, send_displs, recv, recv_bytes,
                                        recv_displs);
    if (send_bytes[0] != recv_bytes[0]) return TD_ERR_INVALID;
    if (send_bytes[0])
        memmove((uint8_t *)recv + recv_displs[0], (const uint8_t *)send + send_displs[0],
                send_bytes[0]);
    return TD_OK;
}

td_status td_comm_send(td_comm *comm, const void *buf, size_t bytes, int peer) {
    if (!comm || (!buf && bytes) || !root_ok(comm, peer) || peer == comm->rank)
        return TD_ERR_INVALID;
    return td_comm_seg_send(comm, buf, bytes, peer);
}

td_status td_comm_recv(td_comm *comm, void *buf, size_t bytes, int peer) {
    if (!comm || (!buf && bytes) || !root_ok(comm, peer) || peer == comm->rank)
        return TD_ERR_INVALID;
    return td_comm_seg_recv(comm, buf, bytes, peer);
}
