/* The prefill service: what tandem-prefill hands td_serve_main. */
#ifndef TD_PREFILL_SERVICE_H
#define TD_PREFILL_SERVICE_H

#include "common/serve/serve.h"

extern const td_serve_role_def td_prefill_service;

#endif
