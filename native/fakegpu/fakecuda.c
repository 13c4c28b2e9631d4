/* fake libcuda.so.1: the CUDA driver API on top of the fakegpu server.
 *
 * Kernels: cuModuleGetFunction(&f, mod, "spin_us_1000") is a 1000 us kernel;
 * "spin_ns_N" N ns; "spin_param" takes its duration (uint64 ns) from the first
 * kernel parameter; "poison" poisons its context (sticky CUDA_ERROR_LAUNCH_FAILED).
 * Device memory is host memory (copies are real); transfers cost device time.
 * Built with -Bsymbolic so cuGetProcAddress returns this library's own entry
 * points, as the real driver does, even with an interposer preloaded.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "client.h"
#include "interpose/cutypes.h"

#define CTX_MAGIC 0x43545846u
#define CU_STREAM_LEGACY_H ((CUstream)0x1)
#define CU_STREAM_PER_THREAD_H ((CUstream)0x2)
#define MAX_STACK 16
#define MAX_DEV 16

#define STREAM_MAGIC 0x53545846u
struct CUctx_st { uint32_t magic; uint32_t id; int dev; int refs; };
struct fg_kernel { uint64_t dur_ns; uint32_t flags; };
struct fg_graph { size_t n, cap; struct fg_kernel *k; }; /* CUgraph and CUgraphExec */
/* A stream; while capturing, its submissions are recorded, not run (stream capture). */
struct CUstream_st { uint32_t magic; CUcontext ctx; int capturing, invalidated; struct fg_graph *g; };
struct CUfunc_st { uint64_t dur_ns; uint32_t flags; };
struct CUevent_st { uint32_t id; };
struct CUmod_st { int unused; };
typedef struct CUevent_st *CUevent;
typedef struct CUmod_st *CUmodule;
typedef struct { unsigned gx, gy, gz, bx, by, bz, shmem; CUstream stream; } fake_launch_config;

static int g_ndev = -1;
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static CUcontext g_primary[MAX_DEV];
static __thread CUcontext t_stack[MAX_STACK];
static __thread int t_depth;

#define API FG_EXPORT CUresult

static CUresult status_of(int st) { return st < 0 ? CUDA_ERROR_NOT_INITIALIZED : st; }
static int capture_unsafe_call(void);

API cuInit(unsigned int flags)
{
    (void)flags;
    struct fg_rep r;
    if (g_ndev >= 0)
        return CUDA_SUCCESS;
    if (fg_simple(FG_HELLO, 0, 0, 0, &r) != 0)
        return CUDA_ERROR_NO_DEVICE;
    g_ndev = (int)r.v0;
    return CUDA_SUCCESS;
}

API cuDriverGetVersion(int *v) { *v = 13000; return CUDA_SUCCESS; }

/* cuCheckpointProcessLock/Unlock/GetState: the server blocks the process's calls. */
typedef struct {
    unsigned int timeoutMs, reserved0;
    unsigned long long reserved1[7];
} fg_lock_args;

API cuCheckpointProcessLock(int pid, fg_lock_args *args)
{
    struct fg_rep r;
    int st = fg_simple(FG_PROC_LOCK, 0, (uint64_t)pid, args ? args->timeoutMs : 0, &r);
    return st != 0 ? status_of(st) : (CUresult)r.status;
}

API cuCheckpointProcessGetState(int pid, int *state)
{
    struct fg_rep r;
    int st = fg_simple(FG_PROC_STATE, 0, (uint64_t)pid, 0, &r);
    if (st == 0)
        *state = (int)r.v0; /* CU_PROCESS_STATE_RUNNING 0, LOCKED 1 */
    return status_of(st);
}

API cuCheckpointProcessUnlock(int pid, void *args)
{
    (void)args;
    struct fg_rep r;
    int st = fg_simple(FG_PROC_UNLOCK, 0, (uint64_t)pid, 0, &r);
    return st != 0 ? status_of(st) : (CUresult)r.status;
}
API cuDeviceGetCount(int *n) { *n = g_ndev < 0 ? 0 : g_ndev; return g_ndev < 0 ? CUDA_ERROR_NOT_INITIALIZED : 0; }

