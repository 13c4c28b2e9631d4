/* Hooked symbols: one registry table, one call-through macro, and the
 * resolution hooks (dlsym, cuGetProcAddress[_v2], hipGetProcAddress).
 *
 * Every hooked ABI variant (cuMemcpyHtoD, cuMemcpyHtoD_v2, cuMemcpyHtoD_v2_ptds,
 * ...) has its own wrappers, one per resolution path, so a caller always
 * gets a wrapper with exactly the ABI of the pointer the driver handed out.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdatomic.h>
#include <string.h>

#include "cutypes.h"
#include "gate.h"

#define KREX_EXPORT __attribute__((visibility("default")))
#define KREX_UNPAREN(...) __VA_ARGS__
#define KREX_UNLIKELY(x) __builtin_expect(!!(x), 0)

enum krex_hook_id {
#define HOOK(name, params, args) K_##name,
#include "cuda_hooks.def"
    K_CUDA_END,
#include "hip_hooks.def"
#undef HOOK
    K_cuGetProcAddress,
    K_cuGetProcAddress_v2,
    K_cuGetProcAddress_v2_ptsz,
    K_hipGetProcAddress,
    K_COUNT
};

struct krex_hook {
    const char *name;
    void *wrap[KREX_NPATHS]; /* direct (exported), via dlsym, via GetProcAddress */
    int api;
};

static _Atomic(void *) g_real[K_COUNT];
static _Atomic uint64_t g_counts[KREX_NPATHS];
static _Atomic uint64_t g_unmatched;
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

/* The library that defines ptr (a no-load dlopen handle), or RTLD_NEXT. */
static void *library_of(void *ptr)
{
    Dl_info info;
    void *h = NULL;
    if (dladdr(ptr, &info) && info.dli_fname)
        h = dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
    return h ? h : RTLD_NEXT;
}

/* Give the drain thread the driver's context calls, from the driver itself. */
static void bind_driver(int api, void *real)
{
    static _Atomic int bound[2];
    int expected = 0;
    if (!atomic_compare_exchange_strong(&bound[api], &expected, 1))
        return;
    dlsym_fn sym = real_dlsym();
    void *lib = library_of(real);
    if (api == KREX_API_CUDA)
        krex_gate_bind_cuda(sym(lib, "cuCtxGetCurrent"), sym(lib, "cuCtxPushCurrent_v2"),
                            sym(lib, "cuCtxPopCurrent_v2"), sym(lib, "cuCtxSynchronize"));
    else
        krex_gate_bind_hip(sym(lib, "hipGetDevice"), sym(lib, "hipSetDevice"),
                           sym(lib, "hipDeviceSynchronize"));
}

static void set_real(int idx, void *real)
{
    void *expected = NULL;
    atomic_compare_exchange_strong(&g_real[idx], &expected, real);
    if (g_hooks[idx].api >= 0)
        bind_driver(g_hooks[idx].api, real);
}

/* The real entry point for a directly linked call: the next definition after us. */
static void *real_of(int idx)
{
    void *r = atomic_load_explicit(&g_real[idx], memory_order_acquire);
    if (__builtin_expect(r != NULL, 1))
        return r;
    dlsym_fn sym = real_dlsym();
    if (sym && (r = sym(RTLD_NEXT, g_hooks[idx].name)) != NULL)
        set_real(idx, r);
    return atomic_load(&g_real[idx]);
}

/* The call-through macro: gate, call the real entry point, leave the gate. */
#define KREX_CALL_THROUGH(api, path, idx, fn_t, args)                          \
    do {                                                                       \
        fn_t real_ = (fn_t)real_of(idx);                                       \
        if (KREX_UNLIKELY(!real_))                                             \
            return CUDA_ERROR_NOT_FOUND;                                       \
        struct krex_gate_proc *p_ = krex_gate_enter(api);                      \
        atomic_fetch_add_explicit(&g_counts[path], 1, memory_order_relaxed);   \
        int r_ = real_ args;                                                   \
        krex_gate_exit(p_);                                                    \
        return r_;                                                             \
    } while (0)

