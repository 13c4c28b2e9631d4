/* Gate and drain: the shared-memory side of the interposer (see gate.h).
 *
 * Launch path (open gate): one atomic add, one load, one atomic sub, no
 * syscalls.  A closed gate parks the launching thread on a futex.  A native
 * drain thread per process acknowledges each close once the contexts it has
 * seen are idle.
 */
#define _GNU_SOURCE
#include "gate.h"
#include "common.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define KREX_MAX_CTX 32
#define KREX_LIKELY(x) __builtin_expect(!!(x), 1)
#define KREX_UNLIKELY(x) __builtin_expect(!!(x), 0)

typedef int (*ctx_get_fn)(void **ctx);
typedef int (*ctx_push_fn)(void *ctx);
typedef int (*ctx_pop_fn)(void **ctx);
typedef int (*ctx_sync_fn)(void);
typedef int (*hip_get_dev_fn)(int *dev);
typedef int (*hip_set_dev_fn)(int dev);
typedef int (*hip_sync_fn)(void);

static pthread_once_t g_map_once = PTHREAD_ONCE_INIT;
static struct krex_gate_dev *g_dev;            /* this job's device record */
static _Atomic(struct krex_gate_proc *) g_proc; /* this process's slot */
static _Atomic int g_attach_state;             /* 0 unknown, 1 attached, -1 disabled */
static pthread_mutex_t g_attach_mu = PTHREAD_MUTEX_INITIALIZER;

static _Atomic(void *) g_ctx_set[KREX_MAX_CTX]; /* contexts seen at launch */
static _Atomic uint64_t g_hip_devs;              /* bitmask of HIP devices seen */
static __thread void *t_last_ctx;
static __thread int t_last_hip_dev = -1;

static _Atomic(ctx_get_fn) g_ctx_get;
static _Atomic(ctx_push_fn) g_ctx_push;
static _Atomic(ctx_pop_fn) g_ctx_pop;
static _Atomic(ctx_sync_fn) g_ctx_sync;
static _Atomic(hip_get_dev_fn) g_hip_get_dev;
static _Atomic(hip_set_dev_fn) g_hip_set_dev;
static _Atomic(hip_sync_fn) g_hip_sync;

static _Atomic uint64_t g_parked_total;
static _Atomic uint64_t g_drains_total;

static long futex(void *addr, int op, uint32_t val, const struct timespec *ts)
{
    return syscall(SYS_futex, addr, op, val, ts, NULL, 0);
}

/* Map KREX_GATE_FILE (once per process; no locks shared with other processes). */
static void map_gate_file(void)
{
    const char *path = getenv("KREX_GATE_FILE");
    if (!path || !*path)
        return;
    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0)
        return;
    struct stat st;
    void *base = MAP_FAILED;
    if (fstat(fd, &st) == 0 && st.st_size >= (off_t)sizeof(struct krex_gate_header))
        base = mmap(NULL, (size_t)st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (base == MAP_FAILED)
        return;
    const struct krex_gate_header *h = base;
    int slot = env_int("KREX_GATE_SLOT", 0);
    size_t need = sizeof(*h) + (size_t)(slot + 1) * sizeof(struct krex_gate_dev);
    if (h->magic != KREX_GATE_MAGIC || h->abi_version != KREX_GATE_ABI || slot < 0 ||
        (uint32_t)slot >= h->ndev || h->nslots != KREX_GATE_NSLOTS || (size_t)st.st_size < need) {
        munmap(base, (size_t)st.st_size);
        return;
    }
    g_dev = (struct krex_gate_dev *)((char *)base + sizeof(*h)) + slot;
}

int krex_gate_active(void)
{
    pthread_once(&g_map_once, map_gate_file);
    return g_dev != NULL;
}

static int pid_dead(uint32_t pid)
{
    return kill((pid_t)pid, 0) == -1 && errno == ESRCH;
}

/* Claim a process slot by CAS: our pid, a free slot, or a dead process's slot. */
static struct krex_gate_proc *claim_slot(void)
{
    uint32_t me = (uint32_t)getpid();
    for (int i = 0; i < KREX_GATE_NSLOTS; i++) {
        struct krex_gate_proc *p = &g_dev->procs[i];
        uint32_t cur = atomic_load(&p->pid);
        if (cur == me || (cur == 0 && atomic_compare_exchange_strong(&p->pid, &cur, me)) ||
            (cur != 0 && pid_dead(cur) && atomic_compare_exchange_strong(&p->pid, &cur, me))) {
            atomic_store(&p->in_flight, 0);
            atomic_store(&p->ack_generation, 0);
            return p;
        }
    }
    return NULL;
}