API cuDeviceGet(CUdevice *d, int ordinal)
{
    if (g_ndev < 0)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (ordinal < 0 || ordinal >= g_ndev)
        return CUDA_ERROR_INVALID_DEVICE;
    *d = ordinal;
    return CUDA_SUCCESS;
}

API cuDeviceGetName(char *name, int len, CUdevice d)
{
    if (len > 0) {
        strncpy(name, "krex fakegpu", (size_t)len);
        name[len - 1] = 0;
    }
    return d >= 0 && d < g_ndev ? CUDA_SUCCESS : CUDA_ERROR_INVALID_DEVICE;
}

API cuDeviceGetAttribute(int *v, int attrib, CUdevice d)
{
    static const int values[] = {[1] = 1024, [2] = 1024, [3] = 1024, [4] = 64, [5] = 2147483647,
                                 [6] = 65535, [7] = 65535, [8] = 49152, [10] = 32, [16] = 132,
                                 [75] = 9, [76] = 0};
    *v = (attrib >= 0 && attrib < (int)(sizeof(values) / sizeof(*values))) ? values[attrib] : 0;
    return d >= 0 && d < g_ndev ? CUDA_SUCCESS : CUDA_ERROR_INVALID_DEVICE;
}

API cuDeviceTotalMem_v2(size_t *bytes, CUdevice d) { (void)d; *bytes = 80ull << 30; return 0; }
/* Device memory of this process (fakegpu keeps allocations in the process): counted so
 * cuMemGetInfo reports real use, and capped by KREX_DEVICE_MEMORY_CAP_MB when set. */
static _Atomic size_t g_mem_used;
#define FG_TOTAL_MEM (80ull << 30)

static size_t mem_cap(void)
{
    const char *cap = getenv("KREX_DEVICE_MEMORY_CAP_MB");
    size_t mb = cap ? (size_t)strtoull(cap, NULL, 10) : 0;
    return mb ? mb << 20 : FG_TOTAL_MEM;
}

API cuMemGetInfo_v2(size_t *free_b, size_t *total)
{
    size_t cap = mem_cap(), used = atomic_load(&g_mem_used);
    *total = cap;
    *free_b = used < cap ? cap - used : 0;
    return 0;
}

static CUresult create_ctx(CUcontext *out, CUdevice dev)
{
    struct fg_rep r;
    int st = fg_simple(FG_CTX_CREATE, 0, (uint64_t)dev, 0, &r);
    if (st != 0)
        return status_of(st);
    CUcontext c = calloc(1, sizeof(*c));
    *c = (struct CUctx_st){CTX_MAGIC, (uint32_t)r.v0, dev, 1};
    *out = c;
    return CUDA_SUCCESS;
}

static CUcontext current(void) { return t_depth ? t_stack[t_depth - 1] : NULL; }

static void push(CUcontext c)
{
    if (t_depth < MAX_STACK)
        t_stack[t_depth++] = c;
}

API cuCtxCreate_v2(CUcontext *pctx, unsigned int flags, CUdevice dev)
{
    (void)flags;
    CUresult st = create_ctx(pctx, dev);
    if (st == CUDA_SUCCESS)
        push(*pctx);
    return st;
}

API cuCtxCreate_v3(CUcontext *pctx, void *params, int n, unsigned int flags, CUdevice dev)
{
    (void)params, (void)n;
    return cuCtxCreate_v2(pctx, flags, dev);
}

API cuCtxCreate_v4(CUcontext *pctx, void *params, unsigned int flags, CUdevice dev)
{
    (void)params;
    return cuCtxCreate_v2(pctx, flags, dev);
}

API cuCtxDestroy_v2(CUcontext c)
{
    if (!c || c->magic != CTX_MAGIC)
        return CUDA_ERROR_INVALID_CONTEXT;
    fg_simple(FG_CTX_DESTROY, c->id, 0, 0, NULL);
    for (int i = 0; i < t_depth; i++)
        if (t_stack[i] == c)
            t_stack[i] = NULL;
    c->magic = 0;
    return CUDA_SUCCESS;
}

API cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev)
{
    if (dev < 0 || dev >= MAX_DEV || dev >= g_ndev)
        return CUDA_ERROR_INVALID_DEVICE;
    CUresult st = CUDA_SUCCESS;
    pthread_mutex_lock(&g_mu);
    if (!g_primary[dev])
        st = create_ctx(&g_primary[dev], dev);
    else
        g_primary[dev]->refs++;
    *pctx = g_primary[dev];
    pthread_mutex_unlock(&g_mu);
    return st;
}

API cuDevicePrimaryCtxRelease_v2(CUdevice dev) { (void)dev; return CUDA_SUCCESS; }
API cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int *flags, int *active)
{
    *flags = 0;
    *active = dev >= 0 && dev < MAX_DEV && g_primary[dev] != NULL;
    return CUDA_SUCCESS;
}
API cuDevicePrimaryCtxSetFlags_v2(CUdevice dev, unsigned int flags) { (void)dev, (void)flags; return 0; }

API cuCtxSetCurrent(CUcontext c)
{
    if (t_depth == 0)
        push(c);
    else
        t_stack[t_depth - 1] = c;
    return CUDA_SUCCESS;
}

API cuCtxGetCurrent(CUcontext *c) { *c = current(); return CUDA_SUCCESS; }
API cuCtxPushCurrent_v2(CUcontext c) { push(c); return CUDA_SUCCESS; }

API cuCtxPopCurrent_v2(CUcontext *c)
{
    if (t_depth == 0)
        return CUDA_ERROR_INVALID_CONTEXT;
    CUcontext top = t_stack[--t_depth];
    if (c)
        *c = top;
    return CUDA_SUCCESS;
}

API cuCtxGetDevice(CUdevice *d)
{
    CUcontext c = current();
    if (!c)
        return CUDA_ERROR_INVALID_CONTEXT;
    *d = c->dev;
    return CUDA_SUCCESS;
}

static CUresult sync_ctx(CUcontext c)
{
    if (!c || c->magic != CTX_MAGIC)
        return CUDA_ERROR_INVALID_CONTEXT;
    return status_of(fg_simple(FG_SYNC, c->id, 0, 0, NULL));
}

API cuCtxSynchronize(void)
{
    if (capture_unsafe_call()) /* a context-wide sync during a capture breaks the capture */
        return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    return sync_ctx(current());
}

/* The context a stream belongs to (legacy / per-thread / NULL: the current one). */
static int explicit_stream(CUstream s)
{
    return s && s != CU_STREAM_LEGACY_H && s != CU_STREAM_PER_THREAD_H;
}

static CUcontext ctx_of(CUstream s)
{
    if (!explicit_stream(s))
        return current();
    return s->magic == STREAM_MAGIC ? s->ctx : NULL;
}

#include "fakecuda_capture.h"

API cuStreamCreate(CUstream *s, unsigned int flags)
{
    (void)flags;
    if (!current())
        return CUDA_ERROR_INVALID_CONTEXT;
    *s = calloc(1, sizeof(**s));
    (*s)->magic = STREAM_MAGIC;
    (*s)->ctx = current();
    return CUDA_SUCCESS;
}

API cuStreamCreateWithPriority(CUstream *s, unsigned int flags, int prio) { (void)prio; return cuStreamCreate(s, flags); }
API cuStreamSynchronize(CUstream s) { return sync_stream(s); }
API cuStreamSynchronize_ptsz(CUstream s) { return sync_stream(s); }
API cuStreamQuery(CUstream s) { return sync_stream(s); }
API cuStreamDestroy_v2(CUstream s)
{
    if (!explicit_stream(s) || s->magic != STREAM_MAGIC)
        return CUDA_ERROR_INVALID_HANDLE;
    s->magic = 0; /* kept, not freed: a stale handle is detected, as the driver does */
    return CUDA_SUCCESS;
}

