/* In-process backend: ranks are threads of one process. The group owns a
 * segment in heap memory laid out exactly like the shm backend's shared
 * object, so both run the same engine (comm-shm.c): the futexes work on
 * private memory as well, and the threads share the staging buffers. */
#include "comm-impl.h"

td_status td_comm_group_create(int n_ranks, td_comm_group **group_p) {
    return td_comm_group_create_params(n_ranks, NULL, group_p);
}

td_status td_comm_group_create_params(int n_ranks, const td_comm_params *params,
                                      td_comm_group **group_p) {
    if (n_ranks < 1 || n_ranks > TD_COMM_MAX_RANKS || !group_p) return TD_ERR_INVALID;
    td_comm_params p = params ? *params : td_comm_default_params();
    td_comm_group *g = calloc(1, sizeof *g);
    if (!g) {
        TD_LOG_ERROR("out of memory");
        return TD_ERR_NOMEM;
    }
    td_status st = td_comm_seg_create_heap(n_ranks, &p, &g->seg);
    if (st) {
        free(g);
        return st;
    }
    g->n = n_ranks;
    *group_p = g;
    return TD_OK;
}

void td_comm_group_destroy(td_comm_group *group) {
    if (!group) return;
    td_comm_seg_unref(group->seg);
    free(group);
}

td_status td_comm_create_local(td_comm_group *group, int rank, td_comm **comm_p) {
    if (!group || rank < 0 || rank >= group->n || !comm_p) return TD_ERR_INVALID;
    return td_comm_seg_comm_create(group->seg, rank, comm_p);
}
