/* Gate and slot: the shared-memory side of the interposer (see gate.h).
 *
 * Gated path (open gate): one atomic add, one load, one atomic sub, no
 * syscalls.  A closed gate parks the calling thread on a futex.  A native
 * drain thread per process acknowledges each close once the streams it has
 * seen are idle (track.c), with a status that says whether they all were.
 */
#define _GNU_SOURCE
#include "gate.h"
#include "common.h"
#include "track.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define KREX_LIKELY(x) __builtin_expect(!!(x), 1)
#define KREX_UNLIKELY(x) __builtin_expect(!!(x), 0)

static pthread_once_t g_map_once = PTHREAD_ONCE_INIT;
static struct krex_gate_dev *g_dev;            /* this job's device record */
static _Atomic(struct krex_gate_proc *) g_proc; /* this process's slot */
static _Atomic int g_attach_state;             /* 0 unknown, 1 attached, -1 ungated */
static pthread_mutex_t g_attach_mu = PTHREAD_MUTEX_INITIALIZER;
static _Atomic uint64_t g_counters[KREX_NCOUNTERS];

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

/* -- counters ---------------------------------------------------------------------- */

uint64_t krex_counter_value(int c);

static void publish(struct krex_gate_proc *p, int c)
{
    uint64_t v = krex_counter_value(c), cur = atomic_load(&p->counters[c]);
    while (cur < v && !atomic_compare_exchange_weak(&p->counters[c], &cur, v))
        ;
}

static void publish_all(struct krex_gate_proc *p)
{
    for (int c = 0; c < KREX_NCOUNTERS; c++)
        publish(p, c);
}

static struct krex_gate_proc *attach(void);

/* A cold event: counted, and published at once (claiming a slot if this process has
 * none yet: a process whose every launch goes around the gate must still be seen). */
void krex_count(enum krex_counter c)
{
    atomic_fetch_add(&g_counters[c], 1);
    struct krex_gate_proc *p = atomic_load(&g_proc);
    if (!p && atomic_load(&g_attach_state) == 0)
        p = attach();
    if (p)
        publish(p, c);
}

/* Per-path call counts live per thread (a plain store on the hot path, no locked
 * instruction); each thread's block is linked once into a list that readers sum. */
struct krex_thread_counts {
    _Atomic uint64_t n[KREX_NPATHS];
    struct krex_thread_counts *next;
};
static _Atomic(struct krex_thread_counts *) g_thread_counts;
static KREX_TLS struct krex_thread_counts *t_counts;

static struct krex_thread_counts *thread_counts(void)
{
    struct krex_thread_counts *t = calloc(1, sizeof(*t));
    if (!t)
        return NULL;
    t->next = atomic_load(&g_thread_counts);
    while (!atomic_compare_exchange_weak(&g_thread_counts, &t->next, t))
        ;
    return t_counts = t;
}

void krex_count_path(int path)
{
    struct krex_thread_counts *t = t_counts;
    if (KREX_UNLIKELY(!t) && !(t = thread_counts()))
        return;
    uint64_t v = atomic_load_explicit(&t->n[path], memory_order_relaxed);
    atomic_store_explicit(&t->n[path], v + 1, memory_order_relaxed);
}

uint64_t krex_counter_value(int c)
{
    if (c < 0 || c >= KREX_NCOUNTERS)
        return 0;
    uint64_t v = atomic_load(&g_counters[c]);
    if (c >= KREX_C_launch_direct && c < KREX_C_launch_direct + KREX_NPATHS)
        for (struct krex_thread_counts *t = atomic_load(&g_thread_counts); t; t = t->next)
            v += atomic_load_explicit(&t->n[c - KREX_C_launch_direct], memory_order_relaxed);
    return v;
}

/* -- slots ---------------------------------------------------------------------------- */

