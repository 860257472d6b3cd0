/* common/base/net.h: HOST:PORT splitting (brackets of IPv6 literals, empty
 * or oversized parts refused) and resolution into the numeric names the
 * router and the decode instances both use for an instance. */
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "common/base/net.h"

static void test_split(void **state) {
    (void)state;
    char h[64], p[8];
    assert_true(td_net_split("tandem-prefill:8100", h, sizeof h, p, sizeof p));
    assert_string_equal(h, "tandem-prefill");
    assert_string_equal(p, "8100");
    assert_true(td_net_split("[fd00::7]:8100", h, sizeof h, p, sizeof p));
    assert_string_equal(h, "fd00::7");
    assert_string_equal(p, "8100");
    assert_true(td_net_split("10.0.0.7:1", h, sizeof h, p, sizeof p));
    assert_string_equal(h, "10.0.0.7");
    const char *bad[] = {"", "nocolon", ":8100", "host:", "[::1]8100", "[]:80", "[::1:80", NULL};
    for (int i = 0; bad[i]; i++) assert_false(td_net_split(bad[i], h, sizeof h, p, sizeof p));
    assert_false(td_net_split(NULL, h, sizeof h, p, sizeof p));
    /* parts that do not fit */
    char small[4];
    assert_false(td_net_split("abcd:80", small, sizeof small, p, sizeof p));
    assert_false(td_net_split("a:123456789", h, sizeof h, p, sizeof p));
}

static void test_resolve(void **state) {
    (void)state;
    char out[8][TD_NET_ADDR_LEN], err[256];
    assert_int_equal(td_net_resolve("127.0.0.1:8100", out, 8, err, sizeof err), 1);
    assert_string_equal(out[0], "127.0.0.1:8100");
    assert_int_equal(td_net_resolve("[::1]:9", out, 8, err, sizeof err), 1);
    assert_string_equal(out[0], "[::1]:9");
    /* a name: its addresses, each once (getaddrinfo gives one per socket
     * type unless asked for one) */
    int n = td_net_resolve("localhost:8100", out, 8, err, sizeof err);
    assert_true(n >= 1);
    bool v4 = false;
    for (int i = 0; i < n; i++) {
        v4 |= !strcmp(out[i], "127.0.0.1:8100");
        for (int k = 0; k < i; k++) assert_string_not_equal(out[i], out[k]);
    }
    assert_true(v4);
    /* bounded by max */
    assert_true(td_net_resolve("localhost:8100", out, 1, err, sizeof err) <= 1);
    /* unknown names and malformed specs are errors with a message */
    err[0] = 0;
    assert_int_equal(td_net_resolve("no-such-host.invalid:80", out, 8, err, sizeof err), -1);
    assert_non_null(strstr(err, "no-such-host.invalid"));
    err[0] = 0;
    assert_int_equal(td_net_resolve("nocolon", out, 8, err, sizeof err), -1);
    assert_non_null(strstr(err, "HOST:PORT"));
    assert_int_equal(td_net_resolve("127.0.0.1:notaport", out, 8, err, sizeof err), -1);
}

/* Waits (bounded) for the watch's eventfd, then takes. */
static bool take_after_wake(td_net_watch *w, int fd, char (*out)[TD_NET_ADDR_LEN], int *n) {
    for (int tries = 0; tries < 100; tries++) {
        struct pollfd pfd = {.fd = fd, .events = POLLIN};
        if (poll(&pfd, 1, 100) == 1) {
            uint64_t v;
            assert_int_equal(read(fd, &v, sizeof v), (ssize_t)sizeof v);
        }
        if (td_net_watch_take(w, out, n)) return true;
    }
    return false;
}

static void test_watch(void **state) {
    (void)state;
    int fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    assert_true(fd >= 0);
    /* an unknown service fails in getaddrinfo without a DNS query */
    const char *names[] = {"127.0.0.1:no-such-service", "127.0.0.1:8100", "[::1]:9"};
    td_net_watch_params p = {.names = names,
                             .n_names = 3,
                             .max_addrs = 4,
                             .interval_ms = 20,
                             .wake_fd = fd,
                             .what = "test"};
    td_net_watch *w = NULL;
    assert_int_equal(td_net_watch_create(&p, &w), TD_OK);
    char out[3 * 4][TD_NET_ADDR_LEN];
    int n[3];
    /* both literals arrive (not necessarily in one take); the failing name
     * never has a result: -1, keep what it had */
    bool seen1 = false, seen2 = false;
    for (int k = 0; k < 10 && !(seen1 && seen2); k++) {
        assert_true(take_after_wake(w, fd, out, n));
        assert_int_equal(n[0], -1);
        if (n[1] >= 0) {
            assert_int_equal(n[1], 1);
            assert_string_equal(out[4], "127.0.0.1:8100");
            seen1 = true;
        }
        if (n[2] >= 0) {
            assert_int_equal(n[2], 1);
            assert_string_equal(out[8], "[::1]:9");
            seen2 = true;
        }
    }
    assert_true(seen1 && seen2);
    /* every interval brings a new result */
    assert_true(take_after_wake(w, fd, out, n));
    td_net_watch_destroy(w);
    close(fd);
    td_net_watch_destroy(NULL);
    /* bad parameters */
    const char *bad[] = {"nocolon"};
    td_net_watch_params q = p;
    q.names = bad;
    q.n_names = 1;
    q.wake_fd = -1;
    assert_int_equal(td_net_watch_create(&q, &w), TD_ERR_INVALID);
    q = p;
    q.n_names = 0;
    assert_int_equal(td_net_watch_create(&q, &w), TD_ERR_INVALID);
    q = p;
    q.interval_ms = 0;
    assert_int_equal(td_net_watch_create(&q, &w), TD_ERR_INVALID);
    assert_null(w);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_split),
        cmocka_unit_test(test_resolve),
        cmocka_unit_test(test_watch),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
