/* Communicator for the ranks of one pool instance. The forward pass calls
 * it wherever a parallel plan needs communication (TP all-reduce after the
 * attention output and the MLP down projection, PP activations at stage
 * boundaries, CP all-gather, EP all-to-all), so one forward pass serves
 * every plan.
 *
 * Backends, each a table of operations (comm-impl.h) behind this interface:
 * - single: a world of one; every call is a no-op or a copy;
 * - shm:    ranks are processes on one host sharing a POSIX shared-memory
 *           segment; barriers spin briefly, then sleep on a futex;
 * - local:  the shm engine over heap memory, ranks being threads of one
 *           process (tests of parallel plans).
 * An NCCL backend fits the same calls: counts are explicit, every data
 * collective takes the element type of a reduction and a stream to order
 * it on, there are no callbacks, and every buffer is caller-owned.
 *
 * Control and data: a parallel plan's executor keeps its control channel
 * (step broadcast, start-up, reports, keep-alives: small messages between
 * the driver and its ranks, always on a CPU backend) apart from the data
 * communicators the forward pass reduces and exchanges activations on (the
 * TP, CP and EP groups and the PP neighbours), so a device backend can take
 * the data path while control stays on shared memory.
 *
 * Collective calls (everything except rank/size, send/recv and destroy)
 * must be made by every rank of the communicator, in the same order, with
 * matching arguments (same count, op, element type and root; for
 * all_to_all_v each sender's send_bytes[j] equals receiver j's
 * recv_bytes[sender]). The
 * shared-memory backends check this and return TD_ERR_INVALID on every
 * rank when the ranks disagree. A communicator is used by one thread at a
 * time; a rank's communicators (the world and its splits) are used from
 * one thread in turn, never concurrently.
 *
 * Reductions combine in rank order 0..n-1 of the communicator:
 * ((x0 op x1) op x2) ..., computed once per element, so every rank
 * receives the same bits, equal to that serial order. float32 elements
 * combine in float32; float16 and bfloat16 elements are widened to
 * float32, combined in float32 in that order and rounded once to their
 * type (to nearest, ties to even).
 *
 * Failures: every wait has a deadline (td_comm_params.timeout_s). A rank
 * that dies or stops calling makes the others return TD_ERR_IO after the
 * deadline, with one log line naming the missing ranks; the communicator
 * (and every communicator split from the same world) is then broken and
 * every later call returns TD_ERR_IO at once. */
#ifndef TD_COMM_H
#define TD_COMM_H

#include "common/base/base.h"

typedef struct td_comm td_comm;

typedef enum {
    TD_COMM_SUM = 0,
    TD_COMM_MAX = 1,
} td_comm_op;

/* The element type of a reduction. */
typedef enum {
    TD_COMM_F32 = 0,
    TD_COMM_F16 = 1,  /* IEEE binary16 */
    TD_COMM_BF16 = 2, /* bfloat16 */
} td_comm_dtype;
#define TD_COMM_N_DTYPES 3
/* Bytes of one element; 0 for a value that is no td_comm_dtype. */
size_t td_comm_dtype_size(td_comm_dtype dt);

/* What a data collective is ordered on: a device backend's stream (a
 * cudaStream_t for NCCL), on which the call is enqueued. The CPU backends
 * complete every call before it returns and take NULL only
 * (TD_ERR_INVALID otherwise). */
typedef void *td_comm_stream;

/* Largest world the shared-memory backends support. */
#define TD_COMM_MAX_RANKS 64

typedef struct {
    /* Bytes of shared staging memory per rank; larger messages are sent in
     * chunks. Rounded down to a multiple of 64; at least 4096 and 256 per
     * rank of the world. Default 1 MiB. */
    size_t chunk_bytes;
    /* Deadline of every wait (a barrier, a send, a receive, attaching to
     * the segment), in seconds. Default 60. */
    double timeout_s;
    /* Optional (NULL by default): a flag of this process that another
     * thread may set to non-zero; every wait of this world on this rank
     * then fails with TD_ERR_IO within a wait slice and breaks the world —
     * also the wait for the other ranks to attach, before any communicator
     * exists that td_comm_abort could be called on. Must outlive the world. */
    const _Atomic int *cancel;
} td_comm_params;

td_comm_params td_comm_default_params(void);

/* World of one. Free with td_comm_destroy(). */
td_status td_comm_create_single(td_comm **comm_p);

/* In-process world of n ranks that are threads of one process (tests of
 * parallel plans, and single-process tensor parallelism). Create the group
 * once, then one communicator per rank; each rank's thread calls the
 * collectives on its own communicator. The group and its communicators
 * share memory by reference count: destroy them in any order.
 * td_comm_group_create uses td_comm_default_params(); params may be NULL
 * for the defaults too. */
typedef struct td_comm_group td_comm_group;
td_status td_comm_group_create(int n_ranks, td_comm_group **group_p);
td_status td_comm_group_create_params(int n_ranks, const td_comm_params *params,
                                      td_comm_group **group_p);
void td_comm_group_destroy(td_comm_group *group); /* accepts NULL */
td_status td_comm_create_local(td_comm_group *group, int rank, td_comm **comm_p);

