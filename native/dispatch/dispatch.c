/* krex._native._dispatch: the sealed call loop of krex.evaluate (issue 42).
 *
 * Two sides share one memory page block (a memfd the trusted driver created):
 *
 *   callee  serve(fd, size, fn, working, pristine, types)   -- in the process that runs
 *           the reference or the candidate; never returns until told to exit.  Bound
 *           before the candidate module is imported: nothing in this loop is looked up
 *           through a Python name, so the candidate cannot rebind it from Python.
 *   driver  call(buffer, op, slot, timeout_ns) -> (status, t0_ns, t1_ns)
 *           -- in the trusted driver: both timestamps from its own CLOCK_MONOTONIC.
 *
 * The empty call (op EMPTY) runs the same sequence without calling anything, copying
 * ``src`` bytes as an output of that size would be: the dispatch and copy overhead,
 * calibrated and subtracted by the driver.
 *
 * One call: the driver waits until the previous call's after-work is done (ready ==
 * req), stamps t0, publishes (op, slot) and bumps req; the callee calls fn(*working[slot])
 * -- or nothing for the empty call -- and copies the output's bytes into the block
 * (exact types only: numpy.ndarray, torch.Tensor, exact tuple/list/str-keyed dict of them,
 * None/bool/int/float), then sets done = req; the driver stamps t1.  Only then, outside
 * the timed span, the callee compares working[slot] with pristine[slot] byte for byte
 * (the mutation flag), copies pristine back into working (every call gets its inputs as
 * built), and sets ready.  Every call -- correctness or timed -- is this same sequence.
 * No logging, no allocation on the driver's side.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <linux/futex.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define KREX_DISPATCH_ABI 1
#define META_OFF 4096
#define META_CAP (60 * 1024)
#define DATA_OFF (64 * 1024)
#define SPIN_NS 0LL  /* no spinning: the region holder (driver and both callees) often has
                       * one core, where a spinning waiter only keeps the other side off
                       * it (a 50 us spin read as preemption in most samples) */

enum { OP_CALL = 0, OP_EMPTY = 1, OP_EXIT = 2, OP_REFILL = 3 };
enum { ST_OK = 0, ST_RAISED = 1, ST_BAD_OUTPUT = 2, ST_TOO_LARGE = 3, ST_TIMEOUT = 4,
       ST_INTERNAL = 5 };

typedef struct {
    _Atomic uint32_t req, done, ready, abi;
    int32_t op, slot, src, status;
    uint32_t mutated, aliases, meta_len, pad;
    uint64_t data_len, data_cap;
} ctl_t;

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void futex_wake(_Atomic uint32_t *word) {
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAKE, INT32_MAX, NULL, NULL, 0);
}

/* Wait until *word != old (callee) or *word == want (driver); spin first, then sleep.
 * Returns 0, or -1 past deadline_ns (0: none). */
static int wait_word(_Atomic uint32_t *word, uint32_t target, int until_equal,
                     int64_t deadline_ns) {
    int64_t spin_end = now_ns() + SPIN_NS;
    for (;;) {
        uint32_t v = atomic_load_explicit(word, memory_order_acquire);
        if (until_equal ? v == target : v != target)
            return 0;
        int64_t t = now_ns();
        if (deadline_ns && t > deadline_ns)
            return -1;
        if (t < spin_end)
            continue;
        struct timespec rel = {0, 20 * 1000 * 1000};
        if (deadline_ns && deadline_ns - t < 20000000LL) {
            rel.tv_nsec = deadline_ns - t;
        }
        syscall(SYS_futex, (uint32_t *)word, FUTEX_WAIT, v, &rel, NULL, 0);
    }
}

/* -- the callee ----------------------------------------------------------------------- */

typedef struct {
    char *meta;
    size_t meta_len;
    char *data;
    size_t data_len, data_cap;
    PyObject *ndarray, *tensor, *to_numpy;  /* exact types; tensor -> ndarray (or None) */
    PyObject *inputs;  /* the working arguments of this call (aliasing check) */
    int status, aliases;
} emit_t;

