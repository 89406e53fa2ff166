/* The summing pool's threads in C (reducerd.summing): no GIL to sum.
 *
 * N worker threads, one FIFO (a partition) each. A task is either
 *   - a sum: widen or add one contribution into a chunk's float32
 *     accumulator, or finish it (divide for MEAN, narrow into the reply's
 *     payload), or a mark (nothing: its completion says every task queued
 *     before it on the partition ran), all with the wire kernels'
 *     C API (reducer_wire/_api.h) and no GIL; or
 *   - a call: a Python callable run with the GIL (tests, and the NumPy path
 *     when the daemon runs without the C kernels).
 * A sum task holds its buffers (Py_buffer views, so they cannot be resized or
 * freed) and a `done` object until the event loop's thread takes them back:
 * take_done() releases the views and returns the done objects in the order
 * the tasks finished, the loop then does the bookkeeping (memory room, result
 * delivery). Workers never wait for the loop: they append to the done list
 * and, when it was empty, wake the loop once, through an eventfd the loop
 * watches (add_reader) or, without one, by calling `notify` with the GIL.
 *
 * Bounds: submit waits (GIL released) while more than `queued_bytes_at_most`
 * of input is queued, until half of it is left, as the Python pool does. An
 * idle worker sleeps on its partition's condition, signalled only when it
 * sleeps. (Spinning 20-200 us before sleeping was measured: no faster in the
 * table's own run, and slower on loopback, where the spinning took CPU from
 * the readers: docs/scaling.md.)
 */
#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

#include "../protos/python/reducer_wire/_api.h"

/* Wire codecs, by the numbers the Python side passes (reducerd.summing). */
enum { CODEC_FLOAT32 = 0, CODEC_FLOAT16, CODEC_BFLOAT16, CODEC_INT8, CODEC_FP8, CODECS };
enum { TASK_COPY = 0, TASK_ADD, TASK_FINISH, TASK_MARK, TASK_CALL };

typedef struct {
    int kind, codec;
    Py_ssize_t param, numel, nbytes;  /* nbytes: input counted against the bound */
    float divisor;                    /* TASK_FINISH: > 0 divides the sum (MEAN) */
    struct Acc *acc;                  /* the chunk's accumulator (a reference) */
    Py_buffer wire;                   /* the contribution, or the reply's payload */
    int has_wire;
    PyObject *done;                   /* TASK_CALL: (callable, args) */
} task_t;

/* A chunk's float32 accumulator, owned here: its first task may swap in the
 * partition's spare (the last finished chunk's, still in that core's cache),
 * and its finish (or a mark) hands its memory to the partition as the spare.
 * Touched by its partition's thread only while it has tasks queued. */
typedef struct Acc {
    PyObject_HEAD
    float *buf;        /* NULL once given back */
    Py_ssize_t numel;
    PyObject *weakrefs;
} Acc;

static PyTypeObject AccType;

typedef struct {
    task_t *items;
    size_t cap, head, count;  /* a ring */
    Py_ssize_t queued_bytes;
    int sleeping;
    pthread_cond_t ready;
    float *spare;             /* one accumulator's memory kept for the next chunk (its thread's) */
    Py_ssize_t spare_numel;
} partition_t;

typedef struct {
    PyObject_HEAD
    int threads, started, closed, stop, ready, signaled;
    Py_ssize_t live, queued_bytes, queued_bytes_at_most, pending;
    int waiters;
    pthread_mutex_t lock;        /* guards everything here and in the partitions */
    pthread_cond_t changed;      /* room, idle, a worker exiting */
    partition_t *parts;
    pthread_t *workers;
    task_t *done;                /* finished sum tasks, not yet taken */
    size_t done_count, done_cap;
    int efd;
    PyObject *notify;            /* called with the GIL when there is no watched eventfd */
    int watched;
    rw_codec codecs[CODECS];
    int has_codec[CODECS];
} Pool;

typedef struct { Pool *pool; int index; } worker_arg;

static void f32_widen(const char *src, float *dst, Py_ssize_t n, Py_ssize_t p) {
    (void)p;
    memcpy(dst, src, (size_t)n * 4);
}

