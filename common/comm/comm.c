/* The communicator's entry points (comm.h): every call's arguments are
 * checked here, once for every backend, then the communicator's table
 * (comm-impl.h) does the work. */
#include <string.h>

#include "comm-impl.h"

td_comm_params td_comm_default_params(void) {
    return (td_comm_params){.chunk_bytes = (size_t)1 << 20, .timeout_s = 60.0};
}

size_t td_comm_dtype_size(td_comm_dtype dt) {
    switch (dt) {
    case TD_COMM_F32: return 4;
    case TD_COMM_F16:
    case TD_COMM_BF16: return 2;
    }
    return 0;
}

void td_comm_destroy(td_comm *comm) {
    if (comm) comm->ops->destroy(comm);
}

void td_comm_abort(td_comm *comm) {
    if (comm) comm->ops->abort(comm);
}

int td_comm_rank(const td_comm *comm) { return comm->rank; }
int td_comm_size(const td_comm *comm) { return comm->size; }

static bool root_ok(const td_comm *c, int root) { return root >= 0 && root < c->size; }
static bool op_ok(td_comm_op op) { return op == TD_COMM_SUM || op == TD_COMM_MAX; }
/* A stream only where the backend takes one. */
static bool stream_ok(const td_comm *c, td_comm_stream s) { return !s || c->ops->streams; }
/* n elements of dt: a known type, and n * size fits. */
static bool elems_ok(td_comm_dtype dt, size_t n, size_t *bytes) {
    size_t esz = td_comm_dtype_size(dt);
    return esz && !td_mul_overflow(n, esz, bytes);
}

td_status td_comm_split(td_comm *comm, int color, int key, td_comm **sub_p) {
    if (!comm || !sub_p) return TD_ERR_INVALID;
    return comm->ops->split(comm, color, key, sub_p);
}

td_status td_comm_barrier(td_comm *comm) {
    if (!comm) return TD_ERR_INVALID;
    return comm->ops->barrier(comm);
}

td_status td_comm_broadcast(td_comm *comm, void *buf, size_t bytes, int root,
                            td_comm_stream stream) {
    if (!comm || (!buf && bytes) || !root_ok(comm, root) || !stream_ok(comm, stream))
        return TD_ERR_INVALID;
    return comm->ops->broadcast(comm, buf, bytes, root, stream);
}

td_status td_comm_scatter(td_comm *comm, const void *send, void *recv, size_t bytes_per_rank,
                          int root, td_comm_stream stream) {
    if (!comm || !root_ok(comm, root) || (!recv && bytes_per_rank) ||
        (!send && bytes_per_rank && comm->rank == root) || !stream_ok(comm, stream))
        return TD_ERR_INVALID;
    return comm->ops->scatter(comm, send, recv, bytes_per_rank, root, stream);
}

td_status td_comm_gather(td_comm *comm, const void *send, void *recv, size_t bytes_per_rank,
                         int root, td_comm_stream stream) {
    if (!comm || !root_ok(comm, root) || (!send && bytes_per_rank) ||
        (!recv && bytes_per_rank && comm->rank == root) || !stream_ok(comm, stream))
        return TD_ERR_INVALID;
    return comm->ops->gather(comm, send, recv, bytes_per_rank, root, stream);
}

td_status td_comm_all_gather(td_comm *comm, const void *send, void *recv, size_t bytes_per_rank,
                             td_comm_stream stream) {
    if (!comm || ((!send || !recv) && bytes_per_rank) || !stream_ok(comm, stream))
        return TD_ERR_INVALID;
    return comm->ops->all_gather(comm, send, recv, bytes_per_rank, stream);
}