static int put(emit_t *e, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(e->meta + e->meta_len, META_CAP - e->meta_len, fmt, ap);
    va_end(ap);
    if (n < 0 || (size_t)n >= META_CAP - e->meta_len) {
        e->status = ST_TOO_LARGE;
        return -1;
    }
    e->meta_len += n;
    return 0;
}

static int bad(emit_t *e, PyObject *obj) {
    PyTypeObject *t = Py_TYPE(obj);
    e->meta_len = 0;
    put(e, "{\"t\":\"bad\",\"type\":\"");
    for (const char *c = t->tp_name; *c && e->meta_len < 200; c++)  /* C field: no Python */
        if (*c != '"' && *c != '\\' && (unsigned char)*c >= 32)
            e->meta[e->meta_len++] = *c;
    put(e, "\"}");
    e->status = ST_BAD_OUTPUT;
    return -1;
}

static int overlaps(emit_t *e, Py_buffer *out);

static int emit_buffer(emit_t *e, PyObject *arr) {
    Py_buffer v;
    if (PyObject_GetBuffer(arr, &v, PyBUF_RECORDS_RO) != 0) {
        PyErr_Clear();
        return bad(e, arr);
    }
    int rc = -1;
    if ((size_t)v.len > e->data_cap - e->data_len) {
        e->status = ST_TOO_LARGE;
        goto out;
    }
    if (overlaps(e, &v))
        e->aliases = 1;
    if (PyBuffer_ToContiguous(e->data + e->data_len, &v, v.len, 'C') != 0) {
        PyErr_Clear();
        rc = bad(e, arr);
        goto out;
    }
    if (put(e, "{\"t\":\"array\",\"format\":\"%s\",\"itemsize\":%zd,\"shape\":[",
            v.format ? v.format : "B", v.itemsize) < 0)
        goto out;
    for (int i = 0; i < v.ndim; i++)
        if (put(e, i ? ",%zd" : "%zd", v.shape[i]) < 0)
            goto out;
    if (put(e, "],\"offset\":%zu,\"nbytes\":%zd}", e->data_len, v.len) < 0)
        goto out;
    e->data_len += (size_t)v.len;
    rc = 0;
out:
    PyBuffer_Release(&v);
    return rc;
}

static int emit(emit_t *e, PyObject *obj, int depth);

static int emit_items(emit_t *e, PyObject *seq, const char *kind, int depth) {
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (put(e, "{\"t\":\"seq\",\"kind\":\"%s\",\"items\":[", kind) < 0)
        return -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        if ((i && put(e, ",") < 0) || emit(e, PySequence_Fast_GET_ITEM(seq, i), depth + 1) < 0)
            return -1;
    }
    return put(e, "]}");
}

static int emit_map(emit_t *e, PyObject *d, int depth) {
    PyObject *k, *v;
    Py_ssize_t pos = 0;
    if (put(e, "{\"t\":\"map\",\"items\":[") < 0)
        return -1;
    int first = 1;
    while (PyDict_Next(d, &pos, &k, &v)) {
        if (!PyUnicode_CheckExact(k))
            return bad(e, k);
        Py_ssize_t len;
        const char *s = PyUnicode_AsUTF8AndSize(k, &len);
        if (!s) {
            PyErr_Clear();
            return bad(e, k);
        }
        if (put(e, first ? "[\"" : ",[\"") < 0)
            return -1;
        for (Py_ssize_t i = 0; i < len; i++)  /* keys: JSON-escaped bytes */
            if (put(e, (unsigned char)s[i] < 32 || s[i] == '"' || s[i] == '\\' ? "\\u%04x" : "%c",
                    (unsigned char)s[i]) < 0)
                return -1;
        if (put(e, "\",") < 0 || emit(e, v, depth + 1) < 0 || put(e, "]") < 0)
            return -1;
        first = 0;
    }
    return put(e, "]}");
}

