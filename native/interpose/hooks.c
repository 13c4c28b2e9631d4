/* Hooked symbols: one registry table, one call-through macro per kind, and the
 * resolution hooks (dlsym, cuGetProcAddress[_v2], hipGetProcAddress).
 *
 * Every hooked ABI variant (cuMemcpyHtoD, cuMemcpyHtoD_v2, cuMemcpyHtoD_v2_ptds,
 * ...) has its own wrappers, one per resolution path, so a caller always gets
 * a wrapper with exactly the ABI of the variant it asked for.  Which variant
 * that is comes from the name (dlsym) or from the name, version and flags
 * (GetProcAddress, tables generated from the headers), never from the address
 * the driver returned: the real driver hands out internal pointers.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <link.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "cutypes.h"
#include "gate.h"
#include "track.h"

#define KREX_EXPORT __attribute__((visibility("default")))
#define KREX_UNPAREN(...) __VA_ARGS__
#define KREX_UNLIKELY(x) __builtin_expect(!!(x), 0)
#define PER_THREAD_FLAG 2 /* CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM (HIP: the same bit) */

enum krex_hook_id {
#define HOOK(name, params, args, stream, pt) K_##name,
#define TRACK(name, params, args, kind, obj) K_##name,
#include "cuda_hooks.def"
#include "cuda_track.def"
#include "hip_hooks.def"
#include "hip_track.def"
#undef HOOK
#undef TRACK
    K_cuGetProcAddress,
    K_cuGetProcAddress_v2,
    K_hipGetProcAddress,
};
#define K_COUNT (K_hipGetProcAddress + 1)

enum krex_hook_kind { KIND_SUBMIT, KIND_TRACK, KIND_RESOLVER };

struct krex_hook {
    const char *name;
    void *wrap[KREX_NPATHS]; /* direct (exported), via dlsym, via GetProcAddress */
    int api;
    int kind;
};

struct krex_proc { const char *base; int idx; int since; int pt; };

static _Atomic(void *) g_real[K_COUNT];
static const struct krex_hook g_hooks[K_COUNT];

typedef void *(*dlsym_fn)(void *, const char *);
static _Atomic(dlsym_fn) g_real_dlsym;

