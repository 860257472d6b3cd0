/* Sampling parameters: C request <-> internal proto -> public JSON
 * (sampling.h). */
#include "sampling.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

td_status td_sampling_to_proto(const td_gen_request *g, td_sampling_proto *out) {
    memset(out, 0, sizeof *out);
    Tandem__V1__SamplingParams *sp = &out->sp;
    tandem__v1__sampling_params__init(sp);
    const td_sampler_params *s = &g->sampling;
    sp->_temperature_case = TANDEM__V1__SAMPLING_PARAMS___TEMPERATURE_TEMPERATURE;
    sp->temperature = s->temperature;
    sp->_top_p_case = TANDEM__V1__SAMPLING_PARAMS___TOP_P_TOP_P;
    sp->top_p = s->top_p;
    sp->top_k = s->top_k;
    sp->min_p = s->min_p;
    if (s->seed != TD_SAMPLER_SEED_RANDOM) {
        sp->_seed_case = TANDEM__V1__SAMPLING_PARAMS___SEED_SEED;
        sp->seed = (int64_t)s->seed;
    }
    sp->_repetition_penalty_case =
        TANDEM__V1__SAMPLING_PARAMS___REPETITION_PENALTY_REPETITION_PENALTY;
    sp->repetition_penalty = s->repetition_penalty;
    sp->frequency_penalty = s->frequency_penalty;
    sp->presence_penalty = s->presence_penalty;
    sp->logprobs = s->logprobs;
    sp->top_logprobs = s->n_logprobs;
    if (g->max_tokens > 0) {
        sp->_max_tokens_case = TANDEM__V1__SAMPLING_PARAMS___MAX_TOKENS_MAX_TOKENS;
        sp->max_tokens = g->max_tokens;
    }
    sp->min_tokens = g->min_tokens;
    sp->stop = (char **)g->stop;
    sp->n_stop = g->n_stop > 0 ? (size_t)g->n_stop : 0;
    sp->stop_token_ids = (int32_t *)g->stop_ids;
    sp->n_stop_token_ids = g->n_stop_ids > 0 ? (size_t)g->n_stop_ids : 0;
    sp->ignore_eos = g->ignore_eos;
    sp->_skip_special_tokens_case =
        TANDEM__V1__SAMPLING_PARAMS___SKIP_SPECIAL_TOKENS_SKIP_SPECIAL_TOKENS;
    sp->skip_special_tokens = g->skip_special;
    sp->include_stop_str_in_output = g->include_stop_str;
    if (s->n_logit_bias > 0) {
        out->lb = calloc((size_t)s->n_logit_bias, sizeof *out->lb);
        out->lbp = calloc((size_t)s->n_logit_bias, sizeof *out->lbp);
        if (!out->lb || !out->lbp) {
            td_sampling_proto_free(out);
            return TD_ERR_NOMEM;
        }
        for (int32_t i = 0; i < s->n_logit_bias; i++) {
            tandem__v1__sampling_params__logit_bias_entry__init(&out->lb[i]);
            out->lb[i].key = s->logit_bias[i].token;
            out->lb[i].value = s->logit_bias[i].bias;
            out->lbp[i] = &out->lb[i];
        }
        sp->logit_bias = out->lbp;
        sp->n_logit_bias = (size_t)s->n_logit_bias;
    }
    return TD_OK;
}

void td_sampling_proto_free(td_sampling_proto *p) {
    if (!p) return;
    free(p->lb);
    free(p->lbp);
    p->lb = NULL;
    p->lbp = NULL;
    p->sp.logit_bias = NULL;
    p->sp.n_logit_bias = 0;
}

static td_status bad(td_api_error *err, const char *param, const char *what) {
    td_api_error_set(err, 400, "invalid_request_error", NULL, param, "%s %s", param, what);
    return TD_ERR_INVALID;
}