#define KREX_WRAPPERS(rtype, api, name, params, args)                                        \
    typedef rtype (*name##_fn) params;                                                       \
    static rtype krex_do_##name(int path, KREX_UNPAREN params)                               \
    {                                                                                        \
        KREX_CALL_THROUGH(api, path, K_##name, name##_fn, args);                             \
    }                                                                                        \
    KREX_EXPORT rtype name params { return krex_do_##name(KREX_PATH_DIRECT, KREX_UNPAREN args); } \
    static rtype krex_dl_##name params { return krex_do_##name(KREX_PATH_DLSYM, KREX_UNPAREN args); } \
    static rtype krex_gp_##name params { return krex_do_##name(KREX_PATH_GETPROC, KREX_UNPAREN args); }

#define HOOK(name, params, args) KREX_WRAPPERS(CUresult, KREX_API_CUDA, name, params, args)
#include "cuda_hooks.def"
#undef HOOK
#define HOOK(name, params, args) KREX_WRAPPERS(hipError_t, KREX_API_HIP, name, params, args)
#include "hip_hooks.def"
#undef HOOK

static void *wrap_resolved(const char *sym, void *ptr, int path);

/* The GetProcAddress hooks: resolve through the driver, then wrap the result. */
#define KREX_GETPROC(rtype, name, params, args, sym, pfn)                          \
    KREX_EXPORT rtype name params                                                  \
    {                                                                              \
        rtype (*real_)params = (rtype(*) params)real_of(K_##name);                 \
        if (!real_)                                                                \
            return CUDA_ERROR_NOT_FOUND;                                           \
        rtype r_ = real_ args;                                                     \
        if (r_ == 0 && (pfn) && *(pfn))                                            \
            *(pfn) = wrap_resolved(sym, *(pfn), KREX_PATH_GETPROC);                \
        return r_;                                                                 \
    }

KREX_GETPROC(CUresult, cuGetProcAddress,
             (const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags),
             (symbol, pfn, cudaVersion, flags), symbol, pfn)
KREX_GETPROC(CUresult, cuGetProcAddress_v2,
             (const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
              CUdriverProcAddressQueryResult *status),
             (symbol, pfn, cudaVersion, flags, status), symbol, pfn)
KREX_GETPROC(CUresult, cuGetProcAddress_v2_ptsz,
             (const char *symbol, void **pfn, int cudaVersion, cuuint64_t flags,
              CUdriverProcAddressQueryResult *status),
             (symbol, pfn, cudaVersion, flags, status), symbol, pfn)
KREX_GETPROC(hipError_t, hipGetProcAddress,
             (const char *symbol, void **pfn, int hipVersion, uint64_t flags,
              hipDriverProcAddressQueryResult *status),
             (symbol, pfn, hipVersion, flags, status), symbol, pfn)

/* The registry: every hooked symbol, its wrappers, its API. */
static const struct krex_hook g_hooks[K_COUNT] = {
#define HOOK(name, params, args) \
    [K_##name] = {#name, {(void *)name, (void *)krex_dl_##name, (void *)krex_gp_##name}, KREX_API_CUDA},
#include "cuda_hooks.def"
#undef HOOK
#define HOOK(name, params, args) \
    [K_##name] = {#name, {(void *)name, (void *)krex_dl_##name, (void *)krex_gp_##name}, KREX_API_HIP},
#include "hip_hooks.def"
#undef HOOK
#define RESOLVER(name) [K_##name] = {#name, {(void *)name, (void *)name, (void *)name}, -1}
    RESOLVER(cuGetProcAddress),
    RESOLVER(cuGetProcAddress_v2),
    RESOLVER(cuGetProcAddress_v2_ptsz),
    RESOLVER(hipGetProcAddress),
#undef RESOLVER
};

static int lookup(const char *name)
{
    for (int i = 0; i < K_COUNT; i++)
        if (g_hooks[i].name && strcmp(g_hooks[i].name, name) == 0)
            return i;
    return -1;
}

static int is_ours(void *ptr)
{
    Dl_info mine, theirs;
    return dladdr((void *)&lookup, &mine) && dladdr(ptr, &theirs) &&
           mine.dli_fbase == theirs.dli_fbase;
}

/* Is `name` an ABI variant of `base` (base, base_v2, base_ptsz, base_v2_ptds...)? */
static int is_variant(const char *name, const char *base)
{
    size_t n = strlen(base);
    if (strncmp(name, base, n) != 0)
        return 0;
    return name[n] == 0 || strncmp(name + n, "_v", 2) == 0 || strncmp(name + n, "_pt", 3) == 0;
}

/* Which hooked variant is `ptr`?  By its exported name, else by address. */
static int identify(const char *sym, void *ptr)
{
    Dl_info info;
    if (dladdr(ptr, &info) && info.dli_saddr == ptr && info.dli_sname) {
        int idx = lookup(info.dli_sname);
        if (idx >= 0)
            return idx;
    }
    dlsym_fn dsym = real_dlsym();
    void *lib = library_of(ptr);
    for (int i = 0; i < K_COUNT; i++)
        if (g_hooks[i].name && is_variant(g_hooks[i].name, sym) && dsym(lib, g_hooks[i].name) == ptr)
            return i;
    return -1;
}

static int family_hooked(const char *sym)
{
    for (int i = 0; i < K_COUNT; i++)
        if (g_hooks[i].name && is_variant(g_hooks[i].name, sym))
            return 1;
    return 0;
}

/* Swap a resolved driver pointer for our wrapper of exactly that variant. */
static void *wrap_resolved(const char *sym, void *ptr, int path)
{
    if (!sym || (sym[0] != 'c' && sym[0] != 'h') || is_ours(ptr))
        return ptr;
    int idx = path == KREX_PATH_DLSYM ? lookup(sym) : identify(sym, ptr);
    if (idx < 0) {
        if (path == KREX_PATH_GETPROC && family_hooked(sym))
            atomic_fetch_add(&g_unmatched, 1); /* left unwrapped: see docs/native.md */
        return ptr;
    }
    set_real(idx, ptr);
    return g_hooks[idx].wrap[path];
}

KREX_EXPORT void *dlsym(void *handle, const char *name)
{
    dlsym_fn real = real_dlsym();
    void *r = real ? real(handle, name) : NULL;
    if (!r || (name[0] != 'c' && name[0] != 'h'))
        return r;
    return wrap_resolved(name, r, KREX_PATH_DLSYM);
}

KREX_EXPORT int krex_interposer_abi_version(void) { return KREX_GATE_ABI; }

KREX_EXPORT int krex_interposer_active(void) { return krex_gate_active(); }

/* out[] = launches via {direct, dlsym, getprocaddress}, parked, drains, unmatched. */
KREX_EXPORT int krex_interposer_counts(uint64_t *out, int n)
{
    uint64_t v[6] = {atomic_load(&g_counts[0]), atomic_load(&g_counts[1]),
                     atomic_load(&g_counts[2]), krex_gate_parked_total(),
                     krex_gate_drains_total(), atomic_load(&g_unmatched)};
    int k = n < 6 ? n : 6;
    for (int i = 0; i < k; i++)
        out[i] = v[i];
    return k;
}

/* Number of hooked symbols (for the self-test). */
KREX_EXPORT int krex_interposer_hook_count(void) { return K_COUNT - 1; }