static void *drain_main(void *arg);

static void reset_after_fork(void)
{
    atomic_store(&g_proc, NULL);
    atomic_store(&g_attach_state, 0);
    pthread_mutex_init(&g_attach_mu, NULL);
    for (int i = 0; i < KREX_MAX_CTX; i++)
        atomic_store(&g_ctx_set[i], NULL);
    atomic_store(&g_hip_devs, 0);
    t_last_ctx = NULL;
    t_last_hip_dev = -1;
}

static void register_atfork(void)
{
    pthread_atfork(NULL, NULL, reset_after_fork);
}

/* Slow path of the first launch: map, claim a slot, start the drain thread. */
static struct krex_gate_proc *attach(void)
{
    static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;
    pthread_once(&atfork_once, register_atfork);
    if (!krex_gate_active()) {
        atomic_store(&g_attach_state, -1);
        return NULL;
    }
    pthread_mutex_lock(&g_attach_mu);
    struct krex_gate_proc *p = atomic_load(&g_proc);
    if (!p && (p = claim_slot()) != NULL) {
        /* Publish before the drain thread starts: it exits at once when g_proc is
         * not its slot (its test for a stale thread after fork). */
        atomic_store(&g_proc, p);
        pthread_t tid;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        sigset_t all, old;
        sigfillset(&all);
        pthread_sigmask(SIG_SETMASK, &all, &old); /* the drain thread takes no signals */
        pthread_create(&tid, &attr, drain_main, p);
        pthread_sigmask(SIG_SETMASK, &old, NULL);
        pthread_attr_destroy(&attr);
    }
    atomic_store(&g_attach_state, p ? 1 : -1);
    pthread_mutex_unlock(&g_attach_mu);
    return p;
}

static void ctx_set_add(void *ctx)
{
    for (int i = 0; i < KREX_MAX_CTX; i++) {
        void *cur = atomic_load_explicit(&g_ctx_set[i], memory_order_acquire);
        if (cur == ctx)
            return;
        if (!cur && atomic_compare_exchange_strong(&g_ctx_set[i], &cur, ctx))
            return;
        if (cur == ctx)
            return;
    }
}

/* Remember the context (CUDA) or device (HIP) this launch runs on. */
static inline void note_context(int api)
{
    if (api == KREX_API_CUDA) {
        ctx_get_fn get = atomic_load_explicit(&g_ctx_get, memory_order_relaxed);
        void *ctx = NULL;
        if (get && get(&ctx) == 0 && ctx && ctx != t_last_ctx) {
            ctx_set_add(ctx);
            t_last_ctx = ctx;
        }
        return;
    }
    hip_get_dev_fn get = atomic_load_explicit(&g_hip_get_dev, memory_order_relaxed);
    int dev = -1;
    if (get && get(&dev) == 0 && dev >= 0 && dev < 64 && dev != t_last_hip_dev) {
        atomic_fetch_or(&g_hip_devs, 1ull << dev);
        t_last_hip_dev = dev;
    }
}

/* Closed gate: step out of in_flight, wake the drain thread, sleep until open. */
static void park(struct krex_gate_proc *p)
{
    atomic_fetch_add_explicit(&p->parked, 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&g_parked_total, 1, memory_order_relaxed);
    do {
        atomic_fetch_sub(&p->in_flight, 1);
        futex(&p->in_flight, FUTEX_WAKE, INT32_MAX, NULL);
        while (atomic_load(&g_dev->gate) != 0)
            futex(&g_dev->gate, FUTEX_WAIT, 1, NULL);
        atomic_fetch_add(&p->in_flight, 1);
    } while (atomic_load(&g_dev->gate) != 0);
}

