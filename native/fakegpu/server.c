/* fakegpu device server: contexts, per-context queues, one execution thread.
 *
 * Kernels are queued per context here (not in the submitting process), and
 * executed by busy-waiting on an execution thread pinned to KREX_FAKEGPU_CORE.
 * Contexts with queued work are time-sliced round-robin (KREX_FAKEGPU_SLICE_US).
 * Context creation is serialised behind KREX_FAKEGPU_CTX_DELAY_MS.
 * Usage: krex-fakegpu-server SOCKET_PATH   (prints "ready" once listening)
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "proto.h"
#include "common.h"

#define MAX_CTX 1024
#define MAX_EVENTS 65536
#define MAX_LOG (4u << 20)

enum item_kind { ITEM_KERNEL, ITEM_EVENT };

struct item {
    int kind;
    int poison;
    uint64_t remaining_ns;
    uint32_t event;
    uint32_t log; /* its launch-log entry + 1 (0: none), for the execution stamps */
    struct item *next;
};

struct ctx {
    int used;
    int dev;
    int poisoned;
    uint32_t pid; /* the process that created it */
    uint64_t busy_ns; /* run for it, ever (kept after destroy, until the slot is reused) */
    struct item *head, *tail;
};

struct event {
    int used;
    int recorded;
    uint64_t ns;
};

struct log_entry {
    uint64_t ns; /* accepted */
    uint32_t pid;
    uint32_t ctx;
    uint32_t flags;
    uint64_t dur_ns;
    uint64_t start_ns, end_ns; /* executed: the device's own clock (0: not yet) */
};

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_work = PTHREAD_COND_INITIALIZER;
static pthread_cond_t g_done = PTHREAD_COND_INITIALIZER;
static pthread_mutex_t g_create_mu = PTHREAD_MUTEX_INITIALIZER;
static struct ctx g_ctx[MAX_CTX];
static struct event g_events[MAX_EVENTS];
static uint32_t g_next_event = 1;
static struct log_entry *g_log;
static uint32_t g_log_n;
static uint64_t g_launches, g_finished, g_busy_ns;
static int g_ndev = 1;
static uint64_t g_slice_ns = 1000000;
static uint64_t g_idle_spin_ns = 200000;
static int g_ctx_delay_ms;
static uint64_t g_enqueued; /* items ever enqueued; read without the lock while polling */
static uint64_t g_exec_tid; /* the execution thread (its run delay is the device's) */

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* Busy-wait for ns on this thread; returns the time actually spent. */
static uint64_t spin(uint64_t ns)
{
    uint64_t start = now_ns(), t;
    while ((t = now_ns()) - start < ns)
        cpu_relax();
    return t - start;
}

static int valid_ctx(uint32_t id)
{
    return id >= 1 && id <= MAX_CTX && g_ctx[id - 1].used;
}

static void free_queue(struct ctx *c)
{
    while (c->head) {
        struct item *it = c->head;
        c->head = it->next;
        if (it->kind == ITEM_EVENT && it->event < MAX_EVENTS) {
            g_events[it->event].recorded = 1; /* an event behind a failure completes */
            g_events[it->event].ns = now_ns();
        }
        free(it);
    }
    c->tail = NULL;
}

static void pop(struct ctx *c)
{
    struct item *it = c->head;
    c->head = it->next;
    if (!c->head)
        c->tail = NULL;
    free(it);
}

/* Next context with queued work, round-robin after `last`; -1 when idle. */
static int pick(int last)
{
    for (int k = 1; k <= MAX_CTX; k++) {
        int i = (last + k) % MAX_CTX;
        if (g_ctx[i].used && g_ctx[i].head)
            return i;
    }
    return -1;
}

/* Run the head item of context i for `budget` ns or what it has left; returns the time credited
 * (the wall time spent: more than `budget` when this thread was descheduled).  Lock held. */