static int emit_value(emit_t *e, PyObject *obj) {
    if (obj == Py_None)
        return put(e, "{\"t\":\"value\",\"value\":null}");
    if (obj == Py_True || obj == Py_False)
        return put(e, "{\"t\":\"value\",\"value\":%s}", obj == Py_True ? "true" : "false");
    if (PyFloat_CheckExact(obj)) {
        double d = PyFloat_AS_DOUBLE(obj);
        if (d != d || d - d != 0)  /* NaN / inf: as a string, JSON has none */
            return put(e, "{\"t\":\"value\",\"float\":\"%s\"}", d != d ? "nan" : d > 0 ? "inf"
                                                                                     : "-inf");
        return put(e, "{\"t\":\"value\",\"float\":%.17g}", d);
    }
    int overflow = 0;
    long long x = PyLong_AsLongLongAndOverflow(obj, &overflow);
    if (overflow || (x == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return bad(e, obj);
    }
    return put(e, "{\"t\":\"value\",\"value\":%lld}", x);
}

static int emit(emit_t *e, PyObject *obj, int depth) {
    if (depth > 32)
        return bad(e, obj);
    PyTypeObject *t = Py_TYPE(obj);
    if ((PyObject *)t == e->ndarray)
        return emit_buffer(e, obj);
    if (e->tensor != Py_None && (PyObject *)t == e->tensor) {
        PyObject *host = PyObject_CallOneArg(e->to_numpy, obj);  /* captured C descriptors */
        if (!host) {
            PyErr_Clear();
            return bad(e, obj);
        }
        int rc = Py_TYPE(host) == (PyTypeObject *)e->ndarray ? emit_buffer(e, host)
                                                              : bad(e, obj);
        Py_DECREF(host);
        return rc;
    }
    if (PyTuple_CheckExact(obj) || PyList_CheckExact(obj)) {
        PyObject *seq = PySequence_Fast(obj, "");  /* exact types: no Python code runs */
        if (!seq)
            return -1;
        int rc = emit_items(e, seq, PyTuple_CheckExact(obj) ? "tuple" : "list", depth);
        Py_DECREF(seq);
        return rc;
    }
    if (PyDict_CheckExact(obj))
        return emit_map(e, obj, depth);
    if (obj == Py_None || PyBool_Check(obj) || PyFloat_CheckExact(obj) || PyLong_CheckExact(obj))
        return emit_value(e, obj);
    return bad(e, obj);
}

typedef struct {
    char *base;
    size_t size;
    ctl_t *ctl;
} block_t;

/* A leaf's buffer: an ndarray's own; a tensor's through its ndarray view (the captured
 * to-host descriptor: the same memory, so a refill writes the tensor).  The view holds
 * the ndarray; a leaf with no buffer (a tensor that needs grad, say) is an empty,
 * read-only placeholder, so that the working and the pristine leaves keep one index. */
static void leaf(PyObject *obj, PyObject *types, Py_buffer *out, int rw) {
    PyObject *ndarray = PyTuple_GET_ITEM(types, 0);
    PyObject *host = obj;
    if ((PyObject *)Py_TYPE(obj) != ndarray) {
        host = PyObject_CallOneArg(PyTuple_GET_ITEM(types, 2), obj);
        if (!host || (PyObject *)Py_TYPE(host) != ndarray) {
            PyErr_Clear();
            Py_XDECREF(host);
            host = NULL;
        }
    }
    /* a read-only input is taken read-only (never refilled: nothing writes it) */
    int ok = 0;
    if (host) {
        ok = PyObject_GetBuffer(host, out, rw ? PyBUF_RECORDS : PyBUF_RECORDS_RO) == 0;
        if (!ok && rw) {
            PyErr_Clear();
            ok = PyObject_GetBuffer(host, out, PyBUF_RECORDS_RO) == 0;
        }
        PyErr_Clear();
        if (host != obj)
            Py_DECREF(host);
    }
    if (!ok) {
        memset(out, 0, sizeof(Py_buffer));  /* no buffer at all: an empty placeholder */
        out->readonly = 1;
    }
}

/* Every leaf buffer of an argument tree, depth first (exact containers only). */
static int buffers(PyObject *tree, PyObject *types, Py_buffer *out, int cap, int n, int rw) {
    if (n < 0 || n >= cap)
        return n;  /* beyond MAX_LEAVES the rest is not looked at */
    PyObject *t = (PyObject *)Py_TYPE(tree), *tensor = PyTuple_GET_ITEM(types, 1);
    if (t == PyTuple_GET_ITEM(types, 0) || (tensor != Py_None && t == tensor)) {
        leaf(tree, types, &out[n], rw);
        return n + 1;
    }
    if (PyTuple_CheckExact(tree) || PyList_CheckExact(tree)) {
        for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(tree); i++)
            n = buffers(PySequence_Fast_GET_ITEM(tree, i), types, out, cap, n, rw);
    } else if (PyDict_CheckExact(tree)) {
        PyObject *k, *v;
        Py_ssize_t pos = 0;
        while (PyDict_Next(tree, &pos, &k, &v))
            n = buffers(v, types, out, cap, n, rw);
    }
    return n;
}

