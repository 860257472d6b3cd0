/* The prefill side of the KV transfer (common/transfer/xfer.h): what
 * tandem-prefill hands its transfer service. */
#ifndef TD_PREFILL_XFER_PREFILL_H
#define TD_PREFILL_XFER_PREFILL_H

#include "common/transfer/xfer.h"

extern const td_xfer_side td_xfer_prefill_side;

#endif
