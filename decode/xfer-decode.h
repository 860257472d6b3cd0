/* The decode side of the KV transfer (common/transfer/xfer.h): what
 * tandem-decode hands its transfer service. */
#ifndef TD_DECODE_XFER_DECODE_H
#define TD_DECODE_XFER_DECODE_H

#include "common/transfer/xfer.h"

extern const td_xfer_side td_xfer_decode_side;

#endif