#define MAX_LEAVES 64
static Py_buffer in_views[MAX_LEAVES];
static int in_count;

static int overlaps(emit_t *e, Py_buffer *out) {
    char *lo = out->buf, *hi = (char *)out->buf + out->len;
    (void)e;
    for (int i = 0; i < in_count; i++) {
        char *a = in_views[i].buf, *b = (char *)in_views[i].buf + in_views[i].len;
        if (out->len && a < hi && lo < b)
            return 1;
    }
    return 0;
}

/* After a call: was working[slot] changed, then copy pristine[src] into it. */
static void after(PyObject *types, PyObject *work, PyObject *pristine, ctl_t *ctl, int check) {
    Py_buffer w[MAX_LEAVES], p[MAX_LEAVES];
    int nw = buffers(work, types, w, MAX_LEAVES, 0, 1);
    int np_ = buffers(pristine, types, p, MAX_LEAVES, 0, 0);
    uint32_t mutated = 0;
    for (int i = 0; i < nw && i < np_ && nw == np_; i++) {
        if (w[i].len != p[i].len || !PyBuffer_IsContiguous(&w[i], 'C') ||
            !PyBuffer_IsContiguous(&p[i], 'C'))
            continue;
        if (w[i].readonly) {
            mutated |= check && memcmp(w[i].buf, p[i].buf, w[i].len) != 0;
            continue;
        }
        if (check && memcmp(w[i].buf, p[i].buf, w[i].len) != 0)
            mutated = 1;
        memcpy(w[i].buf, p[i].buf, w[i].len);
    }
    for (int i = 0; i < nw; i++)
        PyBuffer_Release(&w[i]);
    for (int i = 0; i < np_; i++)
        PyBuffer_Release(&p[i]);
    ctl->mutated = mutated;
}

static void run_call(block_t *b, PyObject *fn, PyObject *args, PyObject *types) {
    ctl_t *ctl = b->ctl;
    emit_t e = {b->base + META_OFF, 0, b->base + DATA_OFF, 0, b->size - DATA_OFF,
                PyTuple_GET_ITEM(types, 0), PyTuple_GET_ITEM(types, 1),
                PyTuple_GET_ITEM(types, 2), args, ST_OK, 0};
    in_count = buffers(args, types, in_views, MAX_LEAVES, 0, 0);
    PyObject *result = PyObject_Call(fn, args, NULL);
    if (!result) {
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        PyErr_NormalizeException(&type, &value, &tb);
        const char *name = type ? ((PyTypeObject *)type)->tp_name : "?";
        PyObject *text = value ? PyObject_Str(value) : NULL;  /* untrusted: evidence only */
        const char *msg = text ? PyUnicode_AsUTF8(text) : NULL;
        PyErr_Clear();
        snprintf(e.meta, META_CAP, "%s: %s", name, msg ? msg : "");
        e.meta_len = strlen(e.meta);
        Py_XDECREF(text);
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(tb);
        e.status = ST_RAISED;
    } else {
        if (emit(&e, result, 0) < 0 && e.status == ST_OK)
            e.status = ST_INTERNAL;
        PyErr_Clear();
        Py_DECREF(result);  /* may run a finaliser: before done, so it counts as the call */
    }
    for (int i = 0; i < in_count; i++)
        PyBuffer_Release(&in_views[i]);
    in_count = 0;
    ctl->status = e.status;
    ctl->aliases = e.aliases;
    ctl->meta_len = (uint32_t)e.meta_len;
    ctl->data_len = e.data_len;
}

