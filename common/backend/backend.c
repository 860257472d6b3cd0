/* Backend selection and the calls every backend shares. */
#include <stdlib.h>
#include <string.h>

#include "backend-impl.h"

td_status td_backend_create_on(td_backend_kind kind, int device, td_threadpool *tp,
                               td_backend **be_p) {
    switch (kind) {
    case TD_BACKEND_CPU: return td_backend_cpu_create(tp, be_p);
    case TD_BACKEND_CPU_CHECK: return td_backend_check_create(tp, be_p);
    case TD_BACKEND_CUDA: return td_backend_cuda_create(device, be_p);
    }
    TD_LOG_ERROR("unknown compute backend %d", (int)kind);
    return TD_ERR_INVALID;
}

td_status td_backend_create(td_backend_kind kind, td_threadpool *tp, td_backend **be_p) {
    return td_backend_create_on(kind, 0, tp, be_p);
}

td_status td_backend_parse(const char *s, td_backend_kind *kind, int *device) {
    *device = 0;
    if (!strcmp(s, "cpu")) {
        *kind = TD_BACKEND_CPU;
    } else if (!strcmp(s, "cpu-check")) {
        *kind = TD_BACKEND_CPU_CHECK;
    } else if (!strncmp(s, "cuda", 4) && (s[4] == 0 || s[4] == ':')) {
        *kind = TD_BACKEND_CUDA;
        if (s[4] == ':') {
            char *end;
            long d = strtol(s + 5, &end, 10);
            if (end == s + 5 || *end || d < 0 || d > 1024) return TD_ERR_INVALID;
            *device = (int)d;
        }
    } else {
        return TD_ERR_INVALID;
    }
    return TD_OK;
}

td_backend_kind td_backend_kind_from_env(void) {
    const char *s = getenv("TANDEM_BACKEND");
    td_backend_kind k;
    int d;
    if (!s || !*s) return TD_BACKEND_CPU;
    if (td_backend_parse(s, &k, &d) == TD_OK) return k;
    TD_LOG_WARN("TANDEM_BACKEND=%s is not a backend (cpu, cpu-check, cuda[:N]): using cpu", s);
    return TD_BACKEND_CPU;
}

int td_backend_device_from_env(void) {
    const char *s = getenv("TANDEM_BACKEND");
    td_backend_kind k;
    int d;
    return s && td_backend_parse(s, &k, &d) == TD_OK ? d : 0;
}

const char *td_backend_kind_name(td_backend_kind kind) {
    switch (kind) {
    case TD_BACKEND_CPU_CHECK: return "cpu-check";
    case TD_BACKEND_CUDA: return "cuda";
    default: return "cpu";
    }
}

void td_backend_destroy(td_backend *be) {
    if (be) be->i->destroy(be);
}
