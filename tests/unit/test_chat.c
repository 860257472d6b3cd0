/* Chat templates by name against what jinja2 renders from the reference texts
 * (tests/tokenizer/templates/, goldens made by tests/tokenizer/make_goldens.py). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>
#include <jansson.h>

#include "common/tokenizer/chat.h"

static char g_dir[4096];

static void find_dir(void) {
    const char *src = getenv("TANDEM_SOURCE_DIR");
    if (src) {
        snprintf(g_dir, sizeof(g_dir), "%s/tests/tokenizer", src);
        return;
    }
    snprintf(g_dir, sizeof(g_dir), "%s", __FILE__);
    char *p = strstr(g_dir, "tests/unit/");
    if (p)
        strcpy(p, "tests/tokenizer");
    else
        snprintf(g_dir, sizeof(g_dir), "tests/tokenizer");
}

static char *read_file(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) fail_msg("cannot open %s", path);
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *s = malloc((size_t)n + 1);
    assert_non_null(s);
    assert_int_equal(fread(s, 1, (size_t)n, f), (size_t)n);
    s[n] = 0;
    fclose(f);
    return s;
}

static const char *const k_names[] = {"chatml", "smollm2", "llama3", "llama2", "mistral", "zephyr"};

/* The six names' embedded texts are the reference files, and render what
 * jinja2 rendered from those files (the goldens) byte for byte. */
static void test_render_goldens(void **state) {
    (void)state;
    char path[4200];
    snprintf(path, sizeof(path), "%s/goldens/chat.json", g_dir);
    json_error_t err;
    json_t *g = json_load_file(path, 0, &err);
    if (!g) fail_msg("%s: %s", path, err.text);
    json_t *rows = json_object_get(g, "rows");
    size_t i, bad = 0, families_seen = 0;
    bool seen[6] = {0};
    json_t *row;
    json_array_foreach(rows, i, row) {
        const char *fam = json_string_value(json_object_get(row, "family"));
        size_t f = 0;
        while (f < 6 && strcmp(k_names[f], fam) != 0) f++;
        assert_true(f < 6);
        if (!seen[f]) families_seen++;
        seen[f] = true;
        td_chat *t = NULL;
        char msg[512];
        assert_int_equal(td_chat_load(fam, &t, msg, sizeof msg), TD_OK);
        json_t *jm = json_object_get(row, "messages");
        size_t n = json_array_size(jm);
        td_chat_msg *msgs = calloc(n + 1, sizeof(*msgs));
        for (size_t k = 0; k < n; k++) {
            msgs[k].role = json_string_value(json_object_get(json_array_get(jm, k), "role"));
            msgs[k].content = json_string_value(json_object_get(json_array_get(jm, k), "content"));
        }
        bool agp = json_is_true(json_object_get(row, "add_generation_prompt"));
        const char *bos = json_string_value(json_object_get(row, "bos"));
        const char *eos = json_string_value(json_object_get(row, "eos"));
        json_t *want = json_object_get(row, "rendered");
        char *out = NULL;
        td_status st = td_chat_apply(t, msgs, n, agp, bos, eos, &out, msg, sizeof msg);
        if (json_is_null(want)) {
            /* the Jinja template raised an exception */
            if (st != TD_ERR_INVALID) {
                fprintf(stderr, "%s/%s: rendered although Jinja raises\n", fam,
                        json_string_value(json_object_get(row, "chat")));
                bad++;
            }
            assert_null(out);
        } else if (st != TD_OK || strcmp(out, json_string_value(want)) != 0) {
            fprintf(stderr, "%s/%s agp=%d:\n  got  [%s]\n  want [%s]\n", fam,
                    json_string_value(json_object_get(row, "chat")), agp, out ? out : msg,
                    json_string_value(want));
            bad++;
        }
        free(out);
        free(msgs);
        td_chat_free(t);
    }
    json_decref(g);
    assert_int_equal(bad, 0);
    assert_int_equal(families_seen, 6);
}

static void test_builtin_texts_are_the_reference_files(void **state) {
    (void)state;
    for (size_t i = 0; i < 6; i++) {
        char path[4200];
        snprintf(path, sizeof(path), "%s/templates/%s.jinja", g_dir, k_names[i]);
        char *text = read_file(path);
        assert_non_null(td_chat_builtin(k_names[i]));
        assert_string_equal(td_chat_builtin(k_names[i]), text);
        free(text);
    }
    assert_null(td_chat_builtin("jinja"));
    assert_null(td_chat_builtin(NULL));
}

static void test_errors(void **state) {
    (void)state;
    td_chat_msg m = {"user", "hi"};
    char *out = NULL, msg[512];
    td_chat *t = NULL;
    /* neither a name nor a file */
    assert_int_equal(td_chat_load("no-such-template", &t, msg, sizeof msg), TD_ERR_NOT_FOUND);
    assert_non_null(strstr(msg, "no-such-template"));
    assert_null(t);
    /* a model without a template, and one that does not compile */
    assert_int_equal(td_chat_pick(NULL, NULL, &t, msg, sizeof msg), TD_ERR_NOT_FOUND);
    assert_non_null(strstr(msg, "--chat-template"));
    assert_int_equal(td_chat_pick(NULL, "{% for m in messages %}", &t, msg, sizeof msg),
                     TD_ERR_INVALID);
    assert_non_null(strstr(msg, "endfor"));
    assert_non_null(strstr(msg, "line 1"));
    assert_null(t);
    /* the template's own exception reaches the caller */
    assert_int_equal(td_chat_load("mistral", &t, msg, sizeof msg), TD_OK);
    td_chat_msg tool[2] = {{"user", "a"}, {"tool", "b"}};
    assert_int_equal(td_chat_apply(t, tool, 2, true, "<s>", "</s>", &out, msg, sizeof msg),
                     TD_ERR_INVALID);
    assert_non_null(strstr(msg, "Only user and assistant roles are supported"));
    assert_null(out);
    td_chat_free(t);
    /* NULL bos/eos are empty strings */
    assert_int_equal(td_chat_load("llama3", &t, msg, sizeof msg), TD_OK);
    assert_int_equal(td_chat_apply(t, &m, 1, false, NULL, NULL, &out, msg, sizeof msg), TD_OK);
    assert_string_equal(out, "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>");
    free(out);
    td_chat_free(t);
    td_chat_free(NULL);
}

int main(void) {
    find_dir();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_render_goldens),
        cmocka_unit_test(test_builtin_texts_are_the_reference_files),
        cmocka_unit_test(test_errors),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
