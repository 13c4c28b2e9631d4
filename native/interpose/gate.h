/* krex gate file: the shared-memory contract between krexd and the interposer.
 *
 * One file per job (path in env KREX_GATE_FILE), created by the daemon
 * (krex/enforce/gate.py mirrors this layout and KREX_GATE_ABI; the interposer
 * reports its ABI and counter names, and the Python loader refuses a mismatch).
 * All integers are little-endian; every record is a whole number of 64-byte lines.
 *
 *   offset 0                 header   {magic u32, abi_version u32, ndev u32, nslots u32, pad}
 *   64 + d * DEV_BYTES       device d {gate u32, overflow_procs u32, generation u64,
 *                                      pad u64, close_ns u64, pad}
 *     + 64 + s * 192         proc slot s {pid u32, in_flight u32, ack_generation u64,
 *                                      ack_ns u64, launches u64, parked u64, start_time u64,
 *                                      ack_status i32, pad, counters u64[16]}
 *
 * gate:        0 = open, 1 = closed.  Futex word (shared): launchers park on it.
 * overflow_procs: processes that found every slot taken (they run ungated).
 * generation:  bumped by the daemon BEFORE each close; its low 32 bits are the
 *              futex word the drain thread waits on (wake it after closing).
 * pid, start_time: the slot's owner, claimed by compare-and-swap on a process's
 *              first gated call; start_time is field 22 of /proc/PID/stat (clock
 *              ticks since boot), so a reused pid never passes for the owner.  A
 *              process frees its slot at exit; a slot whose owner is gone or whose
 *              start time no longer matches is stale and may be reclaimed (by a
 *              process or by the daemon).
 * in_flight:   gated calls of that process currently inside the driver.
 * ack_generation / ack_ns / ack_status: written by the process's native drain
 *              thread once it has finished draining the closed generation
 *              (ack_ns = CLOCK_MONOTONIC ns, ack_status: 0 when every stream it
 *              knows of was synchronised, else a KREX_DRAIN_* reason or the
 *              driver's error code; ack_generation is written last).
 * counters:    the process's named counters (counters.def), published by it.
 * Daemon close: generation += 1; gate = 1; futex_wake(generation low word).
 * Daemon open:  gate = 0; futex_wake(gate).
 */
#ifndef KREX_GATE_H
#define KREX_GATE_H

#include <stdatomic.h>
#include <stdint.h>

#define KREX_GATE_MAGIC 0x4758524bu /* "KRXG" */
#define KREX_GATE_ABI 2             /* the one definition in C; Python: krex/enforce/gate.py */
#define KREX_GATE_NSLOTS 64
#define KREX_GATE_MAX_DEV 64
#define KREX_SLOT_COUNTERS 16

/* The named counters (counters.def). */
enum krex_counter {
#define COUNTER(name, meaning) KREX_C_##name,
#include "counters.def"
#undef COUNTER
};
#define COUNTER(name, meaning) +1
enum { KREX_NCOUNTERS = 0
#include "counters.def"
};
#undef COUNTER
_Static_assert(KREX_NCOUNTERS <= KREX_SLOT_COUNTERS, "counters fit the slot");

/* ack_status reasons that are not a driver error code (negative: never a CUresult). */
#define KREX_DRAIN_OK 0
#define KREX_DRAIN_UNBOUND (-1)   /* calls were submitted but the driver's synchronisation
                                     calls were not found */
#define KREX_DRAIN_CAPTURE (-2)   /* default-stream work could not be synchronised: a
                                     stream of its context was capturing */

struct krex_gate_header {
    uint32_t magic;
    uint32_t abi_version;
    uint32_t ndev;
    uint32_t nslots;
    uint8_t pad[48];
};

struct krex_gate_proc {
    _Atomic uint32_t pid;
    _Atomic uint32_t in_flight;
    _Atomic uint64_t ack_generation;
    _Atomic uint64_t ack_ns;
    _Atomic uint64_t launches;
    _Atomic uint64_t parked;
    _Atomic uint64_t start_time;
    _Atomic int32_t ack_status;
    uint32_t pad0;
    uint8_t pad1[8];
    _Atomic uint64_t counters[KREX_SLOT_COUNTERS];
};

struct krex_gate_dev {
    _Atomic uint32_t gate;
    _Atomic uint32_t overflow_procs;
    _Atomic uint64_t generation;
    uint64_t pad1;
    _Atomic uint64_t close_ns;
    uint8_t pad[32];
    struct krex_gate_proc procs[KREX_GATE_NSLOTS];
};

_Static_assert(sizeof(struct krex_gate_header) == 64, "header is one line");
_Static_assert(sizeof(struct krex_gate_proc) == 192, "proc slot is three lines");
_Static_assert(sizeof(struct krex_gate_dev) == 64 + 192 * KREX_GATE_NSLOTS, "device record");

/* Thread-locals of the interposer: initial-exec (no __tls_get_addr call on the launch
 * path; it is preloaded, so its TLS is in the static block). */
#define KREX_TLS __thread __attribute__((tls_model("initial-exec")))

/* Which API a call came through (selects how the drain synchronises). */
enum krex_api { KREX_API_CUDA = 0, KREX_API_HIP = 1 };

/* How the caller reached the wrapper (indexes the launch_* counters). */
enum krex_path { KREX_PATH_DIRECT = 0, KREX_PATH_DLSYM = 1, KREX_PATH_GETPROC = 2 };
#define KREX_NPATHS 3

/* Enter the gate before a gated call: parks while closed.  NULL when ungated. */
struct krex_gate_proc *krex_gate_enter(void);
/* Leave the gate after the driver call returned. */
void krex_gate_exit(struct krex_gate_proc *p);
/* 1 when the gate file is mapped and valid. */
int krex_gate_active(void);
/* Count one event of a cold counter (published to this process's slot at once). */
void krex_count(enum krex_counter c);
/* This process's value of counter c. */
uint64_t krex_counter_value(int c);
/* Count a call through `path` (hot: process-local, published at each drain). */
void krex_count_path(int path);

#endif
