/* tandem serve: the instance with both roles in one process. */
#include "common/serve/serve.h"
#include "tools.h"

int td_cmd_serve(int argc, char **argv) { return td_serve_main(argc, argv, NULL); }
