/* fake libamdhip64.so: the HIP runtime API on top of the fakegpu server.
 *
 * Same kernel conventions as the fake CUDA driver: hipModuleGetFunction(&f,
 * mod, "spin_us_N") etc.; hipLaunchKernel takes such a hipFunction_t as its
 * function pointer.  One device context per process and device, created on
 * first use (serialised and delayed by the server like a real one).
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "client.h"
#include "interpose/cutypes.h"

#define MAX_DEV 16

struct ihipModuleSymbol_t { uint64_t dur_ns; uint32_t flags; };
struct ihipStream_t { int dev; };
struct ihipEvent_t { uint32_t id; };
typedef struct ihipModule_t *hipModule_t;

static int g_ndev = -1;
static uint32_t g_ctx[MAX_DEV];
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static __thread int t_dev;

#define API FG_EXPORT hipError_t

static hipError_t status_of(int st) { return st < 0 ? hipErrorNotInitialized : st; }

API hipInit(unsigned int flags)
{
    (void)flags;
    struct fg_rep r;
    if (g_ndev >= 0)
        return hipSuccess;
    if (fg_simple(FG_HELLO, 0, 0, 0, &r) != 0)
        return hipErrorNoDevice;
    g_ndev = (int)r.v0;
    return hipSuccess;
}

/* The server context of a device, created on first use. */
static uint32_t ctx_for(int dev)
{
    if (hipInit(0) != hipSuccess || dev < 0 || dev >= g_ndev || dev >= MAX_DEV)
        return 0;
    pthread_mutex_lock(&g_mu);
    struct fg_rep r;
    if (!g_ctx[dev] && fg_simple(FG_CTX_CREATE, 0, (uint64_t)dev, 0, &r) == 0)
        g_ctx[dev] = (uint32_t)r.v0;
    uint32_t id = g_ctx[dev];
    pthread_mutex_unlock(&g_mu);
    return id;
}

static uint32_t ctx_of(hipStream_t s) { return ctx_for(s ? s->dev : t_dev); }

API hipGetDeviceCount(int *n) { hipError_t e = hipInit(0); *n = e ? 0 : g_ndev; return e; }
API hipGetDevice(int *d) { *d = t_dev; return hipSuccess; }
API hipSetDevice(int d) { if (hipInit(0) || d < 0 || d >= g_ndev) return hipErrorInvalidDevice; t_dev = d; return hipSuccess; }
API hipDriverGetVersion(int *v) { *v = 60200000; return hipSuccess; }
API hipRuntimeGetVersion(int *v) { *v = 60200000; return hipSuccess; }

API hipDeviceSynchronize(void)
{
    uint32_t c = ctx_for(t_dev);
    return c ? status_of(fg_simple(FG_SYNC, c, 0, 0, NULL)) : hipErrorInvalidDevice;
}

API hipStreamCreate(hipStream_t *s) { *s = calloc(1, sizeof(**s)); (*s)->dev = t_dev; return hipSuccess; }
API hipStreamDestroy(hipStream_t s) { free(s); return hipSuccess; }
API hipStreamSynchronize(hipStream_t s) { return status_of(fg_simple(FG_SYNC, ctx_of(s), 0, 0, NULL)); }
/* Stream capture is not modelled for HIP: no stream is ever capturing. */
API hipStreamIsCapturing(hipStream_t s, int *status) { (void)s; *status = 0; return hipSuccess; }
API hipStreamGetDevice(hipStream_t s, int *dev) { *dev = s ? s->dev : t_dev; return hipSuccess; }
API hipThreadExchangeStreamCaptureMode(int *mode) { *mode = 0; return hipSuccess; }

API hipModuleLoadData(hipModule_t *m, const void *image) { (void)image; *m = calloc(1, 8); return hipSuccess; }
API hipModuleLoad(hipModule_t *m, const char *path) { return hipModuleLoadData(m, path); }
API hipModuleUnload(hipModule_t m) { free(m); return hipSuccess; }

