/* td-router-bench: routing decisions per second of the router's prefix
 * index (router/index.h) on one core (the bar: at least 20k decisions/s for
 * 2,048-token prompts with 64 instances holding 10k cached blocks each,
 * tokenization excluded).
 *
 *   td-router-bench [--instances N] [--blocks-per-instance B]
 *                   [--prompt-tokens T] [--decisions D] [--documents K]
 *                   [--replicas R] [--prompt-pool P] [--seed S] [--json FILE]
 *
 * The index is filled the way a cluster fills it: K shared documents
 * (system prompts of T tokens of random ids, hashed with td_kv_hash_chain
 * in blocks of 16 from a fixed root) each cached on R instances, and every
 * instance topped up to B blocks with chains of its own. P prompts are
 * generated before timing (a random document's prefix of random length,
 * then random tokens up to T) and used in turn; each decision hashes its
 * prompt into blocks, matches them against every instance and scores
 * every (prefill, decode) pair (common/route/score.h; the first half of the
 * instances prefill, the rest decode, with random load figures). Prints one
 * line for people and, with --json, {"instances", "blocks_per_instance",
 * "prompt_tokens", "decisions", "seconds", "decisions_per_s", "index_size",
 * "mean_chosen_overlap_blocks"} into FILE; the human line also gives the
 * time of the hashing alone (the same prompts, no lookups). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/base/base.h"
#include "common/kv/hash.h"
#include "common/route/score.h"
#include "router/index.h"

#define BLOCK   16
#define N_VOCAB 32000

static uint64_t rng_state;

static uint64_t rnd(void) {
    uint64_t z = (rng_state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static uint32_t rnd_below(uint32_t n) { return (uint32_t)(rnd() % n); }

static void rnd_tokens(int32_t *t, int32_t n) {
    for (int32_t i = 0; i < n; i++) t[i] = (int32_t)rnd_below(N_VOCAB);
}

typedef struct {
    td_rt_index *ix;
    td_kv_hash root;
    td_rt_mask among;
    int instances;
    td_kv_hash *hashes; /* (prompt blocks) */
    int32_t *overlap;   /* (TD_RT_MAX_INSTANCES) */
    int32_t *predicted; /* (TD_RT_MAX_INSTANCES) */
    /* Scoring: the first half of the instances prefill, the rest decode. */
    td_rt_score_params sp;
    td_rt_inst *inst; /* (instances) with load figures */
    float *xfer;      /* (TD_RT_MAX_INSTANCES, TD_RT_MAX_INSTANCES) ms */
    uint64_t counter, rng;
} decider;

/* One routing decision for a tokenized prompt, as the router makes it: its
 * block hashes, every instance's leading overlap (one walk), and the
 * kv-aware scoring of every (prefill, decode) pair; returns the overlap of
 * the chosen prefill instance (the decode instance's for local prefill). */
static int32_t decide_one(decider *d, const int32_t *tokens, int32_t n_tokens, double now) {
    int32_t nb = td_kv_hash_chain(d->root, tokens, n_tokens, BLOCK, d->hashes);
    td_rt_index_match(d->ix, d->hashes, (size_t)nb, &d->among, now, d->overlap, d->predicted);
    td_rt_choice c;
    if (td_rt_choose(&d->sp, d->inst, d->instances, d->overlap, d->xfer, TD_RT_MAX_INSTANCES,
                     n_tokens, 128, d->counter++, &d->rng, &c) != TD_OK)
        return 0;
    return d->overlap[c.p >= 0 ? c.p : c.d];
}

static int parse_long(const char *s, long lo, long hi, long *out) {
    char *end;
    long v = strtol(s, &end, 10);
    if (!*s || *end || v < lo || v > hi) return -1;
    *out = v;
    return 0;
}

static void usage(void) {
    fprintf(stderr, "usage: td-router-bench [--instances N] [--blocks-per-instance B] "
                    "[--prompt-tokens T] [--decisions D] [--documents K] [--replicas R] "
                    "[--prompt-pool P] [--seed S] [--json FILE]\n");
}

