/* The summing pool's threads in C (reducerd.core.summing): no GIL to sum.
 *
 * N worker threads, one FIFO (a partition) each. A task is either
 *   - a sum: widen or add one contribution into a chunk's float32
 *     accumulator, or finish it (divide for MEAN, narrow into the reply's
 *     payload), or a mark (nothing: its completion says every task queued
 *     before it on the partition ran), all with the wire kernels'
 *     C API (reducer_wire/_api.h) and no GIL; or
 *   - a call: a Python callable run with the GIL (tests, and the NumPy path
 *     when the daemon runs without the C kernels).
 * A thread that finds a chunk's copy or add at the head of its FIFO takes the
 * adds to that chunk queued behind it too (up to coalesce_at_most), and the
 * chunk's finish if it comes next, and runs them in one pass, 16 KiB of
 * accumulator at a time: the same operations per
 * element in the same order, with the accumulator read and written once per
 * pass instead of once per add (1.4x the input per second with 2 adds in a
 * pass, 2x with 8, on Intel family 6 model 207). It happens when the threads
 * are behind, which is when it pays.
 * A sum task holds its contribution or payload (a Py_buffer view, so it
 * cannot be resized or freed), its chunk's Accumulator (memory the pool owns)
 * and a `done` object until the event loop's thread takes them back:
 * take_done() releases them and returns the done objects in the order
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
 * the readers: scripts/daemon_threads.py.)
 *
 * This file: the Pool type (creation, start, waits, close) and the module;
 * _sumpool_threads.c: the summing threads; _sumpool_tasks.c: queueing and
 * taking back tasks, and the Accumulator type; _sumpool.h: what they share.
 */
#include "_sumpool.h"

/* ---- the Pool type ---- */

/* A kernel module's C API capsule into *api; NULL where the module was not
 * built (NumPy sums those dtypes, as Python tasks). -1 with an exception if
 * it is there but does not match. Both APIs start with their version. */
static int import_api(const char *module, const char *capsule, const void **api) {
    *api = NULL;
    PyObject *m = PyImport_ImportModule(module);
    if (m == NULL) {
        PyErr_Clear();
        return 0;
    }
    Py_DECREF(m);
    *api = PyCapsule_Import(capsule, 0);
    if (*api == NULL) return -1;
    if (*(const int *)*api != RW_API_VERSION) {
        PyErr_Format(PyExc_ImportError, "%s has version %d, the summing pool needs %d",
                     capsule, *(const int *)*api, RW_API_VERSION);
        return -1;
    }
    return 0;
}

static int load_api(Pool *p) {
    const void *kernels, *quant;
    if (import_api("reducer_wire._kernels", "reducer_wire._kernels._C_API", &kernels) < 0 ||
            import_api("reducer_wire._quant", "reducer_wire._quant._C_API", &quant) < 0)
        return -1;
    if (kernels != NULL) {
        const rw_kernels_api *k = kernels;
        p->codecs[CODEC_FLOAT16] = k->float16;
        p->codecs[CODEC_BFLOAT16] = k->bfloat16;
        p->has_codec[CODEC_FLOAT16] = p->has_codec[CODEC_BFLOAT16] = 1;
    }
    if (quant != NULL) {
        const rw_quant_api *q = quant;
        p->codecs[CODEC_INT8] = q->int8;
        p->codecs[CODEC_FP8] = q->fp8;
        p->has_codec[CODEC_INT8] = p->has_codec[CODEC_FP8] = 1;
    }
    p->codecs[CODEC_FLOAT32] = sp_float32_codec;
    p->has_codec[CODEC_FLOAT32] = 1;
    return 0;
}

