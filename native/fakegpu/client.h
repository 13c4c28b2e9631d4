/* fakegpu client side, shared by the fake libcuda.so.1 and libamdhip64.so. */
#ifndef KREX_FAKEGPU_CLIENT_H
#define KREX_FAKEGPU_CLIENT_H

#include <stdint.h>

#include "proto.h"

#define FG_EXPORT __attribute__((visibility("default")))

/* One synchronous request on this thread's connection; -1 if no server. */
int fg_call(struct fg_req *q, struct fg_rep *r);
/* Convenience: op on ctx with a, flags; returns the status (or -1). */
int fg_simple(uint32_t op, uint32_t ctx, uint64_t a, uint32_t flags, struct fg_rep *r);
/* Kernel duration and flags from a kernel name (spin_us_N, spin_ns_N, poison, ...). */
void fg_parse_kernel(const char *name, uint64_t *dur_ns, uint32_t *flags);
/* Duration of a transfer of n bytes (16 GB/s plus 2 us). */
uint64_t fg_copy_ns(uint64_t n);

#endif