/* Shared-memory world of n_ranks processes on one host. Every rank calls
 * it with the same name, n_ranks and params (name: up to 200 characters,
 * no '/' except an optional leading one; unique per launch, e.g. with the
 * driver's pid in it). Rank 0 creates the POSIX shared-memory object
 * (removing a stale one of the same name), the others attach to it by
 * name; the call returns once every rank has attached (collective), and
 * rank 0 then unlinks the name, so nothing is left behind in /dev/shm even
 * if a process dies later. Ranks may be forked or posix_spawn'ed
 * processes. Returns TD_ERR_IO when the segment cannot be created or not
 * every rank attached before the deadline. Free with td_comm_destroy(). */
td_status td_comm_shm_create(const char *name, int n_ranks, int rank, const td_comm_params *params,
                             td_comm **comm_p);

/* MPI_Comm_split (collective over comm): ranks that pass the same
 * color >= 0 form a new communicator, ordered by (key, rank in comm).
 * A rank that passes a negative color gets *sub_p = NULL. The new
 * communicator is independent of comm (destroy either first). Shared-memory
 * worlds hold at most 255 sub-groups over their lifetime (TD_ERR_RANGE
 * beyond). Free with td_comm_destroy(). */
td_status td_comm_split(td_comm *comm, int color, int key, td_comm **sub_p);

void td_comm_destroy(td_comm *comm); /* accepts NULL */

/* Breaks comm's world on purpose (e.g. a monitor saw a rank process die):
 * every call in progress on any rank of the world returns TD_ERR_IO within
 * a wait slice (50 ms), and every later one at once. The only call that
 * may be made from another thread while a collective is in progress.
 * A no-op for a world of one. */
void td_comm_abort(td_comm *comm);

int td_comm_rank(const td_comm *comm);
int td_comm_size(const td_comm *comm);

/* ---- collectives (every rank of comm, same order) ---- */

/* The control channel's meeting point (no data, no stream). */
td_status td_comm_barrier(td_comm *comm);

/* The data collectives: the byte movers take bytes (a device backend moves
 * them as bytes), the reductions n elements of dtype; all take the stream
 * they are ordered on (NULL on the CPU backends). */

/* buf (bytes) on root is copied to buf on every rank. */
td_status td_comm_broadcast(td_comm *comm, void *buf, size_t bytes, int root,
                            td_comm_stream stream);

/* Root's send (size * bytes_per_rank) is split in rank order: block r goes
 * to recv (bytes_per_rank) of rank r. send is read on root only. */
td_status td_comm_scatter(td_comm *comm, const void *send, void *recv, size_t bytes_per_rank,
                          int root, td_comm_stream stream);

/* Every rank's send (bytes_per_rank) lands at block r of root's recv
 * (size * bytes_per_rank). recv is written on root only. */
td_status td_comm_gather(td_comm *comm, const void *send, void *recv, size_t bytes_per_rank,
                         int root, td_comm_stream stream);

/* Every rank's send (bytes_per_rank) lands at block r of every rank's recv
 * (size * bytes_per_rank). send may equal recv + rank * bytes_per_rank. */
td_status td_comm_all_gather(td_comm *comm, const void *send, void *recv, size_t bytes_per_rank,
                             td_comm_stream stream);

/* recv[i] on root = send[i] of rank 0 op send[i] of rank 1 ... (n elements
 * of dtype); recv is written on root only and may equal send. */
td_status td_comm_reduce(td_comm *comm, const void *send, void *recv, size_t n, td_comm_dtype dtype,
                         td_comm_op op, int root, td_comm_stream stream);

/* In place: buf[i] = buf[i] of rank 0 op ... on every rank (n elements). */
td_status td_comm_all_reduce(td_comm *comm, void *buf, size_t n, td_comm_dtype dtype, td_comm_op op,
                             td_comm_stream stream);

/* send is size blocks of n_per_rank elements; rank r receives block r
 * reduced over all ranks in recv (n_per_rank elements). recv must not
 * overlap send. */
td_status td_comm_reduce_scatter(td_comm *comm, const void *send, void *recv, size_t n_per_rank,
                                 td_comm_dtype dtype, td_comm_op op, td_comm_stream stream);

/* Block j (bytes_per_rank) of every rank's send goes to rank j, landing at
 * block (sender) of its recv. send and recv are size * bytes_per_rank and
 * must not overlap. */
td_status td_comm_all_to_all(td_comm *comm, const void *send, void *recv, size_t bytes_per_rank,
                             td_comm_stream stream);

/* All-to-all with per-rank sizes (bytes): send_bytes[j] bytes at
 * send + send_displs[j] go to rank j, which receives them at
 * recv + recv_displs[sender], expecting recv_bytes[sender]. The four
 * arrays have size entries. Buffers must not overlap. */
td_status td_comm_all_to_all_v(td_comm *comm, const void *send, const size_t *send_bytes,
                               const size_t *send_displs, void *recv, const size_t *recv_bytes,
                               const size_t *recv_displs, td_comm_stream stream);

/* ---- point to point (the two ranks only) ---- */

/* Blocking rendezvous send of bytes to rank peer of comm: returns once the
 * receiver has taken all of them (a device backend: once enqueued on
 * stream). The receiver must post a matching td_comm_recv with the same
 * byte count (TD_ERR_INVALID on both sides otherwise). Messages between two
 * processes are received in the order sent, whichever of their
 * communicators carries them; two ranks that exchange must order their
 * calls (one sends first). peer != own rank. */
td_status td_comm_send(td_comm *comm, const void *buf, size_t bytes, int peer,
                       td_comm_stream stream);
td_status td_comm_recv(td_comm *comm, void *buf, size_t bytes, int peer, td_comm_stream stream);

#endif
