/* Stream capture and graphs for the fake driver (included by fakecuda.c).
 *
 * Modelled on the CUDA programming guide's rules: launches into a capturing
 * stream are recorded into a graph instead of running; synchronising a
 * capturing stream, or the whole context (or the legacy stream) while any
 * stream of the process is capturing, is not allowed: the call returns
 * CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED and the capture is invalidated, so its
 * cuStreamEndCapture returns CUDA_ERROR_STREAM_CAPTURE_INVALIDATED.  A capture
 * ends even when it was invalidated.  cuStreamIsCapturing reports
 * NONE (0), ACTIVE (1) or INVALIDATED (2).
 */
typedef struct fg_graph *CUgraph_fake;
#define MAX_CAPTURING 64
static CUstream g_capturing[MAX_CAPTURING];
static pthread_mutex_t g_capture_mu = PTHREAD_MUTEX_INITIALIZER;
static __thread int t_capture_mode; /* cuThreadExchangeStreamCaptureMode: kept, not enforced */

static void graph_add(struct fg_graph *g, uint64_t dur, uint32_t flags)
{
    if (g->n == g->cap) {
        g->cap = g->cap ? g->cap * 2 : 8;
        g->k = realloc(g->k, g->cap * sizeof(*g->k));
    }
    g->k[g->n++] = (struct fg_kernel){dur, flags};
}

static CUresult capture(CUstream s, uint64_t dur, uint32_t flags)
{
    if (s->invalidated)
        return CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
    graph_add(s->g, dur, flags);
    return CUDA_SUCCESS;
}

/* An unsafe call while streams capture: invalidate them all; 1 if there were any. */
static int capture_unsafe_call(void)
{
    int any = 0;
    pthread_mutex_lock(&g_capture_mu);
    for (int i = 0; i < MAX_CAPTURING; i++)
        if (g_capturing[i]) {
            g_capturing[i]->invalidated = 1;
            any = 1;
        }
    pthread_mutex_unlock(&g_capture_mu);
    return any;
}

static CUresult sync_stream(CUstream s)
{
    if (explicit_stream(s) && s->magic != STREAM_MAGIC)
        return CUDA_ERROR_INVALID_HANDLE;
    if (explicit_stream(s) && s->capturing) {
        s->invalidated = 1;
        return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    }
    if (s != CU_STREAM_PER_THREAD_H && !explicit_stream(s) && capture_unsafe_call())
        return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED; /* the legacy stream syncs with all */
    return sync_ctx(ctx_of(s));
}

API cuStreamBeginCapture_v2(CUstream s, int mode)
{
    if (!explicit_stream(s) || s->magic != STREAM_MAGIC || s->capturing)
        return explicit_stream(s) ? CUDA_ERROR_ILLEGAL_STATE : CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    (void)mode;
    pthread_mutex_lock(&g_capture_mu);
    int slot = -1;
    for (int i = 0; i < MAX_CAPTURING && slot < 0; i++)
        if (!g_capturing[i])
            slot = i;
    if (slot >= 0)
        g_capturing[slot] = s;
    pthread_mutex_unlock(&g_capture_mu);
    if (slot < 0)
        return CUDA_ERROR_OUT_OF_MEMORY;
    s->g = calloc(1, sizeof(*s->g));
    s->invalidated = 0;
    s->capturing = 1;
    return CUDA_SUCCESS;
}

API cuStreamEndCapture(CUstream s, CUgraph_fake *graph)
{
    if (!explicit_stream(s) || !s->capturing)
        return CUDA_ERROR_ILLEGAL_STATE;
    pthread_mutex_lock(&g_capture_mu);
    for (int i = 0; i < MAX_CAPTURING; i++)
        if (g_capturing[i] == s)
            g_capturing[i] = NULL;
    pthread_mutex_unlock(&g_capture_mu);
    s->capturing = 0;
    *graph = s->invalidated ? NULL : s->g;
    if (s->invalidated) {
        free(s->g->k);
        free(s->g);
    }
    s->g = NULL;
    return s->invalidated ? CUDA_ERROR_STREAM_CAPTURE_INVALIDATED : CUDA_SUCCESS;
}

API cuStreamIsCapturing(CUstream s, int *status)
{
    if (explicit_stream(s) && s->magic != STREAM_MAGIC)
        return CUDA_ERROR_INVALID_HANDLE;
    *status = explicit_stream(s) && s->capturing ? (s->invalidated ? 2 : 1) : 0;
    return CUDA_SUCCESS;
}

API cuStreamGetCtx(CUstream s, CUcontext *ctx)
{
    if (explicit_stream(s) && s->magic != STREAM_MAGIC)
        return CUDA_ERROR_INVALID_HANDLE;
    *ctx = ctx_of(s);
    return *ctx ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
}

API cuThreadExchangeStreamCaptureMode(int *mode)
{
    int old = t_capture_mode;
    t_capture_mode = *mode;
    *mode = old;
    return CUDA_SUCCESS;
}

API cuGraphInstantiateWithFlags(CUgraph_fake *exec, CUgraph_fake graph, unsigned long long flags)
{
    (void)flags;
    if (!graph)
        return CUDA_ERROR_INVALID_VALUE;
    struct fg_graph *e = calloc(1, sizeof(*e));
    for (size_t i = 0; i < graph->n; i++)
        graph_add(e, graph->k[i].dur_ns, graph->k[i].flags);
    *exec = e;
    return CUDA_SUCCESS;
}

static CUresult graph_launch(CUgraph_fake exec, CUstream s)
{
    CUcontext c = ctx_of(s);
    if (!c || c->magic != CTX_MAGIC || !exec)
        return !exec ? CUDA_ERROR_INVALID_VALUE : CUDA_ERROR_INVALID_CONTEXT;
    for (size_t i = 0; i < exec->n; i++) {
        int st = explicit_stream(s) && s->capturing
                     ? capture(s, exec->k[i].dur_ns, exec->k[i].flags)
                     : status_of(fg_simple(FG_LAUNCH, c->id, exec->k[i].dur_ns, exec->k[i].flags, NULL));
        if (st != CUDA_SUCCESS)
            return st;
    }
    return CUDA_SUCCESS;
}
API cuGraphLaunch(CUgraph_fake exec, CUstream s) { return graph_launch(exec, s); }
API cuGraphLaunch_ptsz(CUgraph_fake exec, CUstream s) { return graph_launch(exec, s); }

static CUresult graph_free(CUgraph_fake g)
{
    if (g) {
        free(g->k);
        free(g);
    }
    return CUDA_SUCCESS;
}
API cuGraphDestroy(CUgraph_fake g) { return graph_free(g); }
API cuGraphExecDestroy(CUgraph_fake g) { return graph_free(g); }
