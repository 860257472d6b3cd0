/* Communicator for the ranks of one pool instance. The forward pass calls
 * it wherever a parallel plan needs communication (TP all-reduce after the
 * attention output and the MLP down projection), so one forward pass serves
 * every plan. Backends: single (world of one: no-ops / copies) now; shm for
 * CPU ranks and NCCL for GPU ranks later, behind this same interface. */
#ifndef TD_COMM_H
#define TD_COMM_H

#include "../base/base.h"

typedef struct td_comm td_comm;

/* World of one. Free with td_comm_destroy(). */
td_status td_comm_create_single(td_comm **comm_p);

/* In-process world of n ranks that are threads of one process (tests of
 * parallel plans, and single-process tensor parallelism). Create the group
 * once, then one communicator per rank; each rank's thread calls the
 * collectives on its own communicator. Collectives block until every rank
 * has called them (a rank that never calls blocks the others: the caller's
 * plan must be consistent). all_reduce_sum adds in rank order 0..n-1, so
 * every rank gets the same bits. Free each comm with td_comm_destroy() and
 * then the group with td_comm_group_destroy(). */
typedef struct td_comm_group td_comm_group;
td_status td_comm_group_create(int n_ranks, td_comm_group **group_p);
void td_comm_group_destroy(td_comm_group *group); /* accepts NULL */
td_status td_comm_create_local(td_comm_group *group, int rank, td_comm **comm_p);
void td_comm_destroy(td_comm *comm); /* accepts NULL */

int td_comm_rank(const td_comm *comm);
int td_comm_size(const td_comm *comm);

/* In-place sum over all ranks of buf[0..n). Every rank must call with the
 * same n; the summation order is fixed by rank (deterministic). */
td_status td_comm_all_reduce_sum(td_comm *comm, float *buf, size_t n);
td_status td_comm_all_gather(td_comm *comm, const void *send, void *recv, size_t bytes_per_rank);
td_status td_comm_broadcast(td_comm *comm, void *buf, size_t bytes, int root);
td_status td_comm_barrier(td_comm *comm);

#endif
