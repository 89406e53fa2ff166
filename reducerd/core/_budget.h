/* MemoryBudget's counters in C (reducerd.core._budget; reducerd.core.limits
 * wraps the type), and the C API other extensions use through the capsule
 * reducerd.core._budget._C_API: threads without the GIL reserve and give
 * back through it (the C data loop, reducerd.dataplane._cplane). */
#ifndef REDUCERD_BUDGET_H
#define REDUCERD_BUDGET_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <pthread.h>
#include <stdint.h>

/* One job's transport bytes: a chained hash entry, freed when they reach 0. */
typedef struct job_entry {
    struct job_entry *next;
    uint64_t hash;
    int64_t bytes;
    Py_ssize_t len;
    char name[];   /* UTF-8, len bytes (not NUL-terminated for the compare) */
} job_entry;

/* A job as the C API names it: UTF-8 bytes, or name == NULL for none. */
typedef struct {
    const char *name;
    Py_ssize_t len;
} job_ref;

typedef struct {
    PyObject_HEAD
    int64_t limit_bytes, transport_reserve_bytes, job_share_bytes;
    /* lock guards every field below; taken by the event loop thread, the
     * summing threads, the data plane's Python threads and the C loop
     * thread, never while the GIL is being waited for (a holder of lock
     * takes no GIL), so the two cannot deadlock. `room` is signalled
     * (broadcast) whenever bytes are given back while `waiting` > 0. */
    pthread_mutex_t lock;
    pthread_cond_t room;
    int waiting;
    int64_t accumulators, transport, pressure;
    job_entry **jobs;       /* buckets */
    size_t job_buckets, job_count;
} Budget;

#define BUDGET_API_VERSION 1

/* The C API (any thread, GIL or not): MemoryBudget's methods of the same
 * names. try_reserve: nonzero when taken. type: the Budget type. */
typedef struct {
    int version;
    PyTypeObject *type;
    int (*try_reserve)(Budget *b, int64_t nbytes, job_ref job);
    void (*give_transport)(Budget *b, int64_t nbytes, job_ref job);
    void (*take_transport)(Budget *b, int64_t nbytes, job_ref job);
    int (*job_has_room)(Budget *b, job_ref job);
    void (*note_pressure)(Budget *b);
} budget_api;


#endif
