/* Test launcher: launches fake kernels through one resolution path.
 *
 *   launcher API MODE THREADS DURATION_MS KERNEL SYNC_EVERY
 *   API   cuda | hip
 *   MODE  direct | dlsym | getproc | getproc_self | getproc_future | ptds
 *         (getproc_self: asks cuGetProcAddress for "cuGetProcAddress" first;
 *          getproc_future: asks as a caller of a CUDA newer than krex's tables (13010);
 *          ptds: per-thread default stream variants, _ptsz/_ptds/_spt)
 *
 * Prints "started" once set up.  SIGUSR1 ends the run early.
 * Each thread launches KERNEL (and every 8th iteration a small async copy)
 * until DURATION_MS has passed, synchronising every SYNC_EVERY launches.
 * Linked against the (fake) libcuda.so.1 and libamdhip64.so; prints one line:
 *   launches=N direct=A dlsym=B getproc=C NAME=V ...   (every interposer counter by name)
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int (*launch_fn)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                         unsigned, void *, void **, void **);
typedef int (*copy_fn)(unsigned long long, const void *, size_t, void *);
typedef int (*sync_fn)(void);
typedef int (*gpa_fn)(const char *, void **, int, uint64_t, int *);
typedef struct { uint32_t x, y, z; } dim3;
typedef int (*hip_launch_fn)(const void *, dim3, dim3, void **, size_t, void *);
typedef int (*hip_copy_fn)(void *, const void *, size_t, int, void *);

/* Linked entry points (the "direct" path). */
int cuInit(unsigned);
int cuDeviceGet(int *, int);
int cuCtxCreate_v2(void **, unsigned, int);
int cuCtxSetCurrent(void *);
int cuCtxSynchronize(void);
int cuModuleLoadData(void **, const void *);
int cuModuleGetFunction(void **, void *, const char *);
int cuMemAlloc_v2(unsigned long long *, size_t);
int cuLaunchKernel(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                   void *, void **, void **);
int cuLaunchKernel_ptsz(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                        unsigned, void *, void **, void **);
int cuMemcpyHtoDAsync_v2(unsigned long long, const void *, size_t, void *);
int cuMemcpyHtoDAsync_v2_ptsz(unsigned long long, const void *, size_t, void *);
int hipInit(unsigned);
int hipModuleLoadData(void **, const void *);
int hipModuleGetFunction(void **, void *, const char *);
int hipMalloc(void **, size_t);
int hipDeviceSynchronize(void);
int hipLaunchKernel(const void *, dim3, dim3, void **, size_t, void *);
int hipLaunchKernel_spt(const void *, dim3, dim3, void **, size_t, void *);
int hipMemcpyAsync(void *, const void *, size_t, int, void *);

static const char *g_api, *g_mode, *g_kernel;
static int g_threads, g_sync_every;
static double g_duration_s;
static void *g_func, *g_ctx, *g_dev_buf;
static launch_fn g_launch;
static copy_fn g_copy;
static hip_launch_fn g_hlaunch;
static hip_copy_fn g_hcopy;
static long g_launches[64];
static volatile sig_atomic_t g_stop; /* SIGUSR1: finish early */

static void on_usr1(int sig) { (void)sig; g_stop = 1; }

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void die(const char *what, int rc)
{
    fprintf(stderr, "launcher: %s failed (%d)\n", what, rc);
    exit(1);
}

/* Resolve `name` through the chosen path in library `lib`. */
static void *resolve(const char *lib, const char *name, const char *pt_name)
{
    int ptds = strcmp(g_mode, "ptds") == 0;
    if (strcmp(g_mode, "direct") == 0 || (ptds && strcmp(g_api, "hip") == 0))
        return NULL; /* caller uses the linked symbol */
    void *h = dlopen(lib, RTLD_NOW);
    if (strcmp(g_mode, "dlsym") == 0) {
        char v2[128];
        void *p = dlsym(h, name);
        snprintf(v2, sizeof(v2), "%s_v2", name);
        return p ? p : dlsym(h, v2); /* cuda.h maps e.g. cuMemcpyHtoDAsync to _v2 */
    }
    const char *gpa_name = strcmp(g_api, "hip") == 0 ? "hipGetProcAddress" : "cuGetProcAddress_v2";
    gpa_fn gpa = (gpa_fn)dlsym(h, gpa_name);
    int st = 0;
    if (strcmp(g_mode, "getproc_self") == 0) {
        void *self = NULL;
        gpa("cuGetProcAddress", &self, 13000, 0, &st);
        gpa = (gpa_fn)self;
    }
    void *p = NULL;
    (void)pt_name;
    int version = strcmp(g_api, "hip") == 0 ? 60200000
                  : strcmp(g_mode, "getproc_future") == 0 ? 13010 : 13000;
    gpa(name, &p, version, ptds ? 2 : 0, &st);
    return p;
}