API hipModuleGetFunction(hipFunction_t *f, hipModule_t m, const char *name)
{
    if (!m || !name)
        return hipErrorInvalidValue;
    *f = calloc(1, sizeof(**f));
    fg_parse_kernel(name, &(*f)->dur_ns, &(*f)->flags);
    return hipSuccess;
}

static hipError_t launch(const void *fn, hipStream_t s, void **params)
{
    const struct ihipModuleSymbol_t *f = fn;
    uint32_t c = ctx_of(s);
    if (!f || !c)
        return hipErrorInvalidValue;
    uint64_t dur = f->dur_ns;
    if (dur == 0 && params && params[0])
        dur = *(uint64_t *)params[0];
    return status_of(fg_simple(FG_LAUNCH, c, dur, f->flags & FG_POISON, NULL));
}

API hipLaunchKernel(const void *f, dim3 g, dim3 b, void **args, size_t shmem, hipStream_t s)
{ (void)g, (void)b, (void)shmem; return launch(f, s, args); }
API hipLaunchKernel_spt(const void *f, dim3 g, dim3 b, void **args, size_t shmem, hipStream_t s)
{ (void)g, (void)b, (void)shmem; return launch(f, s, args); }
API hipLaunchCooperativeKernel(const void *f, dim3 g, dim3 b, void **args, unsigned shmem, hipStream_t s)
{ (void)g, (void)b, (void)shmem; return launch(f, s, args); }
API hipModuleLaunchKernel(hipFunction_t f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                          unsigned bz, unsigned shmem, hipStream_t s, void **params, void **extra)
{ (void)gx, (void)gy, (void)gz, (void)bx, (void)by, (void)bz, (void)shmem, (void)extra; return launch(f, s, params); }
API hipExtModuleLaunchKernel(hipFunction_t f, uint32_t gx, uint32_t gy, uint32_t gz, uint32_t lx, uint32_t ly,
                             uint32_t lz, size_t shmem, hipStream_t s, void **params, void **extra,
                             hipEvent_t start, hipEvent_t stop, uint32_t flags)
{
    (void)gx, (void)gy, (void)gz, (void)lx, (void)ly, (void)lz, (void)shmem, (void)extra;
    (void)start, (void)stop, (void)flags;
    return launch(f, s, params);
}

API hipMalloc(void **p, size_t n) { return posix_memalign(p, 256, n ? n : 1) ? hipErrorOutOfMemory : hipSuccess; }
API hipFree(void *p) { free(p); return hipSuccess; }

static hipError_t transfer(void *dst, const void *src, int byte, size_t n, hipStream_t s, int wait)
{
    uint32_t c = ctx_of(s);
    if (!c)
        return hipErrorInvalidDevice;
    if (src)
        memmove(dst, src, n);
    else
        memset(dst, byte, n);
    int st = fg_simple(FG_LAUNCH, c, fg_copy_ns(n), FG_COPY, NULL);
    if (st == 0 && wait)
        st = fg_simple(FG_SYNC, c, 0, 0, NULL);
    return status_of(st);
}

API hipMemcpy(void *d, const void *s, size_t n, hipMemcpyKind k) { (void)k; return transfer(d, s, 0, n, NULL, 1); }
API hipMemcpy_spt(void *d, const void *s, size_t n, hipMemcpyKind k) { (void)k; return transfer(d, s, 0, n, NULL, 1); }
API hipMemcpyAsync(void *d, const void *s, size_t n, hipMemcpyKind k, hipStream_t st) { (void)k; return transfer(d, s, 0, n, st, 0); }
API hipMemcpyHtoD(hipDeviceptr_t d, void *s, size_t n) { return transfer(d, s, 0, n, NULL, 1); }
API hipMemcpyDtoH(void *d, hipDeviceptr_t s, size_t n) { return transfer(d, s, 0, n, NULL, 1); }
API hipMemcpyHtoDAsync(hipDeviceptr_t d, void *s, size_t n, hipStream_t st) { return transfer(d, s, 0, n, st, 0); }
API hipMemset(void *d, int v, size_t n) { return transfer(d, NULL, v, n, NULL, 1); }
API hipMemsetAsync(void *d, int v, size_t n, hipStream_t st) { return transfer(d, NULL, v, n, st, 0); }
API hipMemsetD8(hipDeviceptr_t d, unsigned char v, size_t n) { return transfer(d, NULL, v, n, NULL, 1); }

