/* krex gate file: the shared-memory contract between krexd and the interposer.
 *
 * One file per job (path in env KREX_GATE_FILE), created by the daemon
 * (krex/enforce/gate.py mirrors this layout; bump KREX_GATE_ABI on any change).
 * All integers are little-endian; every record is 64 bytes (one cache line).
 *
 *   offset 0                 header   {magic u32, abi_version u32, ndev u32, nslots u32, pad}
 *   64 + d * DEV_BYTES       device d {gate u32, pad u32, generation u64,
 *                                      overflow_in_flight u32, pad u32, close_ns u64, pad}
 *     + 64 + s * 64          proc slot s {pid u32, in_flight u32, ack_generation u64,
 *                                      ack_ns u64, launches u64, parked u64, pad}
 *
 * gate:        0 = open, 1 = closed.  Futex word (shared): launchers park on it.
 * generation:  bumped by the daemon BEFORE each close; its low 32 bits are the
 *              futex word the drain thread waits on (wake it after closing).
 * pid:         claimed by compare-and-swap on a process's first launch
 *              (a slot whose pid is dead may be re-claimed).
 * in_flight:   launches of that process currently inside the driver.
 * ack_generation / ack_ns: written by the process's native drain thread once
 *              the closed generation's queued work has finished
 *              (ack_ns = CLOCK_MONOTONIC nanoseconds, ack_generation last).
 * Daemon close: generation += 1; gate = 1; futex_wake(generation low word).
 * Daemon open:  gate = 0; futex_wake(gate).
 */
#ifndef KREX_GATE_H
#define KREX_GATE_H

#include <stdatomic.h>
#include <stdint.h>

#define KREX_GATE_MAGIC 0x4758524bu /* "KRXG" */
#define KREX_GATE_ABI 1
#define KREX_GATE_NSLOTS 64
#define KREX_GATE_MAX_DEV 64

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
    uint8_t pad[24];
};

struct krex_gate_dev {
    _Atomic uint32_t gate;
    uint32_t pad0;
    _Atomic uint64_t generation;
    _Atomic uint32_t overflow_in_flight;
    uint32_t pad1;
    _Atomic uint64_t close_ns;
    uint8_t pad[32];
    struct krex_gate_proc procs[KREX_GATE_NSLOTS];
};

_Static_assert(sizeof(struct krex_gate_header) == 64, "header is one line");
_Static_assert(sizeof(struct krex_gate_proc) == 64, "proc slot is one line");
_Static_assert(sizeof(struct krex_gate_dev) == 64 + 64 * KREX_GATE_NSLOTS, "device record");

/* Which API a launch came through (selects how the drain synchronises). */
enum krex_api { KREX_API_CUDA = 0, KREX_API_HIP = 1 };

/* How the caller reached the wrapper (for krex_interposer_counts). */
enum krex_path {
    KREX_PATH_DIRECT = 0,
    KREX_PATH_DLSYM = 1,
    KREX_PATH_GETPROC = 2,
    KREX_NPATHS = 3
};

/* Enter the gate before a launch: parks while closed.  NULL when no gate file. */
struct krex_gate_proc *krex_gate_enter(int api);
/* Leave the gate after the driver call returned. */
void krex_gate_exit(struct krex_gate_proc *p);
/* 1 when the gate file is mapped and valid. */
int krex_gate_active(void);
/* Driver entry points the drain thread uses, bound from the driver library. */
void krex_gate_bind_cuda(void *ctx_get, void *ctx_push, void *ctx_pop, void *ctx_sync);
void krex_gate_bind_hip(void *get_device, void *set_device, void *device_sync);
/* Counters: parked launches and drains done by this process. */
uint64_t krex_gate_parked_total(void);
uint64_t krex_gate_drains_total(void);

#endif
