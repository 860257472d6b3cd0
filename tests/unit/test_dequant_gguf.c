/* Every ISA's block dequantizer (the one its matmul kernels use,
 * td_cpu_dequant_row_isa) against the PyPI gguf package's
 * gguf.quants.dequantize (tests/reference/dequant_gguf.py), bit for bit in
 * f32, for every quantized type Tandem reads:
 *   - random blocks with finite scales over the whole fp16 range, and blocks
 *     with extreme scales (+-65504, the smallest subnormal and normal, -0)
 *     under all-zero and all-ones quant bytes (which for the K-quants are
 *     also the packed sub-block scales, so their largest values too);
 *   - every quantized tensor of the real Q4_K_M files the test command
 *     fetches (scripts/fetch-test-models.sh: Qwen2.5-Coder-0.5B-Instruct and
 *     Gemma 3 270M), streamed from the reference through a pipe.
 * Bit equality holds because every product in the GGUF definitions is exact
 * in f32 (an fp16 scale times integers of at most 14 bits together), so each
 * element rounds at most once whatever the order or fusion of the kernels'
 * operations (kernels/cpu/cpu-impl.h, td_cpu_deq_group); no path here is
 * within 1 ulp only. NaN and infinite scales are a loader matter
 * (test_model_load's corrupt-file cases). */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "common/format/gguf.h"
#include "kernels/cpu/cpu.h"
#include "kernels/cpu/qmatmul.h"
#define TD_TEST_RNG_SEED 0x9e3779b97f4a7c15ull
#include "test-rand.h"

static const td_isa k_isas[] = {TD_ISA_SCALAR, TD_ISA_AVX2, TD_ISA_AVX512};

static const struct {
    td_dtype t;
    const char *name; /* gguf.GGMLQuantizationType */
    int scale_at[2];  /* byte offsets of the fp16 scale and min (-1: none) */
} k_types[] = {
    {TD_TYPE_Q4_0, "Q4_0", {0, -1}}, {TD_TYPE_Q4_1, "Q4_1", {0, 2}},
    {TD_TYPE_Q5_0, "Q5_0", {0, -1}}, {TD_TYPE_Q5_1, "Q5_1", {0, 2}},
    {TD_TYPE_Q8_0, "Q8_0", {0, -1}}, {TD_TYPE_Q4_K, "Q4_K", {0, 2}},
    {TD_TYPE_Q5_K, "Q5_K", {0, 2}},  {TD_TYPE_Q6_K, "Q6_K", {208, -1}},
};

static const char *script_path(void) {
    static char buf[1024];
    const char *src = getenv("TANDEM_SOURCE_DIR");
    if (!src) return NULL;
    snprintf(buf, sizeof buf, "%s/tests/reference/dequant_gguf.py", src);
    return access(buf, R_OK) == 0 ? buf : NULL;
}

/* An fp16 scale for block i: random finite values over the whole range,
 * then the extremes. */
static uint16_t scale_bits(int i) {
    switch (i % 6) {
    case 1: return 0x7bff; /* 65504 */
    case 2: return 0xfbff; /* -65504 */
    case 3: return 0x0001; /* smallest subnormal */
    case 4: return 0x0400; /* smallest normal */
    case 5: return 0x8000; /* -0 */
    default: {
        uint16_t h = (uint16_t)rnd64();
        if (((h >> 10) & 31) == 31) h &= 0xbfff; /* not inf or NaN */
        return h;
    }
    }
}

/* Compares n values of every ISA's dequantizer of src (type t) with want. */
static void compare_isas(td_dtype t, const char *what, const void *src, int64_t n,
                         const float *want, float *got) {
    for (size_t ii = 0; ii < sizeof k_isas / sizeof k_isas[0]; ii++) {
        if (!td_cpu_select(k_isas[ii])) continue;
        memset(got, 0xa5, (size_t)n * sizeof(float));
        td_cpu_dequant_row_isa(k_isas[ii], t, src, got, n);
        if (memcmp(got, want, (size_t)n * sizeof(float)) != 0) {
            for (int64_t i = 0; i < n; i++)
                if (memcmp(&got[i], &want[i], sizeof(float)) != 0)
                    fail_msg("%s %s (%s): element %lld = %.9g, gguf-py %.9g",
                             td_cpu_isa_name(k_isas[ii]), td_dtype_name(t), what, (long long)i,
                             (double)got[i], (double)want[i]);
        }
    }
    /* td_cpu_dequant_row (the loaders' and the embedding's) too */
    assert_true(td_cpu_select(td_cpu_isa_best()));
    td_cpu_dequant_row(t, src, got, n);
    assert_memory_equal(got, want, (size_t)n * sizeof(float));
}

