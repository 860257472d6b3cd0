/* The decode service: what tandem-decode hands td_serve_main. */
#ifndef TD_DECODE_SERVICE_H
#define TD_DECODE_SERVICE_H

#include "common/serve/serve.h"

extern const td_serve_role_def td_decode_service;

#endif