static PyObject *serve(PyObject *self, PyObject *a) {
    int fd;
    Py_ssize_t size;
    PyObject *fn, *working, *pristine, *types;
    if (!PyArg_ParseTuple(a, "inOO!O!O!", &fd, &size, &fn, &PyList_Type, &working, &PyList_Type,
                          &pristine, &PyTuple_Type, &types))
        return NULL;
    if (PyTuple_GET_SIZE(types) != 3 || PyList_GET_SIZE(working) != PyList_GET_SIZE(pristine) ||
        size <= DATA_OFF) {
        PyErr_SetString(PyExc_ValueError, "serve: bad arguments");
        return NULL;
    }
    void *base = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (base == MAP_FAILED)
        return PyErr_SetFromErrno(PyExc_OSError);
    close(fd);  /* only this mapping remains: no Python object holds the block */
    Py_INCREF(fn);
    Py_INCREF(working);
    Py_INCREF(pristine);
    Py_INCREF(types);
    block_t b = {base, (size_t)size, base};
    ctl_t *ctl = b.ctl;
    atomic_store(&ctl->abi, KREX_DISPATCH_ABI);
    uint32_t seen = atomic_load(&ctl->ready);  /* a request may be published already */
    for (;;) {
        Py_BEGIN_ALLOW_THREADS  /* idle: the candidate's own threads may run (and are seen) */
        wait_word(&ctl->req, seen, 0, 0);
        Py_END_ALLOW_THREADS
        seen = atomic_load_explicit(&ctl->req, memory_order_acquire);
        int op = ctl->op, slot = ctl->slot, src = ctl->src;
        if (op == OP_EXIT)
            break;
        int valid = slot >= 0 && slot < PyList_GET_SIZE(working);
        ctl->mutated = ctl->aliases = 0;
        if (op == OP_CALL && valid) {
            run_call(&b, fn, PyList_GET_ITEM(working, slot), types);
        } else {
            size_t n = op == OP_EMPTY && src > 0 ? (size_t)src : 0;
            if (n && 2 * n <= b.size - DATA_OFF)  /* the output's copy, without an output */
                memcpy(b.base + DATA_OFF, b.base + DATA_OFF + n, n);
            ctl->status = (op == OP_EMPTY || op == OP_REFILL) ? ST_OK : ST_INTERNAL;
            ctl->meta_len = 0;
            ctl->data_len = 0;
        }
        atomic_store_explicit(&ctl->done, seen, memory_order_release);
        futex_wake(&ctl->done);
        /* outside the timed span: the mutation check and fresh inputs for the next call */
        if (valid && (op == OP_CALL || op == OP_REFILL)) {
            int from = op == OP_REFILL && src >= 0 && src < PyList_GET_SIZE(pristine) ? src : slot;
            after(types, PyList_GET_ITEM(working, slot),
                  PyList_GET_ITEM(pristine, from), ctl, op == OP_CALL);
        }
        atomic_store_explicit(&ctl->ready, seen, memory_order_release);
        futex_wake(&ctl->ready);
    }
    atomic_store_explicit(&ctl->done, seen, memory_order_release);
    futex_wake(&ctl->done);
    munmap(base, size);
    Py_DECREF(fn);
    Py_DECREF(working);
    Py_DECREF(pristine);
    Py_DECREF(types);
    Py_RETURN_NONE;
}

/* -- the driver ----------------------------------------------------------------------- */

enum { W_DONE = 0, W_IN_FLIGHT = 1, W_NOT_READY = 2 };

