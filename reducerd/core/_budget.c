/* reducerd.core._budget: MemoryBudget's counters in C (reducerd.core.limits.MemoryBudget is a thin
 * subclass that adds the messages): the same methods, the same semantics,
 * and a C API (_cplane.h) for threads that hold no GIL.
 *
 * What is counted (reducerd.limits has the full story): `accumulators`, the
 * table's float32 accumulators, which always leave transport_reserve_bytes
 * to the transports; `transport`, receive buffers reserved before a frame is
 * read and replies not yet sent, of which one job holds at most
 * job_share_bytes (a job holding nothing may take one frame of any size the
 * limit admits); `pressure`, the times anything waited for room or was
 * refused it (memory.HeapTrimmer trims after them).
 *
 * Waits (reserve, wait_job_room) release the GIL and sleep on `room`, which
 * every give-back broadcasts while someone waits. */
#include "_budget.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ---- the job map (lock held) ---- */

static uint64_t hash_name(job_ref job) {
    uint64_t h = 1469598103934665603ULL;  /* FNV-1a */
    for (Py_ssize_t i = 0; i < job.len; i++) h = (h ^ (uint8_t)job.name[i]) * 1099511628211ULL;
    return h;
}

static job_entry **find_slot(Budget *b, job_ref job, uint64_t hash) {
    job_entry **slot = &b->jobs[hash & (b->job_buckets - 1)];
    for (; *slot != NULL; slot = &(*slot)->next)
        if ((*slot)->hash == hash && (*slot)->len == job.len &&
            memcmp((*slot)->name, job.name, (size_t)job.len) == 0)
            return slot;
    return slot;
}

static int64_t job_bytes(Budget *b, job_ref job) {
    if (job.name == NULL) return 0;
    job_entry *e = *find_slot(b, job, hash_name(job));
    return e != NULL ? e->bytes : 0;
}

/* Doubles the buckets past 2 entries per bucket; a failed malloc keeps the
 * old ones (longer chains, still correct). */
static void grow(Budget *b) {
    size_t n = b->job_buckets * 2;
    job_entry **buckets = calloc(n, sizeof *buckets);
    if (buckets == NULL) return;
    for (size_t i = 0; i < b->job_buckets; i++) {
        job_entry *e = b->jobs[i];
        while (e != NULL) {
            job_entry *next = e->next;
            e->next = buckets[e->hash & (n - 1)];
            buckets[e->hash & (n - 1)] = e;
            e = next;
        }
    }
    free(b->jobs);
    b->jobs = buckets;
    b->job_buckets = n;
}

/* Count nbytes (negative: give back) of transport, and of the job's. The
 * total is counted even where a job's entry cannot be allocated: the limit
 * holds, only that job's share goes unenforced until memory comes back. */
static void add(Budget *b, int64_t nbytes, job_ref job) {
    b->transport += nbytes;
    if (job.name == NULL) return;
    uint64_t hash = hash_name(job);
    job_entry **slot = find_slot(b, job, hash);
    job_entry *e = *slot;
    int64_t held = (e != NULL ? e->bytes : 0) + nbytes;
    if (held > 0) {
        if (e == NULL) {
            e = malloc(sizeof *e + (size_t)job.len);
            if (e == NULL) return;
            e->next = NULL;
            e->hash = hash;
            e->len = job.len;
            memcpy(e->name, job.name, (size_t)job.len);
            *slot = e;
            if (++b->job_count > 2 * b->job_buckets) grow(b);
        }
        e->bytes = held;
    } else if (e != NULL) {
        *slot = e->next;
        free(e);
        b->job_count--;
    }
}

static int job_fits(Budget *b, job_ref job, int64_t nbytes) {
    int64_t held = job_bytes(b, job);
    return held == 0 || held + nbytes <= b->job_share_bytes;
}

static int reserve_fits(Budget *b, int64_t nbytes, job_ref job) {
    return b->accumulators + b->transport + nbytes <= b->limit_bytes && job_fits(b, job, nbytes);
}

static int has_room(Budget *b, job_ref job) {
    return job.name == NULL || job_bytes(b, job) < b->job_share_bytes;
}

static void wake_waiters(Budget *b) {
    if (b->waiting) pthread_cond_broadcast(&b->room);
}

/* ---- the C API ---- */