td_status td_sampling_from_proto(const Tandem__V1__SamplingParams *s, const td_api_limits *lim,
                                 int32_t n_vocab, td_gen_request *g, td_logit_bias **bias_p,
                                 td_api_error *err) {
    *bias_p = NULL;
    td_sampler_params sp = td_sampler_default_params();
    if (!s) {
        g->sampling = sp;
        return TD_OK;
    }
    float nums[] = {s->temperature,       s->top_p,           s->min_p, s->repetition_penalty,
                    s->frequency_penalty, s->presence_penalty};
    for (size_t i = 0; i < sizeof nums / sizeof nums[0]; i++)
        if (!isfinite(nums[i])) return bad(err, "sampling", "holds a number that is not finite");
    if (s->n_stop > (size_t)lim->max_stop) return bad(err, "stop", "has too many strings");
    for (size_t i = 0; i < s->n_stop; i++)
        if (!s->stop[i] || !s->stop[i][0]) return bad(err, "stop", "holds an empty string");
    if (s->n_stop_token_ids > (size_t)lim->max_stop_ids)
        return bad(err, "stop_token_ids", "has too many ids");
    for (size_t i = 0; i < s->n_stop_token_ids; i++)
        if (s->stop_token_ids[i] < 0 || s->stop_token_ids[i] >= n_vocab)
            return bad(err, "stop_token_ids", "holds an id outside the vocabulary");
    if (s->n_logit_bias > (size_t)n_vocab) return bad(err, "logit_bias", "has too many entries");
    for (size_t i = 0; i < s->n_logit_bias; i++)
        if (s->logit_bias[i]->key < 0 || s->logit_bias[i]->key >= n_vocab ||
            !isfinite(s->logit_bias[i]->value))
            return bad(err, "logit_bias", "holds an id outside the vocabulary or a bad bias");
    if (s->_max_tokens_case == TANDEM__V1__SAMPLING_PARAMS___MAX_TOKENS_MAX_TOKENS &&
        s->max_tokens < 1)
        return bad(err, "max_tokens", "must be at least 1");
    if (s->min_tokens < 0) return bad(err, "min_tokens", "must not be negative");
    if (s->top_logprobs < 0 || s->top_logprobs > 20)
        return bad(err, "top_logprobs", "must be in [0, 20]");

    if (s->_temperature_case == TANDEM__V1__SAMPLING_PARAMS___TEMPERATURE_TEMPERATURE)
        sp.temperature = s->temperature;
    if (s->_top_p_case == TANDEM__V1__SAMPLING_PARAMS___TOP_P_TOP_P) sp.top_p = s->top_p;
    sp.top_k = s->top_k;
    sp.min_p = s->min_p;
    if (s->_seed_case == TANDEM__V1__SAMPLING_PARAMS___SEED_SEED) sp.seed = (uint64_t)s->seed;
    if (s->_repetition_penalty_case ==
        TANDEM__V1__SAMPLING_PARAMS___REPETITION_PENALTY_REPETITION_PENALTY)
        sp.repetition_penalty = s->repetition_penalty;
    sp.frequency_penalty = s->frequency_penalty;
    sp.presence_penalty = s->presence_penalty;
    sp.logprobs = s->logprobs;
    sp.n_logprobs = s->top_logprobs;
    if (s->n_logit_bias > 0) {
        td_logit_bias *b = calloc(s->n_logit_bias, sizeof *b);
        if (!b) {
            td_api_error_set(err, 500, "server_error", NULL, NULL, "out of memory");
            return TD_ERR_NOMEM;
        }
        for (size_t i = 0; i < s->n_logit_bias; i++) {
            b[i].token = s->logit_bias[i]->key;
            b[i].bias = s->logit_bias[i]->value;
        }
        sp.logit_bias = b;
        sp.n_logit_bias = (int32_t)s->n_logit_bias;
        *bias_p = b;
    }
    g->sampling = sp;
    if (s->_max_tokens_case == TANDEM__V1__SAMPLING_PARAMS___MAX_TOKENS_MAX_TOKENS)
        g->max_tokens = s->max_tokens;
    g->min_tokens = s->min_tokens;
    g->stop = (const char *const *)s->stop;
    g->n_stop = (int32_t)s->n_stop;
    g->stop_ids = s->stop_token_ids;
    g->n_stop_ids = (int32_t)s->n_stop_token_ids;
    g->ignore_eos = s->ignore_eos;
    g->skip_special = s->_skip_special_tokens_case !=
                          TANDEM__V1__SAMPLING_PARAMS___SKIP_SPECIAL_TOKENS_SKIP_SPECIAL_TOKENS ||
                      s->skip_special_tokens;
    g->include_stop_str = s->include_stop_str_in_output;
    return TD_OK;
}

static bool nomem(td_api_error *err) {
    td_api_error_set(err, 500, "server_error", NULL, NULL, "out of memory");
    return false;
}

static bool json_put(json_t *o, const char *key, json_t *v) {
    return v && json_object_set_new(o, key, v) == 0;
}

bool td_json_put_float(json_t *o, const char *key, float f, td_api_error *err) {
    if (!isfinite(f)) {
        td_api_error_set(err, 400, "invalid_request_error", NULL, key, "%s must be a finite number",
                         key);
        return false;
    }
    return json_put(o, key, json_real((double)f)) || nomem(err);
}

bool td_json_put_string(json_t *o, const char *key, const char *s, td_api_error *err) {
    json_t *v = json_string(s);
    if (!v) {
        td_api_error_set(err, 400, "invalid_request_error", NULL, key, "%s is not valid UTF-8",
                         key);
        return false;
    }
    return json_object_set_new(o, key, v) == 0 || nomem(err);
}

bool td_json_put_int(json_t *o, const char *key, json_int_t i, td_api_error *err) {
    return json_put(o, key, json_integer(i)) || nomem(err);
}

