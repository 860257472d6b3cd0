/* tandem-decode: a decode instance (DESIGN.md §1, §2): the shared server of
 * common/serve/serve.c in the decode role (service.c: its options, its
 * --help, its side of the KV transfer in xfer-decode.c). */
#include <string.h>

#include "common/parallel/exec.h"
#include "common/runtime/cli.h"
#include "common/serve/serve.h"
#include "common/transfer/xext.h"
#include "service.h"

int main(int argc, char **argv) {
    if (!td_process_init("tandem-decode")) return 1;
    /* internal: a rank process of a parallel plan, started by the driver */
    if (argc > 1 && strcmp(argv[1], "rank") == 0)
        return td_exec_rank_main(argc - 1, argv + 1, &td_xext_ops);
    return td_serve_main(argc, argv, &td_decode_service);
}