API hipEventCreate(hipEvent_t *e)
{
    struct fg_rep r;
    int st = fg_simple(FG_EVENT_CREATE, 0, 0, 0, &r);
    if (st != 0)
        return status_of(st);
    *e = calloc(1, sizeof(**e));
    (*e)->id = (uint32_t)r.v0;
    return hipSuccess;
}
API hipEventRecord(hipEvent_t e, hipStream_t s) { return status_of(fg_simple(FG_EVENT_RECORD, ctx_of(s), e->id, 0, NULL)); }
API hipEventSynchronize(hipEvent_t e) { return status_of(fg_simple(FG_EVENT_SYNC, 0, e->id, 0, NULL)); }
API hipEventDestroy(hipEvent_t e) { free(e); return hipSuccess; }
API hipEventElapsedTime(float *ms, hipEvent_t a, hipEvent_t b)
{
    struct fg_rep ra, rb;
    int st = fg_simple(FG_EVENT_QUERY, 0, a->id, 0, &ra);
    if (st == 0)
        st = fg_simple(FG_EVENT_QUERY, 0, b->id, 0, &rb);
    if (st == 0)
        *ms = (float)((double)(int64_t)(rb.v0 - ra.v0) / 1e6);
    return status_of(st);
}

FG_EXPORT const char *hipGetErrorString(hipError_t e) { return e == 0 ? "hipSuccess" : "fakegpu error"; }

API hipGetProcAddress(const char *symbol, void **pfn, int version, uint64_t flags, int *status);

#define P(name) {#name, (void *)name}
static const struct { const char *name; void *fn; } g_procs[] = {
    P(hipInit), P(hipGetDeviceCount), P(hipGetDevice), P(hipSetDevice), P(hipDeviceSynchronize),
    P(hipStreamCreate), P(hipStreamDestroy), P(hipStreamSynchronize), P(hipModuleLoadData),
    P(hipStreamIsCapturing), P(hipStreamGetDevice), P(hipThreadExchangeStreamCaptureMode),
    P(hipModuleGetFunction), P(hipLaunchKernel), P(hipLaunchKernel_spt), P(hipModuleLaunchKernel),
    P(hipExtModuleLaunchKernel), P(hipLaunchCooperativeKernel), P(hipMalloc), P(hipFree),
    P(hipMemcpy), P(hipMemcpy_spt), P(hipMemcpyAsync), P(hipMemcpyHtoD), P(hipMemcpyDtoH),
    P(hipMemcpyHtoDAsync), P(hipMemset), P(hipMemsetAsync), P(hipMemsetD8), P(hipEventCreate),
    P(hipEventRecord), P(hipEventSynchronize), P(hipEventElapsedTime), P(hipEventDestroy),
    P(hipGetProcAddress),
};
#undef P

API hipGetProcAddress(const char *symbol, void **pfn, int version, uint64_t flags, int *status)
{
    (void)version, (void)flags;
    *pfn = NULL;
    for (size_t i = 0; i < sizeof(g_procs) / sizeof(*g_procs); i++)
        if (strcmp(g_procs[i].name, symbol) == 0)
            *pfn = g_procs[i].fn;
    if (status)
        *status = *pfn ? 0 : 1;
    return *pfn ? hipSuccess : hipErrorNotFound;
}