struct krex_gate_proc *krex_gate_enter(int api)
{
    struct krex_gate_proc *p = atomic_load_explicit(&g_proc, memory_order_acquire);
    if (KREX_UNLIKELY(!p)) {
        if (atomic_load_explicit(&g_attach_state, memory_order_relaxed) < 0 || !(p = attach()))
            return NULL;
    }
    atomic_fetch_add(&p->in_flight, 1); /* seq_cst: pairs with the daemon's gate store */
    if (KREX_UNLIKELY(atomic_load(&g_dev->gate) != 0))
        park(p);
    note_context(api);
    atomic_fetch_add_explicit(&p->launches, 1, memory_order_relaxed);
    return p;
}

void krex_gate_exit(struct krex_gate_proc *p)
{
    if (!p)
        return;
    if (atomic_fetch_sub(&p->in_flight, 1) == 1 && KREX_UNLIKELY(atomic_load(&g_dev->gate)))
        futex(&p->in_flight, FUTEX_WAKE, INT32_MAX, NULL);
}

void krex_gate_bind_cuda(void *get, void *push, void *pop, void *sync)
{
    atomic_store(&g_ctx_push, (ctx_push_fn)push);
    atomic_store(&g_ctx_pop, (ctx_pop_fn)pop);
    atomic_store(&g_ctx_sync, (ctx_sync_fn)sync);
    atomic_store(&g_ctx_get, (ctx_get_fn)get);
}

void krex_gate_bind_hip(void *get_device, void *set_device, void *device_sync)
{
    atomic_store(&g_hip_set_dev, (hip_set_dev_fn)set_device);
    atomic_store(&g_hip_sync, (hip_sync_fn)device_sync);
    atomic_store(&g_hip_get_dev, (hip_get_dev_fn)get_device);
}

uint64_t krex_gate_parked_total(void) { return atomic_load(&g_parked_total); }
uint64_t krex_gate_drains_total(void) { return atomic_load(&g_drains_total); }

/* Wait (futex, 1 ms re-checks) until no launch of this process is in the driver. */
static void wait_no_in_flight(struct krex_gate_proc *p)
{
    const struct timespec ms = {0, 1000000};
    uint32_t v;
    while ((v = atomic_load(&p->in_flight)) != 0)
        futex(&p->in_flight, FUTEX_WAIT, v, &ms);
}

static void sync_cuda_contexts(void)
{
    ctx_push_fn push = atomic_load(&g_ctx_push);
    ctx_pop_fn pop = atomic_load(&g_ctx_pop);
    ctx_sync_fn sync = atomic_load(&g_ctx_sync);
    if (!push || !pop || !sync)
        return;
    for (int i = 0; i < KREX_MAX_CTX; i++) {
        void *ctx = atomic_load(&g_ctx_set[i]), *popped = NULL;
        if (!ctx)
            break;
        if (push(ctx) == 0) {
            sync(); /* a sticky error still means the queue is gone */
            pop(&popped);
        }
    }
}

static void sync_hip_devices(void)
{
    uint64_t devs = atomic_load(&g_hip_devs);
    hip_set_dev_fn set = atomic_load(&g_hip_set_dev);
    hip_sync_fn sync = atomic_load(&g_hip_sync);
    if (!set || !sync)
        return;
    for (int d = 0; d < 64; d++)
        if ((devs >> d & 1) && set(d) == 0)
            sync();
}

static void drain_once(struct krex_gate_proc *p, uint64_t gen)
{
    wait_no_in_flight(p);
    sync_cuda_contexts();
    sync_hip_devices();
    atomic_store(&p->ack_ns, now_ns());
    atomic_store(&p->ack_generation, gen);
    atomic_fetch_add(&g_drains_total, 1);
}

/* The native drain thread: acknowledges every close of the gate. */
static void *drain_main(void *arg)
{
    struct krex_gate_proc *p = arg;
    uint32_t *gen_lo = (uint32_t *)&g_dev->generation; /* little-endian low word */
    const struct timespec tick = {0, 200000000};
    for (;;) {
        if (atomic_load(&g_proc) != p)
            return NULL; /* forked child or re-attached: this thread is stale */
        uint32_t seq = __atomic_load_n(gen_lo, __ATOMIC_SEQ_CST);
        uint64_t gen = atomic_load(&g_dev->generation);
        if (atomic_load(&g_dev->gate) != 0 && gen != atomic_load(&p->ack_generation)) {
            drain_once(p, gen);
            continue;
        }
        futex(gen_lo, FUTEX_WAIT, seq, &tick);
    }
    return NULL;
}