static int budget_try_reserve(Budget *b, int64_t nbytes, job_ref job) {
    pthread_mutex_lock(&b->lock);
    int fits = reserve_fits(b, nbytes, job);
    if (fits) add(b, nbytes, job);
    pthread_mutex_unlock(&b->lock);
    return fits;
}

static void budget_give_transport(Budget *b, int64_t nbytes, job_ref job) {
    if (!nbytes) return;
    pthread_mutex_lock(&b->lock);
    add(b, -nbytes, job);
    wake_waiters(b);
    pthread_mutex_unlock(&b->lock);
}

static void budget_take_transport(Budget *b, int64_t nbytes, job_ref job) {
    pthread_mutex_lock(&b->lock);
    add(b, nbytes, job);
    pthread_mutex_unlock(&b->lock);
}

static int budget_job_has_room(Budget *b, job_ref job) {
    pthread_mutex_lock(&b->lock);
    int room = has_room(b, job);
    pthread_mutex_unlock(&b->lock);
    return room;
}

static void budget_note_pressure(Budget *b) {
    pthread_mutex_lock(&b->lock);
    b->pressure++;
    pthread_mutex_unlock(&b->lock);
}

/* ---- the Python type ---- */

/* A job argument: None or a str (its UTF-8 is cached in the str, alive while
 * the caller holds it). -1 with an exception otherwise. */
static int parse_job(PyObject *obj, job_ref *job) {
    if (obj == NULL || obj == Py_None) {
        job->name = NULL;
        job->len = 0;
        return 0;
    }
    if (!PyUnicode_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "a job must be a str or None, not %.100s",
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    job->name = PyUnicode_AsUTF8AndSize(obj, &job->len);
    return job->name == NULL ? -1 : 0;
}

/* Waits until `ready` holds or timeout_s passes (lock held, GIL released by
 * the caller); whether it holds. Counts the wait as pressure. */
static int wait_for(Budget *b, int (*ready)(Budget *, int64_t, job_ref), int64_t nbytes,
                    job_ref job, double timeout_s) {
    if (ready(b, nbytes, job)) return 1;
    b->pressure++;
    if (timeout_s <= 0) return 0;
    struct timespec deadline;
    clock_gettime(CLOCK_MONOTONIC, &deadline);
    double whole = (double)(time_t)timeout_s;
    deadline.tv_sec += (time_t)timeout_s;
    deadline.tv_nsec += (long)((timeout_s - whole) * 1e9);
    if (deadline.tv_nsec >= 1000000000L) {
        deadline.tv_sec++;
        deadline.tv_nsec -= 1000000000L;
    }
    b->waiting++;
    int ok;
    while (!(ok = ready(b, nbytes, job)))
        if (pthread_cond_timedwait(&b->room, &b->lock, &deadline) == ETIMEDOUT) {
            ok = ready(b, nbytes, job);
            break;
        }
    b->waiting--;
    return ok;
}

static int room_ready(Budget *b, int64_t nbytes, job_ref job) {
    (void)nbytes;
    return has_room(b, job);
}

static int Budget_init(Budget *self, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"limit_bytes", "transport_reserve_bytes", NULL};
    long long limit, reserve = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "L|L", names, &limit, &reserve)) return -1;
    if (self->jobs != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "a MemoryBudget is initialised once");
        return -1;
    }
    self->limit_bytes = limit;
    self->transport_reserve_bytes = reserve < limit ? reserve : limit;
    self->job_share_bytes = limit / 2;  /* JOB_TRANSPORT_SHARE */
    self->job_buckets = 16;
    self->jobs = calloc(self->job_buckets, sizeof *self->jobs);
    if (self->jobs == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    pthread_condattr_t attr;
    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    pthread_cond_init(&self->room, &attr);
    pthread_condattr_destroy(&attr);
    pthread_mutex_init(&self->lock, NULL);
    return 0;
}

static void Budget_dealloc(Budget *self) {
    if (self->jobs != NULL) {
        for (size_t i = 0; i < self->job_buckets; i++) {
            job_entry *e = self->jobs[i];
            while (e != NULL) {
                job_entry *next = e->next;
                free(e);
                e = next;
            }
        }
        free(self->jobs);
        pthread_mutex_destroy(&self->lock);
        pthread_cond_destroy(&self->room);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int check_ready(Budget *self) {
    if (self->jobs != NULL) return 0;
    PyErr_SetString(PyExc_RuntimeError, "MemoryBudget.__init__ was not called");
    return -1;
}

/* (nbytes[, job]) into n and *job; -1 with an exception. */
static int parse_n_job(Budget *self, PyObject *args, PyObject *kwargs, const char *fmt,
                       long long *n, job_ref *job) {
    static char *names[] = {"nbytes", "job", NULL};
    PyObject *job_obj = NULL;
    if (check_ready(self) < 0) return -1;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, fmt, names, n, &job_obj)) return -1;
    return parse_job(job_obj, job);
}