static void f32_add(float *acc, const char *src, Py_ssize_t n, Py_ssize_t p) {
    (void)p;
    for (Py_ssize_t i = 0; i < n; i++) {
        float v;
        memcpy(&v, src + 4 * i, 4);
        acc[i] += v;
    }
}

static void f32_narrow(const float *src, char *dst, Py_ssize_t n, Py_ssize_t p) {
    (void)p;
    memcpy(dst, src, (size_t)n * 4);
}

/* Spares larger than this are freed instead (they are not counted in the
 * daemon's memory budget: at most one per summing thread). */
#define SPARE_NUMEL_AT_MOST (1 << 20)  /* 4 MiB of float32: a 1 MiB chunk of any wire */

static void release_task(task_t *t) {  /* with the GIL */
    if (t->has_wire) PyBuffer_Release(&t->wire);
    t->has_wire = 0;
    Py_CLEAR(t->acc);
    Py_CLEAR(t->done);
}

/* The chunk is done with its accumulator: its memory becomes the spare. */
static void give_back(partition_t *part, Acc *a) {
    if (a->buf == NULL) return;
    if (a->numel <= SPARE_NUMEL_AT_MOST) {
        free(part->spare);
        part->spare = a->buf;
        part->spare_numel = a->numel;
    } else {
        free(a->buf);
    }
    a->buf = NULL;
}

static void run_sum(Pool *p, partition_t *part, task_t *t) {
    const rw_codec *c = &p->codecs[t->codec];
    Acc *a = t->acc;
    if (a == NULL || a->buf == NULL) return;  /* a mark alone; or given back (never queued so) */
    if (t->kind == TASK_MARK) {
        give_back(part, a);
        return;
    }
    if (t->kind == TASK_COPY && part->spare != NULL && part->spare_numel == a->numel) {
        float *fresh = a->buf;  /* never touched: it waits as the spare instead */
        a->buf = part->spare;
        part->spare = fresh;
    }
    float *acc = a->buf;
    switch (t->kind) {
    case TASK_COPY: c->widen((const char *)t->wire.buf, acc, a->numel, t->param); break;
    case TASK_ADD: c->add(acc, (const char *)t->wire.buf, a->numel, t->param); break;
    case TASK_FINISH:
        if (t->divisor > 0) {
            float d = t->divisor;
            for (Py_ssize_t i = 0; i < a->numel; i++) acc[i] = acc[i] / d;
        }
        c->narrow(acc, (char *)t->wire.buf, a->numel, t->param);
        give_back(part, a);
        break;
    default: break;
    }
}

static void run_call(task_t *t) {  /* with the GIL */
    PyObject *fn = PyTuple_GET_ITEM(t->done, 0), *args = PyTuple_GET_ITEM(t->done, 1);
    PyObject *r = PyObject_CallObject(fn, args);
    if (r == NULL) PyErr_WriteUnraisable(fn);
    Py_XDECREF(r);
    Py_CLEAR(t->done);
}

/* Wake the loop for the done list (called without the lock); *ts is the
 * worker's thread state, for the GIL. */
static void wake_loop(Pool *p, PyThreadState **ts) {
    if (p->watched) {
        uint64_t one = 1;
        ssize_t ignored = write(p->efd, &one, sizeof one);
        (void)ignored;
        return;
    }
    PyEval_RestoreThread(*ts);
    if (p->notify != NULL) {
        PyObject *r = PyObject_CallNoArgs(p->notify);
        if (r == NULL) PyErr_WriteUnraisable(p->notify);
        Py_XDECREF(r);
    }
    *ts = PyEval_SaveThread();
}

/* Take the partition's next task into *out; 0 once stopped and empty. */
static int next_task(Pool *p, partition_t *part, task_t *out) {
    pthread_mutex_lock(&p->lock);
    while (part->count == 0 && !p->stop) {
        part->sleeping = 1;
        pthread_cond_wait(&part->ready, &p->lock);
        part->sleeping = 0;
    }
    if (part->count == 0) {
        pthread_mutex_unlock(&p->lock);
        return 0;
    }
    *out = part->items[part->head];
    part->head = (part->head + 1) % part->cap;
    __atomic_store_n(&part->count, part->count - 1, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&p->lock);
    return 1;
}

