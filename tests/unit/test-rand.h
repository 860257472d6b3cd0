/* The unit tests' random inputs: xorshift64* over a state each test file
 * seeds (define TD_TEST_RNG_SEED before including), uniform doubles in
 * [0, 1), and the fp16 bits of a normal number. */
#ifndef TD_TEST_RAND_H
#define TD_TEST_RAND_H

#include <stdint.h>

#ifndef TD_TEST_RNG_SEED
#error "define TD_TEST_RNG_SEED before including test-rand.h"
#endif

static uint64_t g_rng = TD_TEST_RNG_SEED;

static inline uint64_t rnd64(void) {
    g_rng ^= g_rng >> 12;
    g_rng ^= g_rng << 25;
    g_rng ^= g_rng >> 27;
    return g_rng * 0x2545f4914f6cdd1dull;
}

static inline double urand(void) { return (double)(rnd64() >> 11) / 9007199254740992.0; }

/* fp16 bits of a normal number with exponent e (value 2^e * (1 + man/1024)) */
static inline uint16_t h_bits(int sign, int e, int man) {
    return (uint16_t)((sign << 15) | ((e + 15) << 10) | man);
}

#endif
