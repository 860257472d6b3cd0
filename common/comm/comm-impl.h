/* The seam between the communicator's entry points and its backends
 * (comm.h is the contract). comm.c checks every call's arguments and
 * calls the communicator's table; each backend fills one table and never
 * calls into another's: comm-single.c (a world of one) and comm-shm.c
 * (the shared-memory engine, for rank processes mapping one POSIX object,
 * or for threads sharing the same layout in heap memory). A device backend
 * (NCCL) is a third table. */
#ifndef TD_COMM_IMPL_H
#define TD_COMM_IMPL_H

#include <stdbool.h>

#include "comm.h"

/* A backend's operations. Arguments are checked by comm.c (buffers,
 * roots, peers, counts, op and dtype valid, a stream only where streams
 * is true). */
typedef struct {
    const char *name;
    bool streams; /* takes a non-NULL stream */
    void (*destroy)(td_comm *c);
    void (*abort)(td_comm *c);
    td_status (*split)(td_comm *c, int color, int key, td_comm **sub_p);
    td_status (*barrier)(td_comm *c);
    td_status (*broadcast)(td_comm *c, void *buf, size_t bytes, int root, td_comm_stream s);
    td_status (*scatter)(td_comm *c, const void *send, void *recv, size_t bpr, int root,
                         td_comm_stream s);
    td_status (*gather)(td_comm *c, const void *send, void *recv, size_t bpr, int root,
                        td_comm_stream s);
    td_status (*all_gather)(td_comm *c, const void *send, void *recv, size_t bpr, td_comm_stream s);
    /* reduce to root, or (all) to every rank; recv is send's buffer for
     * the all-reduce */
    td_status (*reduce)(td_comm *c, const void *send, void *recv, size_t n, td_comm_dtype dt,
                        td_comm_op op, int root, bool all, td_comm_stream s);
    td_status (*reduce_scatter)(td_comm *c, const void *send, void *recv, size_t n,
                                td_comm_dtype dt, td_comm_op op, td_comm_stream s);
    td_status (*all_to_all_v)(td_comm *c, const void *send, const size_t *send_bytes,
                              const size_t *send_displs, void *recv, const size_t *recv_bytes,
                              const size_t *recv_displs, td_comm_stream s);
    td_status (*send)(td_comm *c, const void *buf, size_t bytes, int peer, td_comm_stream s);
    td_status (*recv)(td_comm *c, void *buf, size_t bytes, int peer, td_comm_stream s);
} td_comm_ops;

/* What every communicator starts with; a backend's own struct embeds it
 * first. */
struct td_comm {
    const td_comm_ops *ops;
    int rank;
    int size;
};

#endif
