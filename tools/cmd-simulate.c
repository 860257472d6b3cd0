/* tandem simulate: runs a workload through simulated clusters
 * (planner/sim.h, files as planner/simio.h) and prints each run's result
 * as JSON, with tandem bench's report keys.
 *
 *   tandem simulate --cluster C.json --workload W.jsonl [--slo ttft:MS,tpot:MS]
 *                   [--threads N]
 *
 * The clusters of C.json (one, or an array) run in parallel over N threads;
 * the output is an object for one cluster, an array for an array. Exit 0,
 * 1 when a file cannot be read or a cluster cannot run (one line naming
 * it), 2 for bad usage. tandem plan drives it. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/base/opts.h"
#include "common/runtime/cli.h"
#include "planner/simio.h"
#include "tools.h"

enum { S_CLUSTER, S_WORKLOAD, S_SLO, S_THREADS, S_N };
static const td_opt k_sim_opts[S_N] = {
    [S_CLUSTER] = {"cluster", 0, "PATH", "the cluster(s), JSON: an object or an array"},
    [S_WORKLOAD] = {"workload", 0, "PATH", "the requests, JSON Lines in arrival order"},
    [S_SLO] = {"slo", 0, "ttft:MS,tpot:MS[,e2e:MS]", "goodput's bounds, as tandem bench --slo"},
    [S_THREADS] = {"threads", 0, "N", "clusters simulated at once (default: the cores)"},
};

typedef struct {
    const char *cluster, *workload;
    td_sim_slo slo;
    long threads;
} sim_args;

static bool parse_slo(const char *s, td_sim_slo *slo) {
    char buf[256];
    if (strlen(s) >= sizeof buf) return false;
    strcpy(buf, s);
    char *save = NULL;
    for (char *part = strtok_r(buf, ",", &save); part; part = strtok_r(NULL, ",", &save)) {
        char *colon = strchr(part, ':');
        if (!colon) return false;
        *colon = '\0';
        float ms;
        if (!td_cli_parse_float(colon + 1, &ms) || !(ms > 0)) return false;
        if (strcmp(part, "ttft") == 0)
            slo->ttft_ms = ms;
        else if (strcmp(part, "tpot") == 0)
            slo->tpot_ms = ms;
        else if (strcmp(part, "e2e") == 0)
            slo->e2e_ms = ms;
        else
            return false;
    }
    return true;
}

static bool set_sim_opt(void *ctx, int i, const char *val, bool *printed) {
    sim_args *a = ctx;
    TD_UNUSED(printed);
    switch (i) {
    case S_CLUSTER: a->cluster = val; return *val != '\0';
    case S_WORKLOAD: a->workload = val; return *val != '\0';
    case S_SLO: return parse_slo(val, &a->slo);
    case S_THREADS: return td_cli_parse_long(val, 1, 256, &a->threads);
    }
    return false;
}

static void usage(FILE *f, void *ctx) {
    TD_UNUSED(ctx);
    fprintf(f,
            "usage: tandem simulate --cluster C.json --workload W.jsonl [--slo ttft:MS,tpot:MS]\n"
            "                       [--threads N]\n\n"
            "Runs the workload through each cluster on a virtual clock: every instance runs\n"
            "the real scheduling core, the requests are routed by the router's real scoring,\n"
            "and each step's duration comes from the instance's step model. Prints each\n"
            "run's result as JSON with tandem bench's keys (ttft_ms, tpot_ms, itl_ms, e2e_ms\n"
            "percentiles, goodput) and the simulator's own (steps, preemptions, busy).\n\n"
            "cluster: {\"name\", \"router\": bool, \"score\": {router weights},\n"
            "          \"xfer_s_per_token\", \"xfer_fixed_s\", \"request_overhead_s\",\n"
            "          \"poll_interval_s\" (the router's state polls; 0: exact figures),\n"
            "          \"instances\": [{\"role\": colocated|prefill|decode, \"count\",\n"
            "                         \"n_blocks\", \"block_size\", \"sched\": {max_running,\n"
            "                         max_batch_tokens, max_waiting, reserve_output_tokens,\n"
            "                         max_ctx, prefix_cache}, \"step\": {c0, c_tok, c_tok2,\n"
            "                         c_attn, c_attn2, c_ctx, c_seq, c_n2..c_n16}, "
            "\"step_overhead_s\",\n"
            "                         \"host\" (instances of one host >= 0 share a machine;\n"
            "                         default -1: their own), \"beside\": {\"step\": {...},\n"
            "                         \"step_overhead_s\"} (the step model while another\n"
            "                         instance of the host steps)}]}\n"
            "workload: one request per line, {\"t\": s, \"seg\": [[id, tokens], ...], \"out\": n}\n"
            "          (id >= 0: a segment shared by the requests naming it; -1: its own)\n\n");
    td_opts_print(f, k_sim_opts, S_N);
}

typedef struct {
    const td_sim_named_cluster *cl;
    int32_t n_cl;
    const td_sim_workload *w;
    const td_sim_slo *slo;
    json_t **res;
    char (*why)[256];
    pthread_mutex_t mu;
    int32_t next;
} pool;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void *worker(void *arg) {
    pool *p = arg;
    td_sim_outcome *o = malloc((size_t)p->w->n * sizeof *o);
    for (;;) {
        pthread_mutex_lock(&p->mu);
        int32_t i = p->next++;
        pthread_mutex_unlock(&p->mu);
        if (i >= p->n_cl) break;
        if (!o) {
            snprintf(p->why[i], sizeof p->why[i], "out of memory");
            continue;
        }
        td_sim_stats st;
        double t0 = now_s();
        td_status s =
            td_sim_run(&p->cl[i].c, p->w->reqs, p->w->n, true, o, &st, p->why[i], sizeof p->why[i]);
        if (s == TD_OK) {
            p->res[i] = td_sim_result_json(&p->cl[i], p->w, o, &st, p->slo, now_s() - t0);
            if (!p->res[i]) snprintf(p->why[i], sizeof p->why[i], "out of memory");
        } else if (s == TD_ERR_NOMEM) {
            snprintf(p->why[i], sizeof p->why[i], "out of memory");
        }
        free(st.itl);
    }
    free(o);
    return NULL;
}

int td_cmd_simulate(int argc, char **argv) {
    sim_args a = {0};
    a.threads = sysconf(_SC_NPROCESSORS_ONLN);
    if (a.threads < 1) a.threads = 1;
    td_optset set = {k_sim_opts, S_N, set_sim_opt, &a};
    int rc = td_opts_parse("tandem simulate", argc, argv, &set, 1, usage, NULL);
    if (rc) return rc == 1 ? 0 : 2;
    if (!a.cluster || !a.workload) {
        fprintf(stderr, "tandem simulate: --cluster and --workload are needed (see --help)\n");
        return 2;
    }
    char why[512] = "";
    td_sim_named_cluster *cl = NULL;
    int32_t n_cl = 0;
    td_sim_workload w;
    bool array = false;
    if (td_sim_read_clusters(a.cluster, &cl, &n_cl, &array, why, sizeof why) != TD_OK) {
        fprintf(stderr, "tandem simulate: %s\n", why);
        return 1;
    }
    if (td_sim_read_workload(a.workload, &w, why, sizeof why) != TD_OK) {
        fprintf(stderr, "tandem simulate: %s\n", why);
        free(cl);
        return 1;
    }
    pool p = {.cl = cl, .n_cl = n_cl, .w = &w, .slo = &a.slo};
    p.res = calloc((size_t)n_cl, sizeof *p.res);
    p.why = calloc((size_t)n_cl, sizeof *p.why);
    pthread_mutex_init(&p.mu, NULL);
    int n_thr = (int)(a.threads < n_cl ? a.threads : n_cl);
    pthread_t *thr = calloc((size_t)n_thr, sizeof *thr);
    rc = 0;
    if (!p.res || !p.why || !thr) {
        fprintf(stderr, "tandem simulate: out of memory\n");
        rc = 1;
    }
    int started = 0;
    for (int t = 0; rc == 0 && t < n_thr; t++)
        if (pthread_create(&thr[t], NULL, worker, &p) == 0) started++;
    if (rc == 0 && started == 0) worker(&p); /* no thread: run them here */
    for (int t = 0; t < started; t++) pthread_join(thr[t], NULL);
    for (int32_t i = 0; rc == 0 && i < n_cl; i++)
        if (!p.res[i]) {
            fprintf(stderr, "tandem simulate: %s: cluster %d%s%s: %s\n", a.cluster, i,
                    cl[i].name[0] ? " " : "", cl[i].name, p.why[i]);
            rc = 1;
        }
    if (rc == 0) {
        json_t *out = json_array();
        for (int32_t i = 0; i < n_cl; i++) json_array_append(out, p.res[i]);
        char *s =
            json_dumps(array ? out : json_array_get(out, 0), JSON_COMPACT | JSON_REAL_PRECISION(9));
        if (s) {
            puts(s);
            free(s);
        } else {
            fprintf(stderr, "tandem simulate: out of memory\n");
            rc = 1;
        }
        json_decref(out);
    }
    for (int32_t i = 0; p.res && i < n_cl; i++) json_decref(p.res[i]);
    pthread_mutex_destroy(&p.mu);
    free(thr);
    free(p.res);
    free(p.why);
    free(cl);
    td_sim_workload_free(&w);
    return rc;
}
