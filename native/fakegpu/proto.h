/* fakegpu wire protocol: fixed-size request/response over a unix stream socket.
 *
 * Each client thread holds its own connection; every request gets exactly one
 * response (LAUNCH answers once the work is queued, SYNC once it has run).
 */
#ifndef KREX_FAKEGPU_PROTO_H
#define KREX_FAKEGPU_PROTO_H

#include <stdint.h>

#include "errors.h"

enum fg_op {
    FG_HELLO = 1,     /* -> v0 = device count */
    FG_CTX_CREATE,    /* a = device -> v0 = context id (serialised, delayed) */
    FG_CTX_DESTROY,   /* ctx */
    FG_LAUNCH,        /* ctx, a = duration ns, flags -> status */
    FG_SYNC,          /* ctx: wait until its queue is empty -> status */
    FG_EVENT_CREATE,  /* -> v0 = event id */
    FG_EVENT_RECORD,  /* ctx, a = event id: queue a timestamp marker */
    FG_EVENT_QUERY,   /* a = event id -> status 0 + v0 = ns, or 600 not ready */
    FG_EVENT_SYNC,    /* a = event id -> v0 = ns once recorded */
    FG_STATS,         /* -> v0 launches, v1 kernels finished, v2 busy ns */
    FG_DUMP_LOG,      /* text = path, a = ns (0: all): write the launch log's entries not
                         ended before a -> v0 = entries in the log */
    FG_PROC_LOCK,     /* a = pid, flags = timeout ms: cuCheckpointProcessLock, as NVIDIA
                         documents it: waits (up to the timeout) for the process's calls in
                         progress, then blocks its further calls; its queued work keeps
                         running.  Timeout: CUDA_ERROR_NOT_READY, left unlocked.  A process
                         without a context: CUDA_ERROR_INVALID_VALUE */
    FG_PROC_UNLOCK,   /* a = pid: its calls go on (cuCheckpointProcessUnlock) */
    FG_PROC_STATE,    /* a = pid -> v0 = 0 running, 1 locked (cuCheckpointProcessGetState);
                         CUDA_ERROR_INVALID_VALUE: the process has no context */
    FG_PROC_QUEUED,   /* a = pid -> v0 = work items queued on its contexts (device truth) */
    FG_BUSY,          /* text = up to 23 uint32 pids (0 ends) -> v0 = busy ns run for those
                         processes' contexts, v1 = busy ns in all, v2 = the execution thread's
                         tid (a region's device audit: work of other contexts, run delay) */
};

#define FG_BUSY_PIDS 23 /* pids in one FG_BUSY request (the text's last byte is a terminator) */

enum fg_flags {
    FG_POISON = 1, /* the kernel poisons its context (sticky error) */
    FG_COPY = 2,   /* a transfer, not a kernel (for the log) */
};

#define FG_SPIN_PARAM 0x100 /* client side: the kernel's duration is its first parameter */

struct fg_req {
    uint32_t op;
    uint32_t ctx;
    uint64_t a;
    uint64_t b;
    uint32_t pid;
    uint32_t flags;
    char text[96];
};

struct fg_rep {
    int32_t status;
    uint32_t pad;
    uint64_t v0;
    uint64_t v1;
    uint64_t v2;
};

#endif
