/* The summing pool's shared declarations: its records, and what each of its
 * three files gives the others. _sumpool.c: the Pool type (lifecycle, waits,
 * the module); _sumpool_threads.c: the summing threads; _sumpool_tasks.c:
 * queueing tasks, taking back finished ones, the Accumulator type. */
#ifndef REDUCERD_SUMPOOL_H
#define REDUCERD_SUMPOOL_H

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

#include "../../protos/python/reducer_wire/_api.h"

/* Wire codecs, by the numbers the Python side passes (reducerd.core.summing). */
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

extern PyTypeObject SpAccType;  /* _sumpool_tasks.c */

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
    int coalesce_at_most;        /* tasks summed in one pass at most (1: each alone) */
    Py_ssize_t live, queued_bytes, queued_bytes_at_most, pending;
    Py_ssize_t summed;           /* copies and adds run so far */
    Py_ssize_t coalesced;        /* of those, the ones that ran in a pass with others */
    Py_ssize_t finished_in_pass; /* finishes that ran in a pass with their chunk's adds */
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

/* Spares larger than this are freed instead (they are not counted in the
 * daemon's memory budget: at most one per summing thread). */
#define SPARE_NUMEL_AT_MOST (1 << 20)  /* 4 MiB of float32: a 1 MiB chunk of any wire */

/* A summing thread takes the adds queued for its chunk with it (up to the
 * pool's coalesce_at_most) and runs them in one pass, block by block, so the
 * accumulator's block stays in L1 for all of them: _sumpool_threads.c. */
#define COALESCE_DEFAULT 16
#define COALESCE_LIMIT 64       /* the most a Pool accepts (a thread's stack array) */
#define COALESCE_SCAN 64        /* queued tasks looked through for them, at most */
#define COALESCE_BLOCK 4096     /* elements: 16 KiB of accumulator */

/* _sumpool_threads.c */
extern const rw_codec sp_float32_codec;
void *sp_worker_main(void *raw);  /* its argument: a malloc'd worker_arg */
void sp_release_task(task_t *t);  /* with the GIL */

/* _sumpool_tasks.c: the Pool's methods and getter that queue and take back */
PyObject *sp_submit_sum(Pool *p, PyObject *args);
PyObject *sp_submit_mark(Pool *p, PyObject *args);
PyObject *sp_submit_call(Pool *p, PyObject *args);
PyObject *sp_new_accumulator(Pool *p, PyObject *arg);
PyObject *sp_take_done(Pool *p, PyObject *unused);
PyObject *sp_pick_partition(Pool *p, PyObject *start_obj);
PyObject *sp_spare_bytes(Pool *p, void *c);

#endif