static void setup_cuda(void)
{
    int dev, rc;
    void *mod;
    if ((rc = cuInit(0)) || (rc = cuDeviceGet(&dev, 0)) || (rc = cuCtxCreate_v2(&g_ctx, 0, dev)))
        die("cuda init", rc);
    if ((rc = cuModuleLoadData(&mod, "x")) || (rc = cuModuleGetFunction(&g_func, mod, g_kernel)))
        die("module", rc);
    cuMemAlloc_v2((unsigned long long *)&g_dev_buf, 4096);
    int ptds = strcmp(g_mode, "ptds") == 0;
    g_launch = (launch_fn)resolve("libcuda.so.1", "cuLaunchKernel", NULL);
    g_copy = (copy_fn)resolve("libcuda.so.1", "cuMemcpyHtoDAsync", NULL);
    if (!g_launch)
        g_launch = ptds ? (launch_fn)cuLaunchKernel_ptsz : (launch_fn)cuLaunchKernel;
    if (!g_copy)
        g_copy = ptds ? (copy_fn)cuMemcpyHtoDAsync_v2_ptsz : (copy_fn)cuMemcpyHtoDAsync_v2;
}

static void setup_hip(void)
{
    void *mod;
    int rc;
    if ((rc = hipInit(0)) || (rc = hipModuleLoadData(&mod, "x")) ||
        (rc = hipModuleGetFunction(&g_func, mod, g_kernel)))
        die("hip init", rc);
    hipMalloc(&g_dev_buf, 4096);
    int spt = strcmp(g_mode, "ptds") == 0;
    g_hlaunch = (hip_launch_fn)resolve("libamdhip64.so", "hipLaunchKernel", NULL);
    g_hcopy = (hip_copy_fn)resolve("libamdhip64.so", "hipMemcpyAsync", NULL);
    if (!g_hlaunch)
        g_hlaunch = spt ? hipLaunchKernel_spt : hipLaunchKernel;
    if (!g_hcopy)
        g_hcopy = hipMemcpyAsync;
}

static int launch_once(long i)
{
    static char host[64];
    dim3 one = {1, 1, 1};
    if (g_hlaunch)
        return (i % 8 == 7) ? g_hcopy(g_dev_buf, host, sizeof(host), 1, NULL)
                            : g_hlaunch(g_func, one, one, NULL, 0, NULL);
    if (i % 8 == 7)
        return g_copy((unsigned long long)(uintptr_t)g_dev_buf, host, sizeof(host), NULL);
    return g_launch(g_func, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
}

static void *worker(void *arg)
{
    long idx = (long)arg, n = 0;
    if (g_ctx)
        cuCtxSetCurrent(g_ctx);
    double end = now_s() + g_duration_s;
    while (!g_stop && now_s() < end) {
        int rc = launch_once(n);
        if (rc)
            die("launch", rc);
        if (++n % g_sync_every == 0)
            g_hlaunch ? hipDeviceSynchronize() : cuCtxSynchronize();
    }
    g_launches[idx] = n;
    return NULL;
}

static void report(void)
{
    long total = 0;
    for (int i = 0; i < g_threads; i++)
        total += g_launches[i];
    const char *(*name)(int) = (const char *(*)(int))dlsym(RTLD_DEFAULT, "krex_interposer_counter_name");
    uint64_t (*value)(int) = (uint64_t(*)(int))dlsym(RTLD_DEFAULT, "krex_interposer_counter");
    uint64_t paths[3] = {0, 0, 0};
    for (int i = 0; name && i < 3; i++)
        paths[i] = value(i); /* launch_direct, launch_dlsym, launch_getproc */
    printf("launches=%ld direct=%llu dlsym=%llu getproc=%llu", total, (unsigned long long)paths[0],
           (unsigned long long)paths[1], (unsigned long long)paths[2]);
    for (int i = 0; name && name(i); i++)
        printf(" %s=%llu", name(i), (unsigned long long)value(i));
    printf("\n");
}

int main(int argc, char **argv)
{
    if (argc != 7) {
        fprintf(stderr, "usage: launcher cuda|hip MODE THREADS DURATION_MS KERNEL SYNC_EVERY\n");
        return 2;
    }
    g_api = argv[1], g_mode = argv[2], g_threads = atoi(argv[3]);
    g_duration_s = atof(argv[4]) / 1000.0, g_kernel = argv[5], g_sync_every = atoi(argv[6]);
    if (g_threads < 1 || g_threads > 64 || g_sync_every < 1)
        return 2;
    signal(SIGUSR1, on_usr1);
    strcmp(g_api, "hip") == 0 ? setup_hip() : setup_cuda();
    printf("started\n");
    fflush(stdout);
    pthread_t tids[64];
    for (long i = 0; i < g_threads; i++)
        pthread_create(&tids[i], NULL, worker, (void *)i);
    for (int i = 0; i < g_threads; i++)
        pthread_join(tids[i], NULL);
    g_hlaunch ? hipDeviceSynchronize() : cuCtxSynchronize();
    report();
    return 0;
}
