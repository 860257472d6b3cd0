/* Names of GGUF tensor type ids (ggml_type), including ids Tandem does not
 * compute with, so that loaders can name an unsupported tensor type. */
#include "kernels/dtype.h"

static const char *const g_type_names[] = {
    [0] = "f32",     [1] = "f16",         [2] = "q4_0",        [3] = "q4_1",        [4] = "q4_2",
    [5] = "q4_3",    [6] = "q5_0",        [7] = "q5_1",        [8] = "q8_0",        [9] = "q8_1",
    [10] = "q2_K",   [11] = "q3_K",       [12] = "q4_K",       [13] = "q5_K",       [14] = "q6_K",
    [15] = "q8_K",   [16] = "iq2_xxs",    [17] = "iq2_xs",     [18] = "iq3_xxs",    [19] = "iq1_s",
    [20] = "iq4_nl", [21] = "iq3_s",      [22] = "iq2_s",      [23] = "iq4_xs",     [24] = "i8",
    [25] = "i16",    [26] = "i32",        [27] = "i64",        [28] = "f64",        [29] = "iq1_m",
    [30] = "bf16",   [31] = "q4_0_4_4",   [32] = "q4_0_4_8",   [33] = "q4_0_8_8",   [34] = "tq1_0",
    [35] = "tq2_0",  [36] = "iq4_nl_4_4", [37] = "iq4_nl_4_8", [38] = "iq4_nl_8_8", [39] = "mxfp4",
    [40] = "nvfp4",  [41] = "q1_0",
};

const char *td_dtype_name(int t) {
    if (t < 0 || t >= (int)(sizeof g_type_names / sizeof g_type_names[0]) || !g_type_names[t])
        return "unknown";
    return g_type_names[t];
}