static uint64_t run_head(int i, uint64_t budget)
{
    struct ctx *c = &g_ctx[i];
    struct item *it = c->head;
    if (it->kind == ITEM_EVENT) {
        g_events[it->event].ns = now_ns();
        g_events[it->event].recorded = 1;
        pop(c);
        pthread_cond_broadcast(&g_done);
        return 0;
    }
    uint64_t run = it->remaining_ns < budget ? it->remaining_ns : budget;
    struct log_entry *entry = it->log && g_log ? &g_log[it->log - 1] : NULL;
    if (entry && !entry->start_ns)
        entry->start_ns = now_ns();
    pthread_mutex_unlock(&g_mu);
    uint64_t spent = spin(run);
    pthread_mutex_lock(&g_mu);
    g_busy_ns += spent;
    c->busy_ns += spent;
    /* A GPU runs while its host thread is descheduled: credit the wall time spent, not
     * just the slice asked for, so that a preempted slice does not stretch the kernel
     * (under host load, 10 ms kernels once read 14-19 ms). */
    run = spent < it->remaining_ns ? spent : it->remaining_ns;
    it->remaining_ns -= run;
    if (it->remaining_ns == 0 && entry)
        entry->end_ns = now_ns();
    if (it->remaining_ns == 0) {
        g_finished++;
        if (it->poison) {
            c->poisoned = 1;
            free_queue(c);
        } else {
            pop(c);
        }
        pthread_cond_broadcast(&g_done);
    }
    return run;
}

static void pin_to_core(void)
{
    int core = env_int("KREX_FAKEGPU_CORE", -1);
    if (core < 0)
        return;
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(core, &set);
    pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
}

/* The device: one context at a time, each for up to one slice, round-robin. */
static void *executor(void *arg)
{
    (void)arg;
    pin_to_core();
    pthread_setname_np(pthread_self(), "fakegpu-exec");
    pid_t tid = (pid_t)syscall(SYS_gettid);
    __atomic_store_n(&g_exec_tid, (uint64_t)tid, __ATOMIC_RELEASE);
    int last = MAX_CTX - 1;
    pthread_mutex_lock(&g_mu);
    for (;;) {
        int i = pick(last);
        if (i < 0) {
            /* A GPU's front end polls its queues; it does not sleep.  Poll for a
             * while before blocking, so that the next command of a program that
             * is enqueueing (an event, then its kernel) does not wait for this
             * thread to be woken — in a VM that wake-up alone is tens of µs. */
            uint64_t seen = __atomic_load_n(&g_enqueued, __ATOMIC_ACQUIRE);
            pthread_mutex_unlock(&g_mu);
            uint64_t start = now_ns();
            while (__atomic_load_n(&g_enqueued, __ATOMIC_ACQUIRE) == seen &&
                   now_ns() - start < g_idle_spin_ns)
                cpu_relax();
            pthread_mutex_lock(&g_mu);
            if (__atomic_load_n(&g_enqueued, __ATOMIC_ACQUIRE) == seen && pick(last) < 0)
                pthread_cond_wait(&g_work, &g_mu);
            continue;
        }
        uint64_t left = g_slice_ns;
        while (left > 0 && g_ctx[i].used && g_ctx[i].head) {
            uint64_t ran = run_head(i, left);
            left = ran < left ? left - ran : 0;
        }
        last = i;
    }
    return NULL;
}

static void enqueue(struct ctx *c, struct item *it)
{
    it->next = NULL;
    if (c->tail)
        c->tail->next = it;
    else
        c->head = it;
    c->tail = it;
    __atomic_add_fetch(&g_enqueued, 1, __ATOMIC_RELEASE);
    pthread_cond_signal(&g_work);
}

static uint32_t log_launch(const struct fg_req *q, uint64_t ns)
{
    if (!g_log)
        g_log = calloc(MAX_LOG, sizeof(*g_log));
    if (!g_log || g_log_n >= MAX_LOG)
        return 0;
    g_log[g_log_n++] = (struct log_entry){ns, q->pid, q->ctx, q->flags, q->a, 0, 0};
    return g_log_n;
}

static void op_launch(const struct fg_req *q, struct fg_rep *r)
{
    uint64_t t = now_ns();
    if (!valid_ctx(q->ctx)) {
        r->status = CUDA_ERROR_INVALID_CONTEXT;
        return;
    }
    struct ctx *c = &g_ctx[q->ctx - 1];
    if (c->poisoned) {
        r->status = CUDA_ERROR_LAUNCH_FAILED;
        return;
    }
    struct item *it = calloc(1, sizeof(*it));
    it->kind = ITEM_KERNEL;
    it->poison = (q->flags & FG_POISON) != 0;
    it->remaining_ns = q->a ? q->a : 1;
    g_launches++;
    it->log = log_launch(q, t);
    enqueue(c, it);
}

static void op_sync(const struct fg_req *q, struct fg_rep *r)
{
    if (!valid_ctx(q->ctx)) {
        r->status = CUDA_ERROR_INVALID_CONTEXT;
        return;
    }
    struct ctx *c = &g_ctx[q->ctx - 1];
    while (c->used && c->head)
        pthread_cond_wait(&g_done, &g_mu);
    r->status = c->poisoned ? CUDA_ERROR_LAUNCH_FAILED : 0;
}