static void test_random_and_extreme_blocks(void **state) {
    (void)state;
    const char *script = script_path();
    if (!script) skip();
    char dir[] = "/tmp/td_test_dequant_XXXXXX";
    assert_non_null(mkdtemp(dir));
    enum { NB = 96 }; /* 6 scale kinds x 3 quant kinds, and more random ones */
    for (size_t ti = 0; ti < sizeof k_types / sizeof k_types[0]; ti++) {
        const td_dtype t = k_types[ti].t;
        const size_t bb = td_dtype_block_bytes(t);
        const int64_t be = td_dtype_block_elems(t), n = NB * be;
        uint8_t *blk = malloc(NB * bb);
        float *want = malloc((size_t)n * sizeof(float)), *got = malloc((size_t)n * sizeof(float));
        assert_non_null(blk);
        assert_non_null(want);
        assert_non_null(got);
        for (int i = 0; i < NB; i++) {
            uint8_t *p = blk + (size_t)i * bb;
            int qk = (i / 6) % 3; /* random, all zero, all ones */
            for (size_t j = 0; j < bb; j++) p[j] = qk == 0 ? (uint8_t)rnd64() : qk == 1 ? 0 : 0xff;
            for (int s = 0; s < 2; s++) {
                if (k_types[ti].scale_at[s] < 0) continue;
                uint16_t h = scale_bits(s == 0 ? i : i / 3); /* the min: other extremes */
                memcpy(p + k_types[ti].scale_at[s], &h, 2);
            }
        }
        char in[128], out[128], cmd[1536];
        snprintf(in, sizeof in, "%s/%s.bin", dir, k_types[ti].name);
        snprintf(out, sizeof out, "%s/%s.f32", dir, k_types[ti].name);
        FILE *f = fopen(in, "wb");
        assert_non_null(f);
        assert_int_equal(fwrite(blk, bb, NB, f), NB);
        assert_int_equal(fclose(f), 0);
        snprintf(cmd, sizeof cmd, "python3 '%s' blocks %s '%s' '%s'", script, k_types[ti].name, in,
                 out);
        int rc = system(cmd);
        if (rc != -1 && WIFEXITED(rc) && WEXITSTATUS(rc) == 77) skip(); /* numpy or gguf missing */
        assert_true(rc != -1 && WIFEXITED(rc) && WEXITSTATUS(rc) == 0);
        f = fopen(out, "rb");
        assert_non_null(f);
        assert_int_equal(fread(want, sizeof(float), (size_t)n, f), (size_t)n);
        assert_int_equal(fgetc(f), EOF);
        fclose(f);
        compare_isas(t, "random and extreme blocks", blk, n, want, got);
        unlink(in);
        unlink(out);
        free(blk);
        free(want);
        free(got);
    }
    rmdir(dir);
}

/* Every quantized tensor of one real file, streamed by the reference. */
static void check_real_file(const char *file, int *n_by_type) {
    const char *script = script_path();
    if (!script) skip();
    char path[1024];
    const char *md = getenv("TANDEM_MODEL_DIR");
    const char *home = getenv("HOME");
    if (md)
        snprintf(path, sizeof path, "%s/%s", md, file);
    else
        snprintf(path, sizeof path, "%s/.cache/tandem/models/%s", home ? home : "", file);
    if (access(path, R_OK) != 0) {
        print_message("%s is missing: scripts/fetch-test-models.sh fetches it\n", path);
        skip();
    }
    td_gguf *g = NULL;
    assert_int_equal(td_gguf_open(path, &g), TD_OK);
    char cmd[2600];
    snprintf(cmd, sizeof cmd, "python3 '%s' file '%s'", script, path);
    FILE *p = popen(cmd, "r");
    assert_non_null(p);
    char line[512];
    int n_tensors = 0;
    float *want = NULL, *got = NULL;
    size_t cap = 0;
    while (fgets(line, sizeof line, p)) {
        if (strcmp(line, "END\n") == 0) break;
        char name[256], type[32];
        long long n;
        assert_int_equal(sscanf(line, "%255s %31s %lld", name, type, &n), 3);
        const td_gguf_tensor *t = td_gguf_find_tensor(g, name);
        assert_non_null(t);
        int ti = -1;
        for (size_t i = 0; i < sizeof k_types / sizeof k_types[0]; i++)
            if (strcmp(k_types[i].name, type) == 0) ti = (int)i;
        if (ti < 0)
            fail_msg("%s: tensor %s has type %s, which Tandem does not read", file, name, type);
        assert_int_equal(t->type, k_types[ti].t);
        if ((size_t)n > cap) {
            free(want);
            free(got);
            cap = (size_t)n;
            want = malloc(cap * sizeof(float));
            got = malloc(cap * sizeof(float));
            assert_non_null(want);
            assert_non_null(got);
        }
        assert_int_equal(fread(want, sizeof(float), (size_t)n, p), (size_t)n);
        compare_isas(k_types[ti].t, name, t->data, n, want, got);
        n_by_type[ti]++;
        n_tensors++;
    }
    assert_string_equal(line, "END\n");
    int rc = pclose(p);
    assert_true(rc != -1 && WIFEXITED(rc) && WEXITSTATUS(rc) == 0);
    print_message("%s: %d quantized tensors equal on every ISA\n", file, n_tensors);
    assert_true(n_tensors > 0);
    free(want);
    free(got);
    td_gguf_close(g);
}

static void test_real_files(void **state) {
    (void)state;
    int n_by_type[sizeof k_types / sizeof k_types[0]] = {0};
    check_real_file("Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf", n_by_type);
    check_real_file("gemma-3-270m-Q4_K_M.gguf", n_by_type);
    /* the two files hold Q4_K, Q6_K, Q5_0 and Q8_0 tensors (their
     * publishers' listing); each must have been compared */
    for (size_t i = 0; i < sizeof k_types / sizeof k_types[0]; i++) {
        td_dtype t = k_types[i].t;
        if (t == TD_TYPE_Q4_K || t == TD_TYPE_Q6_K || t == TD_TYPE_Q5_0 || t == TD_TYPE_Q8_0) {
            if (n_by_type[i] == 0) fail_msg("no %s tensor in the real files", k_types[i].name);
        }
        print_message("%s: %d tensors\n", k_types[i].name, n_by_type[i]);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_random_and_extreme_blocks),
        cmocka_unit_test(test_real_files),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
