/* Streams and contexts seen at gated calls, and the per-stream drain (track.h).
 *
 * Hot path: a gated call looks its stream up in a small per-thread cache; only a
 * stream new to the thread takes the process-local mutex.  The drain holds that
 * mutex while it synchronises, so a stream or context being destroyed waits for
 * it (their hooks forget them first) and is never synchronised after it is gone.
 */
#define _GNU_SOURCE
#include "track.h"
#include "gate.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>

#define STREAM_LEGACY ((void *)0x1)     /* CU_STREAM_LEGACY, hipStreamLegacy */
#define STREAM_PER_THREAD ((void *)0x2) /* CU_STREAM_PER_THREAD, hipStreamPerThread */
#define CAPTURE_MODE_RELAXED 2          /* CU_STREAM_CAPTURE_MODE_RELAXED, hipStreamCaptureModeRelaxed */
#define ERR_INVALID_VALUE 1
#define ERR_INVALID_CONTEXT 201
#define ERR_INVALID_HANDLE 400
#define ERR_ILLEGAL_STATE 401
#define ERR_CONTEXT_IS_DESTROYED 709
#define TCACHE 4

enum kind { K_EXPLICIT, K_LEGACY, K_PER_THREAD, K_WIDE };

struct entry {
    int api;
    int kind;
    void *ctx; /* CUDA context */
    int dev;   /* HIP device */
    void *stream;
};

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static struct entry *g_entries;
static size_t g_n, g_cap;
static _Atomic uint64_t g_epoch = 1; /* bumped whenever an entry is forgotten */
static _Atomic int g_captures;       /* stream captures in progress in this process */
static struct krex_cuda_calls g_cuda;
static struct krex_hip_calls g_hip;
static _Atomic int g_bound[2];
static _Atomic int g_unbound_calls[2]; /* gated calls seen before the drain's calls were bound */

static KREX_TLS struct {
    uint64_t epoch;
    int api;
    void *stream, *ctx;
    int dev;
} t_cache[TCACHE];
static KREX_TLS unsigned t_next;

void krex_track_bind_cuda(const struct krex_cuda_calls *c)
{
    int expected = 0;
    if (atomic_compare_exchange_strong(&g_bound[KREX_API_CUDA], &expected, 2)) {
        g_cuda = *c;
        atomic_store(&g_bound[KREX_API_CUDA], 1);
    }
}

void krex_track_bind_hip(const struct krex_hip_calls *c)
{
    int expected = 0;
    if (atomic_compare_exchange_strong(&g_bound[KREX_API_HIP], &expected, 2)) {
        g_hip = *c;
        atomic_store(&g_bound[KREX_API_HIP], 1);
    }
}

static int bound(int api) { return atomic_load(&g_bound[api]) == 1; }

static enum kind kind_of(void *stream, int pt)
{
    if (stream == KREX_CTX_WIDE)
        return K_WIDE;
    if (stream == NULL)
        return pt ? K_PER_THREAD : K_LEGACY;
    if (stream == STREAM_LEGACY)
        return K_LEGACY;
    return stream == STREAM_PER_THREAD ? K_PER_THREAD : K_EXPLICIT;
}

static void add(const struct entry *e)
{
    pthread_mutex_lock(&g_mu);
    for (size_t i = 0; i < g_n; i++) {
        const struct entry *o = &g_entries[i];
        if (o->api == e->api && o->kind == e->kind && o->stream == e->stream &&
            o->ctx == e->ctx && o->dev == e->dev) {
            pthread_mutex_unlock(&g_mu);
            return;
        }
    }
    if (g_n == g_cap) {
        size_t cap = g_cap ? g_cap * 2 : 16;
        struct entry *grown = realloc(g_entries, cap * sizeof(*grown));
        if (!grown) { /* out of memory: the drain falls back to whole contexts */
            pthread_mutex_unlock(&g_mu);
            return;
        }
        g_entries = grown, g_cap = cap;
    }
    g_entries[g_n++] = *e;
    pthread_mutex_unlock(&g_mu);
}