API cuModuleLoadData(CUmodule *m, const void *image) { (void)image; *m = calloc(1, sizeof(**m)); return 0; }
API cuModuleLoadDataEx(CUmodule *m, const void *image, unsigned n, void *o, void **v)
{
    (void)n, (void)o, (void)v;
    return cuModuleLoadData(m, image);
}
API cuModuleLoad(CUmodule *m, const char *path) { return cuModuleLoadData(m, path); }
API cuModuleUnload(CUmodule m) { free(m); return CUDA_SUCCESS; }

API cuModuleGetFunction(CUfunction *f, CUmodule m, const char *name)
{
    if (!m || !name)
        return CUDA_ERROR_INVALID_VALUE;
    *f = calloc(1, sizeof(**f));
    fg_parse_kernel(name, &(*f)->dur_ns, &(*f)->flags);
    if ((*f)->dur_ns == 0 && !(*f)->flags)
        (*f)->flags = FG_SPIN_PARAM;
    return CUDA_SUCCESS;
}

static CUresult launch(CUfunction f, CUstream s, void **params)
{
    CUcontext c = ctx_of(s);
    if (!c || c->magic != CTX_MAGIC)
        return CUDA_ERROR_INVALID_CONTEXT;
    if (!f)
        return CUDA_ERROR_INVALID_HANDLE;
    uint64_t dur = f->dur_ns;
    if ((f->flags & FG_SPIN_PARAM) && params && params[0])
        dur = *(uint64_t *)params[0];
    if (explicit_stream(s) && s->capturing)
        return capture(s, dur, f->flags & FG_POISON);
    return status_of(fg_simple(FG_LAUNCH, c->id, dur, f->flags & FG_POISON, NULL));
}

#define LAUNCH_PARAMS CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, \
    unsigned by, unsigned bz, unsigned shmem, CUstream s, void **params, void **extra
API cuLaunchKernel(LAUNCH_PARAMS) { (void)gx, (void)gy, (void)gz, (void)bx, (void)by, (void)bz, (void)shmem, (void)extra; return launch(f, s, params); }
API cuLaunchKernel_ptsz(LAUNCH_PARAMS) { (void)gx, (void)gy, (void)gz, (void)bx, (void)by, (void)bz, (void)shmem, (void)extra; return launch(f, s, params); }
API cuLaunchKernelEx(const fake_launch_config *cfg, CUfunction f, void **params, void **extra) { (void)extra; return launch(f, cfg->stream, params); }
API cuLaunchKernelEx_ptsz(const fake_launch_config *cfg, CUfunction f, void **params, void **extra) { (void)extra; return launch(f, cfg->stream, params); }

static CUresult host_func(CUstream s, CUhostFn fn, void *data)
{
    CUresult st = sync_ctx(ctx_of(s));
    if (st == CUDA_SUCCESS)
        fn(data);
    return st;
}
API cuLaunchHostFunc(CUstream s, CUhostFn fn, void *data) { return host_func(s, fn, data); }
API cuLaunchHostFunc_ptsz(CUstream s, CUhostFn fn, void *data) { return host_func(s, fn, data); }