static PyObject *Pool_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    static char *names[] = {"threads", "queued_bytes_at_most", "coalesce_at_most", NULL};
    int threads, coalesce = COALESCE_DEFAULT;
    Py_ssize_t at_most;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "in|i", names, &threads, &at_most, &coalesce))
        return NULL;
    if (threads < 1 || at_most < 0) {
        PyErr_Format(PyExc_ValueError, "Pool: threads must be >= 1 and queued_bytes_at_most "
                     ">= 0, got %d, %zd", threads, at_most);
        return NULL;
    }
    if (coalesce < 1 || coalesce > COALESCE_LIMIT) {
        PyErr_Format(PyExc_ValueError, "Pool: coalesce_at_most must be within [1, %d], got %d",
                     COALESCE_LIMIT, coalesce);
        return NULL;
    }
    Pool *p = (Pool *)type->tp_alloc(type, 0);
    if (p == NULL) return NULL;
    p->efd = -1;
    p->threads = threads;
    p->queued_bytes_at_most = at_most;
    p->coalesce_at_most = coalesce;
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
        int err = pthread_create(&p->workers[i], NULL, sp_worker_main, a);
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

/* (copies and adds run, of those run in a pass with others, finishes run in
 * a pass) so far */
static PyObject *Pool_sums(Pool *p, PyObject *unused) {
    Py_ssize_t summed, coalesced, finished;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&p->lock);
    summed = p->summed;
    coalesced = p->coalesced;
    finished = p->finished_in_pass;
    pthread_mutex_unlock(&p->lock);
    Py_END_ALLOW_THREADS
    return Py_BuildValue("(nnn)", summed, coalesced, finished);
}

static void Pool_dealloc(Pool *p) {
    /* Workers hold a reference until joined, so none runs here. */
    for (size_t i = 0; i < p->done_count; i++) sp_release_task(&p->done[i]);
    free(p->done);
    if (p->parts) {
        for (int i = 0; i < p->threads; i++) {
            partition_t *part = &p->parts[i];
            for (size_t k = 0; k < part->count; k++)
                sp_release_task(&part->items[(part->head + k) % part->cap]);
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
    {"submit_sum", (PyCFunction)sp_submit_sum, METH_VARARGS,
     "submit_sum(partition, kind, acc, wire, codec, param, numel, nbytes, done[, divisor]) "
     "-> bool (False: the pool is closed)."},
    {"submit_mark", (PyCFunction)sp_submit_mark, METH_VARARGS,
     "submit_mark(partition, done[, acc]) -> bool."},
    {"new_accumulator", (PyCFunction)sp_new_accumulator, METH_O,
     "new_accumulator(numel) -> Accumulator: float32 memory, not touched yet."},
    {"submit_call", (PyCFunction)sp_submit_call, METH_VARARGS,
     "submit_call(partition, fn, args, nbytes) -> bool: fn(*args) with the GIL."},
    {"take_done", (PyCFunction)sp_take_done, METH_NOARGS,
     "take_done() -> list: the done objects of the sums finished since the last call."},
    {"pick_partition", (PyCFunction)sp_pick_partition, METH_O,
     "pick_partition(start) -> int: the least loaded partition, from start on ties."},
    {"wait_idle", (PyCFunction)Pool_wait_idle, METH_O, "wait_idle(timeout_s) -> bool."},
    {"close", (PyCFunction)Pool_close, METH_O, "close(timeout_s) -> bool."},
    {"fileno", (PyCFunction)Pool_fileno, METH_NOARGS, "The eventfd readable when sums wait."},
    {"sums", (PyCFunction)Pool_sums, METH_NOARGS,
     "sums() -> (copies and adds run, those of them run in a pass with others, finishes "
     "run in a pass with their chunk's adds), so far."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef pool_getset[] = {
    {"pending", (getter)get_pending, NULL, "tasks queued or running", NULL},
    {"queued_bytes", (getter)get_queued, NULL, "input queued", NULL},
    {"started", (getter)get_started, NULL, "whether the threads run", NULL},
    {"spare_bytes", (getter)sp_spare_bytes, NULL, "accumulator memory kept as spares", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject PoolType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "reducerd.core._sumpool.Pool",
    .tp_basicsize = sizeof(Pool),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Summing threads in C (see reducerd/core/_sumpool.c).",
    .tp_new = Pool_new,
    .tp_dealloc = (destructor)Pool_dealloc,
    .tp_methods = pool_methods,
    .tp_getset = pool_getset,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_sumpool", "The summing pool's threads in C.", -1, NULL,
};

PyMODINIT_FUNC PyInit__sumpool(void) {
    if (PyType_Ready(&PoolType) < 0 || PyType_Ready(&SpAccType) < 0) return NULL;
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
