/* Replays a scheduler's step trace (`--step-trace`, common/sched/sched.h)
 * through the scheduling core (common/sched/core.h) on a fresh KV pool of
 * the recorded size, and checks that the core takes the recorded
 * decisions: at every step the same sequences admitted, the same ones
 * preempted, and the same batch (each sequence's position and chunk). The
 * inputs come from the trace: the arrivals with their prompts, the tokens
 * each sequence took and when each one ended (stop rules and cancels are
 * the instance's, not the policy's). So the simulator, which runs the same
 * core, is checked against the real scheduler's decisions on a real run.
 * Colocated instances (a trace with remote prefills is refused). */
#ifndef TD_PLANNER_REPLAY_H
#define TD_PLANNER_REPLAY_H

#include <stdbool.h>
#include <stdint.h>

#include "common/base/base.h"

typedef struct {
    int64_t steps;       /* lines replayed */
    int64_t batches;     /* steps with a batch */
    int64_t requests;    /* arrivals */
    int64_t admissions;  /* compared */
    int64_t preemptions; /* compared */
    int64_t batch_seqs;  /* batch entries compared */
    int64_t tokens;      /* tokens taken */
    bool same;           /* every decision equal */
    char why[512];       /* the first difference, or why the trace was refused */
} td_replay_result;

/* TD_OK with r->same telling whether the core agreed (r->why naming the
 * first step that differed); TD_ERR_FORMAT for a malformed trace,
 * TD_ERR_UNSUPPORTED for one with remote prefills, TD_ERR_IO when the file
 * cannot be read (r->why says which line and what). */
td_status td_replay_step_trace(const char *path, td_replay_result *r);

#endif
