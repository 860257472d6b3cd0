/* libFuzzer target for the grammar engine's parser layer: the input up to
 * a NUL is a Lark grammar (common/grammar/lark.h), the rest a text. The
 * grammar is compiled under small limits; when it compiles, the text is
 * pushed byte by byte into a matcher, then taken back to a random depth
 * (the text's first byte picks it) and pushed again: the second walk must
 * end exactly as the first (the rollback leaves no trace), and a refusal
 * must carry a message. Then the token level: a vocabulary of the text's
 * substrings of up to 3 bytes, those of 4 to 40 bytes (longer than the
 * body slices' TD_TRIE_BODY_MAX characters) from its first four starts and
 * after its first quotes (eight starts in all), and
 * one end-of-generation token; the mask after every prefix of the text
 * (td_gm_mask, whose trie walk caches per lexer state: every mask after
 * the first from a state is the cached kind) must equal the one made token
 * by token with td_gm_consume_token.
 * Seeds: tests/fuzz/corpus/fuzz_grammar. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/grammar/grammar.h"
#include "common/grammar/lark.h"
#include "common/grammar/vocab.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define MAXTOK 320

static void check_masks(td_gram *g, const uint8_t *text, size_t tn) {
    const char *pieces[MAXTOK + 1];
    size_t lens[MAXTOK + 1];
    int32_t n = 0;
    for (size_t len = 1; len <= 3; len++)
        for (size_t i = 0; i + len <= tn && n < MAXTOK; i++) {
            bool dup = false;
            for (int32_t k = 0; k < n && !dup; k++)
                dup = lens[k] == len && !memcmp(pieces[k], text + i, len);
            if (!dup) pieces[n] = (const char *)text + i, lens[n++] = len;
        }
    for (size_t i = 0, starts = 0; i < tn && starts < 8; i++) {
        if (i >= 4 && text[i - 1] != '"') continue;
        starts++;
        for (size_t len = 4; len <= 40 && i + len <= tn && n < MAXTOK; len++)
            pieces[n] = (const char *)text + i, lens[n++] = len;
    }
    pieces[n] = NULL, lens[n] = 0; /* the end of generation */
    const int32_t eog = n++;
    td_vocab *v = td_vocab_from_pieces(n, pieces, lens, &eog, 1);
    td_gm *m = v ? td_gm_new(g) : NULL;
    uint32_t mask[(MAXTOK + 1 + 31) / 32];
    for (size_t depth = 0; m && depth <= tn && depth < 24; depth++) {
        if (depth && td_gm_push(m, text[depth - 1]) != TD_GM_OK) break;
        for (int rep = 0; rep < 2; rep++) {
            if (td_gm_mask(m, v, mask) < 0) goto out;
            for (int32_t id = 0; id < n; id++) {
                const bool in = (mask[id / 32] >> (id % 32)) & 1;
                bool want;
                if (id == eog) {
                    want = td_gm_accepting(m);
                } else {
                    const td_gm_result r = td_gm_consume_token(m, v, id, NULL);
                    if (r == TD_GM_LIMIT) goto out;
                    want = r == TD_GM_OK;
                    if (want) td_gm_pop(m, lens[id]);
                }
                if (in != want) abort();
            }
            if (td_gm_depth(m) != depth) abort();
        }
    }
out:
    td_gm_free(m);
    td_vocab_free(v);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const uint8_t *nul = memchr(data, 0, size);
    const size_t gn = nul ? (size_t)(nul - data) : size;
    const uint8_t *text = nul ? nul + 1 : data + size;
    const size_t tn = nul ? size - gn - 1 : 0;
    td_gram_limits lim = td_gram_default_limits();
    lim.max_lexemes = 200;
    lim.max_rules = 2000;
    lim.max_lexer_states = 2000;
    lim.max_items_set = 5000;
    lim.max_items = 200000;
    lim.rx.max_nodes = 20000;
    lim.rx.max_steps = 400000;
    lim.rx.max_repeat = 100;
    lim.rx.max_depth = 40;
    char err[256];
    td_gram *g = td_lark_compile((const char *)data, gn, &lim, err, sizeof err);
    if (!g) {
        if (strncmp(err, "grammar: ", 9) != 0) abort();
        return 0;
    }
    td_gm *m = td_gm_new(g);
    if (m) {
        size_t done1, done2;
        td_gm_result r1 = td_gm_push_bytes(m, text, tn, &done1);
        const bool a1 = r1 == TD_GM_OK && td_gm_accepting(m);
        if (r1 != TD_GM_LIMIT) {
            const size_t back = tn ? text[0] % (done1 + 1) : 0;
            td_gm_pop(m, back);
            if (td_gm_depth(m) != done1 - back) abort();
            td_gm_result r2 = td_gm_push_bytes(m, text + done1 - back, tn - (done1 - back), &done2);
            const bool a2 = r2 == TD_GM_OK && td_gm_accepting(m);
            if (r2 != TD_GM_LIMIT && (r1 != r2 || done1 - back + done2 != done1 || a1 != a2))
                abort();
        } else if (!td_gm_error(m)) {
            abort();
        }
        td_gm_free(m);
    }
    check_masks(g, text, tn);
    td_gram_free(g);
    return 0;
}