void krex_track(int api, void *stream, int pt)
{
    if (!bound(api)) {
        atomic_store_explicit(&g_unbound_calls[api], 1, memory_order_relaxed);
        return;
    }
    enum kind k = kind_of(stream, pt);
    struct entry e = {api, k, NULL, -1, k == K_EXPLICIT ? stream : (void *)(uintptr_t)k};
    if (k != K_EXPLICIT) { /* the default streams belong to the caller's context/device */
        if (api == KREX_API_CUDA)
            g_cuda.ctx_get_current(&e.ctx);
        else
            g_hip.get_device(&e.dev);
    }
    uint64_t epoch = atomic_load_explicit(&g_epoch, memory_order_relaxed);
    for (int i = 0; i < TCACHE; i++)
        if (t_cache[i].epoch == epoch && t_cache[i].api == api && t_cache[i].stream == e.stream &&
            t_cache[i].ctx == e.ctx && t_cache[i].dev == e.dev)
            return;
    unsigned slot = t_next++ % TCACHE;
    t_cache[slot].epoch = epoch, t_cache[slot].api = api, t_cache[slot].stream = e.stream;
    t_cache[slot].ctx = e.ctx, t_cache[slot].dev = e.dev;
    if (k == K_EXPLICIT) { /* a stream may belong to a context that is not current */
        if (api == KREX_API_CUDA && (!g_cuda.stream_get_ctx || g_cuda.stream_get_ctx(stream, &e.ctx)))
            g_cuda.ctx_get_current(&e.ctx);
        if (api == KREX_API_HIP && (!g_hip.stream_get_device || g_hip.stream_get_device(stream, &e.dev)))
            g_hip.get_device(&e.dev);
    }
    add(&e);
}

/* Remove entries matching (api, stream) or ctx; the caller holds g_mu. */
static void prune(int api, void *stream, void *ctx)
{
    size_t k = 0;
    for (size_t i = 0; i < g_n; i++) {
        const struct entry *e = &g_entries[i];
        int gone = stream ? (e->api == api && e->kind == K_EXPLICIT && e->stream == stream)
                          : (e->api == KREX_API_CUDA && e->ctx == ctx);
        if (!gone)
            g_entries[k++] = *e;
    }
    g_n = k;
    atomic_fetch_add(&g_epoch, 1);
}

void krex_track_forget_stream(int api, void *stream)
{
    if (kind_of(stream, 0) != K_EXPLICIT)
        return;
    pthread_mutex_lock(&g_mu);
    prune(api, stream, NULL);
    pthread_mutex_unlock(&g_mu);
}

void krex_track_forget_ctx(void *ctx)
{
    pthread_mutex_lock(&g_mu);
    prune(KREX_API_CUDA, NULL, ctx);
    pthread_mutex_unlock(&g_mu);
}

void krex_track_capture(int delta)
{
    if (delta > 0) {
        atomic_fetch_add(&g_captures, 1);
        return;
    }
    int cur = atomic_load(&g_captures); /* never below 0 */
    while (cur > 0 && !atomic_compare_exchange_weak(&g_captures, &cur, cur - 1))
        ;
}

void krex_track_reset(void)
{
    pthread_mutex_init(&g_mu, NULL);
    free(g_entries);
    g_entries = NULL, g_n = g_cap = 0;
    atomic_fetch_add(&g_epoch, 1);
    atomic_store(&g_captures, 0);
    atomic_store(&g_unbound_calls[0], 0);
    atomic_store(&g_unbound_calls[1], 0);
}

/* -- the drain (only ever runs on the drain thread, with g_mu held) ------------------- */

static int failed(int status, int rc)
{
    krex_count(KREX_C_sync_errors);
    return status != KREX_DRAIN_OK ? status : rc;
}

static int same_group(const struct entry *a, const struct entry *b)
{
    return a->api == b->api && (a->api == KREX_API_CUDA ? a->ctx == b->ctx : a->dev == b->dev);
}

