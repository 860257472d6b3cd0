/* Internals shared by the comm backends (comm-single.c dispatches). */
#ifndef TD_COMM_IMPL_H
#define TD_COMM_IMPL_H

#include "comm.h"

struct td_comm {
    int rank;
    int size;
    td_comm_group *group; /* NULL: world of one */
};

td_status td_comm_local_all_reduce_sum(td_comm *comm, float *buf, size_t n);
td_status td_comm_local_all_gather(td_comm *comm, const void *send, void *recv,
                                   size_t bytes_per_rank);
td_status td_comm_local_broadcast(td_comm *comm, void *buf, size_t bytes, int root);
td_status td_comm_local_barrier(td_comm *comm);

#endif
