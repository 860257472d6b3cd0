/* Chat templates against what jinja2 renders from the real template texts
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

static void test_render_goldens(void **state) {
    (void)state;
    char path[4200];
    snprintf(path, sizeof(path), "%s/goldens/chat.json", g_dir);
    json_error_t err;
    json_t *g = json_load_file(path, 0, &err);
    if (!g) fail_msg("%s: %s", path, err.text);
    json_t *rows = json_object_get(g, "rows");
    size_t i, bad = 0, families_seen = 0;
    bool seen[TD_CHAT_COUNT] = {0};
    json_t *row;
    json_array_foreach(rows, i, row) {
        const char *fam = json_string_value(json_object_get(row, "family"));
        td_chat_template t = td_chat_template_from_name(fam);
        assert_int_not_equal(t, TD_CHAT_UNKNOWN);
        if (!seen[t]) families_seen++;
        seen[t] = true;
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
        td_status st = td_chat_apply(t, msgs, n, agp, bos, eos, &out);
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
                    json_string_value(json_object_get(row, "chat")), agp, out ? out : "(error)",
                    json_string_value(want));
            bad++;
        }
        free(out);
        free(msgs);
    }
    json_decref(g);
    assert_int_equal(bad, 0);
    assert_int_equal(families_seen, TD_CHAT_COUNT);
}

static void test_detect(void **state) {
    (void)state;
    for (int t = 0; t < TD_CHAT_COUNT; t++) {
        char path[4200];
        snprintf(path, sizeof(path), "%s/templates/%s.jinja", g_dir, td_chat_template_name(t));
        char *text = read_file(path);
        assert_int_equal(td_chat_template_detect(text), t);
        assert_int_equal(td_chat_template_from_name(td_chat_template_name(t)), t);
        free(text);
    }
    /* Phi-3 and Gemma templates are none of these families */
    assert_int_equal(td_chat_template_detect("{% for message in messages %}{% if (message['role'] "
                                             "== 'user') %}{{'<|user|>' + '\\n' + "
                                             "message['content'] + '<|end|>' + '\\n' + "
                                             "'<|assistant|>' + '\\n'}}{% endif %}{% endfor %}"),
                     TD_CHAT_UNKNOWN);
    assert_int_equal(td_chat_template_detect("{{ '<start_of_turn>' + role + '\\n' }}"),
                     TD_CHAT_UNKNOWN);
    assert_int_equal(td_chat_template_detect(""), TD_CHAT_UNKNOWN);
    assert_int_equal(td_chat_template_detect(NULL), TD_CHAT_UNKNOWN);
}

static void test_errors(void **state) {
    (void)state;
    td_chat_msg m = {"user", "hi"};
    char *out = NULL;
    assert_int_equal(td_chat_template_from_name("jinja"), TD_CHAT_UNKNOWN);
    assert_int_equal(td_chat_template_from_name(NULL), TD_CHAT_UNKNOWN);
    assert_string_equal(td_chat_template_name(TD_CHAT_UNKNOWN), "unknown");
    assert_int_equal(td_chat_apply(TD_CHAT_UNKNOWN, &m, 1, true, "", "", &out), TD_ERR_INVALID);
    assert_null(out);
    td_chat_msg bad = {NULL, "x"};
    assert_int_equal(td_chat_apply(TD_CHAT_CHATML, &bad, 1, true, "", "", &out), TD_ERR_INVALID);
    td_chat_msg tool[2] = {{"user", "a"}, {"tool", "b"}};
    assert_int_equal(td_chat_apply(TD_CHAT_MISTRAL, tool, 2, true, "<s>", "</s>", &out),
                     TD_ERR_INVALID);
    assert_null(out);
    /* NULL bos/eos are empty strings */
    assert_int_equal(td_chat_apply(TD_CHAT_LLAMA3, &m, 1, false, NULL, NULL, &out), TD_OK);
    assert_string_equal(out, "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>");
    free(out);
}

int main(void) {
    find_dir();
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_render_goldens),
        cmocka_unit_test(test_detect),
        cmocka_unit_test(test_errors),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