static PyObject *Budget_take_accumulator(Budget *self, PyObject *arg) {
    long long n = PyLong_AsLongLong(arg);
    if ((n == -1 && PyErr_Occurred()) || check_ready(self) < 0) return NULL;
    pthread_mutex_lock(&self->lock);
    int64_t transport = self->transport > self->transport_reserve_bytes
                            ? self->transport : self->transport_reserve_bytes;
    int ok = self->accumulators + transport + n <= self->limit_bytes;
    if (ok) self->accumulators += n;
    else self->pressure++;
    pthread_mutex_unlock(&self->lock);
    return PyBool_FromLong(ok);
}

static PyObject *Budget_give_accumulator(Budget *self, PyObject *arg) {
    long long n = PyLong_AsLongLong(arg);
    if ((n == -1 && PyErr_Occurred()) || check_ready(self) < 0) return NULL;
    pthread_mutex_lock(&self->lock);
    self->accumulators -= n;
    wake_waiters(self);
    pthread_mutex_unlock(&self->lock);
    Py_RETURN_NONE;
}

static PyObject *Budget_note_pressure(Budget *self, PyObject *unused) {
    (void)unused;
    if (check_ready(self) < 0) return NULL;
    budget_note_pressure(self);
    Py_RETURN_NONE;
}

static PyObject *Budget_fits_transport(Budget *self, PyObject *arg) {
    long long n = PyLong_AsLongLong(arg);
    if ((n == -1 && PyErr_Occurred()) || check_ready(self) < 0) return NULL;
    pthread_mutex_lock(&self->lock);
    int ok = self->accumulators + self->transport + n <= self->limit_bytes;
    pthread_mutex_unlock(&self->lock);
    return PyBool_FromLong(ok);
}

static PyObject *Budget_reserve(Budget *self, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"nbytes", "timeout_s", "job", NULL};
    long long n;
    double timeout_s;
    PyObject *job_obj = NULL;
    job_ref job;
    if (check_ready(self) < 0 ||
        !PyArg_ParseTupleAndKeywords(args, kwargs, "Ld|O", names, &n, &timeout_s, &job_obj) ||
        parse_job(job_obj, &job) < 0)
        return NULL;
    if (n > self->limit_bytes) Py_RETURN_FALSE;  /* it can never fit */
    int ok;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&self->lock);
    ok = wait_for(self, reserve_fits, n, job, timeout_s);
    if (ok) add(self, n, job);
    pthread_mutex_unlock(&self->lock);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(ok);
}

static PyObject *Budget_try_reserve(Budget *self, PyObject *args, PyObject *kwargs) {
    long long n;
    job_ref job;
    if (parse_n_job(self, args, kwargs, "L|O", &n, &job) < 0) return NULL;
    return PyBool_FromLong(budget_try_reserve(self, n, job));
}

static PyObject *Budget_take_transport(Budget *self, PyObject *args, PyObject *kwargs) {
    long long n;
    job_ref job;
    if (parse_n_job(self, args, kwargs, "L|O", &n, &job) < 0) return NULL;
    budget_take_transport(self, n, job);
    Py_RETURN_NONE;
}

static PyObject *Budget_give_transport(Budget *self, PyObject *args, PyObject *kwargs) {
    long long n;
    job_ref job;
    if (parse_n_job(self, args, kwargs, "L|O", &n, &job) < 0) return NULL;
    budget_give_transport(self, n, job);
    Py_RETURN_NONE;
}

static PyObject *Budget_job_transport_bytes(Budget *self, PyObject *arg) {
    job_ref job;
    if (check_ready(self) < 0 || parse_job(arg, &job) < 0) return NULL;
    pthread_mutex_lock(&self->lock);
    int64_t held = job_bytes(self, job);
    pthread_mutex_unlock(&self->lock);
    return PyLong_FromLongLong(held);
}

