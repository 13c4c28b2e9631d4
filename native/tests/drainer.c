/* Drain scenarios on the fake driver, linked against it (the direct path).
 *
 *   drainer capture | capture_ctxsync | default_capture | poison | destroyed
 *
 * Sets up the scenario, prints "ready", waits for a line on stdin (the test
 * closes the gate and checks the drain meanwhile), then prints key=value results:
 *   capture:          stream S1 capturing (global mode) with 3 kernels recorded, stream
 *                     S2 running 3 x 100 ms; at the end S1's capture is ended and its
 *                     graph launched: capture=<cuStreamEndCapture> graph=<cuGraphLaunch>
 *   capture_ctxsync:  the negative control: the program itself calls cuCtxSynchronize
 *                     during the capture: capture=901 (invalidated), as on a GPU
 *   default_capture:  S1 capturing, and 3 x 100 ms queued on the legacy default stream
 *   poison:           a kernel that poisons the context (sticky 719) ran on S1
 *   destroyed:        a stream used and destroyed, then S2 running 3 x 100 ms
 * DRAINER_LONG_KERNEL names the long kernel (default spin_us_100000).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef void *CUstream;
int cuInit(unsigned);
int cuDeviceGet(int *, int);
int cuCtxCreate_v2(void **, unsigned, int);
int cuCtxSynchronize(void);
int cuStreamCreate(CUstream *, unsigned);
int cuStreamSynchronize(CUstream);
int cuStreamDestroy_v2(CUstream);
int cuStreamBeginCapture_v2(CUstream, int);
int cuStreamEndCapture(CUstream, void **);
int cuGraphInstantiateWithFlags(void **, void *, unsigned long long);
int cuGraphLaunch(void *, CUstream);
int cuModuleLoadData(void **, const void *);
int cuModuleGetFunction(void **, void *, const char *);
int cuLaunchKernel(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                   void *, void **, void **);

static void *g_mod;

static int launch(const char *kernel, CUstream s, int n)
{
    void *f;
    int rc = cuModuleGetFunction(&f, g_mod, kernel);
    for (int i = 0; i < n && rc == 0; i++)
        rc = cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, s, NULL, NULL);
    return rc;
}

static void wait_line(void)
{
    char line[64];
    printf("ready\n");
    fflush(stdout);
    if (!fgets(line, sizeof(line), stdin))
        line[0] = 0;
}

int main(int argc, char **argv)
{
    const char *what = argc > 1 ? argv[1] : "";
    int dev, rc, ctxsync = 0;
    void *ctx, *graph = NULL, *exec = NULL;
    CUstream s1, s2;
    if ((rc = cuInit(0)) || (rc = cuDeviceGet(&dev, 0)) || (rc = cuCtxCreate_v2(&ctx, 0, dev)) ||
        (rc = cuModuleLoadData(&g_mod, "x")) || (rc = cuStreamCreate(&s1, 0)) ||
        (rc = cuStreamCreate(&s2, 0))) {
        fprintf(stderr, "setup failed (%d)\n", rc);
        return 1;
    }
    int capturing = strstr(what, "capture") != NULL;
    if (capturing && ((rc = cuStreamBeginCapture_v2(s1, 0)) || (rc = launch("spin_us_1000", s1, 3))))
        return fprintf(stderr, "capture setup failed (%d)\n", rc), 1;
    if (strcmp(what, "poison") == 0) {
        launch("poison", s1, 1);
        cuStreamSynchronize(s1); /* it ran: the context is poisoned */
    }
    if (strcmp(what, "destroyed") == 0) {
        launch("spin_us_10", s1, 1);
        cuStreamSynchronize(s1);
        cuStreamDestroy_v2(s1);
    }
    if (strcmp(what, "capture_ctxsync") == 0)
        ctxsync = cuCtxSynchronize();
    const char *longk = getenv("DRAINER_LONG_KERNEL");
    if (strcmp(what, "poison") != 0)
        launch(longk ? longk : "spin_us_100000", strcmp(what, "default_capture") == 0 ? NULL : s2, 3);
    wait_line();
    if (capturing) {
        rc = cuStreamEndCapture(s1, &graph);
        printf("capture=%d", rc);
        if (rc == 0 && (rc = cuGraphInstantiateWithFlags(&exec, graph, 0)) == 0)
            rc = cuGraphLaunch(exec, s2);
        printf(" graph=%d", rc);
    }
    printf(" ctxsync=%d sync=%d\n", ctxsync, cuCtxSynchronize());
    return 0;
}