static void op_ctx_create(const struct fg_req *q, struct fg_rep *r)
{
    pthread_mutex_unlock(&g_mu);
    pthread_mutex_lock(&g_create_mu); /* context creation is serialised node-wide */
    if (g_ctx_delay_ms > 0)
        usleep((useconds_t)g_ctx_delay_ms * 1000);
    pthread_mutex_unlock(&g_create_mu);
    pthread_mutex_lock(&g_mu);
    if ((int)q->a < 0 || (int)q->a >= g_ndev) {
        r->status = CUDA_ERROR_INVALID_DEVICE;
        return;
    }
    for (int i = 0; i < MAX_CTX; i++) {
        if (!g_ctx[i].used) {
            g_ctx[i] = (struct ctx){.used = 1, .dev = (int)q->a, .pid = q->pid};
            r->v0 = (uint64_t)i + 1;
            return;
        }
    }
    r->status = CUDA_ERROR_OUT_OF_MEMORY;
}

static void op_ctx_destroy(const struct fg_req *q, struct fg_rep *r)
{
    if (!valid_ctx(q->ctx)) {
        r->status = CUDA_ERROR_INVALID_CONTEXT;
        return;
    }
    struct ctx *c = &g_ctx[q->ctx - 1];
    while (c->head) /* destroying a context waits for its work, as cuCtxDestroy does */
        pthread_cond_wait(&g_done, &g_mu);
    c->used = 0;
}

static void op_event(const struct fg_req *q, struct fg_rep *r)
{
    uint32_t id = (uint32_t)q->a;
    if (q->op == FG_EVENT_CREATE) {
        if (g_next_event >= MAX_EVENTS)
            g_next_event = 1;
        id = g_next_event++;
        g_events[id] = (struct event){.used = 1};
        r->v0 = id;
        return;
    }
    if (id == 0 || id >= MAX_EVENTS || !g_events[id].used) {
        r->status = CUDA_ERROR_INVALID_VALUE;
        return;
    }
    struct event *e = &g_events[id];
    if (q->op == FG_EVENT_RECORD) {
        if (!valid_ctx(q->ctx)) {
            r->status = CUDA_ERROR_INVALID_CONTEXT;
            return;
        }
        if (g_ctx[q->ctx - 1].poisoned) {
            r->status = CUDA_ERROR_LAUNCH_FAILED;
            return;
        }
        e->recorded = 0;
        struct item *it = calloc(1, sizeof(*it));
        it->kind = ITEM_EVENT;
        it->event = id;
        enqueue(&g_ctx[q->ctx - 1], it);
        return;
    }
    while (q->op == FG_EVENT_SYNC && !e->recorded)
        pthread_cond_wait(&g_done, &g_mu);
    r->status = e->recorded ? 0 : CUDA_ERROR_NOT_READY;
    r->v0 = e->ns;
}

static void op_busy(const struct fg_req *q, struct fg_rep *r)
{
    uint32_t pids[FG_BUSY_PIDS];
    memcpy(pids, q->text, sizeof(pids));
    for (int i = 0; i < MAX_CTX; i++)
        for (int k = 0; k < FG_BUSY_PIDS && pids[k]; k++)
            if (g_ctx[i].pid == pids[k]) {
                r->v0 += g_ctx[i].busy_ns;
                break;
            }
    r->v1 = g_busy_ns;
    r->v2 = __atomic_load_n(&g_exec_tid, __ATOMIC_ACQUIRE);
}

static void op_dump(const struct fg_req *q, struct fg_rep *r)
{
    FILE *f = fopen(q->text, "w");
    if (!f) {
        r->status = CUDA_ERROR_INVALID_VALUE;
        return;
    }
    for (uint32_t i = 0; i < g_log_n; i++)
        if (!g_log[i].end_ns || g_log[i].end_ns >= q->a) /* a: ended since (0: all) */
            fprintf(f, "%llu %u %u %u %llu %llu %llu\n", (unsigned long long)g_log[i].ns,
                    g_log[i].pid, g_log[i].ctx, g_log[i].flags,
                    (unsigned long long)g_log[i].dur_ns, (unsigned long long)g_log[i].start_ns,
                    (unsigned long long)g_log[i].end_ns);
    fclose(f);
    r->v0 = g_log_n;
}

/* Process locks (the fake cuCheckpointProcessLock, as NVIDIA documents it): a locked
 * process's further calls wait in the server until it is unlocked; the lock waits for
 * the process's calls in progress (a sync waiting for its queue), not for its queued work. */
