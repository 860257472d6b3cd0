/* Internals shared by the comm backends. comm-single.c holds the public
 * entry points (argument checks, the world of one) and dispatches to the
 * shared-memory engine of comm-shm.c, which serves both the shm backend
 * (a POSIX shared-memory object mapped by every rank process) and the
 * local backend (the same layout in heap memory shared by threads). */
#ifndef TD_COMM_IMPL_H
#define TD_COMM_IMPL_H

#include <stdbool.h>

#include "comm.h"

/* A segment as mapped by this process; reference-counted by the
 * communicators (and the local group) that use it. */
typedef struct td_comm_seg td_comm_seg;

struct td_comm {
    int rank;
    int size;
    td_comm_seg *seg; /* NULL: world of one */
    int gid;          /* group slot in the segment */
    int *members;     /* (size) world ranks of this communicator's ranks */
    uint32_t epoch;   /* barriers this rank has passed in its group */
};

struct td_comm_group {
    td_comm_seg *seg;
    int n;
};

/* Segment in heap memory for n threads (the local backend). */
td_status td_comm_seg_create_heap(int n, const td_comm_params *p, td_comm_seg **seg_p);
void td_comm_seg_ref(td_comm_seg *seg);
void td_comm_seg_unref(td_comm_seg *seg); /* accepts NULL; unmaps at zero */

/* A communicator on the world group of seg for `rank` (takes a reference). */
td_status td_comm_seg_comm_create(td_comm_seg *seg, int rank, td_comm **comm_p);

/* Engine entry points; arguments already checked by comm-single.c. */
td_status td_comm_seg_barrier(td_comm *c);
td_status td_comm_seg_broadcast(td_comm *c, void *buf, size_t bytes, int root);
td_status td_comm_seg_scatter(td_comm *c, const void *send, void *recv, size_t bpr, int root);
td_status td_comm_seg_gather(td_comm *c, const void *send, void *recv, size_t bpr, int root);
td_status td_comm_seg_all_gather(td_comm *c, const void *send, void *recv, size_t bpr);
td_status td_comm_seg_reduce(td_comm *c, const float *send, float *recv, size_t n, td_comm_op op,
                             int root, bool all);
td_status td_comm_seg_reduce_scatter(td_comm *c, const float *send, float *recv, size_t n,
                                     td_comm_op op);
td_status td_comm_seg_all_to_all_v(td_comm *c, const void *send, const size_t *send_bytes,
                                   const size_t *send_displs, void *recv, const size_t *recv_bytes,
                                   const size_t *recv_displs);
td_status td_comm_seg_send(td_comm *c, const void *buf, size_t bytes, int peer);
td_status td_comm_seg_recv(td_comm *c, void *buf, size_t bytes, int peer);
void td_comm_seg_abort(td_comm_seg *seg);
td_status td_comm_seg_split(td_comm *c, int color, int key, td_comm **sub_p);

#endif