static int grow_done(Pool *p) {  /* with the lock */
    if (p->done_count < p->done_cap) return 0;
    size_t cap = p->done_cap ? 2 * p->done_cap : 64;
    task_t *items = realloc(p->done, cap * sizeof *items);
    if (items == NULL) return -1;
    p->done = items;
    p->done_cap = cap;
    return 0;
}

static void *worker_main(void *raw) {
    worker_arg a = *(worker_arg *)raw;
    free(raw);
    Pool *p = a.pool;
    partition_t *part = &p->parts[a.index];
    char name[24];  /* cut to 15 characters: the kernel's limit */
    snprintf(name, sizeof name, "reducerd-sum-%d", a.index);
    name[15] = 0;
    pthread_setname_np(pthread_self(), name);
    /* One thread state for the thread's life (not one per Python task). */
    PyGILState_STATE gil = PyGILState_Ensure();
    PyThreadState *ts = PyEval_SaveThread();
    pthread_mutex_lock(&p->lock);
    p->ready++;  /* start() returns once every thread has its state: none needs the GIL later */
    pthread_cond_broadcast(&p->changed);
    pthread_mutex_unlock(&p->lock);
    task_t t;
    while (next_task(p, part, &t)) {
        int wake = 0;
        if (t.kind == TASK_CALL) {
            PyEval_RestoreThread(ts);
            run_call(&t);
            ts = PyEval_SaveThread();
        } else {
            run_sum(p, part, &t);
        }
        pthread_mutex_lock(&p->lock);
        if (t.kind != TASK_CALL) {
            while (grow_done(p) < 0) {  /* out of memory: wait for the loop to take some */
                pthread_mutex_unlock(&p->lock);
                usleep(1000);
                pthread_mutex_lock(&p->lock);
            }
            p->done[p->done_count++] = t;
            if (!p->signaled) p->signaled = wake = 1;
        }
        pthread_mutex_unlock(&p->lock);
        if (wake) wake_loop(p, &ts);  /* before the task counts as finished (wait_idle) */
        pthread_mutex_lock(&p->lock);
        part->queued_bytes -= t.nbytes;
        p->queued_bytes -= t.nbytes;
        p->pending--;
        if (p->waiters) pthread_cond_broadcast(&p->changed);
        pthread_mutex_unlock(&p->lock);
    }
    PyEval_RestoreThread(ts);
    PyGILState_Release(gil);
    pthread_mutex_lock(&p->lock);
    p->live--;
    pthread_cond_broadcast(&p->changed);
    pthread_mutex_unlock(&p->lock);
    return NULL;
}

/* ---- Python side ---- */

static int load_api(Pool *p) {
    PyObject *m = PyImport_ImportModule("reducer_wire._kernels");
    if (m != NULL) {
        Py_DECREF(m);
        const rw_kernels_api *k = PyCapsule_Import("reducer_wire._kernels._C_API", 0);
        if (k == NULL || k->version != RW_API_VERSION) return -1;
        p->codecs[CODEC_FLOAT16] = k->float16;
        p->codecs[CODEC_BFLOAT16] = k->bfloat16;
        p->has_codec[CODEC_FLOAT16] = p->has_codec[CODEC_BFLOAT16] = 1;
    } else {
        PyErr_Clear();
    }
    m = PyImport_ImportModule("reducer_wire._quant");
    if (m != NULL) {
        Py_DECREF(m);
        const rw_quant_api *q = PyCapsule_Import("reducer_wire._quant._C_API", 0);
        if (q == NULL || q->version != RW_API_VERSION) return -1;
        p->codecs[CODEC_INT8] = q->int8;
        p->codecs[CODEC_FP8] = q->fp8;
        p->has_codec[CODEC_INT8] = p->has_codec[CODEC_FP8] = 1;
    } else {
        PyErr_Clear();
    }
    p->codecs[CODEC_FLOAT32] = (rw_codec){f32_widen, f32_add, f32_narrow};
    p->has_codec[CODEC_FLOAT32] = 1;
    return 0;
}