/* Synchronise the explicit streams of e's group; 1 when one of them is capturing. */
static int sync_streams(const struct entry *g, int *status)
{
    int capturing = 0;
    for (size_t i = 0; i < g_n; i++) {
        struct entry *e = &g_entries[i];
        if (e->kind != K_EXPLICIT || !same_group(e, g))
            continue;
        int st = 0;
        int rc = e->api == KREX_API_CUDA ? g_cuda.stream_is_capturing(e->stream, &st)
                                         : g_hip.stream_is_capturing(e->stream, &st);
        if (rc == ERR_INVALID_HANDLE || rc == ERR_CONTEXT_IS_DESTROYED) {
            e->kind = -1; /* destroyed behind our back: pruned below */
            continue;
        }
        if (rc == 0 && st != 0) { /* capturing (or invalidated): no device work to wait for */
            capturing = 1;
            krex_count(KREX_C_capturing_skipped);
            continue;
        }
        if (rc == 0)
            rc = e->api == KREX_API_CUDA ? g_cuda.stream_synchronize(e->stream)
                                         : g_hip.stream_synchronize(e->stream);
        if (rc != 0)
            *status = failed(*status, rc);
    }
    return capturing;
}

/* Synchronise the default streams of g's group (whole context or device). */
static void sync_defaults(const struct entry *g, int capturing, int *status)
{
    int legacy = 0, wide = 0;
    for (size_t i = 0; i < g_n; i++) {
        if (!same_group(&g_entries[i], g) || g_entries[i].kind <= K_EXPLICIT)
            continue;
        if (g_entries[i].kind == K_LEGACY)
            legacy = 1;
        else
            wide = 1;
    }
    if (!legacy && !wide)
        return;
    if (capturing || atomic_load(&g_captures) > 0) {
        if (*status == KREX_DRAIN_OK) /* synchronising now would break the capture */
            *status = KREX_DRAIN_CAPTURE;
        return;
    }
    int rc;
    if (g->api == KREX_API_HIP)
        rc = g_hip.device_synchronize();
    else
        rc = wide ? g_cuda.ctx_synchronize() : g_cuda.stream_synchronize(STREAM_LEGACY);
    if (rc != 0)
        *status = failed(*status, rc);
}

static void drain_group(const struct entry *g, int *status)
{
    void *popped = NULL;
    int rc = g->api == KREX_API_CUDA ? g_cuda.ctx_push(g->ctx) : g_hip.set_device(g->dev);
    if (rc == ERR_INVALID_CONTEXT || rc == ERR_CONTEXT_IS_DESTROYED) {
        for (size_t i = 0; i < g_n; i++) /* a destroyed context: forget it */
            if (same_group(&g_entries[i], g))
                g_entries[i].kind = -1;
        return;
    }
    if (rc != 0) {
        *status = failed(*status, rc);
        return;
    }
    sync_defaults(g, sync_streams(g, status), status);
    if (g->api == KREX_API_CUDA)
        g_cuda.ctx_pop(&popped);
}

static void relax_capture_mode(void)
{
    static KREX_TLS int relaxed[2];
    for (int api = 0; api < 2; api++) {
        int mode = CAPTURE_MODE_RELAXED;
        int (*exchange)(int *) = api == KREX_API_CUDA ? g_cuda.exchange_capture_mode
                                                      : g_hip.exchange_capture_mode;
        if (!relaxed[api] && bound(api) && exchange && exchange(&mode) == 0)
            relaxed[api] = 1;
    }
}

int krex_track_drain(void)
{
    int status = KREX_DRAIN_OK;
    relax_capture_mode();
    for (int api = 0; api < 2; api++)
        if (atomic_load(&g_unbound_calls[api]) && !bound(api))
            status = KREX_DRAIN_UNBOUND; /* work was submitted that this drain cannot see */
    pthread_mutex_lock(&g_mu);
    for (size_t i = 0; i < g_n; i++) {
        const struct entry *g = &g_entries[i];
        int first = g->kind >= 0;
        for (size_t j = 0; first && j < i; j++)
            first = !(g_entries[j].kind >= 0 && same_group(&g_entries[j], g));
        if (!first)
            continue;
        if (!bound(g->api) && status == KREX_DRAIN_OK)
            status = KREX_DRAIN_UNBOUND;
        else if (bound(g->api))
            drain_group(g, &status);
    }
    size_t k = 0; /* drop what was found destroyed */
    for (size_t i = 0; i < g_n; i++)
        if (g_entries[i].kind >= 0)
            g_entries[k++] = g_entries[i];
    if (k != g_n)
        atomic_fetch_add(&g_epoch, 1);
    g_n = k;
    pthread_mutex_unlock(&g_mu);
    return status;
}
