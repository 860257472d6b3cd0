/* Token sampler; the contract and the order of the steps are in sampler.h. */
#include "sampler.h"

#include <math.h>
#include <string.h>
#include <sys/random.h>

typedef struct {
    float logit;
    float p; /* exp(logit - max), once the maximum is known */
    int32_t id;
} td_cand;

struct td_sampler {
    td_sampler_params p;
    td_logit_bias *bias; /* (n_bias) own copy of p.logit_bias */
    int32_t n_vocab;
    uint64_t rng[4]; /* xoshiro256** state */

    int32_t *cnt_all;  /* (n_vocab) occurrences in the penalty window, prompt or generated */
    int32_t *cnt_gen;  /* (n_vocab) generated occurrences in the penalty window */
    uint32_t *ring;    /* (penalty_last_n) window: token | TD_RING_GEN; NULL when the
                        * window is the whole history */
    int32_t ring_head; /* index of the oldest entry */
    int32_t ring_len;

    float *work;   /* (n_vocab) processed logits */
    td_cand *cand; /* (n_vocab) candidates */
};

#define TD_RING_GEN 0x80000000u

/* ---- PRNG: splitmix64 seeds xoshiro256** (Blackman & Vigna) ---- */

static uint64_t splitmix64(uint64_t *x) {
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static inline uint64_t rotl64(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

static uint64_t rng_next(uint64_t s[4]) {
    uint64_t result = rotl64(s[1] * 5, 7) * 9;
    uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl64(s[3], 45);
    return result;
}

/* Uniform in [0, 1) with 53 random bits. */
static double rng_uniform(uint64_t s[4]) { return (double)(rng_next(s) >> 11) * 0x1.0p-53; }

static void rng_seed(td_sampler *s) {
    uint64_t seed = s->p.seed;
    if (seed == TD_SAMPLER_SEED_RANDOM) {
        /* A fresh sequence without a seed: the OS's entropy, falling back to
         * the clock (a seed only needs to differ between sequences here). */
        if (getrandom(&seed, sizeof seed, GRND_NONBLOCK) != (ssize_t)sizeof seed)
            seed = td_time_ns() ^ (uint64_t)(uintptr_t)s;
    }
    uint64_t x = seed;
    for (int i = 0; i < 4; i++) s->rng[i] = splitmix64(&x);
}

/* ---- candidate ordering: logit descending, then id ascending ---- */

static inline bool cand_before(const td_cand *a, const td_cand *b) {
    return a->logit > b->logit || (a->logit == b->logit && a->id < b->id);
}

static inline void cand_swap(td_cand *a, td_cand *b) {
    td_cand t = *a;
    *a = *b;
    *b = t;
}

static void cand_insertion_sort(td_cand *c, int32_t n) {
    for (int32_t i = 1; i < n; i++) {
        td_cand x = c[i];
        int32_t j = i;
        while (j > 0 && cand_before(&x, &c[j - 1])) {
            c[j] = c[j - 1];
            j--;
        }
        c[j] = x;
    }
}

/* Lomuto partition of c[0..n) around a median-of-three pivot; returns the
 * pivot's final index (everything before it comes before it in the order). */
static int32_t cand_partition(td_cand *c, int32_t n) {
    int32_t mid = n / 2, last = n - 1;
    if (cand_before(&c[mid], &c[0])) cand_swap(&c[mid], &c[0]);
    if (cand_before(&c[last], &c[0])) cand_swap(&c[last], &c[0]);
    if (cand_before(&c[last], &c[mid])) cand_swap(&c[last], &c[mid]);
    cand_swap(&c[mid], &c[last]); /* median as pivot at the end */
    int32_t store = 0;
    for (int32_t i = 0; i < last; i++)
        if (cand_before(&c[i], &c[last])) cand_swap(&c[i], &c[store++]);
    cand_swap(&c[store], &c[last]);
    return store;
}

/* Moves the k first candidates in the order into c[0..k), in no particular
 * order. No allocation (the library qsort may allocate). */
static void cand_select(td_cand *c, int32_t n, int32_t k) {
    while (n > 16 && k > 0 && k < n) {
        int32_t p = cand_partition(c, n);
        if (p == k || p + 1 == k) return;
        if (p > k) {
            n = p;
        } else {
            c += p + 1;
            n -= p + 1;
            k -= p + 1;
        }
    }
    if (k > 0 && k < n) cand_insertion_sort(c, n);
}

/* Top-k for small k: a heap of the k best so far whose root is the worst
 * of them, so most tokens cost one comparison with the root. */
#define TD_TOPK_HEAP_MAX 1024

static void heap_push(td_cand *h, int32_t n, td_cand x) {
    int32_t i = n;
    while (i > 0) {
        int32_t parent = (i - 1) / 2;
        if (!cand_before(&h[parent], &x)) break; /* the worse one goes above */
        h[i] = h[parent];
        i = parent;
    }
    h[i] = x;
}

static void heap_replace_root(td_cand *h, int32_t n, td_cand x) {
    int32_t i = 0;
    for (;;) {
        int32_t l = 2 * i + 1, r = l + 1, worst = l;
        if (l >= n) break;
        if (r < n && cand_before(&h[l], &h[r])) worst = r;
        if (cand_before(&h[worst], &x)) break; /* x is worse than both children */
        h[i] = h[worst];
        i = worst;
    }
    h[i] = x;
}

/* Top-p without a full sort: the length of the shortest prefix, in the
 * candidate order, whose mass reaches target, moved to c[0..len) (in no
 * particular order). A quickselect that partitions by the order and
 * descends by the mass on each side: O(n) expected. */
static int32_t top_p_prefix(td_cand *c, int32_t n, double target) {
    int32_t lo = 0, hi = n; /* c[0..lo) kept for sure, with mass acc; the cut is in [lo, hi) */
    double acc = 0;
    while (hi - lo > 16) {
        int32_t p = lo + cand_partition(c + lo, hi - lo);
        double before = 0;
        for (int32_t i = lo; i < p; i++) before += c[i].p;
        if (acc + before >= target) {
            hi = p;
        } else if (acc + before + c[p].p >= target) {
            return p + 1;
        } else {
            acc += before + c[p].p;
            lo = p + 1;
        }
    }
    cand_insertion_sort(c + lo, hi - lo);
    for (int32_t i = lo; i < hi; i++) {
        acc += c[i].p;
        if (acc >= target) return i + 1;
    }
    return hi; /* rounding kept the sum just below target */
}

/* ---- parameters ---- */

td_sampler_params td_sampler_default_params(void) {
    return (td_sampler_params){
        .temperature = 0.0f,
        .top_k = 0,
        .top_p = 1.0f,
        .min_p = 0.0f,
        .seed = TD_SAMPLER_SEED_RANDOM,
        .repetition_penalty = 1.0f,
        .frequency_penalty = 0.0f,
        .presence_penalty = 0.0f,
        .penalty_last_n = 0,
        .logit_bias = NULL,
        .n_logit_bias = 0,
        .logprobs = false,
        .n_logprobs = 0,
    };
}

static td_status validate(const td_sampler_params *p, int32_t n_vocab) {
    const char *why = NULL;
    if (n_vocab <= 0 || (uint32_t)n_vocab >= TD_RING_GEN)
        why = "vocabulary size out of range";
    else if (!isfinite(p->temperature) || p->temperature < 0)
        why = "temperature must be >= 0";
    else if (!(p->top_p > 0 && p->top_p <= 1))
        why = "top_p must be in (0, 1]";
    else if (!(p->min_p >= 0 && p->min_p <= 1))
        why = "min_p must be in [0, 1]";
    else if (!isfinite(p->repetition_penalty) || p->repetition_penalty <= 0)
        why = "repetition_penalty must be > 0";
    else if (!isfinite(p->frequency_penalty))
        why = "frequency_penalty must be finite";
    else if (!isfinite(p->presence_penalty))
        why = "presence_penalty must be finite";
    else if (p->penalty_last_n < 0)
        why = "penalty_last_n must be >= 0";
    else if (p->n_logprobs < 0 || p->n_logprobs > TD_SAMPLER_MAX_LOGPROBS)
        why = "n_logprobs must be in [0, 20]";
    else if (p->n_logit_bias < 0 || (p->n_logit_bias > 0 && !p->logit_bias))
        why = "bad logit_bias array";
    for (int32_t i = 0; !why && i < p->n_logit_bias; i++) {
        if (p->logit_bias[i].token < 0 || p->logit_bias[i].token >= n_vocab)
            why = "logit_bias token outside the vocabulary";
        else if (isnan(p->logit_bias[i].bias) || p->logit_bias[i].bias == INFINITY)
            why = "logit_bias value must be finite or -inf";
    }
    if (why) {
        TD_LOG_ERROR("invalid sampling parameters: %s", why);
        return TD_ERR_INVALID;
    }
    return TD_OK;
}

td_status td_sampler_create(const td_sampler_params *p, int32_t n_vocab, td_sampler **s_p) {
    td_status st = validate(p, n_vocab);
    if (st != TD_OK) return st;

    td_sampler *s = calloc(1, sizeof *s);
    if (!s) goto err_nomem;
    s->p = *p;
    s->n_vocab = n_vocab;
    if (p->n_logit_bias > 0) {
        s->bias = malloc((size_t)p->n_logit_bias * sizeof *s->bias);
        if (!s->bias) goto err_free;
        memcpy(s->bias, p->logit_bias, (size_t)p->n_logit_bias * sizeof *s->bias);
    }
    s->p.logit_bias = s->bias;
    s->cnt_all = calloc((size_t)n_vocab, sizeof *s->cnt_all);
    s->cnt_gen = calloc((size_t)n_vocab, sizeof *s->cnt_gen);
    s->work = malloc((size_t)n_vocab * sizeof *s->work);
    s->cand = malloc((size_t)n_vocab * sizeof *s->cand);
    if (!s->cnt_all || !s->cnt_gen || !s->work || !s->cand) goto err_free;
    if (p->penalty_last_n > 0) {
        s->ring = malloc((size_t)p->penalty_last_n * sizeof *s->ring);
        if (!s->ring) goto err_free;
    }
    rng_seed(s);
    *s_p = s;
    return TD_OK;

err_free:
    td_sampler_destroy(s);
err_nomem:
    TD_LOG_ERROR("out of memory for a sampler over %d tokens", n_vocab);
    return TD_ERR_NOMEM;
}

void td_sampler_destroy(td_sampler *s) {
    if (!s) return;
    free(s->bias);
    free(s->cnt_all);
    free(s->cnt_gen);
    free(s->ring);
    free(s->work);
    free(s->cand);
    free(s);
}

void td_sampler_reset(td_sampler *s) {
    memset(s->cnt_all, 0, (size_t)s->n_vocab * sizeof *s->cnt_all);
    memset(s->cnt_gen, 0, (size_t)s->n_vocab * sizeof *s->cnt_gen);
    s->ring_head = 0;
    s->ring_len = 0;
    rng_seed(s);
}

/* ---- history ---- */

static void history_push(td_sampler *s, int32_t tok, bool generated) {
    if (s->ring) {
        int32_t cap = s->p.penalty_last_n;
        if (s->ring_len == cap) {
            uint32_t old = s->ring[s->ring_head];
            int32_t ot = (int32_t)(old & ~TD_RING_GEN);
            s->cnt_all[ot]--;
            if (old & TD_RING_GEN) s->cnt_gen[ot]--;
            s->ring[s->ring_head] = (uint32_t)tok | (generated ? TD_RING_GEN : 0);
            s->ring_head = (s->ring_head + 1) % cap;
        } else {
            s->ring[(s->ring_head + s->ring_len) % cap] =
                (uint32_t)tok | (generated ? TD_RING_GEN : 0);
            s->ring_len++;
        }
    }
    /* Counts saturate instead of overflowing on absurdly long histories. */
    if (s->cnt_all[tok] < INT32_MAX) s->cnt_all[tok]++;
    if (generated && s->cnt_gen[tok] < INT32_MAX) s->cnt_gen[tok]++;
}

td_status td_sampler_accept_prompt(td_sampler *s, const int32_t *tokens, size_t n) {
    for (size_t i = 0; i < n; i++) {
        if (tokens[i] < 0 || tokens[i] >= s->n_vocab) {
            TD_LOG_ERROR("prompt token %d at %zu is outside the vocabulary (%d)", tokens[i], i,
                         s->n_vocab);
            return TD_ERR_INVALID;
        }
    }
    for (size_t i = 0; i < n; i++) history_push(s, tokens[i], false);
    return TD_OK;
}

td_status td_sampler_accept(td_sampler *s, int32_t token) {
    if (token < 0 || token >= s->n_vocab) {
        TD_LOG_ERROR("token %d is outside the vocabulary (%d)", token, s->n_vocab);
        return TD_ERR_INVALID;
    }
    history_push(s, token, true);
    return TD_OK;
}

/* ---- the pipeline ---- */

/* Steps 1-3 into s->work. */
static void apply_bias_and_penalties(td_sampler *s, const float *logits) {
    float *w = s->work;
    int32_t nv = s->n_vocab;
    for (int32_t v = 0; v < nv; v++) w[v] = isnan(logits[v]) ? -INFINITY : logits[v];
    for (int32_t i = 0; i < s->p.n_logit_bias; i++) w[s->bias[i].token] += s->bias[i].bias;

    float rp = s->p.repetition_penalty, fp = s->p.frequency_penalty, pp = s->p.presence_penalty;
    if (rp != 1.0f) {
        for (int32_t v = 0; v < nv; v++)
            if (s->cnt_all[v] > 0) w[v] = w[v] > 0 ? w[v] / rp : w[v] * rp;
    }
    if (fp != 0.0f || pp != 0.0f) {
        for (int32_t v = 0; v < nv; v++)
            if (s->cnt_gen[v] > 0) w[v] -= fp * (float)s->cnt_gen[v] + pp;
    }
    /* -inf * a penalty stays -inf; inf - inf cannot arise (no +inf bias). */
    for (int32_t v = 0; v < nv; v++)
        if (isnan(w[v])) w[v] = -INFINITY;
}

static int32_t argmax_lowest(const float *w, int32_t n) {
    int32_t best = -1;
    for (int32_t v = 0; v < n; v++)
        if (w[v] != -INFINITY && (best < 0 || w[v] > w[best])) best = v;
    return best;
}

/* Steps 5-8: leaves the survivors in s->cand[0..*n_p), with .p their
 * unnormalised probabilities and *z_p the sum of those. Returns false if no
 * token survives. */
static bool truncate_candidates(td_sampler *s, int32_t *n_p, double *z_p) {
    float t = s->p.temperature;
    td_cand *c = s->cand;
    int32_t n = 0, top_k = s->p.top_k;
    bool use_heap = top_k > 0 && top_k <= TD_TOPK_HEAP_MAX;
    for (int32_t v = 0; v < s->n_vocab; v++) {
        if (s->work[v] == -INFINITY) continue;
        float l = s->work[v] / t;
        if (isnan(l) || l == -INFINITY) continue;
        td_cand x = {l, 0.0f, v};
        if (!use_heap)
            c[n++] = x;
        else if (n < top_k)
            heap_push(c, n++, x);
        else if (cand_before(&x, &c[0]))
            heap_replace_root(c, n, x);
    }
    if (n == 0) return false;

    if (!use_heap && top_k > 0 && top_k < n) {
        cand_select(c, n, top_k);
        n = top_k;
    }
    float m = -INFINITY;
    for (int32_t i = 0; i < n; i++) m = c[i].logit > m ? c[i].logit : m;
    if (m == INFINITY) {
        /* Overflowing logits: the +inf ones share all the mass. */
        int32_t k = 0;
        for (int32_t i = 0; i < n; i++)
            if (c[i].logit == INFINITY) c[k++] = (td_cand){0.0f, 0.0f, c[i].id};
        n = k;
        m = 0.0f;
    }
    /* Unnormalised probabilities, computed once (float exp: the sum is
     * accumulated in double, and 1e-7 relative is far below any threshold
     * a user can set). */
    double z = 0;
    for (int32_t i = 0; i < n; i++) {
        c[i].p = expf(c[i].logit - m);
        z += c[i].p;
    }

    if (s->p.top_p < 1.0f && n > 1) n = top_p_prefix(c, n, (double)s->p.top_p * z);

    if (s->p.min_p > 0.0f && n > 1) {
        int32_t k = 0;
        for (int32_t i = 0; i < n; i++)
            if (c[i].p >= s->p.min_p) c[k++] = c[i];
        n = k; /* the maximum itself always survives (p = 1 >= min_p) */
    }
    double zk = 0;
    for (int32_t i = 0; i < n; i++) zk += c[i].p;
    *n_p = n;
    *z_p = zk;
    return true;
}

static td_status no_candidate(void) {
    TD_LOG_ERROR("no token has a finite logit after bias and penalties");
    return TD_ERR_RANGE;
}

static void raw_logprobs(const td_sampler *s, const float *logits, int32_t chosen,
                         td_sample_result *r) {
    int32_t nv = s->n_vocab;
    float m = -INFINITY;
    for (int32_t v = 0; v < nv; v++)
        if (!isnan(logits[v]) && logits[v] > m) m = logits[v];
    double lse = -INFINITY;
    if (isfinite(m)) {
        double z = 0;
        for (int32_t v = 0; v < nv; v++)
            if (!isnan(logits[v])) z += exp((double)logits[v] - m);
        lse = m + log(z);
    }
#define LP(v) (isnan(logits[v]) || !isfinite(lse) ? -INFINITY : (float)((double)logits[v] - lse))
    r->logprob = LP(chosen);

    int32_t want = TD_MIN(s->p.n_logprobs, nv), have = 0;
    td_cand top[TD_SAMPLER_MAX_LOGPROBS];
    for (int32_t v = 0; v < nv && want > 0; v++) {
        td_cand x = {isnan(logits[v]) ? -INFINITY : logits[v], 0.0f, v};
        if (have == want && !cand_before(&x, &top[have - 1])) continue;
        int32_t j = have < want ? have++ : want - 1;
        while (j > 0 && cand_before(&x, &top[j - 1])) {
            top[j] = top[j - 1];
            j--;
        }
        top[j] = x;
    }
    r->n_top = have;
    for (int32_t i = 0; i < have; i++) {
        r->top[i].token = top[i].id;
        r->top[i].logprob = LP(top[i].id);
    }
#undef LP
}

td_status td_sampler_sample(td_sampler *s, const float *logits, td_sample_result *result_p) {
    apply_bias_and_penalties(s, logits);
    int32_t tok;
    if (s->p.temperature == 0.0f) {
        tok = argmax_lowest(s->work, s->n_vocab);
        if (tok < 0) return no_candidate();
    } else {
        int32_t n;
        double z;
        if (!truncate_candidates(s, &n, &z)) return no_candidate();
        double u = rng_uniform(s->rng) * z, cum = 0;
        tok = s->cand[n - 1].id; /* if rounding leaves u above the total */
        for (int32_t i = 0; i < n; i++) {
            cum += s->cand[i].p;
            if (u < cum) {
                tok = s->cand[i].id;
                break;
            }
        }
    }
    td_sample_result r;
    r.token = tok;
    r.logprob = 0.0f;
    r.n_top = 0;
    if (s->p.logprobs || s->p.n_logprobs > 0) raw_logprobs(s, logits, tok, &r);
    *result_p = r;
    return TD_OK;
}

td_status td_sampler_probs(td_sampler *s, const float *logits, float *probs) {
    apply_bias_and_penalties(s, logits);
    if (s->p.temperature == 0.0f) {
        int32_t tok = argmax_lowest(s->work, s->n_vocab);
        if (tok < 0) return no_candidate();
        memset(probs, 0, (size_t)s->n_vocab * sizeof *probs);
        probs[tok] = 1.0f;
        return TD_OK;
    }
    int32_t n;
    double z;
    if (!truncate_candidates(s, &n, &z)) return no_candidate();
    memset(probs, 0, (size_t)s->n_vocab * sizeof *probs);
    for (int32_t i = 0; i < n; i++) probs[s->cand[i].id] = (float)(s->cand[i].p / z);
    return TD_OK;
}

void td_sampler_state_get(const td_sampler *s, uint8_t out[TD_SAMPLER_STATE_BYTES]) {
    for (int i = 0; i < 4; i++)
        for (int b = 0; b < 8; b++) out[i * 8 + b] = (uint8_t)(s->rng[i] >> (8 * b));
}

td_status td_sampler_state_set(td_sampler *s, const uint8_t *state, size_t len) {
    if (!state || len != TD_SAMPLER_STATE_BYTES) return TD_ERR_INVALID;
    uint64_t r[4] = {0};
    for (int i = 0; i < 4; i++)
        for (int b = 0; b < 8; b++) r[i] |= (uint64_t)state[i * 8 + b] << (8 * b);
    if ((r[0] | r[1] | r[2] | r[3]) == 0) return TD_ERR_INVALID; /* xoshiro's one bad state */
    memcpy(s->rng, r, sizeof r);
    return TD_OK;
}