/* Each allocation carries its size in a 256-byte header (keeps 256-byte alignment). */
API cuMemAlloc_v2(CUdeviceptr *p, size_t n)
{
    size_t used = atomic_fetch_add(&g_mem_used, n);
    if (used + n > mem_cap()) {
        atomic_fetch_sub(&g_mem_used, n);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    void *mem = NULL;
    if (posix_memalign(&mem, 256, n + 256) != 0) {
        atomic_fetch_sub(&g_mem_used, n);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *(size_t *)mem = n;
    *p = (CUdeviceptr)(uintptr_t)((char *)mem + 256);
    return CUDA_SUCCESS;
}
API cuMemFree_v2(CUdeviceptr p)
{
    if (!p)
        return CUDA_SUCCESS;
    char *mem = (char *)(uintptr_t)p - 256;
    atomic_fetch_sub(&g_mem_used, *(size_t *)mem);
    free(mem);
    return CUDA_SUCCESS;
}

/* A transfer: copy now, charge device time in order; sync variants wait. */
static CUresult transfer(void *dst, const void *src, int byte, size_t n, CUstream s, int wait)
{
    CUcontext c = ctx_of(s);
    if (!c || c->magic != CTX_MAGIC)
        return CUDA_ERROR_INVALID_CONTEXT;
    if (src)
        memmove(dst, src, n);
    else
        memset(dst, byte, n);
    int st = fg_simple(FG_LAUNCH, c->id, fg_copy_ns(n), FG_COPY, NULL);
    if (st == 0 && wait)
        st = fg_simple(FG_SYNC, c->id, 0, 0, NULL);
    return status_of(st);
}

#define DP(p) ((void *)(uintptr_t)(p))
#define COPY_VARIANTS(name, params, dst, src, n, s, wait) \
    API name params { return transfer(dst, src, 0, n, s, wait); }
COPY_VARIANTS(cuMemcpyHtoD_v2, (CUdeviceptr d, const void *h, size_t n), DP(d), h, n, NULL, 1)
COPY_VARIANTS(cuMemcpyHtoD_v2_ptds, (CUdeviceptr d, const void *h, size_t n), DP(d), h, n, NULL, 1)
COPY_VARIANTS(cuMemcpyDtoH_v2, (void *h, CUdeviceptr d, size_t n), h, DP(d), n, NULL, 1)
COPY_VARIANTS(cuMemcpyDtoH_v2_ptds, (void *h, CUdeviceptr d, size_t n), h, DP(d), n, NULL, 1)
COPY_VARIANTS(cuMemcpyDtoD_v2, (CUdeviceptr a, CUdeviceptr b, size_t n), DP(a), DP(b), n, NULL, 1)
COPY_VARIANTS(cuMemcpyDtoD_v2_ptds, (CUdeviceptr a, CUdeviceptr b, size_t n), DP(a), DP(b), n, NULL, 1)
COPY_VARIANTS(cuMemcpy, (CUdeviceptr a, CUdeviceptr b, size_t n), DP(a), DP(b), n, NULL, 1)
COPY_VARIANTS(cuMemcpy_ptds, (CUdeviceptr a, CUdeviceptr b, size_t n), DP(a), DP(b), n, NULL, 1)
COPY_VARIANTS(cuMemcpyHtoDAsync_v2, (CUdeviceptr d, const void *h, size_t n, CUstream s), DP(d), h, n, s, 0)
COPY_VARIANTS(cuMemcpyHtoDAsync_v2_ptsz, (CUdeviceptr d, const void *h, size_t n, CUstream s), DP(d), h, n, s, 0)
COPY_VARIANTS(cuMemcpyDtoHAsync_v2, (void *h, CUdeviceptr d, size_t n, CUstream s), h, DP(d), n, s, 0)
COPY_VARIANTS(cuMemcpyDtoHAsync_v2_ptsz, (void *h, CUdeviceptr d, size_t n, CUstream s), h, DP(d), n, s, 0)
COPY_VARIANTS(cuMemcpyDtoDAsync_v2, (CUdeviceptr a, CUdeviceptr b, size_t n, CUstream s), DP(a), DP(b), n, s, 0)
COPY_VARIANTS(cuMemcpyDtoDAsync_v2_ptsz, (CUdeviceptr a, CUdeviceptr b, size_t n, CUstream s), DP(a), DP(b), n, s, 0)
COPY_VARIANTS(cuMemcpyAsync, (CUdeviceptr a, CUdeviceptr b, size_t n, CUstream s), DP(a), DP(b), n, s, 0)
COPY_VARIANTS(cuMemcpyAsync_ptsz, (CUdeviceptr a, CUdeviceptr b, size_t n, CUstream s), DP(a), DP(b), n, s, 0)

API cuMemsetD8_v2(CUdeviceptr d, unsigned char v, size_t n) { return transfer(DP(d), NULL, v, n, NULL, 1); }
API cuMemsetD8_v2_ptds(CUdeviceptr d, unsigned char v, size_t n) { return transfer(DP(d), NULL, v, n, NULL, 1); }
API cuMemsetD8Async(CUdeviceptr d, unsigned char v, size_t n, CUstream s) { return transfer(DP(d), NULL, v, n, s, 0); }
API cuMemsetD8Async_ptsz(CUdeviceptr d, unsigned char v, size_t n, CUstream s) { return transfer(DP(d), NULL, v, n, s, 0); }

static CUresult memset32(CUdeviceptr d, unsigned v, size_t n, CUstream s, int wait)
{
    uint32_t *p = DP(d);
    for (size_t i = 0; i < n; i++)
        p[i] = v;
    return transfer(p, p, 0, n * 4, s, wait);
}
API cuMemsetD32_v2(CUdeviceptr d, unsigned v, size_t n) { return memset32(d, v, n, NULL, 1); }
API cuMemsetD32_v2_ptds(CUdeviceptr d, unsigned v, size_t n) { return memset32(d, v, n, NULL, 1); }
API cuMemsetD32Async(CUdeviceptr d, unsigned v, size_t n, CUstream s) { return memset32(d, v, n, s, 0); }
API cuMemsetD32Async_ptsz(CUdeviceptr d, unsigned v, size_t n, CUstream s) { return memset32(d, v, n, s, 0); }

API cuEventCreate(CUevent *e, unsigned int flags)
{
    (void)flags;
    struct fg_rep r;
    int st = fg_simple(FG_EVENT_CREATE, 0, 0, 0, &r);
    if (st != 0)
        return status_of(st);
    *e = calloc(1, sizeof(**e));
    (*e)->id = (uint32_t)r.v0;
    return CUDA_SUCCESS;
}

static CUresult record(CUevent e, CUstream s)
{
    CUcontext c = ctx_of(s);
    if (!c || !e)
        return CUDA_ERROR_INVALID_HANDLE;
    return status_of(fg_simple(FG_EVENT_RECORD, c->id, e->id, 0, NULL));
}
API cuEventRecord(CUevent e, CUstream s) { return record(e, s); }
API cuEventRecord_ptsz(CUevent e, CUstream s) { return record(e, s); }
API cuEventRecordWithFlags(CUevent e, CUstream s, unsigned f) { (void)f; return record(e, s); }
API cuEventSynchronize(CUevent e) { return status_of(fg_simple(FG_EVENT_SYNC, 0, e->id, 0, NULL)); }
API cuEventQuery(CUevent e) { return status_of(fg_simple(FG_EVENT_QUERY, 0, e->id, 0, NULL)); }
API cuEventDestroy_v2(CUevent e) { free(e); return CUDA_SUCCESS; }

static CUresult elapsed(float *ms, CUevent a, CUevent b)
{
    struct fg_rep ra, rb;
    int st = fg_simple(FG_EVENT_QUERY, 0, a->id, 0, &ra);
    if (st == 0)
        st = fg_simple(FG_EVENT_QUERY, 0, b->id, 0, &rb);
    if (st != 0)
        return status_of(st);
    *ms = (float)((double)((int64_t)(rb.v0 - ra.v0)) / 1e6);
    return CUDA_SUCCESS;
}
API cuEventElapsedTime(float *ms, CUevent a, CUevent b) { return elapsed(ms, a, b); }
API cuEventElapsedTime_v2(float *ms, CUevent a, CUevent b) { return elapsed(ms, a, b); }

API cuGetErrorString(CUresult e, const char **s)
{
    *s = e == 0 ? "no error" : e == CUDA_ERROR_LAUNCH_FAILED ? "unspecified launch failure" : "fakegpu error";
    return CUDA_SUCCESS;
}
API cuGetErrorName(CUresult e, const char **s)
{
    *s = e == 0 ? "CUDA_SUCCESS" : e == CUDA_ERROR_LAUNCH_FAILED ? "CUDA_ERROR_LAUNCH_FAILED" : "CUDA_ERROR_UNKNOWN";
    return CUDA_SUCCESS;
}

#include "fakecuda_procs.h"