bool td_json_put_bool(json_t *o, const char *key, bool b, td_api_error *err) {
    return json_put(o, key, json_boolean(b)) || nomem(err);
}

bool td_json_put_int_array(json_t *o, const char *key, const int32_t *v, size_t n,
                           td_api_error *err) {
    json_t *a = json_array();
    if (!a) return nomem(err);
    for (size_t i = 0; i < n; i++) {
        if (json_array_append_new(a, json_integer(v[i])) != 0) {
            json_decref(a);
            return nomem(err);
        }
    }
    return json_object_set_new(o, key, a) == 0 || nomem(err);
}

bool td_sampling_to_json(const Tandem__V1__SamplingParams *s, td_api_kind kind, json_t *o,
                         td_api_error *err) {
    if (!s) return true;
    if (s->_temperature_case == TANDEM__V1__SAMPLING_PARAMS___TEMPERATURE_TEMPERATURE &&
        !td_json_put_float(o, "temperature", s->temperature, err))
        return false;
    if (s->_top_p_case == TANDEM__V1__SAMPLING_PARAMS___TOP_P_TOP_P &&
        !td_json_put_float(o, "top_p", s->top_p, err))
        return false;
    if (s->top_k != 0 && !td_json_put_int(o, "top_k", s->top_k, err)) return false;
    if (s->min_p != 0 && !td_json_put_float(o, "min_p", s->min_p, err)) return false;
    if (s->_seed_case == TANDEM__V1__SAMPLING_PARAMS___SEED_SEED &&
        !td_json_put_int(o, "seed", (json_int_t)s->seed, err))
        return false;
    if (s->_repetition_penalty_case ==
            TANDEM__V1__SAMPLING_PARAMS___REPETITION_PENALTY_REPETITION_PENALTY &&
        !td_json_put_float(o, "repetition_penalty", s->repetition_penalty, err))
        return false;
    if (s->frequency_penalty != 0 &&
        !td_json_put_float(o, "frequency_penalty", s->frequency_penalty, err))
        return false;
    if (s->presence_penalty != 0 &&
        !td_json_put_float(o, "presence_penalty", s->presence_penalty, err))
        return false;
    if (s->_max_tokens_case == TANDEM__V1__SAMPLING_PARAMS___MAX_TOKENS_MAX_TOKENS &&
        !td_json_put_int(o, "max_tokens", s->max_tokens, err))
        return false;
    if (s->min_tokens != 0 && !td_json_put_int(o, "min_tokens", s->min_tokens, err)) return false;
    if (s->n_stop > 0) {
        json_t *a = json_array();
        if (!a || json_object_set_new(o, "stop", a) != 0) return nomem(err);
        for (size_t i = 0; i < s->n_stop; i++) {
            json_t *v = json_string(s->stop[i]);
            if (!v) {
                td_api_error_set(err, 400, "invalid_request_error", NULL, "stop",
                                 "stop[%zu] is not valid UTF-8", i);
                return false;
            }
            if (json_array_append_new(a, v) != 0) return nomem(err);
        }
    }
    if (s->n_stop_token_ids > 0 &&
        !td_json_put_int_array(o, "stop_token_ids", s->stop_token_ids, s->n_stop_token_ids, err))
        return false;
    if (s->ignore_eos && !td_json_put_bool(o, "ignore_eos", true, err)) return false;
    bool logprobs = s->logprobs || s->top_logprobs > 0;
    if (kind == TD_API_COMPLETIONS) {
        /* Completions spell "logprobs and the top N" as logprobs: N. */
        if ((logprobs || s->top_logprobs != 0) &&
            !td_json_put_int(o, "logprobs", s->top_logprobs, err))
            return false;
    } else {
        if (logprobs && !td_json_put_bool(o, "logprobs", true, err)) return false;
        if (s->top_logprobs != 0 && !td_json_put_int(o, "top_logprobs", s->top_logprobs, err))
            return false;
    }
    if (s->_skip_special_tokens_case ==
            TANDEM__V1__SAMPLING_PARAMS___SKIP_SPECIAL_TOKENS_SKIP_SPECIAL_TOKENS &&
        !td_json_put_bool(o, "skip_special_tokens", s->skip_special_tokens, err))
        return false;
    if (s->include_stop_str_in_output &&
        !td_json_put_bool(o, "include_stop_str_in_output", true, err))
        return false;
    if (s->n_logit_bias > 0) {
        json_t *lb = json_object();
        if (!lb || json_object_set_new(o, "logit_bias", lb) != 0) return nomem(err);
        for (size_t i = 0; i < s->n_logit_bias; i++) {
            char key[16];
            snprintf(key, sizeof(key), "%d", (int)s->logit_bias[i]->key);
            if (!td_json_put_float(lb, key, s->logit_bias[i]->value, err)) {
                snprintf(err->param, sizeof(err->param), "logit_bias");
                return false;
            }
        }
    }
    return true;
}
