/* The one conversion of a generation request's sampling parameters
 * between its three forms: the C request (td_gen_request), the internal
 * proto (tandem.v1.SamplingParams: router -> decode in the internal
 * Generate, decode -> prefill in a PrefillRequest) and the public JSON
 * (the gRPC front end hands its requests to the one parser, request.h).
 *
 * The rules of the values are the API's (request.h), applied where a
 * request enters (JSON, or gRPC through JSON). A proto from a peer is
 * checked for what would break the receiver: counts against the API's
 * limits (td_api_limits: stop strings, stop ids) and the vocabulary, token
 * ids in it, finite numbers. Thread-safe: no shared state. */
#ifndef TD_API_SAMPLING_H
#define TD_API_SAMPLING_H

#include <jansson.h>

#include "common/sched/sched.h"
#include "proto/tandem.pb-c.h"
#include "request.h"

/* A proto of a request's sampling parameters. sp points into the request
 * it was made from (stop strings, stop ids) and into the logit-bias
 * entries below, which it owns. */
typedef struct {
    Tandem__V1__SamplingParams sp;
    Tandem__V1__SamplingParams__LogitBiasEntry *lb, **lbp;
} td_sampling_proto;

/* Every sampling field of g: the sampler's parameters, max_tokens (when
 * > 0), min_tokens, stop strings and ids, ignore_eos, skip_special,
 * include_stop_str. TD_ERR_NOMEM (nothing to free) or TD_OK: free with
 * td_sampling_proto_free. */
td_status td_sampling_to_proto(const td_gen_request *g, td_sampling_proto *out);
void td_sampling_proto_free(td_sampling_proto *p); /* accepts a zeroed one */

/* The fields td_sampling_to_proto writes, back into g (s NULL: the
 * defaults). g borrows the stop strings and ids of s; *bias_p (malloc'd,
 * NULL when there is none, the caller frees it after the submit) holds the
 * logit biases g->sampling points to. On a bad value fills err (400,
 * naming the parameter) and returns TD_ERR_INVALID, g untouched. */
td_status td_sampling_from_proto(const Tandem__V1__SamplingParams *s, const td_api_limits *lim,
                                 int32_t n_vocab, td_gen_request *g, td_logit_bias **bias_p,
                                 td_api_error *err);

/* The proto in its OpenAI JSON spelling for a request of kind, into o:
 * only what the client set, so the API's defaults apply to the rest. */
bool td_sampling_to_json(const Tandem__V1__SamplingParams *s, td_api_kind kind, json_t *o,
                         td_api_error *err);

/* The JSON members the gRPC front end also builds a request with
 * (fill err: 400 for a value JSON cannot hold, 500 out of memory). */
bool td_json_put_float(json_t *o, const char *key, float f, td_api_error *err);
bool td_json_put_string(json_t *o, const char *key, const char *s, td_api_error *err);
bool td_json_put_int(json_t *o, const char *key, json_int_t i, td_api_error *err);
bool td_json_put_bool(json_t *o, const char *key, bool b, td_api_error *err);
bool td_json_put_int_array(json_t *o, const char *key, const int32_t *v, size_t n,
                           td_api_error *err);

#endif