static PyObject *Budget_job_has_room(Budget *self, PyObject *arg) {
    job_ref job;
    if (check_ready(self) < 0 || parse_job(arg, &job) < 0) return NULL;
    return PyBool_FromLong(budget_job_has_room(self, job));
}

static PyObject *Budget_wait_job_room(Budget *self, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"job", "timeout_s", NULL};
    PyObject *job_obj;
    double timeout_s;
    job_ref job;
    if (check_ready(self) < 0 ||
        !PyArg_ParseTupleAndKeywords(args, kwargs, "Od", names, &job_obj, &timeout_s) ||
        parse_job(job_obj, &job) < 0)
        return NULL;
    int ok;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&self->lock);
    ok = wait_for(self, room_ready, 0, job, timeout_s);
    pthread_mutex_unlock(&self->lock);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(ok);
}

static PyObject *Budget_job_fits(Budget *self, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"job", "nbytes", NULL};
    PyObject *job_obj;
    long long n;
    job_ref job;
    if (check_ready(self) < 0 ||
        !PyArg_ParseTupleAndKeywords(args, kwargs, "OL", names, &job_obj, &n) ||
        parse_job(job_obj, &job) < 0)
        return NULL;
    pthread_mutex_lock(&self->lock);
    int ok = job_fits(self, job, n);
    pthread_mutex_unlock(&self->lock);
    return PyBool_FromLong(ok);
}

/* The per-job counts as a dict (tests; a snapshot). */
static PyObject *Budget_get_jobs(Budget *self, void *closure) {
    (void)closure;
    if (check_ready(self) < 0) return NULL;
    PyObject *result = PyDict_New();
    if (result == NULL) return NULL;
    /* Copied under the lock, built after it: no allocation that may take
     * the GIL's path under the budget's lock (we hold the GIL anyway). */
    pthread_mutex_lock(&self->lock);
    size_t count = self->job_count, i = 0;
    job_entry **copy = malloc((count ? count : 1) * sizeof *copy);
    int64_t *bytes = malloc((count ? count : 1) * sizeof *bytes);
    char **names = calloc(count ? count : 1, sizeof *names);
    Py_ssize_t *lens = malloc((count ? count : 1) * sizeof *lens);
    if (copy && bytes && names && lens) {
        for (size_t k = 0; k < self->job_buckets; k++)
            for (job_entry *e = self->jobs[k]; e != NULL && i < count; e = e->next, i++) {
                names[i] = malloc((size_t)e->len + 1);
                if (names[i] != NULL) memcpy(names[i], e->name, (size_t)e->len);
                lens[i] = e->len;
                bytes[i] = e->bytes;
            }
    }
    pthread_mutex_unlock(&self->lock);
    int failed = !(copy && bytes && names && lens);
    for (size_t k = 0; k < i && !failed; k++) {
        if (names[k] == NULL) { failed = 1; break; }
        PyObject *key = PyUnicode_DecodeUTF8(names[k], lens[k], "strict");
        PyObject *value = key ? PyLong_FromLongLong(bytes[k]) : NULL;
        if (value == NULL || PyDict_SetItem(result, key, value) < 0) failed = 1;
        Py_XDECREF(key);
        Py_XDECREF(value);
    }
    if (names) for (size_t k = 0; k < i; k++) free(names[k]);
    free(copy);
    free(bytes);
    free(names);
    free(lens);
    if (failed) {
        Py_DECREF(result);
        return PyErr_Occurred() ? NULL : PyErr_NoMemory();
    }
    return result;
}

static PyObject *counter(Budget *self, int64_t *field) {
    if (check_ready(self) < 0) return NULL;
    pthread_mutex_lock(&self->lock);
    int64_t value = *field;
    pthread_mutex_unlock(&self->lock);
    return PyLong_FromLongLong(value);
}

static PyObject *Budget_get_accumulators(Budget *self, void *c) {
    (void)c;
    return counter(self, &self->accumulators);
}

static PyObject *Budget_get_transport(Budget *self, void *c) {
    (void)c;
    return counter(self, &self->transport);
}

static PyObject *Budget_get_pressure(Budget *self, void *c) {
    (void)c;
    return counter(self, &self->pressure);
}

static PyObject *Budget_get_held(Budget *self, void *c) {
    (void)c;
    if (check_ready(self) < 0) return NULL;
    pthread_mutex_lock(&self->lock);
    int64_t held = self->accumulators + self->transport;
    pthread_mutex_unlock(&self->lock);
    return PyLong_FromLongLong(held);
}

