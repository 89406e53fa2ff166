/* The C data loop's shared declarations (reducerd.dataplane._cplane).
 *
 * _cplane.c: the module. _cplane_loop.c: the loop thread and the Python
 * types; _cplane_conn.c: one connection's frames and replies. The memory
 * budget is reducerd.core._budget's, through its C API. */
#ifndef REDUCERD_CPLANE_H
#define REDUCERD_CPLANE_H

#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <pthread.h>
#include <stdint.h>

#include "../core/_budget.h"

/* The budget's C API (reducerd/core/_budget.h), imported at module init. */
extern const budget_api *budget_c;

/* ---- the data loop (_cplane_loop.c: the thread, the Python type;
 * _cplane_conn.c: one connection's frames and replies) ---- */

#include <sys/types.h>

enum { ST_HEADER, ST_ADMIT, ST_WHOLE, ST_PAYLOAD, ST_SKIP, ST_DROP, ST_HALF, ST_DONE };
enum { EV_FRAME = 1, EV_END, EV_NO_ROOM, EV_HALF_CLOSE, EV_CLOSED };

/* A reply frame queued for sending: its buffer is a Py_buffer view, so it is
 * released (and its bytes given back to the budget) with the GIL, in take(). */
typedef struct reply {
    struct reply *next;
    Py_buffer view;
    PyObject *job;        /* the str its bytes count against, or NULL */
    char *job_utf8;       /* that job's UTF-8 (malloc'd), for the loop thread */
    Py_ssize_t job_len;
    int64_t counted;      /* bytes counted in the budget, until sent or dropped */
    int priority;         /* > 0: before lower ones, put order among equals */
    int last;             /* the status frame: after everything */
    Py_ssize_t sent;
} reply_t;

typedef struct conn {
    int fd;
    int64_t id;
    int state, interest;        /* interest: the epoll events asked for */
    int ending;                 /* Python ended the stream: drop what follows */
    int status_queued, wr_shut, gone;
    uint8_t header[5];
    int header_got;
    int64_t length, got, left;  /* the frame; left: bytes still to skip */
    char *payload;              /* malloc'd once admitted; handed to Python whole */
    int reserved, slot, with_job, pressure_noted;
    int in_pieces, waited_whole;  /* how this payload is read (_cplane_conn.c) */
    int lowat;                  /* the socket's SO_RCVLOWAT */
    double reserve_deadline, frame_deadline, drop_deadline, send_stalled_since;
    char *job;                  /* its job's UTF-8 (set once), or NULL */
    Py_ssize_t job_len;
    reply_t *replies;           /* in send order */
    int64_t queued_frames, unsent_bytes;
    int64_t promised_bytes;     /* frames Python holds (atomic: Payloads give back) */
    struct conn *next_all;      /* the loop thread's list of open ones */
    /* Touched by Python threads too (Payload objects), atomically: */
    int64_t refs;               /* the loop's (while open) and each Payload's */
} conn_t;

typedef struct {
    int kind;
    int64_t id, length;
    char *payload;              /* EV_FRAME: ownership passes to a Payload object */
    struct conn *conn;          /* EV_FRAME: its connection (a reference) */
    int with_job;               /* EV_FRAME: reserved against the conn's job */
    char *job;                  /* EV_FRAME: a copy of that job, or NULL */
    Py_ssize_t job_len;
    int code;                   /* EV_END: grpc.StatusCode value */
    char *message;              /* EV_END: malloc'd */
} event_t;

/* A command from Python to the loop thread. */
enum { CMD_ADD = 1, CMD_SEND, CMD_END, CMD_SET_JOB, CMD_STOP };
typedef struct cmd {
    struct cmd *next;
    int kind;
    int64_t id;
    int fd;
    reply_t *reply;             /* CMD_SEND, CMD_END */
    char *job;                  /* CMD_ADD, CMD_SET_JOB: malloc'd */
    Py_ssize_t job_len;
} cmd_t;

typedef struct {
    PyObject_HEAD
    Budget *budget;             /* a reference */
    int64_t max_message_bytes, payload_slots, unsent_frames, unsent_bytes;
    double frame_timeout_s, send_timeout_s, linger_s, reserve_wait_s;
    int epfd, cmd_efd, py_efd;
    pthread_t thread;
    int started;
    /* cmd_lock guards cmds and cmd_signaled; taken by Python threads (add,
     * send, end, set_job) and the loop thread (draining). */
    pthread_mutex_t cmd_lock;
    cmd_t *cmds, *cmds_tail;
    int cmd_signaled;
    /* out_lock guards events, released and py_signaled; taken by the loop
     * thread (appending) and the Python thread in take(). */
    pthread_mutex_t out_lock;
    event_t *events;
    size_t n_events, cap_events;
    reply_t *released;          /* sent or dropped replies, for take() to release */
    size_t n_released;
    int py_signaled;
    /* Payloads alive (being received or not yet freed by Python): atomics,
     * as Payload objects are freed on Python threads. */
    int64_t slots_taken;
    int slot_waiters;           /* a reader waits for a slot or its unsent bound */
    int stop;                   /* set under cmd_lock (CMD_STOP) */
    /* The loop thread's own (no lock): the open connections, by fd. */
    conn_t *conns;
    conn_t **by_fd;
    size_t by_fd_len;
} Loop;

extern PyTypeObject LoopType, PayloadType;

/* Payloads up to this size wait in the kernel until they are whole
 * (reducerd.dataplane.recvside.WHOLE_MAX); the receive buffer a connection
 * is given before its first frame holds one. */
#define WHOLE_MAX (4 << 20)

/* _cplane_conn.c (loop thread) */
void conn_set_lowat(conn_t *c, int nbytes);
double loop_now(void);
void conn_on_ready(Loop *l, conn_t *c, uint32_t events);
void conn_check(Loop *l, conn_t *c, double now);  /* deadlines, paused reads */
void conn_queue_reply(Loop *l, conn_t *c, reply_t *r);
void conn_begin_end(Loop *l, conn_t *c, reply_t *status);
void conn_update_interest(Loop *l, conn_t *c);
void conn_close(Loop *l, conn_t *c);          /* gone: tell Python once */
void conn_unref(conn_t *c);                   /* any thread */

/* _cplane_loop.c (loop thread) */
void loop_emit(Loop *l, event_t *ev);          /* append an event; wake Python */
void loop_release(Loop *l, reply_t *r);        /* a reply done with */
void loop_wake_self(Loop *l);

#endif