/* Field 22 of /proc/PID/stat: start time in clock ticks since boot (0 if gone). */
uint64_t krex_start_time(uint32_t pid)
{
    char path[64], buf[1024];
    snprintf(path, sizeof(path), "/proc/%u/stat", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return 0;
    ssize_t n = read(fd, buf, sizeof(buf) - 1);
    close(fd);
    if (n <= 0)
        return 0;
    buf[n] = 0;
    char *s = strrchr(buf, ')'); /* the command name may contain spaces */
    for (int field = 2; s && field < 22; field++)
        s = strchr(s + 1, ' ');
    return s ? strtoull(s + 1, NULL, 10) : 0;
}

/* A slot is stale when its owner is gone or its pid now names another process. */
static int slot_stale(const struct krex_gate_proc *p, uint32_t pid)
{
    uint64_t started = atomic_load(&p->start_time);
    uint64_t now = krex_start_time(pid);
    return now == 0 || (started != 0 && now != started);
}

static void take_slot(struct krex_gate_proc *p, uint64_t started)
{
    atomic_store(&p->in_flight, 0);
    atomic_store(&p->ack_generation, 0);
    atomic_store(&p->ack_status, 0);
    atomic_store(&p->launches, 0);
    atomic_store(&p->parked, 0);
    for (int c = 0; c < KREX_SLOT_COUNTERS; c++)
        atomic_store(&p->counters[c], 0);
    atomic_store(&p->start_time, started);
}

/* Claim a process slot by CAS: a free slot, our own, or a stale one. */
static struct krex_gate_proc *claim_slot(void)
{
    uint32_t me = (uint32_t)getpid();
    uint64_t started = krex_start_time(me);
    for (int i = 0; i < KREX_GATE_NSLOTS; i++) {
        struct krex_gate_proc *p = &g_dev->procs[i];
        uint32_t cur = atomic_load(&p->pid);
        if ((cur == me && atomic_load(&p->start_time) == started) ||
            (cur == 0 && atomic_compare_exchange_strong(&p->pid, &cur, me)) ||
            (cur != 0 && slot_stale(p, cur) && atomic_compare_exchange_strong(&p->pid, &cur, me))) {
            take_slot(p, started);
            return p;
        }
    }
    atomic_fetch_add(&g_dev->overflow_procs, 1); /* runs ungated: the daemon sees it */
    return NULL;
}

/* At exit, give the slot back (a killed process's slot is reaped as stale). */
static void free_slot(void)
{
    atomic_store(&g_attach_state, -1); /* calls made while exiting do not claim again */
    struct krex_gate_proc *p = atomic_exchange(&g_proc, NULL);
    uint32_t me = (uint32_t)getpid();
    if (p && atomic_load(&p->in_flight) == 0)
        atomic_compare_exchange_strong(&p->pid, &me, 0);
}

static void reset_after_fork(void)
{
    atomic_store(&g_proc, NULL);
    atomic_store(&g_attach_state, 0);
    pthread_mutex_init(&g_attach_mu, NULL);
    for (int c = 0; c < KREX_NCOUNTERS; c++)
        atomic_store(&g_counters[c], 0);
    for (struct krex_thread_counts *t = atomic_load(&g_thread_counts); t; t = t->next)
        for (int i = 0; i < KREX_NPATHS; i++)
            atomic_store(&t->n[i], 0);
    krex_track_reset();
}

static void register_process_hooks(void)
{
    pthread_atfork(NULL, NULL, reset_after_fork);
    atexit(free_slot);
}

static void *drain_main(void *arg);

static void start_drain_thread(struct krex_gate_proc *p)
{
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

/* Slow path of the first gated call: map, claim a slot, start the drain thread. */
static struct krex_gate_proc *attach(void)
{
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, register_process_hooks);
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
        publish_all(p);
        start_drain_thread(p);
    }
    atomic_store(&g_attach_state, p ? 1 : -1);
    pthread_mutex_unlock(&g_attach_mu);
    return p;
}

/* Closed gate: step out of in_flight, wake the drain thread, sleep until open. */
static void park(struct krex_gate_proc *p)
{
    atomic_fetch_add_explicit(&p->parked, 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&g_counters[KREX_C_parked], 1, memory_order_relaxed);
    /* Cold path: publish now.  The drain thread may have acknowledged this close before
     * the launch arrived, and the next publication would come only at the next drain. */
    publish(p, KREX_C_parked);
    do {
        atomic_fetch_sub(&p->in_flight, 1);
        futex(&p->in_flight, FUTEX_WAKE, INT32_MAX, NULL);
        while (atomic_load(&g_dev->gate) != 0)
            futex(&g_dev->gate, FUTEX_WAIT, 1, NULL);
        atomic_fetch_add(&p->in_flight, 1);
    } while (atomic_load(&g_dev->gate) != 0);
}

struct krex_gate_proc *krex_gate_enter(void)
{
    struct krex_gate_proc *p = atomic_load_explicit(&g_proc, memory_order_acquire);
    if (KREX_UNLIKELY(!p)) {
        int state = atomic_load_explicit(&g_attach_state, memory_order_relaxed);
        if ((state < 0 || !(p = attach()))) {
            if (g_dev) /* a gate file is named but this process has no slot */
                atomic_fetch_add_explicit(&g_counters[KREX_C_ungated], 1, memory_order_relaxed);
            return NULL;
        }
    }
    atomic_fetch_add(&p->in_flight, 1); /* seq_cst: pairs with the daemon's gate store */
    if (KREX_UNLIKELY(atomic_load(&g_dev->gate) != 0))
        park(p);
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

/* -- drain ------------------------------------------------------------------------------ */

/* Wait (futex, 1 ms re-checks) until no gated call of this process is in the driver. */
static void wait_no_in_flight(struct krex_gate_proc *p)
{
    const struct timespec ms = {0, 1000000};
    uint32_t v;
    while ((v = atomic_load(&p->in_flight)) != 0)
        futex(&p->in_flight, FUTEX_WAIT, v, &ms);
}

static void drain_once(struct krex_gate_proc *p, uint64_t gen)
{
    wait_no_in_flight(p);
    int status = krex_track_drain();
    if (status != KREX_DRAIN_OK)
        krex_count(KREX_C_drain_failures);
    krex_count(KREX_C_drains);
    publish_all(p);
    atomic_store(&p->ack_status, status);
    atomic_store(&p->ack_ns, now_ns());
    atomic_store(&p->ack_generation, gen); /* last: the daemon reads the rest after it */
}

/* The native drain thread: acknowledges every close of the gate. */
static void *drain_main(void *arg)
{
    struct krex_gate_proc *p = arg;
    uint32_t *gen_lo = (uint32_t *)&g_dev->generation; /* little-endian low word */
    const struct timespec tick = {0, 200000000};
    for (;;) {
        if (atomic_load(&g_proc) != p)
            return NULL; /* forked child, exited or re-attached: this thread is stale */
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