static PyObject *Budget_get_fixed(Budget *self, void *which) {
    int64_t value = which == (void *)0 ? self->limit_bytes
                  : which == (void *)1 ? self->transport_reserve_bytes
                                       : self->job_share_bytes;
    return PyLong_FromLongLong(value);
}

/* job_share_bytes may be set (tests shrink it); the others are fixed. */
static int Budget_set_job_share(Budget *self, PyObject *value, void *c) {
    (void)c;
    long long n = value != NULL ? PyLong_AsLongLong(value) : -1;
    if (value == NULL || (n == -1 && PyErr_Occurred()) || check_ready(self) < 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_AttributeError, "cannot delete it");
        return -1;
    }
    pthread_mutex_lock(&self->lock);
    self->job_share_bytes = n;
    pthread_mutex_unlock(&self->lock);
    return 0;
}

static PyGetSetDef Budget_getset[] = {
    {"limit_bytes", (getter)Budget_get_fixed, NULL, "--max-inflight-bytes", (void *)0},
    {"transport_reserve_bytes", (getter)Budget_get_fixed, NULL,
     "bytes accumulators leave to the transports", (void *)1},
    {"job_share_bytes", (getter)Budget_get_fixed, (setter)Budget_set_job_share,
     "the transport bytes one job may hold", (void *)2},
    {"accumulator_bytes", (getter)Budget_get_accumulators, NULL, NULL, NULL},
    {"transport_bytes", (getter)Budget_get_transport, NULL, NULL, NULL},
    {"held_bytes", (getter)Budget_get_held, NULL, NULL, NULL},
    {"pressure", (getter)Budget_get_pressure, NULL,
     "times anything waited for room or was refused it", NULL},
    {"_jobs", (getter)Budget_get_jobs, NULL, "transport bytes by job (a copy)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

#define KW (METH_VARARGS | METH_KEYWORDS)
static PyMethodDef Budget_methods[] = {
    {"take_accumulator", (PyCFunction)Budget_take_accumulator, METH_O, NULL},
    {"give_accumulator", (PyCFunction)Budget_give_accumulator, METH_O, NULL},
    {"note_pressure", (PyCFunction)Budget_note_pressure, METH_NOARGS, NULL},
    {"fits_transport", (PyCFunction)Budget_fits_transport, METH_O, NULL},
    {"reserve", (PyCFunction)(void (*)(void))Budget_reserve, KW, NULL},
    {"try_reserve", (PyCFunction)(void (*)(void))Budget_try_reserve, KW, NULL},
    {"take_transport", (PyCFunction)(void (*)(void))Budget_take_transport, KW, NULL},
    {"give_transport", (PyCFunction)(void (*)(void))Budget_give_transport, KW, NULL},
    {"job_transport_bytes", (PyCFunction)Budget_job_transport_bytes, METH_O, NULL},
    {"job_has_room", (PyCFunction)Budget_job_has_room, METH_O, NULL},
    {"wait_job_room", (PyCFunction)(void (*)(void))Budget_wait_job_room, KW, NULL},
    {"job_fits", (PyCFunction)(void (*)(void))Budget_job_fits, KW, NULL},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject BudgetType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "reducerd.core._budget.Budget",
    .tp_basicsize = sizeof(Budget),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "MemoryBudget's counters (reducerd.limits.MemoryBudget).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Budget_init,
    .tp_dealloc = (destructor)Budget_dealloc,
    .tp_methods = Budget_methods,
    .tp_getset = Budget_getset,
};

/* ---- the module ---- */

static const budget_api api = {
    BUDGET_API_VERSION, &BudgetType, budget_try_reserve, budget_give_transport,
    budget_take_transport, budget_job_has_room, budget_note_pressure,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_budget", "MemoryBudget's counters in C.", -1, NULL, NULL, NULL,
    NULL, NULL,
};

PyMODINIT_FUNC PyInit__budget(void) {
    if (PyType_Ready(&BudgetType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    PyObject *capsule = PyCapsule_New((void *)&api, "reducerd.core._budget._C_API", NULL);
    Py_INCREF(&BudgetType);
    if (capsule == NULL || PyModule_AddObject(m, "_C_API", capsule) < 0 ||
        PyModule_AddObject(m, "Budget", (PyObject *)&BudgetType) < 0) {
        Py_XDECREF(capsule);
        Py_DECREF(&BudgetType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