/* The real dlsym, found without calling dlsym (no recursion). */
static dlsym_fn real_dlsym(void)
{
    dlsym_fn f = atomic_load_explicit(&g_real_dlsym, memory_order_acquire);
    if (f)
        return f;
    static const char *versions[] = {"GLIBC_2.34", "GLIBC_2.2.5", "GLIBC_2.17", "GLIBC_2.0"};
    for (size_t i = 0; !f && i < sizeof(versions) / sizeof(*versions); i++)
        f = (dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", versions[i]);
    atomic_store(&g_real_dlsym, f);
    return f;
}

static int is_ours(void *ptr)
{
    static char anchor;
    Dl_info mine, theirs;
    return dladdr((void *)&anchor, &mine) && dladdr(ptr, &theirs) &&
           mine.dli_fbase == theirs.dli_fbase;
}

/* -- the driver library, wherever it was loaded (RTLD_LOCAL included) ------------------ */

static const char *const g_driver_names[2] = {"libcuda.so", "libamdhip64.so"};
static _Atomic(void *) g_driver[2];

struct find_lib { const char *prefix; const char *path; };

static int find_loaded(struct dl_phdr_info *info, size_t size, void *arg)
{
    (void)size;
    struct find_lib *f = arg;
    const char *base = info->dlpi_name ? strrchr(info->dlpi_name, '/') : NULL;
    base = base ? base + 1 : info->dlpi_name;
    if (base && strncmp(base, f->prefix, strlen(f->prefix)) == 0 && !is_ours((void *)info->dlpi_addr)) {
        f->path = info->dlpi_name;
        return 1;
    }
    return 0;
}

/* A handle on the loaded driver library of `api` (searched by name among every
 * loaded object: dlsym(RTLD_NEXT) sees only the global scope), or NULL. */
static void *driver_handle(int api)
{
    void *h = atomic_load(&g_driver[api]);
    if (h)
        return h;
    struct find_lib f = {g_driver_names[api], NULL};
    dl_iterate_phdr(find_loaded, &f);
    if (f.path && (h = dlopen(f.path, RTLD_LAZY | RTLD_NOLOAD)) != NULL)
        atomic_store(&g_driver[api], h);
    return h;
}

/* The library that defines ptr (a no-load dlopen handle), else the driver's. */
static void *library_of(int api, void *ptr)
{
    Dl_info info;
    void *h = NULL;
    if (dladdr(ptr, &info) && info.dli_fname && !is_ours(ptr))
        h = dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
    return h ? h : driver_handle(api);
}

/* Give the drain the driver's own synchronisation calls (never our wrappers). */
static void bind_driver(int api, void *real)
{
    static _Atomic int tried[2];
    int expected = 0;
    dlsym_fn sym = real_dlsym();
    void *lib = library_of(api, real);
    if (!lib || !atomic_compare_exchange_strong(&tried[api], &expected, 1))
        return;
    if (api == KREX_API_CUDA) {
        struct krex_cuda_calls c = {
            sym(lib, "cuCtxGetCurrent"), sym(lib, "cuCtxPushCurrent_v2"),
            sym(lib, "cuCtxPopCurrent_v2"), sym(lib, "cuCtxSynchronize"),
            sym(lib, "cuStreamSynchronize"), sym(lib, "cuStreamIsCapturing"),
            sym(lib, "cuStreamGetCtx"), sym(lib, "cuThreadExchangeStreamCaptureMode")};
        if (c.ctx_get_current && c.ctx_push && c.ctx_pop && c.ctx_synchronize &&
            c.stream_synchronize && c.stream_is_capturing)
            krex_track_bind_cuda(&c);
        return;
    }
    struct krex_hip_calls c = {
        sym(lib, "hipGetDevice"), sym(lib, "hipSetDevice"), sym(lib, "hipDeviceSynchronize"),
        sym(lib, "hipStreamSynchronize"), sym(lib, "hipStreamIsCapturing"),
        sym(lib, "hipStreamGetDevice"), sym(lib, "hipThreadExchangeStreamCaptureMode")};
    if (c.get_device && c.set_device && c.device_synchronize && c.stream_synchronize &&
        c.stream_is_capturing)
        krex_track_bind_hip(&c);
}

static void set_real(int idx, void *real)
{
    void *expected = NULL;
    atomic_compare_exchange_strong(&g_real[idx], &expected, real);
    bind_driver(g_hooks[idx].api, real);
}

/* The real entry point for a directly linked call: the next definition after us
 * in the global scope, else the driver library's own (a caller loaded RTLD_LOCAL). */
static void *real_of(int idx)
{
    void *r = atomic_load_explicit(&g_real[idx], memory_order_acquire);
    if (__builtin_expect(r != NULL, 1))
        return r;
    dlsym_fn sym = real_dlsym();
    void *lib;
    if (sym && (r = sym(RTLD_NEXT, g_hooks[idx].name)) == NULL &&
        (lib = driver_handle(g_hooks[idx].api)) != NULL)
        r = sym(lib, g_hooks[idx].name);
    if (r && !is_ours(r))
        set_real(idx, r);
    return atomic_load(&g_real[idx]);
}

/* -- wrappers ------------------------------------------------------------------------------ */

/* The stream of a launch configuration (CUlaunchConfig, HIP_LAUNCH_CONFIG). */
static inline void *krex_config_stream(const void *config)
{
    return config ? ((const struct krex_launch_config_prefix *)config)->hStream : NULL;
}

#define KREX_SUBMIT_BODY(rtype, api, path, idx, fn_t, args, stream, pt, notfound) \
    do {                                                                         \
        fn_t real_ = (fn_t)real_of(idx);                                         \
        if (KREX_UNLIKELY(!real_))                                               \
            return notfound;                                                     \
        struct krex_gate_proc *p_ = krex_gate_enter();                           \
        krex_count_path(path);                                                   \
        if (p_)                                                                  \
            krex_track(api, (void *)(stream), pt);                               \
        rtype r_ = real_ args;                                                   \
        krex_gate_exit(p_);                                                      \
        return r_;                                                               \
    } while (0)

/* Tracking calls: what happens to a stream or context, around the real call. */
#define KREX_TB_STREAM_DESTROY(api, obj, call) \
    do { krex_track_forget_stream(api, (void *)(obj)); return call; } while (0)
#define KREX_TB_CTX_DESTROY(api, obj, call) \
    do { krex_track_forget_ctx((void *)(obj)); return call; } while (0)
#define KREX_TB_CAPTURE_BEGIN(api, obj, call)                    \
    do { /* gated: no capture begins while a drain is under way */ \
        struct krex_gate_proc *p_ = krex_gate_enter();           \
        int r_ = call;                                           \
        if (r_ == 0)                                             \
            krex_track_capture(1);                               \
        krex_gate_exit(p_);                                      \
        return r_;                                               \
    } while (0)
#define KREX_TB_CAPTURE_END(api, obj, call)                       \
    do {                                                          \
        int r_ = call;                                            \
        if (r_ != KREX_ERR_ILLEGAL_STATE && r_ != KREX_ERR_INVALID_VALUE) \
            krex_track_capture(-1);                               \
        return r_;                                                \
    } while (0)

#define KREX_PATH_WRAPPERS(rtype, name, params, args)                                         \
    KREX_EXPORT rtype name params { return krex_do_##name(KREX_PATH_DIRECT, KREX_UNPAREN args); } \
    static rtype krex_dl_##name params { return krex_do_##name(KREX_PATH_DLSYM, KREX_UNPAREN args); } \
    static rtype krex_gp_##name params { return krex_do_##name(KREX_PATH_GETPROC, KREX_UNPAREN args); }

#define KREX_SUBMIT(rtype, api, notfound, name, params, args, stream, pt)                   \
    typedef rtype (*name##_fn) params;                                                      \
    static rtype krex_do_##name(int path, KREX_UNPAREN params)                              \
    {                                                                                       \
        KREX_SUBMIT_BODY(rtype, api, path, K_##name, name##_fn, args, stream, pt, notfound); \
    }                                                                                       \
    KREX_PATH_WRAPPERS(rtype, name, params, args)

#define KREX_TRACK(rtype, api, notfound, name, params, args, kind, obj) \
    typedef rtype (*name##_fn) params;                                  \
    static rtype krex_do_##name(int path, KREX_UNPAREN params)          \
    {                                                                   \
        (void)path;                                                     \
        name##_fn real_ = (name##_fn)real_of(K_##name);                 \
        if (KREX_UNLIKELY(!real_))                                      \
            return notfound;                                            \
        KREX_TB_##kind(api, obj, real_ args);                           \
    }                                                                   \
    KREX_PATH_WRAPPERS(rtype, name, params, args)

#define HOOK(name, params, args, stream, pt) \
    KREX_SUBMIT(CUresult, KREX_API_CUDA, CUDA_ERROR_NOT_FOUND, name, params, args, stream, pt)
#define TRACK(name, params, args, kind, obj) \
    KREX_TRACK(CUresult, KREX_API_CUDA, CUDA_ERROR_NOT_FOUND, name, params, args, kind, obj)
#include "cuda_hooks.def"
#include "cuda_track.def"
#undef HOOK
#undef TRACK
#define HOOK(name, params, args, stream, pt) \
    KREX_SUBMIT(hipError_t, KREX_API_HIP, hipErrorNotFound, name, params, args, stream, pt)
#define TRACK(name, params, args, kind, obj) \
    KREX_TRACK(hipError_t, KREX_API_HIP, hipErrorNotFound, name, params, args, kind, obj)
#include "hip_hooks.def"
#include "hip_track.def"
#undef HOOK
#undef TRACK

KREX_EXPORT CUresult cuGetProcAddress(const char *, void **, int, cuuint64_t);
KREX_EXPORT CUresult cuGetProcAddress_v2(const char *, void **, int, cuuint64_t,
                                         CUdriverProcAddressQueryResult *);
KREX_EXPORT hipError_t hipGetProcAddress(const char *, void **, int, uint64_t,
                                         hipDriverProcAddressQueryResult *);

/* The registry: every hooked symbol, its wrappers, its API. */
static const struct krex_hook g_hooks[K_COUNT] = {
#define ENTRY(name, api, kind) \
    [K_##name] = {#name, {(void *)name, (void *)krex_dl_##name, (void *)krex_gp_##name}, api, kind},
#define HOOK(name, params, args, stream, pt) ENTRY(name, KREX_API_CUDA, KIND_SUBMIT)
#define TRACK(name, params, args, kind, obj) ENTRY(name, KREX_API_CUDA, KIND_TRACK)
#include "cuda_hooks.def"
#include "cuda_track.def"
#undef HOOK
#undef TRACK
#define HOOK(name, params, args, stream, pt) ENTRY(name, KREX_API_HIP, KIND_SUBMIT)
#define TRACK(name, params, args, kind, obj) ENTRY(name, KREX_API_HIP, KIND_TRACK)
#include "hip_hooks.def"
#include "hip_track.def"
#undef HOOK
#undef TRACK
#undef ENTRY
#define RESOLVER(name, api) [K_##name] = {#name, {(void *)name, (void *)name, (void *)name}, api, KIND_RESOLVER}
    RESOLVER(cuGetProcAddress, KREX_API_CUDA),
    RESOLVER(cuGetProcAddress_v2, KREX_API_CUDA),
    RESOLVER(hipGetProcAddress, KREX_API_HIP),
#undef RESOLVER
};

#define PROC(base, variant, since, pt) {#base, K_##variant, since, pt},
static const struct krex_proc g_cuda_procs[] = {
#include "cuda_procs.def"
};
static const struct krex_proc g_hip_procs[] = {
#include "hip_procs.def"
};
#undef PROC


/* -- name lookup ---------------------------------------------------------------------- */

static int g_sorted[K_COUNT];
static pthread_once_t g_sorted_once = PTHREAD_ONCE_INIT;

static int by_name(const void *a, const void *b)
{
    return strcmp(g_hooks[*(const int *)a].name, g_hooks[*(const int *)b].name);
}

static void sort_names(void)
{
    for (int i = 0; i < K_COUNT; i++)
        g_sorted[i] = i;
    qsort(g_sorted, K_COUNT, sizeof(int), by_name);
}

/* The hook of exactly this exported name, or -1. */
static int lookup(const char *name)
{
    pthread_once(&g_sorted_once, sort_names);
    int lo = 0, hi = K_COUNT - 1;
    while (lo <= hi) {
        int mid = (lo + hi) / 2, c = strcmp(name, g_hooks[g_sorted[mid]].name);
        if (c == 0)
            return g_sorted[mid];
        if (c < 0)
            hi = mid - 1;
        else
            lo = mid + 1;
    }
    return -1;
}

/* -- GetProcAddress: the wrapper from (name, version, flags) -------------------------------- */

/* The variant a driver of the tables' version hands out; -2: not a hooked family. */
static int choose(int api, const char *sym, int version, uint64_t flags)
{
    const struct krex_proc *t = api == KREX_API_CUDA ? g_cuda_procs : g_hip_procs;
    size_t n = api == KREX_API_CUDA ? sizeof(g_cuda_procs) / sizeof(*t)
                                    : sizeof(g_hip_procs) / sizeof(*t);
    int pt = (flags & PER_THREAD_FLAG) != 0, family = 0;
    const struct krex_proc *best = NULL;
    for (size_t i = 0; i < n; i++) {
        const struct krex_proc *e = &t[i];
        if (strcmp(e->base, sym) != 0)
            continue;
        family = 1;
        if (e->since > version || (e->pt && !pt))
            continue;
        if (!best || e->pt > best->pt || (e->pt == best->pt && e->since > best->since))
            best = e;
    }
    return best ? best->idx : family ? -1 : -2;
}

typedef CUresult (*getproc_fn)(const char *, void **, int, cuuint64_t, void *);

/* Swap a pointer the driver resolved for (sym, version, flags) for our wrapper of that
 * variant.  Left unwrapped only when the variant cannot be told: counted, and the
 * daemon marks the regions of this process's siblings not clean. */
static void *wrap_getproc(int api, const char *sym, void *ptr, int version, uint64_t flags,
                          getproc_fn probe)
{
    if (!sym || !ptr || is_ours(ptr))
        return ptr;
    int idx = choose(api, sym, version, flags);
    if (idx == -2)
        return ptr; /* not a call that submits device work */
    if (idx >= 0 && api == KREX_API_CUDA && version > KREX_CUDA_TABLE_VERSION) {
        /* a newer caller: only the same pointer as at our tables' version is known */
        void *known = NULL;
        if (!probe || probe(sym, &known, KREX_CUDA_TABLE_VERSION, flags, NULL) != 0 || known != ptr)
            idx = -1;
    }
    if (idx < 0) {
        krex_count(KREX_C_unmatched);
        krex_count(KREX_C_unwrapped);
        return ptr;
    }
    set_real(idx, ptr);
    return g_hooks[idx].wrap[KREX_PATH_GETPROC];
}

static CUresult getproc_v1_as_v2(const char *s, void **p, int v, cuuint64_t f, void *st)
{
    (void)st;
    CUresult (*real)(const char *, void **, int, cuuint64_t) =
        (CUresult(*)(const char *, void **, int, cuuint64_t))real_of(K_cuGetProcAddress);
    return real ? real(s, p, v, f) : CUDA_ERROR_NOT_FOUND;
}

KREX_EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int cudaVersion,
                                      cuuint64_t flags)
{
    CUresult r = getproc_v1_as_v2(symbol, pfn, cudaVersion, flags, NULL);
    if (r == CUDA_SUCCESS && pfn && *pfn)
        *pfn = wrap_getproc(KREX_API_CUDA, symbol, *pfn, cudaVersion, flags, getproc_v1_as_v2);
    return r;
}

KREX_EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int cudaVersion,
                                         cuuint64_t flags, CUdriverProcAddressQueryResult *status)
{
    getproc_fn real = (getproc_fn)real_of(K_cuGetProcAddress_v2);
    if (!real)
        return CUDA_ERROR_NOT_FOUND;
    CUresult r = real(symbol, pfn, cudaVersion, flags, status);
    if (r == CUDA_SUCCESS && pfn && *pfn)
        *pfn = wrap_getproc(KREX_API_CUDA, symbol, *pfn, cudaVersion, flags, real);
    return r;
}

KREX_EXPORT hipError_t hipGetProcAddress(const char *symbol, void **pfn, int hipVersion,
                                         uint64_t flags, hipDriverProcAddressQueryResult *status)
{
    hipError_t (*real)(const char *, void **, int, uint64_t, hipDriverProcAddressQueryResult *) =
        (hipError_t(*)(const char *, void **, int, uint64_t, hipDriverProcAddressQueryResult *))
            real_of(K_hipGetProcAddress);
    if (!real)
        return hipErrorNotFound;
    hipError_t r = real(symbol, pfn, hipVersion, flags, status);
    if (r == hipSuccess && pfn && *pfn)
        *pfn = wrap_getproc(KREX_API_HIP, symbol, *pfn, hipVersion, flags, NULL);
    return r;
}

/* -- dlsym ------------------------------------------------------------------------------- */

/* dlsym of a hooked name (not RTLD_NEXT): the real symbol, swapped for our wrapper. */
static void *dlsym_wrapping(void *handle, const char *name)
{
    dlsym_fn real = real_dlsym();
    void *r = real ? real(handle, name) : NULL;
    int idx = lookup(name);
    if (!r || idx < 0 || is_ours(r))
        return r;
    set_real(idx, r);
    return g_hooks[idx].wrap[KREX_PATH_DLSYM];
}

static void *dlsym_missing(void *handle, const char *name)
{
    (void)handle, (void)name;
    return NULL;
}

/* Where the exported dlsym jumps: the real dlsym itself for RTLD_NEXT and every name
 * we do not hook (a tail call: the real dlsym sees its caller's return address, which
 * RTLD_NEXT is relative to), dlsym_wrapping for a hooked name, and NULL for a NULL
 * name (glibc's own dlsym would crash on it). */
__attribute__((used, visibility("hidden"))) void *krex_dlsym_route(void *handle, const char *name)
{
    dlsym_fn real = real_dlsym();
    if (!real || !name)
        return (void *)dlsym_missing;
    if (handle == RTLD_NEXT || (name[0] != 'c' && name[0] != 'h') || lookup(name) < 0)
        return (void *)real;
    return (void *)dlsym_wrapping;
}

#if defined(__x86_64__)
__asm__(".text\n.globl dlsym\n.type dlsym,@function\n.p2align 4\ndlsym:\n.cfi_startproc\n"
#if defined(__CET__)
        "endbr64\n"
#endif
        "pushq %rdi\n.cfi_adjust_cfa_offset 8\npushq %rsi\n.cfi_adjust_cfa_offset 8\n"
        "subq $8, %rsp\n.cfi_adjust_cfa_offset 8\ncall krex_dlsym_route\n"
        "addq $8, %rsp\n.cfi_adjust_cfa_offset -8\npopq %rsi\n.cfi_adjust_cfa_offset -8\n"
        "popq %rdi\n.cfi_adjust_cfa_offset -8\njmp *%rax\n.cfi_endproc\n.size dlsym, .-dlsym\n");
#elif defined(__aarch64__)
__asm__(".text\n.globl dlsym\n.type dlsym,%function\n.p2align 4\ndlsym:\n.cfi_startproc\n"
        "stp x29, x30, [sp, #-32]!\n.cfi_def_cfa_offset 32\n.cfi_offset 29, -32\n"
        ".cfi_offset 30, -24\nmov x29, sp\nstp x0, x1, [sp, #16]\nbl krex_dlsym_route\n"
        "mov x16, x0\nldp x0, x1, [sp, #16]\nldp x29, x30, [sp], #32\n.cfi_def_cfa_offset 0\n"
        "br x16\n.cfi_endproc\n.size dlsym, .-dlsym\n");
#else /* elsewhere a plain call: dlsym(RTLD_NEXT) from other code is relative to us */
KREX_EXPORT void *dlsym(void *handle, const char *name)
{
    return ((dlsym_fn)krex_dlsym_route(handle, name))(handle, name);
}
#endif

/* -- exports ------------------------------------------------------------------------------- */

KREX_EXPORT int krex_interposer_abi_version(void) { return KREX_GATE_ABI; }

KREX_EXPORT int krex_interposer_active(void) { return krex_gate_active(); }

static const char *const g_counter_names[] = {
#define COUNTER(name, meaning) #name,
#include "counters.def"
#undef COUNTER
};

/* Counter i's name (counters.def), NULL past the last. */
KREX_EXPORT const char *krex_interposer_counter_name(int i)
{
    return i >= 0 && i < KREX_NCOUNTERS ? g_counter_names[i] : NULL;
}

/* This process's value of counter i. */
KREX_EXPORT uint64_t krex_interposer_counter(int i) { return krex_counter_value(i); }

/* Number of hooked symbols (for the self-test). */
KREX_EXPORT int krex_interposer_hook_count(void) { return K_COUNT; }
