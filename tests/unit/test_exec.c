/* The rank executor (common/parallel/exec.h) with real rank processes:
 * the tandem binary ($TANDEM_BIN) started by td_exec_create, on a tiny test
 * model. Checks what the integration tests cannot reach from outside:
 * ranks that die before attaching make start-up fail fast (not after the
 * attach deadline), a rank killed between steps fails the next step at
 * once, and nothing is left behind (no child process, no descriptor, no
 * shared-memory segment). */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "common/parallel/exec.h"

static char g_model[1024];

static int count_fds(void) {
    DIR *d = opendir("/proc/self/fd");
    assert_non_null(d);
    int n = 0;
    while (readdir(d)) n++;
    closedir(d);
    return n;
}

static bool no_children(void) {
    errno = 0;
    return waitpid(-1, NULL, WNOHANG) < 0 && errno == ECHILD;
}

static td_exec_params params(const char *exe, int tp, double timeout_s) {
    td_exec_params p = td_exec_default_params();
    p.model_path = g_model;
    p.plan.tp = tp;
    p.engine.max_batch_tokens = 64;
    p.engine.max_seqs = 4;
    p.engine.max_ctx = 64;
    p.block_size = 4;
    p.kv_blocks = 64;
    p.n_threads = 1;
    p.exe = exe;
    p.comm.timeout_s = timeout_s;
    return p;
}

/* Ranks that exit at once (a binary that is not tandem): start-up fails
 * within seconds although the attach deadline is 60 s. */
static void test_ranks_dead_at_start_fail_fast(void **state) {
    (void)state;
    int fds = count_fds();
    const char *bins[] = {"/bin/false", "/bin/true"};
    for (int i = 0; i < 2; i++) {
        td_exec_params p = params(bins[i], 2, 60.0);
        td_exec *x = NULL;
        double t0 = td_time_s();
        assert_int_equal(td_exec_create(&p, &x), TD_ERR_IO);
        assert_null(x);
        assert_true(td_time_s() - t0 < 10.0);
    }
    assert_int_equal(count_fds(), fds);
    assert_true(no_children());
}

static void step(int32_t *tok, int32_t *blk, td_seq_chunk *c) {
    for (int i = 0; i < 8; i++) tok[i] = 5 + 7 * i;
    for (int i = 0; i < 2; i++) blk[i] = 3 + i;
    *c = (td_seq_chunk){.tokens = tok, .n_tokens = 8, .pos0 = 0, .block_table = blk, .n_blocks = 2};
}

/* TP 2 on real ranks gives the single-rank logits (within the TP
 * tolerance); a rank killed while idle fails the next step at once, and
 * teardown reaps everything. */
static void test_tp2_then_a_killed_rank(void **state) {
    (void)state;
    const char *bin = getenv("TANDEM_BIN");
    assert_non_null(bin);
    int fds = count_fds();
    int32_t tok[8], blk[2];
    td_seq_chunk c;
    step(tok, blk, &c);

    td_exec_params p1 = params(bin, 1, 60.0);
    td_exec *one = NULL;
    assert_int_equal(td_exec_create(&p1, &one), TD_OK);
    int32_t V = td_model_get_config(td_exec_model(one))->n_vocab;
    float *want = malloc((size_t)V * sizeof(float)), *got = malloc((size_t)V * sizeof(float));
    assert_non_null(want);
    assert_non_null(got);
    assert_int_equal(td_exec_forward(one, &c, 1, want), TD_OK);
    td_exec_destroy(one);

    td_exec_params p2 = params(bin, 2, 60.0);
    td_exec *x = NULL;
    assert_int_equal(td_exec_create(&p2, &x), TD_OK);
    assert_int_equal(td_exec_world(x), 2);
    assert_int_equal(td_exec_forward(x, &c, 1, got), TD_OK);
    float scale = 0, err = 0;
    for (int32_t v = 0; v < V; v++) {
        scale = fmaxf(scale, fabsf(want[v]));
        err = fmaxf(err, fabsf(want[v] - got[v]));
    }
    assert_true(scale > 0 && err / scale <= 1e-4f);
    td_rank_time t[2];
    assert_int_equal(td_exec_last_times(x, t, 2), 2);
    assert_true(t[1].compute_s > 0 && t[1].comm_s > 0);
    assert_false(td_exec_failed(x));

    /* The one child is rank 1. */
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/task/%d/children", (int)getpid(), (int)getpid());
    FILE *f = fopen(path, "r");
    assert_non_null(f);
    int pid = 0;
    assert_int_equal(fscanf(f, "%d", &pid), 1);
    fclose(f);
    assert_int_equal(kill(pid, SIGKILL), 0);
    double t0 = td_time_s();
    while (!td_exec_failed(x) && td_time_s() - t0 < 5.0) usleep(10000);
    assert_true(td_exec_failed(x));
    t0 = td_time_s();
    assert_int_equal(td_exec_forward(x, &c, 1, got), TD_ERR_IO);
    assert_true(td_time_s() - t0 < 1.0);
    td_exec_destroy(x);
    free(want);
    free(got);
    assert_int_equal(count_fds(), fds);
    assert_true(no_children());
}

/* Bad parameters are refused before any rank starts. */
static void test_bad_params(void **state) {
    (void)state;
    td_exec *x = NULL;
    td_exec_params p = params("/bin/false", 2, 60.0);
    p.comm.timeout_s = 0;
    assert_int_equal(td_exec_create(&p, &x), TD_ERR_INVALID);
    p = params("/bin/false", 3, 60.0); /* 3 does not divide the 4 heads */
    assert_int_equal(td_exec_create(&p, &x), TD_ERR_INVALID);
    assert_null(x);
    assert_true(no_children());
}

int main(void) {
    const char *dir = getenv("TANDEM_TEST_MODELS");
    if (!dir) {
        fprintf(stderr, "TANDEM_TEST_MODELS is not set\n");
        return 1;
    }
    snprintf(g_model, sizeof g_model, "%s/gguf/llama2-f32.gguf", dir);
    /* SIGPIPE from a dead rank must not end the test */
    signal(SIGPIPE, SIG_IGN);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_bad_params),
        cmocka_unit_test(test_ranks_dead_at_start_fail_fast),
        cmocka_unit_test(test_tp2_then_a_killed_rank),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
