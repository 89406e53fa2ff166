/* The summing threads (see _sumpool.c): each takes its partition's tasks in
 * order, runs a sum without the GIL (a Python call with it), and hands the
 * finished sum to the done list, waking the loop when that list was empty.
 * A copy or add takes the adds to its chunk already queued with it, and the
 * chunk's finish if it follows them, and runs them in one pass (take_adds,
 * run_pass).
 * A chunk's accumulator is touched only here while it has tasks queued: its
 * first task may swap in the partition's spare, its finish (or a mark) hands
 * its memory back as the spare. */
#include "_sumpool.h"

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

const rw_codec sp_float32_codec = {f32_widen, f32_add, f32_narrow};


void sp_release_task(task_t *t) {  /* with the GIL */
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

#define INT8_SCALE_BYTES 4  /* a float32 per block, all of a message's first */

/* Wire bytes per element of an element-wise codec (a slice of its message
 * is the message of those elements); 0 for int8, whose message holds all
 * its block scales before its codes (piece_of gathers a piece's). */
static Py_ssize_t element_width(int codec) {
    switch (codec) {
    case CODEC_FLOAT32: return 4;
    case CODEC_FLOAT16: case CODEC_BFLOAT16: return 2;
    case CODEC_FP8: return 1;
    default: return 0;
    }
}

/* Whether a message can be cut into COALESCE_BLOCK pieces: every
 * element-wise codec, and int8 whose blocks divide the piece. */
static int cuttable(int codec, Py_ssize_t param) {
    return element_width(codec) > 0 || (param > 0 && COALESCE_BLOCK % param == 0);
}

/* MEAN's division of n accumulated elements. */
static void divide(float *acc, Py_ssize_t n, float divisor) {
    for (Py_ssize_t i = 0; i < n; i++) acc[i] = acc[i] / divisor;
}

/* Elements [at, at + n) of t's message, as the message of those elements: a
 * pointer into it, or for int8 (all its scales, then all its codes) the
 * piece's scales and codes copied into `scratch`. */
static const char *piece_of(const task_t *t, Py_ssize_t numel, Py_ssize_t at, Py_ssize_t n,
                            char *scratch) {
    const char *src = (const char *)t->wire.buf;
    Py_ssize_t width = element_width(t->codec);
    if (width > 0) return src + width * at;
    Py_ssize_t block = t->param, blocks = (numel + block - 1) / block;
    Py_ssize_t first = at / block, count = (n + block - 1) / block;
    memcpy(scratch, src + INT8_SCALE_BYTES * first, (size_t)(INT8_SCALE_BYTES * count));
    memcpy(scratch + INT8_SCALE_BYTES * count, src + INT8_SCALE_BYTES * blocks + at, (size_t)n);
    return scratch;
}

/* The finish f of elements [at, at + n), an element-wise codec's: MEAN's
 * division, then the narrowing into the reply's payload. (int8's finish
 * runs alone: narrowing it piece by piece, through a scratch message, cost
 * more than the pass saved, 2-5 % in the table run.) */
static void finish_piece(const rw_codec *c, float *acc, const task_t *f, Py_ssize_t at,
                         Py_ssize_t n) {
    if (f->divisor > 0) divide(acc + at, n, f->divisor);
    c->narrow(acc + at, (char *)f->wire.buf + element_width(f->codec) * at, n, f->param);
}

/* A chunk's copy or adds, t[0..k) in order, and its finish if t[k - 1] is it
 * (k > 1 only where cuttable; a finish only for element-wise codecs): piece
 * by piece, every task over the piece before the next piece, so each element
 * sees the same operations in the same order as task by task (the same
 * bits), and the accumulator's piece is read and written once per pass
 * instead of once per task. */
static void run_pass(const rw_codec *c, float *acc, Py_ssize_t numel, const task_t *t, int k) {
    if (k == 1) {
        if (t->kind == TASK_COPY) c->widen((const char *)t->wire.buf, acc, numel, t->param);
        else c->add(acc, (const char *)t->wire.buf, numel, t->param);
        return;
    }
    const task_t *finish = t[k - 1].kind == TASK_FINISH ? &t[k - 1] : NULL;
    int adds = finish ? k - 1 : k;
    char scratch[COALESCE_BLOCK * (INT8_SCALE_BYTES + 1)];  /* an int8 piece at most */
    for (Py_ssize_t at = 0; at < numel; at += COALESCE_BLOCK) {
        Py_ssize_t n = numel - at < COALESCE_BLOCK ? numel - at : COALESCE_BLOCK;
        for (int i = 0; i < adds; i++) {
            const char *src = piece_of(&t[i], numel, at, n, scratch);
            if (t[i].kind == TASK_COPY) c->widen(src, acc + at, n, t[i].param);
            else c->add(acc + at, src, n, t[i].param);
        }
        if (finish) finish_piece(c, acc, finish, at, n);
    }
}

/* Run t[0..k): one task, or a pass (a chunk's copy or add, the adds after it,
 * maybe its finish). */
static void run_sums(Pool *p, partition_t *part, task_t *t, int k) {
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
    case TASK_COPY: case TASK_ADD:
        run_pass(c, acc, a->numel, t, k);
        if (t[k - 1].kind == TASK_FINISH) give_back(part, a);
        break;
    case TASK_FINISH:
        if (t->divisor > 0) divide(acc, a->numel, t->divisor);
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

/* Take the partition's item at ring offset i out of its queue (with the lock). */
static task_t take_at(partition_t *part, size_t i) {
    task_t t = part->items[(part->head + i) % part->cap];
    for (size_t j = i; j > 0; j--)  /* the ones before it move up one */
        part->items[(part->head + j) % part->cap] = part->items[(part->head + j - 1) % part->cap];
    part->head = (part->head + 1) % part->cap;
    __atomic_store_n(&part->count, part->count - 1, __ATOMIC_RELEASE);
    return t;
}

/* With out[0] a copy or add just taken: take the adds to the same chunk
 * queued behind it into out[1..), and its finish if it comes next (not
 * int8's: finish_piece), up to `at_most` tasks in all. Tasks of other chunks may be passed (they touch
 * other memory); the look stops at the chunk's finish, at any other task of
 * the chunk (a mark) and at a Python task, which may read anything. Returns
 * the count in out. */
static int take_adds(partition_t *part, task_t *out, int at_most) {
    int k = 1;
    if (!cuttable(out[0].codec, out[0].param)) return k;
    size_t i = 0;
    while (k < at_most && i < part->count && i < COALESCE_SCAN) {
        task_t *next = &part->items[(part->head + i) % part->cap];
        if (next->kind == TASK_CALL) break;
        if (next->acc != out[0].acc) {
            i++;
            continue;
        }
        int same_codec = next->codec == out[0].codec && next->param == out[0].param;
        if (next->kind == TASK_FINISH) {
            if (same_codec && element_width(next->codec) > 0) out[k++] = take_at(part, i);
            break;
        }
        if (next->kind != TASK_ADD || !same_codec) break;
        out[k++] = take_at(part, i);
    }
    return k;
}

/* Take the partition's next task, and the adds that go with it, into out;
 * their count, or 0 once stopped and empty. */
static int next_tasks(Pool *p, partition_t *part, task_t *out) {
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
    out[0] = take_at(part, 0);
    int k = 1;
    if (out[0].kind == TASK_COPY || out[0].kind == TASK_ADD) {  /* a pass, maybe */
        k = take_adds(part, out, p->coalesce_at_most);
        int finished = out[k - 1].kind == TASK_FINISH;
        p->summed += k - finished;
        if (k > 1) p->coalesced += k - finished;
        p->finished_in_pass += finished;
    }
    pthread_mutex_unlock(&p->lock);
    return k;
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

void *sp_worker_main(void *raw) {
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
    task_t tasks[COALESCE_LIMIT];
    int k;
    while ((k = next_tasks(p, part, tasks)) > 0) {
        int wake = 0;
        if (tasks[0].kind == TASK_CALL) {
            PyEval_RestoreThread(ts);
            run_call(&tasks[0]);
            ts = PyEval_SaveThread();
        } else {
            run_sums(p, part, tasks, k);
        }
        Py_ssize_t nbytes = 0;
        pthread_mutex_lock(&p->lock);
        for (int i = 0; i < k; i++) {
            nbytes += tasks[i].nbytes;
            if (tasks[i].kind == TASK_CALL) continue;
            while (grow_done(p) < 0) {  /* out of memory: wait for the loop to take some */
                pthread_mutex_unlock(&p->lock);
                usleep(1000);
                pthread_mutex_lock(&p->lock);
            }
            p->done[p->done_count++] = tasks[i];
            if (!p->signaled) p->signaled = wake = 1;
        }
        pthread_mutex_unlock(&p->lock);
        if (wake) wake_loop(p, &ts);  /* before the tasks count as finished (wait_idle) */
        pthread_mutex_lock(&p->lock);
        part->queued_bytes -= nbytes;
        p->queued_bytes -= nbytes;
        p->pending -= k;
        /* Wake the waiters only when one can go on: a submit waits for the
         * queue to fall to half its bound, wait_idle for nothing pending.
         * (Waking it for every finished task cost the loop a context switch
         * per task while it waited.) */
        if (p->waiters && (p->queued_bytes <= p->queued_bytes_at_most / 2 || p->pending == 0))
            pthread_cond_broadcast(&p->changed);
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
