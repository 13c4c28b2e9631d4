/* Small helpers shared by the interposer and the fakegpu server (header-only:
 * each is its own shared object or executable). */
#ifndef KREX_NATIVE_COMMON_H
#define KREX_NATIVE_COMMON_H

#include <stdint.h>
#include <stdlib.h>
#include <time.h>

/* CLOCK_MONOTONIC in nanoseconds: comparable with Python's time.monotonic_ns(). */
static inline uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* An integer from the environment, or ``dflt`` when unset or empty. */
static inline int env_int(const char *name, int dflt)
{
    const char *v = getenv(name);
    return (v && *v) ? atoi(v) : dflt;
}

#endif
