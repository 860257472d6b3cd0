/* Communicator entry points and the single-rank backend: a world of one,
 * where every collective is the identity (or a copy where send and receive
 * buffers differ). Multi-rank backends are reached through comm->group. */
#include <string.h>

#include "comm-impl.h"

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

void td_comm_destroy(td_comm *comm) { free(comm); }

int td_comm_rank(const td_comm *comm) { return comm->rank; }
int td_comm_size(const td_comm *comm) { return comm->size; }

td_status td_comm_all_reduce_sum(td_comm *comm, float *buf, size_t n) {
    if (!comm || (!buf && n)) return TD_ERR_INVALID;
    if (comm->group) return td_comm_local_all_reduce_sum(comm, buf, n);
    return TD_OK;
}

td_status td_comm_all_gather(td_comm *comm, const void *send, void *recv, size_t bytes_per_rank) {
    if (!comm || ((!send || !recv) && bytes_per_rank)) return TD_ERR_INVALID;
    if (comm->group) return td_comm_local_all_gather(comm, send, recv, bytes_per_rank);
    if (send != recv && bytes_per_rank) memmove(recv, send, bytes_per_rank);
    return TD_OK;
}

td_status td_comm_broadcast(td_comm *comm, void *buf, size_t bytes, int root) {
    if (!comm || (!buf && bytes) || root < 0 || root >= comm->size) return TD_ERR_INVALID;
    if (comm->group) return td_comm_local_broadcast(comm, buf, bytes, root);
    return TD_OK;
}

td_status td_comm_barrier(td_comm *comm) {
    if (!comm) return TD_ERR_INVALID;
    if (comm->group) return td_comm_local_barrier(comm);
    return TD_OK;
}
