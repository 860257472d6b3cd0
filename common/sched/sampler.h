/* Token sampler: logit bias, repetition/frequency/presence penalties,
 * temperature, top-k, top-p, min-p, seeded sampling, and top-N logprobs.
 *
 * Pipeline of td_sampler_sample(), in this order:
 *   1. logit_bias          l[v] += bias[v]
 *   2. repetition penalty  (HF / llama.cpp / vLLM semantics) for every token
 *                          seen in the penalty window, prompt or generated:
 *                          l > 0 ? l / r : l * r
 *   3. frequency/presence  (OpenAI semantics) for every token generated in
 *                          the window: l -= f * count + p * (count > 0)
 *   4. temperature == 0    -> greedy: argmax, ties broken toward the lowest id;
 *                             steps 5-9 are skipped and no randomness is drawn.
 *   5. temperature         l /= T
 *   6. top-k               keep the k highest (k <= 0: off)
 *   7. top-p               keep the smallest prefix of the candidates sorted by
 *                          probability whose mass (renormalised over what
 *                          top-k kept) reaches p (p >= 1: off; at least one kept)
 *   8. min-p               keep tokens whose probability is >= min_p times the
 *                          highest remaining probability (0: off)
 *   9. sample              one draw from the renormalised survivors with the
 *                          sampler's own PRNG (xoshiro256** seeded through
 *                          splitmix64), so a seed gives the same sequence on
 *                          every run and every machine.
 * Candidates are ordered by (logit descending, id ascending) wherever an
 * order matters, so every step is deterministic, ties included.
 *
 * Logprobs: the chosen token's logprob and the top-N logprobs are the
 * log-softmax of the RAW logits passed in, before bias, penalties,
 * temperature and truncation (what vLLM reports by default, "raw_logprobs",
 * and what OpenAI's API documents as the model's log probabilities).
 *
 * A sampler holds one sequence's state (PRNG, token history); all scratch is
 * allocated at create, so td_sampler_sample() never allocates.
 * Not thread-safe: one sequence, one thread at a time. */
#ifndef TD_SAMPLER_H
#define TD_SAMPLER_H

#include <stdbool.h>
#include <stdint.h>

#include "common/base/base.h"

#define TD_SAMPLER_MAX_LOGPROBS 20         /* OpenAI's cap on top_logprobs */
#define TD_SAMPLER_SEED_RANDOM  UINT64_MAX /* seed from the OS at create/reset */

typedef struct {
    int32_t token;
    float bias; /* added to the logit; -INFINITY bans the token */
} td_logit_bias;

typedef struct {
    float temperature;               /* >= 0; 0 = greedy (default 0) */
    int32_t top_k;                   /* <= 0: off (default 0) */
    float top_p;                     /* (0, 1]; 1 = off (default 1) */
    float min_p;                     /* [0, 1]; 0 = off (default 0) */
    uint64_t seed;                   /* TD_SAMPLER_SEED_RANDOM (default): from the OS */
    float repetition_penalty;        /* > 0; 1 = off (default 1) */
    float frequency_penalty;         /* 0 = off (default 0) */
    float presence_penalty;          /* 0 = off (default 0) */
    int32_t penalty_last_n;          /* window of the history the penalties look at:
                                      * 0 = the whole history (vLLM), N > 0 = the last N
                                      * tokens (llama.cpp) (default 0) */
    const td_logit_bias *logit_bias; /* copied at create; may be NULL */
    int32_t n_logit_bias;
    bool logprobs;      /* report the sampled token's logprob (one more pass over
                         * the vocabulary per token; default false) */
    int32_t n_logprobs; /* and the top-N logprobs, 0..TD_SAMPLER_MAX_LOGPROBS
                         * (> 0 implies logprobs) */
} td_sampler_params;

typedef struct {
    int32_t token;
    float logprob;
} td_token_logprob;

typedef struct {
    int32_t token;                                 /* the sampled token */
    float logprob;                                 /* its raw log-softmax */
    int32_t n_top;                                 /* = params.n_logprobs (or n_vocab if smaller) */
    td_token_logprob top[TD_SAMPLER_MAX_LOGPROBS]; /* highest first, ties by lower id */
} td_sample_result;

typedef struct td_sampler td_sampler;

td_sampler_params td_sampler_default_params(void);

/* Validates p (TD_ERR_INVALID with a logged reason for a temperature < 0 or
 * not finite, top_p outside (0, 1], min_p outside [0, 1], a repetition
 * penalty <= 0, a penalty that is not finite, a logit_bias token outside
 * [0, n_vocab), n_logprobs outside [0, 20], penalty_last_n < 0) and
 * allocates every buffer the sampler needs. Free with td_sampler_destroy(). */
td_status td_sampler_create(const td_sampler_params *p, int32_t n_vocab, td_sampler **s_p);
void td_sampler_destroy(td_sampler *s); /* accepts NULL */

/* Forgets the history and reseeds the PRNG from params.seed (a new OS seed
 * for TD_SAMPLER_SEED_RANDOM), as for a new sequence. */
void td_sampler_reset(td_sampler *s);

/* Appends prompt tokens to the history (they count for the repetition
 * penalty, not for frequency/presence). TD_ERR_INVALID for an id outside the
 * vocabulary (history unchanged). */
td_status td_sampler_accept_prompt(td_sampler *s, const int32_t *tokens, size_t n);
/* Appends one generated token (counts for every penalty). TD_ERR_INVALID for
 * an id outside the vocabulary. */
td_status td_sampler_accept(td_sampler *s, int32_t token);

/* Samples one token from logits (n_vocab floats; not modified). Does not
 * accept the token: call td_sampler_accept() with it. NaN logits count as
 * -infinity; TD_ERR_RANGE (logged) if no token has a finite processed logit.
 * result_p is written only on success. */
td_status td_sampler_sample(td_sampler *s, const float *logits, td_sample_result *result_p);

/* The PRNG state (xoshiro256**, 32 bytes little-endian), so that a
 * sequence whose first token was drawn elsewhere (a prefill instance)
 * continues with the same draws. set: TD_ERR_INVALID unless len == 32 and
 * the state is not all zero. */
#define TD_SAMPLER_STATE_BYTES 32
void td_sampler_state_get(const td_sampler *s, uint8_t out[TD_SAMPLER_STATE_BYTES]);
td_status td_sampler_state_set(td_sampler *s, const uint8_t *state, size_t len);

/* The distribution step 9 draws from: probs[v] for every v (n_vocab floats,
 * zero for the tokens steps 6-8 removed; one-hot for greedy). Uses the same
 * code as td_sampler_sample() and draws nothing from the PRNG; for tests and
 * for callers that need the processed distribution. */
td_status td_sampler_probs(td_sampler *s, const float *logits, float *probs);

#endif
