/* Backend selection and the calls every backend shares. */
#include <stdlib.h>
#include <string.h>

#include "backend-impl.h"

td_status td_backend_create(td_backend_kind kind, td_threadpool *tp, td_backend **be_p) {
    switch (kind) {
    case TD_BACKEND_CPU: return td_backend_cpu_create(tp, be_p);
    case TD_BACKEND_CPU_CHECK: return td_backend_check_create(tp, be_p);
    }
    TD_LOG_ERROR("unknown compute backend %d", (int)kind);
    return TD_ERR_INVALID;
}

td_backend_kind td_backend_kind_from_env(void) {
    const char *s = getenv("TANDEM_BACKEND");
    if (!s || !*s || strcmp(s, "cpu") == 0) return TD_BACKEND_CPU;
    if (strcmp(s, "cpu-check") == 0) return TD_BACKEND_CPU_CHECK;
    TD_LOG_WARN("TANDEM_BACKEND=%s is not a backend (cpu, cpu-check): using cpu", s);
    return TD_BACKEND_CPU;
}

const char *td_backend_kind_name(td_backend_kind kind) {
    return kind == TD_BACKEND_CPU_CHECK ? "cpu-check" : "cpu";
}

void td_backend_destroy(td_backend *be) {
    if (be) be->i->destroy(be);
}