#define MAX_LOCKED 64
#define MAX_BUSY 256
static uint32_t g_locked[MAX_LOCKED];
static struct { uint32_t pid, calls; } g_busy[MAX_BUSY]; /* calls in progress per process */
static pthread_cond_t g_unlocked = PTHREAD_COND_INITIALIZER;

static int is_locked(uint32_t pid)
{
    for (int i = 0; i < MAX_LOCKED; i++)
        if (g_locked[i] == pid)
            return 1;
    return 0;
}

static void busy(uint32_t pid, int delta)
{
    int free_slot = -1;
    for (int i = 0; i < MAX_BUSY; i++) {
        if (g_busy[i].pid == pid && g_busy[i].calls) {
            g_busy[i].calls += (uint32_t)delta;
            if (delta < 0)
                pthread_cond_broadcast(&g_done);
            return;
        }
        if (free_slot < 0 && g_busy[i].calls == 0)
            free_slot = i;
    }
    if (delta > 0 && free_slot >= 0)
        g_busy[free_slot].pid = pid, g_busy[free_slot].calls = 1;
}

static int calls_in_progress(uint32_t pid)
{
    for (int i = 0; i < MAX_BUSY; i++)
        if (g_busy[i].pid == pid && g_busy[i].calls)
            return 1;
    return 0;
}

static uint64_t queued_for(uint32_t pid)
{
    uint64_t n = 0;
    for (int i = 0; i < MAX_CTX; i++)
        if (g_ctx[i].used && g_ctx[i].pid == pid)
            for (struct item *it = g_ctx[i].head; it; it = it->next)
                n++;
    return n;
}

static int has_context(uint32_t pid)
{
    for (int i = 0; i < MAX_CTX; i++)
        if (g_ctx[i].used && g_ctx[i].pid == pid)
            return 1;
    return 0;
}

static void op_proc_lock(const struct fg_req *q, struct fg_rep *r)
{
    uint32_t pid = (uint32_t)q->a;
    int slot = -1;
    for (int i = 0; i < MAX_LOCKED && slot < 0; i++)
        if (g_locked[i] == 0 || g_locked[i] == pid)
            slot = i;
    if (slot < 0 || pid == 0 || !has_context(pid)) {
        r->status = CUDA_ERROR_INVALID_VALUE;
        return;
    }
    struct timespec deadline;
    clock_gettime(CLOCK_REALTIME, &deadline);
    uint64_t ns = (uint64_t)deadline.tv_nsec + (uint64_t)q->flags * 1000000ull;
    deadline.tv_sec += (time_t)(ns / 1000000000ull);
    deadline.tv_nsec = (long)(ns % 1000000000ull);
    while (calls_in_progress(pid)) {
        if (q->flags == 0)
            pthread_cond_wait(&g_done, &g_mu);
        else if (pthread_cond_timedwait(&g_done, &g_mu, &deadline) != 0 && calls_in_progress(pid)) {
            r->status = CUDA_ERROR_NOT_READY; /* timed out: left running, not locked */
            return;
        }
    }
    g_locked[slot] = pid;
}

static void op_proc_unlock(const struct fg_req *q)
{
    for (int i = 0; i < MAX_LOCKED; i++)
        if (g_locked[i] == (uint32_t)q->a)
            g_locked[i] = 0;
    pthread_cond_broadcast(&g_unlocked);
}

static void op_proc_state(const struct fg_req *q, struct fg_rep *r)
{
    uint32_t pid = (uint32_t)q->a;
    if (!has_context(pid))
        r->status = CUDA_ERROR_INVALID_VALUE;
    r->v0 = (uint64_t)is_locked(pid);
}