td_status td_comm_reduce(td_comm *comm, const void *send, void *recv, size_t n, td_comm_dtype dtype,
                         td_comm_op op, int root, td_comm_stream stream) {
    size_t bytes;
    if (!comm || !op_ok(op) || !root_ok(comm, root) || !elems_ok(dtype, n, &bytes) ||
        (!send && n) || (!recv && n && comm->rank == root) || !stream_ok(comm, stream))
        return TD_ERR_INVALID;
    return comm->ops->reduce(comm, send, recv, n, dtype, op, root, false, stream);
}

td_status td_comm_all_reduce(td_comm *comm, void *buf, size_t n, td_comm_dtype dtype, td_comm_op op,
                             td_comm_stream stream) {
    size_t bytes;
    if (!comm || !op_ok(op) || !elems_ok(dtype, n, &bytes) || (!buf && n) ||
        !stream_ok(comm, stream))
        return TD_ERR_INVALID;
    return comm->ops->reduce(comm, buf, buf, n, dtype, op, 0, true, stream);
}

td_status td_comm_reduce_scatter(td_comm *comm, const void *send, void *recv, size_t n_per_rank,
                                 td_comm_dtype dtype, td_comm_op op, td_comm_stream stream) {
    size_t bytes, total;
    if (!comm || !op_ok(op) || !elems_ok(dtype, n_per_rank, &bytes) ||
        td_mul_overflow(bytes, (size_t)comm->size, &total) || ((!send || !recv) && n_per_rank) ||
        !stream_ok(comm, stream))
        return TD_ERR_INVALID;
    return comm->ops->reduce_scatter(comm, send, recv, n_per_rank, dtype, op, stream);
}

td_status td_comm_all_to_all_v(td_comm *comm, const void *send, const size_t *send_bytes,
                               const size_t *send_displs, void *recv, const size_t *recv_bytes,
                               const size_t *recv_displs, td_comm_stream stream) {
    if (!comm || !send_bytes || !send_displs || !recv_bytes || !recv_displs ||
        !stream_ok(comm, stream))
        return TD_ERR_INVALID;
    for (int k = 0; k < comm->size; k++) {
        size_t end;
        if ((send_bytes[k] && !send) || (recv_bytes[k] && !recv) ||
            td_add_overflow(send_displs[k], send_bytes[k], &end) ||
            td_add_overflow(recv_displs[k], recv_bytes[k], &end))
            return TD_ERR_INVALID;
    }
    return comm->ops->all_to_all_v(comm, send, send_bytes, send_displs, recv, recv_bytes,
                                   recv_displs, stream);
}

td_status td_comm_all_to_all(td_comm *comm, const void *send, void *recv, size_t bytes_per_rank,
                             td_comm_stream stream) {
    size_t total;
    if (!comm || ((!send || !recv) && bytes_per_rank) ||
        td_mul_overflow(bytes_per_rank, (size_t)comm->size, &total))
        return TD_ERR_INVALID;
    size_t counts[TD_COMM_MAX_RANKS], displs[TD_COMM_MAX_RANKS];
    for (int k = 0; k < comm->size && k < TD_COMM_MAX_RANKS; k++) {
        counts[k] = bytes_per_rank;
        displs[k] = (size_t)k * bytes_per_rank;
    }
    return td_comm_all_to_all_v(comm, send, counts, displs, recv, counts, displs, stream);
}

td_status td_comm_send(td_comm *comm, const void *buf, size_t bytes, int peer,
                       td_comm_stream stream) {
    if (!comm || (!buf && bytes) || !root_ok(comm, peer) || peer == comm->rank ||
        !stream_ok(comm, stream))
        return TD_ERR_INVALID;
    return comm->ops->send(comm, buf, bytes, peer, stream);
}

td_status td_comm_recv(td_comm *comm, void *buf, size_t bytes, int peer, td_comm_stream stream) {
    if (!comm || (!buf && bytes) || !root_ok(comm, peer) || peer == comm->rank ||
        !stream_ok(comm, stream))
        return TD_ERR_INVALID;
    return comm->ops->recv(comm, buf, bytes, peer, stream);
}