static PyObject *Pool_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    static char *names[] = {"threads", "queued_bytes_at_most", NULL};
    int threads;
    Py_ssize_t at_most;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "in", names, &threads, &at_most))
        return NULL;
    if (threads < 1 || at_most < 0) {
        PyErr_Format(PyExc_ValueError, "Pool: threads must be >= 1 and queued_bytes_at_most "
                     ">= 0, got %d, %zd", threads, at_most);
        return NULL;
    }
    Pool *p = (Pool *)type->tp_alloc(type, 0);
    if (p == NULL) return NULL;
    p->efd = -1;
    p->threads = threads;
    p->queued_bytes_at_most = at_most;
    pthread_mutex_init(&p->lock, NULL);
    pthread_cond_init(&p->changed, NULL);
    p->parts = calloc((size_t)threads, sizeof *p->parts);
    p->workers = calloc((size_t)threads, sizeof *p->workers);
    if (p->parts == NULL || p->workers == NULL) {
        Py_DECREF(p);
        return PyErr_NoMemory();
    }
    for (int i = 0; i < threads; i++) pthread_cond_init(&p->parts[i].ready, NULL);
    p->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (p->efd < 0 || load_api(p) < 0) {
        if (!PyErr_Occurred()) PyErr_SetFromErrno(PyExc_OSError);
        Py_DECREF(p);
        return NULL;
    }
    return (PyObject *)p;
}

static PyObject *Pool_start(Pool *p, PyObject *args, PyObject *kw) {
    static char *names[] = {"notify", "watched", NULL};
    PyObject *notify;
    int watched;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "Op", names, &notify, &watched)) return NULL;
    if (p->started) {
        PyErr_SetString(PyExc_RuntimeError, "summing pool already started");
        return NULL;
    }
    Py_INCREF(notify);
    p->notify = notify;
    p->watched = watched;
    for (int i = 0; i < p->threads; i++) {
        worker_arg *a = malloc(sizeof *a);
        if (a == NULL) return PyErr_NoMemory();
        a->pool = p;
        a->index = i;
        Py_INCREF(p);  /* each worker holds the pool until close() joined it */
        pthread_mutex_lock(&p->lock);
        p->live++;
        pthread_mutex_unlock(&p->lock);
        int err = pthread_create(&p->workers[i], NULL, worker_main, a);
        if (err) {
            free(a);
            Py_DECREF(p);
            pthread_mutex_lock(&p->lock);
            p->live--;
            pthread_mutex_unlock(&p->lock);
            errno = err;
            return PyErr_SetFromErrno(PyExc_OSError);
        }
        p->started = i + 1;
    }
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&p->lock);
    while (p->ready < p->started) pthread_cond_wait(&p->changed, &p->lock);
    pthread_mutex_unlock(&p->lock);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* Queue t on `partition`, waiting for room; 0, or -1 with an exception,
 * or 1 if the pool is closed (t is not queued). With the GIL. */
static int enqueue(Pool *p, int partition, task_t *t) {
    if (partition < 0 || partition >= p->threads) {
        PyErr_Format(PyExc_ValueError, "partition %d: the pool has %d", partition, p->threads);
        return -1;
    }
    partition_t *part = &p->parts[partition];
    int closed = 0, oom = 0, wake = 0;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&p->lock);
    if (p->queued_bytes && !p->closed
            && p->queued_bytes + t->nbytes > p->queued_bytes_at_most) {
        p->waiters++;
        while (p->queued_bytes > p->queued_bytes_at_most / 2 && !p->closed)
            pthread_cond_wait(&p->changed, &p->lock);
        p->waiters--;
    }
    if (p->closed) {
        closed = 1;
    } else if (part->count == part->cap) {
        size_t cap = part->cap ? 2 * part->cap : 16;
        task_t *items = malloc(cap * sizeof *items);
        if (items == NULL) {
            oom = 1;
        } else {
            for (size_t i = 0; i < part->count; i++)
                items[i] = part->items[(part->head + i) % part->cap];
            free(part->items);
            part->items = items;
            part->cap = cap;
            part->head = 0;
        }
    }
    if (!closed && !oom) {
        part->items[(part->head + part->count) % part->cap] = *t;
        __atomic_store_n(&part->count, part->count + 1, __ATOMIC_RELEASE);
        part->queued_bytes += t->nbytes;
        p->queued_bytes += t->nbytes;
        p->pending++;
        wake = part->sleeping;
    }
    if (wake) pthread_cond_signal(&part->ready);
    pthread_mutex_unlock(&p->lock);
    Py_END_ALLOW_THREADS
    if (oom) {
        PyErr_NoMemory();
        return -1;
    }
    return closed;
}