static ctl_t *block_of(Py_buffer *view) {
    if (view->len <= DATA_OFF) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_ValueError, "dispatch: block too small");
        return NULL;
    }
    return view->buf;
}

/* call(block, op, slot, src, timeout_ns) -> (state, t0_ns, t1_ns): W_NOT_READY (the previous
 * call's after-work is not done: nothing published), W_IN_FLIGHT (published, not done
 * within timeout_ns: continue with wait()), W_DONE (t1_ns is when done was seen). */
static PyObject *call(PyObject *self, PyObject *a) {
    Py_buffer view;
    int op, slot, src, state = W_NOT_READY;
    long long timeout_ns;
    if (!PyArg_ParseTuple(a, "w*iiiL", &view, &op, &slot, &src, &timeout_ns))
        return NULL;
    ctl_t *ctl = block_of(&view);
    if (!ctl)
        return NULL;
    int64_t t0 = 0, t1 = 0;
    Py_BEGIN_ALLOW_THREADS
    uint32_t req = atomic_load(&ctl->req);
    if (wait_word(&ctl->ready, req, 1, now_ns() + timeout_ns) == 0) {
        ctl->op = op;
        ctl->slot = slot;
        ctl->src = src;
        t0 = now_ns();
        atomic_store_explicit(&ctl->req, req + 1, memory_order_release);
        futex_wake(&ctl->req);
        state = wait_word(&ctl->done, req + 1, 1, t0 + timeout_ns) ? W_IN_FLIGHT : W_DONE;
        t1 = now_ns();
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    return Py_BuildValue("iLL", state, (long long)t0, (long long)t1);
}

/* Parse (block, timeout_ns) and wait, the GIL released, for the call in flight's word
 * `done` (or `ready`: its after-work); *came: whether it came, *t1: when the wait ended.
 * 0, or -1 with an exception set. */
static int wait_in_flight(PyObject *a, int ready, int *came, int64_t *t1) {
    Py_buffer view;
    long long timeout_ns;
    if (!PyArg_ParseTuple(a, "w*L", &view, &timeout_ns))
        return -1;
    ctl_t *ctl = block_of(&view);
    if (!ctl)
        return -1;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    uint32_t req = atomic_load(&ctl->req);
    rc = wait_word(ready ? &ctl->ready : &ctl->done, req, 1, now_ns() + timeout_ns);
    *t1 = now_ns();
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    *came = rc == 0;
    return 0;
}

/* wait(block, timeout_ns) -> (state, t1_ns): keep waiting for the call in flight. */
static PyObject *wait_done(PyObject *self, PyObject *a) {
    int came;
    int64_t t1;
    if (wait_in_flight(a, 0, &came, &t1) < 0)
        return NULL;
    return Py_BuildValue("iL", came ? W_DONE : W_IN_FLIGHT, (long long)t1);
}

/* settle(block, timeout_ns) -> bool: the last call's after-work (mutation flag) is done. */
static PyObject *settle(PyObject *self, PyObject *a) {
    int came;
    int64_t t1;
    if (wait_in_flight(a, 1, &came, &t1) < 0)
        return NULL;
    return PyBool_FromLong(came);
}

static PyObject *layout(PyObject *self, PyObject *unused) {
    return Py_BuildValue("{s:i,s:i,s:i,s:i}", "abi", KREX_DISPATCH_ABI, "meta_offset", META_OFF,
                         "meta_capacity", META_CAP, "data_offset", DATA_OFF);
}

static PyMethodDef methods[] = {
    {"serve", serve, METH_VARARGS, "serve(fd, size, fn, working, pristine, types): callee loop"},
    {"call", call, METH_VARARGS, "call(block, op, slot, src, timeout_ns) -> (state, t0, t1)"},
    {"wait", wait_done, METH_VARARGS, "wait(block, timeout_ns) -> (state, t1)"},
    {"settle", settle, METH_VARARGS, "settle(block, timeout_ns) -> the after-work is done"},
    {"layout", layout, METH_NOARGS, "the shared block's layout"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_dispatch", NULL, -1, methods,
                                     NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__dispatch(void) { return PyModule_Create(&module); }