static void handle(struct fg_req *q, struct fg_rep *r)
{
    memset(r, 0, sizeof(*r));
    q->text[sizeof(q->text) - 1] = 0;
    pthread_mutex_lock(&g_mu);
    while (is_locked(q->pid)) /* a locked process's calls block (all of them) */
        pthread_cond_wait(&g_unlocked, &g_mu);
    int blocking = q->op == FG_SYNC || q->op == FG_EVENT_SYNC || q->op == FG_CTX_DESTROY;
    if (blocking)
        busy(q->pid, 1);
    switch (q->op) {
    case FG_PROC_LOCK: op_proc_lock(q, r); break;
    case FG_PROC_UNLOCK: op_proc_unlock(q); break;
    case FG_PROC_STATE: op_proc_state(q, r); break;
    case FG_PROC_QUEUED: r->v0 = queued_for((uint32_t)q->a); break;
    case FG_HELLO: r->v0 = (uint64_t)g_ndev; break;
    case FG_CTX_CREATE: op_ctx_create(q, r); break;
    case FG_CTX_DESTROY: op_ctx_destroy(q, r); break;
    case FG_LAUNCH: op_launch(q, r); break;
    case FG_SYNC: op_sync(q, r); break;
    case FG_EVENT_CREATE:
    case FG_EVENT_RECORD:
    case FG_EVENT_QUERY:
    case FG_EVENT_SYNC: op_event(q, r); break;
    case FG_STATS: r->v0 = g_launches; r->v1 = g_finished; r->v2 = g_busy_ns; break;
    case FG_DUMP_LOG: op_dump(q, r); break;
    case FG_BUSY: op_busy(q, r); break;
    default: r->status = CUDA_ERROR_INVALID_VALUE;
    }
    if (blocking)
        busy(q->pid, -1);
    pthread_mutex_unlock(&g_mu);
}

static int read_full(int fd, void *buf, size_t n)
{
    for (size_t got = 0; got < n;) {
        ssize_t k = read(fd, (char *)buf + got, n - got);
        if (k <= 0 && !(k < 0 && errno == EINTR))
            return -1;
        if (k > 0)
            got += (size_t)k;
    }
    return 0;
}

/* A serving thread does a driver's work for its caller: it runs on any core but the
 * device's own (the GPU's stand-in), so it never preempts the execution thread there. */
static void keep_off_device_core(void)
{
    int core = env_int("KREX_FAKEGPU_CORE", -1);
    cpu_set_t set;
    if (core < 0 || pthread_getaffinity_np(pthread_self(), sizeof(set), &set) != 0)
        return;
    CPU_CLR(core, &set);
    if (CPU_COUNT(&set) > 0)
        pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
}

static void *serve_client(void *arg)
{
    int fd = (int)(intptr_t)arg;
    keep_off_device_core();
    struct fg_req q;
    struct fg_rep r;
    while (read_full(fd, &q, sizeof(q)) == 0) {
        handle(&q, &r);
        if (write(fd, &r, sizeof(r)) != (ssize_t)sizeof(r))
            break;
    }
    close(fd);
    return NULL;
}

static int listen_on(const char *path)
{
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    if (fd < 0 || strlen(path) >= sizeof(addr.sun_path))
        return -1;
    strcpy(addr.sun_path, path);
    unlink(path);
    if (bind(fd, (struct sockaddr *)&addr, sizeof(addr)) < 0 || listen(fd, 128) < 0)
        return -1;
    return fd;
}

/* The server belongs to the process that started it (a daemon, a test): when
 * that process dies, even by SIGKILL, the server is reparented and exits too. */
static pid_t g_parent;
static const char *g_path;

static void *watch_parent(void *arg)
{
    (void)arg;
    while (getppid() == g_parent)
        usleep(200000);
    unlink(g_path);
    _exit(0);
    return NULL;
}

int main(int argc, char **argv)
{
    const char *path = argc > 1 ? argv[1] : getenv("KREX_FAKEGPU_SOCKET");
    if (!path) {
        fprintf(stderr, "usage: krex-fakegpu-server SOCKET_PATH\n");
        return 2;
    }
    g_ndev = env_int("KREX_FAKEGPU_DEVICES", 1);
    g_slice_ns = (uint64_t)env_int("KREX_FAKEGPU_SLICE_US", 1000) * 1000;
    g_idle_spin_ns = (uint64_t)env_int("KREX_FAKEGPU_IDLE_SPIN_US", 200) * 1000;
    g_ctx_delay_ms = env_int("KREX_FAKEGPU_CTX_DELAY_MS", 0);
    signal(SIGPIPE, SIG_IGN);
    int lfd = listen_on(path);
    if (lfd < 0) {
        perror("krex-fakegpu-server: listen");
        return 1;
    }
    pthread_t tid;
    g_parent = getppid();
    g_path = path;
    pthread_create(&tid, NULL, watch_parent, NULL);
    pthread_create(&tid, NULL, executor, NULL);
    printf("ready\n");
    fflush(stdout);
    for (;;) {
        int fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
        if (fd < 0)
            continue;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pthread_attr_setstacksize(&attr, 128 * 1024);
        pthread_create(&tid, &attr, serve_client, (void *)(intptr_t)fd);
        pthread_attr_destroy(&attr);
    }
}