static PyObject *queued(Pool *p, int partition, task_t *t) {
    int r = enqueue(p, partition, t);
    if (r < 0) {
        release_task(t);
        return NULL;
    }
    if (r == 1) release_task(t);
    return PyBool_FromLong(r == 0);  /* False: the pool was closed */
}

/* The wire bytes of n elements (reducer_wire.dtypes.wire_nbytes); -1 for a bad param. */
static Py_ssize_t wire_nbytes(int codec, Py_ssize_t n, Py_ssize_t param) {
    switch (codec) {
    case CODEC_FLOAT32: return 4 * n;
    case CODEC_FLOAT16: case CODEC_BFLOAT16: return 2 * n;
    case CODEC_INT8: return param < 1 ? -1 : 4 * ((n + param - 1) / param) + n;
    case CODEC_FP8: return param == 0 || param == 1 ? n : -1;
    default: return -1;
    }
}

static int check_codec(Pool *p, int codec) {
    if (codec < 0 || codec >= CODECS || !p->has_codec[codec]) {
        PyErr_Format(PyExc_ValueError, "codec %d: not one this pool can sum", codec);
        return -1;
    }
    return 0;
}

/* submit_sum(partition, kind, acc, wire, codec, param, nbytes, done[, divisor]) -> bool */
static PyObject *Pool_submit_sum(Pool *p, PyObject *args) {
    task_t t = {0};
    int partition;
    float divisor = 0;
    PyObject *wire;
    Acc *acc;
    if (!PyArg_ParseTuple(args, "iiO!OinnO|f", &partition, &t.kind, &AccType, &acc, &wire,
                          &t.codec, &t.param, &t.nbytes, &t.done, &divisor))
        return NULL;
    if (t.kind < TASK_COPY || t.kind > TASK_FINISH || check_codec(p, t.codec) < 0) {
        if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "task kind %d", t.kind);
        return NULL;
    }
    if (acc->buf == NULL) {
        PyErr_SetString(PyExc_ValueError, "submit_sum: the accumulator was given back");
        return NULL;
    }
    t.divisor = divisor;
    Py_INCREF(t.done);
    Py_INCREF(acc);
    t.acc = acc;
    t.numel = acc->numel;
    int flags = t.kind == TASK_FINISH ? PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS : PyBUF_C_CONTIGUOUS;
    if (PyObject_GetBuffer(wire, &t.wire, flags) < 0) {
        release_task(&t);
        return NULL;
    }
    t.has_wire = 1;
    Py_ssize_t expect = wire_nbytes(t.codec, t.numel, t.param);
    if (expect < 0 || t.wire.len != expect) {
        PyErr_Format(PyExc_ValueError, "submit_sum: %zd wire bytes for %zd elements of codec "
                     "%d (param %zd), which take %zd", t.wire.len, t.numel, t.codec, t.param,
                     expect);
        release_task(&t);
        return NULL;
    }
    return queued(p, partition, &t);
}

/* submit_mark(partition, done[, acc]) -> bool: with acc, its memory is given
 * back once the tasks queued before ran (a chunk that failed). */