int main(int argc, char **argv) {
    long instances = 64, per_inst = 10000, prompt_tokens = 2048, decisions = 200000;
    long documents = 256, replicas = 8, pool = 2048, seed = 1;
    const char *json = NULL;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        long *dst = NULL, lo = 1, hi = 0;
        if (!strcmp(a, "--json") && v) {
            json = v;
            i++;
            continue;
        }
        if (!strcmp(a, "--instances"))
            dst = &instances, hi = TD_RT_MAX_INSTANCES;
        else if (!strcmp(a, "--blocks-per-instance"))
            dst = &per_inst, lo = 0, hi = 10000000;
        else if (!strcmp(a, "--prompt-tokens"))
            dst = &prompt_tokens, lo = BLOCK, hi = 1 << 20;
        else if (!strcmp(a, "--decisions"))
            dst = &decisions, hi = 1000000000;
        else if (!strcmp(a, "--documents"))
            dst = &documents, lo = 0, hi = 100000;
        else if (!strcmp(a, "--replicas"))
            dst = &replicas, hi = TD_RT_MAX_INSTANCES;
        else if (!strcmp(a, "--prompt-pool"))
            dst = &pool, hi = 1000000;
        else if (!strcmp(a, "--seed"))
            dst = &seed, lo = 0, hi = INT32_MAX;
        if (!dst || !v || parse_long(v, lo, hi, dst) != 0) {
            usage();
            return 2;
        }
        i++;
    }
    if (replicas > instances) replicas = instances;
    if ((size_t)pool * (size_t)prompt_tokens > ((size_t)1 << 28)) {
        fprintf(stderr, "td-router-bench: --prompt-pool x --prompt-tokens over 2^28 tokens\n");
        return 2;
    }
    rng_state = (uint64_t)seed;
    int32_t T = (int32_t)prompt_tokens, nb = T / BLOCK;
    int n_inst = (int)instances;

    td_rt_index *ix = NULL;
    size_t expect = (size_t)instances * (size_t)per_inst;
    if (td_rt_index_create(expect, &ix) != TD_OK) return 1;
    int32_t *doc_tokens = malloc((size_t)TD_MAX(documents, 1) * (size_t)T * sizeof *doc_tokens);
    int32_t *prompts = malloc((size_t)pool * (size_t)T * sizeof *prompts);
    td_kv_hash *hashes = malloc((size_t)nb * sizeof *hashes);
    int32_t *tmp = malloc((size_t)T * sizeof *tmp);
    size_t *held = calloc((size_t)n_inst, sizeof *held);
    int32_t overlap[TD_RT_MAX_INSTANCES], predicted[TD_RT_MAX_INSTANCES];
    if (!doc_tokens || !prompts || !hashes || !tmp || !held) {
        fprintf(stderr, "td-router-bench: out of memory\n");
        return 1;
    }
    td_kv_hash root = {0x74616e64656d0001ull, 0x726f757465720002ull};

    /* Shared documents, each on `replicas` distinct instances that still
     * have room for it. */
    for (long k = 0; k < documents; k++) {
        int32_t *t = doc_tokens + (size_t)k * (size_t)T;
        rnd_tokens(t, T);
        td_kv_hash_chain(root, t, T, BLOCK, hashes);
        for (long r = 0, tries = 0; r < replicas && tries < 4 * instances; tries++) {
            int s = (int)rnd_below((uint32_t)n_inst);
            if (held[s] + (size_t)nb > (size_t)per_inst) continue;
            size_t before = td_rt_index_count(ix, s);
            if (td_rt_index_store(ix, s, hashes, (size_t)nb) != TD_OK) return 1;
            if (td_rt_index_count(ix, s) == before) continue; /* already there */
            held[s] += (size_t)nb;
            r++;
        }
    }
    /* Every instance's own chains up to its budget. */
    for (int s = 0; s < n_inst; s++) {
        while (held[s] < (size_t)per_inst) {
            rnd_tokens(tmp, T);
            td_kv_hash_chain(root, tmp, T, BLOCK, hashes);
            size_t n = TD_MIN((size_t)nb, (size_t)per_inst - held[s]);
            if (td_rt_index_store(ix, s, hashes, n) != TD_OK) return 1;
            held[s] += n;
        }
    }
    /* Prompts: a document's prefix of random length, then fresh tokens. */
    for (long p = 0; p < pool; p++) {
        int32_t *t = prompts + (size_t)p * (size_t)T;
        int32_t pre = 0;
        if (documents) {
            const int32_t *doc = doc_tokens + (size_t)rnd_below((uint32_t)documents) * (size_t)T;
            pre = (int32_t)rnd_below((uint32_t)T + 1);
            memcpy(t, doc, (size_t)pre * sizeof *t);
        }
        rnd_tokens(t + pre, T - pre);
    }

    td_rt_inst *inst = calloc((size_t)n_inst, sizeof *inst);
    float *xfer = malloc((size_t)TD_RT_MAX_INSTANCES * TD_RT_MAX_INSTANCES * sizeof *xfer);
    if (!inst || !xfer) {
        fprintf(stderr, "td-router-bench: out of memory\n");
        return 1;
    }
    for (int s = 0; s < n_inst; s++)
        inst[s] = (td_rt_inst){.prefill = s < n_inst / 2,
                               .usable = true,
                               .block_size = BLOCK,
                               .queued_prefill_tokens = (int64_t)rnd_below(8192),
                               .kv_total = 65536,
                               .kv_used = (int64_t)rnd_below(30000),
                               .kv_free = 30000,
                               .running = (int32_t)rnd_below(64)};
    for (size_t k = 0; k < (size_t)TD_RT_MAX_INSTANCES * TD_RT_MAX_INSTANCES; k++)
        xfer[k] = 1.0f + (float)rnd_below(100) / 10.0f;
    decider d = {.ix = ix,
                 .root = root,
                 .instances = n_inst,
                 .hashes = hashes,
                 .overlap = overlap,
                 .predicted = predicted,
                 .sp = td_rt_score_default_params(),
                 .inst = inst,
                 .xfer = xfer,
                 .rng = 1};
    for (int s = 0; s < n_inst; s++) td_rt_mask_set(&d.among, s);
    double now = td_time_s();
    int64_t sum_best = 0;
    double t0 = td_time_s();
    for (long i = 0; i < decisions; i++)
        sum_best += decide_one(&d, prompts + (size_t)(i % pool) * (size_t)T, T, now);
    double secs = td_time_s() - t0;
    /* The same prompts hashed without the lookups: the part of a decision
     * the index does not control. */
    volatile uint64_t sink = 0;
    t0 = td_time_s();
    for (long i = 0; i < decisions; i++) {
        td_kv_hash_chain(root, prompts + (size_t)(i % pool) * (size_t)T, T, BLOCK, hashes);
        sink ^= hashes[nb - 1].lo;
    }
    double hash_secs = td_time_s() - t0;
    (void)sink; /* read once: the loop's results are used, so it is not optimised away */

    size_t size = td_rt_index_size(ix);
    double rate = (double)decisions / secs, mean_best = (double)sum_best / (double)decisions;
    printf("td-router-bench: %d instances x %ld blocks (index %zu hashes), %d-token prompts: "
           "%ld decisions in %.3f s = %.0f decisions/s on one core, mean overlap at the chosen "
           "instance %.1f "
           "blocks; hashing alone %.2f us of the %.2f us per decision\n",
           n_inst, per_inst, size, T, decisions, secs, rate, mean_best, hash_secs / decisions * 1e6,
           secs / decisions * 1e6);
    int rc = 0;
    if (json) {
        FILE *f = fopen(json, "w");
        if (!f) {
            perror(json);
            rc = 1;
        } else {
            fprintf(f,
                    "{\"instances\": %d, \"blocks_per_instance\": %ld, \"prompt_tokens\": %d, "
                    "\"decisions\": %ld, \"seconds\": %.6f, \"decisions_per_s\": %.1f, "
                    "\"index_size\": %zu, \"mean_chosen_overlap_blocks\": %.3f}\n",
                    n_inst, per_inst, T, decisions, secs, rate, size, mean_best);
            if (fclose(f) != 0) rc = 1;
        }
    }
    free(doc_tokens);
    free(prompts);
    free(hashes);
    free(tmp);
    free(held);
    free(inst);
    free(xfer);
    td_rt_index_destroy(ix);
    return rc;
}
