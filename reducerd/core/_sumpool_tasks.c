/* Queueing a pool's tasks, taking back the finished ones, and the
 * Accumulator type (see _sumpool.c). All with the GIL; a submit waits for
 * room with it released. */
#include "_sumpool.h"

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
        sp_release_task(t);
        return NULL;
    }
    if (r == 1) sp_release_task(t);
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
PyObject *sp_submit_sum(Pool *p, PyObject *args) {
    task_t t = {0};
    int partition;
    float divisor = 0;
    PyObject *wire;
    Acc *acc;
    if (!PyArg_ParseTuple(args, "iiO!OinnO|f", &partition, &t.kind, &SpAccType, &acc, &wire,
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
        sp_release_task(&t);
        return NULL;
    }
    t.has_wire = 1;
    Py_ssize_t expect = wire_nbytes(t.codec, t.numel, t.param);
    if (expect < 0 || t.wire.len != expect) {
        PyErr_Format(PyExc_ValueError, "submit_sum: %zd wire bytes for %zd elements of codec "
                     "%d (param %zd), which take %zd", t.wire.len, t.numel, t.codec, t.param,
                     expect);
        sp_release_task(&t);
        return NULL;
    }
    return queued(p, partition, &t);
}

/* submit_mark(partition, done[, acc]) -> bool: with acc, its memory is given
 * back once the tasks queued before ran (a chunk that failed). */
PyObject *sp_submit_mark(Pool *p, PyObject *args) {
    task_t t = {0};
    int partition;
    Acc *acc = NULL;
    if (!PyArg_ParseTuple(args, "iO|O!", &partition, &t.done, &SpAccType, &acc)) return NULL;
    t.kind = TASK_MARK;
    Py_INCREF(t.done);
    Py_XINCREF(acc);
    t.acc = acc;
    return queued(p, partition, &t);
}

PyObject *sp_new_accumulator(Pool *p, PyObject *arg) {
    Py_ssize_t numel = PyLong_AsSsize_t(arg);
    if (numel == -1 && PyErr_Occurred()) return NULL;
    if (numel < 0) {
        PyErr_Format(PyExc_ValueError, "new_accumulator: %zd elements", numel);
        return NULL;
    }
    Acc *a = PyObject_New(Acc, &SpAccType);
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

PyObject *sp_spare_bytes(Pool *p, void *c) {
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

PyTypeObject SpAccType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "reducerd.core._sumpool.Accumulator",
    .tp_basicsize = sizeof(Acc),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A chunk's float32 accumulator (Pool.new_accumulator); a buffer while held.",
    .tp_dealloc = (destructor)Acc_dealloc,
    .tp_as_buffer = &acc_buffer,
    .tp_getset = acc_getset,
    .tp_weaklistoffset = offsetof(Acc, weakrefs),
};

PyObject *sp_submit_call(Pool *p, PyObject *args) {
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

PyObject *sp_take_done(Pool *p, PyObject *unused) {
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
        sp_release_task(&items[i]);
    }
    free(items);
    return out;
}

PyObject *sp_pick_partition(Pool *p, PyObject *start_obj) {
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