static PyObject *Pool_submit_mark(Pool *p, PyObject *args) {
    task_t t = {0};
    int partition;
    Acc *acc = NULL;
    if (!PyArg_ParseTuple(args, "iO|O!", &partition, &t.done, &AccType, &acc)) return NULL;
    t.kind = TASK_MARK;
    Py_INCREF(t.done);
    Py_XINCREF(acc);
    t.acc = acc;
    return queued(p, partition, &t);
}

static PyObject *Pool_new_accumulator(Pool *p, PyObject *arg) {
    Py_ssize_t numel = PyLong_AsSsize_t(arg);
    if (numel == -1 && PyErr_Occurred()) return NULL;
    if (numel < 0) {
        PyErr_Format(PyExc_ValueError, "new_accumulator: %zd elements", numel);
        return NULL;
    }
    Acc *a = PyObject_New(Acc, &AccType);
    if (a == NULL) return NULL;
    a->weakrefs = NULL;
    a->numel = numel;
    /* Not touched here: its first task writes it (or swaps in the spare). */
    if (posix_memalign((void **)&a->buf, 64, (size_t)(numel ? numel : 1) * 4)) {
        a->buf = NULL;
        Py_DECREF(a);
        return PyErr_NoMemory();
    }
    return (PyObject *)a;
}

static PyObject *get_spare_bytes(Pool *p, void *c) {
    Py_ssize_t total = 0;
    pthread_mutex_lock(&p->lock);  /* a worker swaps spares under no lock: a hint */
    for (int i = 0; i < p->threads; i++)
        if (p->parts[i].spare != NULL) total += 4 * p->parts[i].spare_numel;
    pthread_mutex_unlock(&p->lock);
    return PyLong_FromSsize_t(total);
}

/* ---- the accumulator's Python type: its float32 memory as a buffer ---- */

static int Acc_getbuffer(Acc *a, Py_buffer *view, int flags) {
    if (a->buf == NULL) {
        PyErr_SetString(PyExc_BufferError, "the accumulator was given back");
        return -1;
    }
    return PyBuffer_FillInfo(view, (PyObject *)a, a->buf, 4 * a->numel, 0, flags);
}

static PyBufferProcs acc_buffer = {(getbufferproc)Acc_getbuffer, NULL};

static void Acc_dealloc(Acc *a) {
    if (a->weakrefs != NULL) PyObject_ClearWeakRefs((PyObject *)a);
    free(a->buf);
    PyObject_Free(a);
}

static PyObject *Acc_numel(Acc *a, void *c) { return PyLong_FromSsize_t(a->numel); }
static PyObject *Acc_nbytes(Acc *a, void *c) { return PyLong_FromSsize_t(4 * a->numel); }
static PyObject *Acc_held(Acc *a, void *c) { return PyBool_FromLong(a->buf != NULL); }

static PyGetSetDef acc_getset[] = {
    {"size", (getter)Acc_numel, NULL, "float32 elements", NULL},
    {"nbytes", (getter)Acc_nbytes, NULL, "bytes", NULL},
    {"held", (getter)Acc_held, NULL, "whether it still holds its memory", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject AccType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "reducerd._sumpool.Accumulator",
    .tp_basicsize = sizeof(Acc),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A chunk's float32 accumulator (Pool.new_accumulator); a buffer while held.",
    .tp_dealloc = (destructor)Acc_dealloc,
    .tp_as_buffer = &acc_buffer,
    .tp_getset = acc_getset,
    .tp_weaklistoffset = offsetof(Acc, weakrefs),
};

static PyObject *Pool_submit_call(Pool *p, PyObject *args) {
    task_t t = {0};
    int partition;
    PyObject *fn, *fargs;
    if (!PyArg_ParseTuple(args, "iOO!n", &partition, &fn, &PyTuple_Type, &fargs, &t.nbytes))
        return NULL;
    t.kind = TASK_CALL;
    t.done = PyTuple_Pack(2, fn, fargs);
    if (t.done == NULL) return NULL;
    return queued(p, partition, &t);
}

static PyObject *Pool_take_done(Pool *p, PyObject *unused) {
    uint64_t count;
    ssize_t ignored = read(p->efd, &count, sizeof count);  /* first: no wake-up is lost */
    (void)ignored;
    pthread_mutex_lock(&p->lock);
    task_t *items = p->done;
    size_t n = p->done_count;
    p->done = NULL;
    p->done_count = p->done_cap = 0;
    p->signaled = 0;
    pthread_mutex_unlock(&p->lock);
    PyObject *out = PyList_New((Py_ssize_t)n);
    for (size_t i = 0; i < n; i++) {
        if (out != NULL) {
            PyList_SET_ITEM(out, (Py_ssize_t)i, items[i].done);
            items[i].done = NULL;
        }
        release_task(&items[i]);
    }
    free(items);
    return out;
}

static PyObject *Pool_pick_partition(Pool *p, PyObject *start_obj) {
    Py_ssize_t start = PyLong_AsSsize_t(start_obj);
    if (start == -1 && PyErr_Occurred()) return NULL;
    start = ((start % p->threads) + p->threads) % p->threads;
    pthread_mutex_lock(&p->lock);
    Py_ssize_t best = start, best_bytes = p->parts[start].queued_bytes;
    for (int step = 1; step < p->threads; step++) {
        Py_ssize_t i = (start + step) % p->threads;
        if (p->parts[i].queued_bytes < best_bytes) best = i, best_bytes = p->parts[i].queued_bytes;
    }
    pthread_mutex_unlock(&p->lock);
    return PyLong_FromSsize_t(best);
}

/* The CLOCK_REALTIME time `seconds` from now (pthread_cond_timedwait's clock). */
static struct timespec deadline_after(double seconds) {
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    long ns = t.tv_nsec + (long)((seconds - (long)seconds) * 1e9);
    t.tv_sec += (time_t)seconds + ns / 1000000000L;
    t.tv_nsec = ns % 1000000000L;
    return t;
}

/* Wait (with the lock) on `changed` until *count is 0 or the deadline passed. */
static void wait_until_zero(Pool *p, const Py_ssize_t *count, const struct timespec *until) {
    p->waiters++;
    int err = 0;
    while (*count && err != ETIMEDOUT) err = pthread_cond_timedwait(&p->changed, &p->lock, until);
    p->waiters--;
}

static PyObject *Pool_wait_idle(Pool *p, PyObject *arg) {
    double timeout = PyFloat_AsDouble(arg);
    if (timeout == -1 && PyErr_Occurred()) return NULL;
    int idle;
    Py_BEGIN_ALLOW_THREADS
    struct timespec until = deadline_after(timeout);
    pthread_mutex_lock(&p->lock);
    wait_until_zero(p, &p->pending, &until);
    idle = p->pending == 0;
    pthread_mutex_unlock(&p->lock);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(idle);
}

/* close(timeout) -> bool: refuse new tasks, run the queued ones, stop the
 * threads; False if some were still busy after timeout (they stay running). */
static PyObject *Pool_close(Pool *p, PyObject *arg) {
    double timeout = PyFloat_AsDouble(arg);
    if (timeout == -1 && PyErr_Occurred()) return NULL;
    Py_ssize_t live;
    Py_BEGIN_ALLOW_THREADS
    struct timespec until = deadline_after(timeout);
    pthread_mutex_lock(&p->lock);
    p->closed = 1;
    __atomic_store_n(&p->stop, 1, __ATOMIC_RELEASE);  /* workers drain their queues first */
    for (int i = 0; i < p->threads; i++) pthread_cond_signal(&p->parts[i].ready);
    pthread_cond_broadcast(&p->changed);
    wait_until_zero(p, &p->live, &until);
    live = p->live;
    pthread_mutex_unlock(&p->lock);
    Py_END_ALLOW_THREADS
    if (live == 0) {
        for (int i = 0; i < p->started; i++) {
            Py_BEGIN_ALLOW_THREADS
            pthread_join(p->workers[i], NULL);
            Py_END_ALLOW_THREADS
            Py_DECREF(p);
        }
        p->started = 0;
    }
    return PyBool_FromLong(live == 0);
}

static PyObject *Pool_fileno(Pool *p, PyObject *unused) { return PyLong_FromLong(p->efd); }

static PyObject *get_pending(Pool *p, void *c) { return PyLong_FromSsize_t(p->pending); }
static PyObject *get_queued(Pool *p, void *c) { return PyLong_FromSsize_t(p->queued_bytes); }
static PyObject *get_started(Pool *p, void *c) { return PyBool_FromLong(p->started > 0); }

static void Pool_dealloc(Pool *p) {
    /* Workers hold a reference until joined, so none runs here. */
    for (size_t i = 0; i < p->done_count; i++) release_task(&p->done[i]);
    free(p->done);
    if (p->parts) {
        for (int i = 0; i < p->threads; i++) {
            partition_t *part = &p->parts[i];
            for (size_t k = 0; k < part->count; k++)
                release_task(&part->items[(part->head + k) % part->cap]);
            free(part->items);
            free(part->spare);
            pthread_cond_destroy(&part->ready);
        }
    }
    free(p->parts);
    free(p->workers);
    if (p->efd >= 0) close(p->efd);
    Py_XDECREF(p->notify);
    pthread_mutex_destroy(&p->lock);
    pthread_cond_destroy(&p->changed);
    Py_TYPE(p)->tp_free((PyObject *)p);
}

static PyMethodDef pool_methods[] = {
    {"start", (PyCFunction)(void (*)(void))Pool_start, METH_VARARGS | METH_KEYWORDS,
     "start(notify, watched): start the threads; notify() is called with the GIL when "
     "finished sums wait and the eventfd is not watched."},
    {"submit_sum", (PyCFunction)Pool_submit_sum, METH_VARARGS,
     "submit_sum(partition, kind, acc, wire, codec, param, numel, nbytes, done[, divisor]) "
     "-> bool (False: the pool is closed)."},
    {"submit_mark", (PyCFunction)Pool_submit_mark, METH_VARARGS,
     "submit_mark(partition, done[, acc]) -> bool."},
    {"new_accumulator", (PyCFunction)Pool_new_accumulator, METH_O,
     "new_accumulator(numel) -> Accumulator: float32 memory, not touched yet."},
    {"submit_call", (PyCFunction)Pool_submit_call, METH_VARARGS,
     "submit_call(partition, fn, args, nbytes) -> bool: fn(*args) with the GIL."},
    {"take_done", (PyCFunction)Pool_take_done, METH_NOARGS,
     "take_done() -> list: the done objects of the sums finished since the last call."},
    {"pick_partition", (PyCFunction)Pool_pick_partition, METH_O,
     "pick_partition(start) -> int: the least loaded partition, from start on ties."},
    {"wait_idle", (PyCFunction)Pool_wait_idle, METH_O, "wait_idle(timeout_s) -> bool."},
    {"close", (PyCFunction)Pool_close, METH_O, "close(timeout_s) -> bool."},
    {"fileno", (PyCFunction)Pool_fileno, METH_NOARGS, "The eventfd readable when sums wait."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef pool_getset[] = {
    {"pending", (getter)get_pending, NULL, "tasks queued or running", NULL},
    {"queued_bytes", (getter)get_queued, NULL, "input queued", NULL},
    {"started", (getter)get_started, NULL, "whether the threads run", NULL},
    {"spare_bytes", (getter)get_spare_bytes, NULL, "accumulator memory kept as spares", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject PoolType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "reducerd._sumpool.Pool",
    .tp_basicsize = sizeof(Pool),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Summing threads in C (see reducerd/_sumpool.c).",
    .tp_new = Pool_new,
    .tp_dealloc = (destructor)Pool_dealloc,
    .tp_methods = pool_methods,
    .tp_getset = pool_getset,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_sumpool", "The summing pool's threads in C.", -1, NULL,
};

PyMODINIT_FUNC PyInit__sumpool(void) {
    if (PyType_Ready(&PoolType) < 0 || PyType_Ready(&AccType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&PoolType);
    if (PyModule_AddObject(m, "Pool", (PyObject *)&PoolType) < 0) {
        Py_DECREF(&PoolType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
