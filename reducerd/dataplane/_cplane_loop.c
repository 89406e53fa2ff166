/* The C data loop: one thread, one epoll set, the plain-TCP connections that
 * Python handed over after their handshake and admission
 * (reducerd.dataplane's C path).
 *
 * Python -> loop: commands (add a connection, set its job, send a reply,
 * end the stream, stop), queued under cmd_lock; the loop is woken through
 * an eventfd only when none was pending. Loop -> Python: events (a frame, an
 * end the loop decided, no room for a frame, the client's half-close, a
 * connection done with), appended under out_lock; Python is woken through
 * another eventfd (the asyncio loop watches it) only when none was pending,
 * so one wake-up takes a batch: take() returns all queued by then.
 *
 * A frame's payload reaches Python as a Payload object over the malloc'd
 * buffer it was received into: freeing it (once the session took the shard:
 * the table copies what it keeps) gives back its budget reservation and its
 * payload slot, and counts it as taken against its connection's unsent
 * bound. Replies are Py_buffer views of the Reply.frame buffers, released
 * with the GIL in take() once sent (or dropped), when their bytes are given
 * back to the budget too: held until then, they stay counted. */
#include "_cplane.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#define TICK_MS 20           /* paused reads and deadlines are looked at this often */
#define RELEASED_WAKE 64     /* sent replies that wake Python to release them */

static void wake(int efd) {
    uint64_t one = 1;
    ssize_t ignored = write(efd, &one, sizeof one);
    (void)ignored;
}

static void drain(int efd) {
    uint64_t count;
    ssize_t ignored = read(efd, &count, sizeof count);
    (void)ignored;
}

void loop_wake_self(Loop *l) { wake(l->cmd_efd); }

void loop_emit(Loop *l, event_t *ev) {
    pthread_mutex_lock(&l->out_lock);
    if (l->n_events == l->cap_events) {
        size_t cap = l->cap_events ? 2 * l->cap_events : 64;
        event_t *grown = realloc(l->events, cap * sizeof *grown);
        if (grown == NULL) {  /* cannot happen short of memory: drop the frame, say so */
            pthread_mutex_unlock(&l->out_lock);
            free(ev->payload);
            free(ev->job);
            free(ev->message);
            return;
        }
        l->events = grown;
        l->cap_events = cap;
    }
    l->events[l->n_events++] = *ev;
    int signal = !l->py_signaled;
    l->py_signaled = 1;
    pthread_mutex_unlock(&l->out_lock);
    if (signal) wake(l->py_efd);
}

void loop_release(Loop *l, reply_t *r) {
    /* Its bytes come back at once (the budget needs no GIL): a sent reply
     * must not hold its job's share or the accumulators' room until Python
     * next wakes; only its buffer waits for the GIL. */
    if (r->counted) {
        job_ref job = {r->job_utf8, r->job_len};
        budget_c->give_transport(l->budget, r->counted, job);
        r->counted = 0;
    }
    pthread_mutex_lock(&l->out_lock);
    r->next = l->released;
    l->released = r;
    int signal = ++l->n_released >= RELEASED_WAKE && !l->py_signaled;
    if (signal) l->py_signaled = 1;
    pthread_mutex_unlock(&l->out_lock);
    if (signal) wake(l->py_efd);
}

/* ---- the loop thread ---- */

static conn_t *find(Loop *l, int fd, int64_t id) {
    if (fd < 0 || (size_t)fd >= l->by_fd_len) return NULL;
    conn_t *c = l->by_fd[fd];
    return c != NULL && c->id == id ? c : NULL;
}

static void add_conn(Loop *l, cmd_t *cmd) {
    if ((size_t)cmd->fd >= l->by_fd_len) {
        size_t n = l->by_fd_len ? l->by_fd_len : 1024;
        while (n <= (size_t)cmd->fd) n *= 2;
        conn_t **grown = realloc(l->by_fd, n * sizeof *grown);
        if (grown == NULL) goto fail;
        memset(grown + l->by_fd_len, 0, (n - l->by_fd_len) * sizeof *grown);
        l->by_fd = grown;
        l->by_fd_len = n;
    }
    conn_t *c = calloc(1, sizeof *c);
    if (c == NULL) goto fail;
    c->fd = cmd->fd;
    c->id = cmd->id;
    c->job = cmd->job;
    c->job_len = cmd->job_len;
    cmd->job = NULL;
    c->refs = 1;
    c->lowat = 1;
    /* Open the window for a whole payload (recvside.ReceiveSide.open_window). */
    conn_set_lowat(c, WHOLE_MAX);
    conn_set_lowat(c, 1);
    c->state = ST_HEADER;
    c->interest = EPOLLIN;
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = c};
    if (epoll_ctl(l->epfd, EPOLL_CTL_ADD, c->fd, &ev) < 0) {
        free(c->job);
        free(c);
        goto fail;
    }
    c->next_all = l->conns;
    l->conns = c;
    l->by_fd[c->fd] = c;
    return;
fail: {
        event_t closed = {.kind = EV_CLOSED, .id = cmd->id};
        loop_emit(l, &closed);
    }
}

static void run_command(Loop *l, cmd_t *cmd) {
    conn_t *c = cmd->kind == CMD_ADD ? NULL : find(l, cmd->fd, cmd->id);
    switch (cmd->kind) {
    case CMD_ADD:
        add_conn(l, cmd);
        break;
    case CMD_SET_JOB:
        if (c != NULL && c->job == NULL) {
            c->job = cmd->job;
            c->job_len = cmd->job_len;
            cmd->job = NULL;
        }
        break;
    case CMD_SEND:
        if (c != NULL) conn_queue_reply(l, c, cmd->reply);
        else loop_release(l, cmd->reply);
        cmd->reply = NULL;
        break;
    case CMD_END:
        if (c != NULL) conn_begin_end(l, c, cmd->reply);
        else loop_release(l, cmd->reply);
        cmd->reply = NULL;
        break;
    default:
        break;
    }
    free(cmd->job);
    free(cmd);
}

/* Forget the connections done with (their fd is Python's to close). */
static void sweep(Loop *l) {
    conn_t **at = &l->conns;
    while (*at != NULL) {
        conn_t *c = *at;
        if (c->state == ST_DONE) {
            *at = c->next_all;
            if (l->by_fd[c->fd] == c) l->by_fd[c->fd] = NULL;
            conn_unref(c);
        } else {
            at = &c->next_all;
        }
    }
}

static void *loop_main(void *raw) {
    Loop *l = raw;
    struct epoll_event evs[256];
    double last_tick = loop_now();
    for (;;) {
        int n = epoll_wait(l->epfd, evs, 256, l->conns != NULL ? TICK_MS : -1);
        int woken = 0;
        for (int i = 0; i < n; i++) {
            if (evs[i].data.ptr == NULL) {
                drain(l->cmd_efd);
                woken = 1;
            } else {
                conn_on_ready(l, evs[i].data.ptr, evs[i].events);
            }
        }
        pthread_mutex_lock(&l->cmd_lock);
        cmd_t *cmds = l->cmds;
        l->cmds = l->cmds_tail = NULL;
        l->cmd_signaled = 0;
        int stop = l->stop;
        pthread_mutex_unlock(&l->cmd_lock);
        while (cmds != NULL) {
            cmd_t *next = cmds->next;
            run_command(l, cmds);
            cmds = next;
        }
        if (stop) break;
        double now = loop_now();
        /* A give-back (a payload freed) wakes the loop for paused readers. */
        if (woken && __atomic_exchange_n(&l->slot_waiters, 0, __ATOMIC_SEQ_CST)) last_tick = 0;
        if (now - last_tick >= TICK_MS * 1e-3) {
            last_tick = now;
            for (conn_t *c = l->conns; c != NULL; c = c->next_all) conn_check(l, c, now);
        }
        sweep(l);
    }
    return NULL;
}

/* ---- the Python side ---- */

static void queue_command(Loop *l, cmd_t *cmd) {
    cmd->next = NULL;
    pthread_mutex_lock(&l->cmd_lock);
    if (l->cmds_tail != NULL) l->cmds_tail->next = cmd;
    else l->cmds = cmd;
    l->cmds_tail = cmd;
    int signal = !l->cmd_signaled;
    l->cmd_signaled = 1;
    pthread_mutex_unlock(&l->cmd_lock);
    if (signal) wake(l->cmd_efd);
}

/* A job argument as a malloc'd copy (NULL for None); -1 with an exception. */
static int copy_job(PyObject *obj, char **job, Py_ssize_t *len) {
    *job = NULL;
    *len = 0;
    if (obj == Py_None) return 0;
    const char *utf8 = PyUnicode_AsUTF8AndSize(obj, len);
    if (utf8 == NULL) return -1;
    *job = malloc((size_t)*len + 1);
    if (*job == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    memcpy(*job, utf8, (size_t)*len);
    return 0;
}

static int Loop_init(Loop *self, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"budget", "max_message_bytes", "frame_timeout_s", "send_timeout_s",
                            "linger_s", "reserve_wait_s", "payload_slots", "unsent_frames",
                            "unsent_bytes", NULL};
    PyObject *budget;
    long long max_message, slots, unsent_frames, unsent_bytes;
    if (self->budget != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "a Loop is initialised once");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!LddddLLL", names, budget_c->type, &budget,
                                     &max_message, &self->frame_timeout_s,
                                     &self->send_timeout_s, &self->linger_s,
                                     &self->reserve_wait_s, &slots, &unsent_frames,
                                     &unsent_bytes))
        return -1;
    self->max_message_bytes = max_message;
    self->payload_slots = slots;
    self->unsent_frames = unsent_frames;
    self->unsent_bytes = unsent_bytes;
    self->epfd = epoll_create1(EPOLL_CLOEXEC);
    self->cmd_efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    self->py_efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (self->epfd < 0 || self->cmd_efd < 0 || self->py_efd < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = NULL};
    if (epoll_ctl(self->epfd, EPOLL_CTL_ADD, self->cmd_efd, &ev) < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    pthread_mutex_init(&self->cmd_lock, NULL);
    pthread_mutex_init(&self->out_lock, NULL);
    Py_INCREF(budget);
    self->budget = (Budget *)budget;
    return 0;
}

static int check_running(Loop *self) {
    if (self->started && !self->stop) return 0;
    PyErr_SetString(PyExc_RuntimeError, "the C data loop is not running");
    return -1;
}

static PyObject *Loop_start(Loop *self, PyObject *unused) {
    (void)unused;
    if (self->budget == NULL || self->started) {
        PyErr_SetString(PyExc_RuntimeError, "the C data loop starts once, after __init__");
        return NULL;
    }
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, 1 << 20);  /* the 64 KiB skip buffer and little else */
    int err = pthread_create(&self->thread, &attr, loop_main, self);
    pthread_attr_destroy(&attr);
    if (err) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    self->started = 1;
    Py_RETURN_NONE;
}

static PyObject *Loop_add(Loop *self, PyObject *args) {
    long long id;
    int fd;
    PyObject *job;
    if (!PyArg_ParseTuple(args, "LiO", &id, &fd, &job) || check_running(self) < 0) return NULL;
    cmd_t *cmd = calloc(1, sizeof *cmd);
    if (cmd == NULL) return PyErr_NoMemory();
    if (copy_job(job, &cmd->job, &cmd->job_len) < 0) {
        free(cmd);
        return NULL;
    }
    cmd->kind = CMD_ADD;
    cmd->id = id;
    cmd->fd = fd;
    queue_command(self, cmd);
    Py_RETURN_NONE;
}

static PyObject *Loop_set_job(Loop *self, PyObject *args) {
    long long id;
    int fd;
    PyObject *job;
    if (!PyArg_ParseTuple(args, "LiU", &id, &fd, &job) || check_running(self) < 0) return NULL;
    cmd_t *cmd = calloc(1, sizeof *cmd);
    if (cmd == NULL) return PyErr_NoMemory();
    if (copy_job(job, &cmd->job, &cmd->job_len) < 0) {
        free(cmd);
        return NULL;
    }
    cmd->kind = CMD_SET_JOB;
    cmd->id = id;
    cmd->fd = fd;
    queue_command(self, cmd);
    Py_RETURN_NONE;
}

/* send(id, fd, frame, priority, job, counted) / end(id, fd, status_frame) */
static PyObject *queue_reply(Loop *self, PyObject *args, int kind) {
    long long id, counted = 0;
    int fd, priority = 0;
    PyObject *frame, *job = Py_None;
    if (kind == CMD_SEND
            ? !PyArg_ParseTuple(args, "LiOiOL", &id, &fd, &frame, &priority, &job, &counted)
            : !PyArg_ParseTuple(args, "LiO", &id, &fd, &frame))
        return NULL;
    if (check_running(self) < 0) return NULL;
    if (job != Py_None && !PyUnicode_Check(job)) {
        PyErr_SetString(PyExc_TypeError, "a job must be a str or None");
        return NULL;
    }
    reply_t *r = calloc(1, sizeof *r);
    cmd_t *cmd = calloc(1, sizeof *cmd);
    if (r == NULL || cmd == NULL) {
        free(r);
        free(cmd);
        return PyErr_NoMemory();
    }
    if (PyObject_GetBuffer(frame, &r->view, PyBUF_SIMPLE) < 0) {
        free(r);
        free(cmd);
        return NULL;
    }
    if (job != Py_None) {
        if (copy_job(job, &r->job_utf8, &r->job_len) < 0) {
            PyBuffer_Release(&r->view);
            free(r);
            free(cmd);
            return NULL;
        }
        Py_INCREF(job);
        r->job = job;
    }
    r->counted = counted;
    r->priority = priority;
    cmd->kind = kind;
    cmd->id = id;
    cmd->fd = fd;
    cmd->reply = r;
    queue_command(self, cmd);
    Py_RETURN_NONE;
}

static PyObject *Loop_send(Loop *self, PyObject *args) { return queue_reply(self, args, CMD_SEND); }
static PyObject *Loop_end(Loop *self, PyObject *args) { return queue_reply(self, args, CMD_END); }

/* With the GIL: release the replies done with, giving their bytes back. */
static void release_replies(Loop *self, reply_t *r) {
    while (r != NULL) {
        reply_t *next = r->next;
        if (r->counted) {
            job_ref job = {NULL, 0};
            if (r->job != NULL) job.name = PyUnicode_AsUTF8AndSize(r->job, &job.len);
            budget_c->give_transport(self->budget, r->counted, job);
        }
        PyBuffer_Release(&r->view);
        Py_XDECREF(r->job);
        free(r->job_utf8);
        free(r);
        r = next;
    }
}

typedef struct {
    PyObject_HEAD
    Loop *loop;
    conn_t *conn;
    char *buf;
    Py_ssize_t len;
    char *job;
    Py_ssize_t job_len;
    int with_job;
    int exports;
} Payload;

static PyObject *make_payload(Loop *self, event_t *ev) {
    Payload *p = PyObject_New(Payload, &PayloadType);
    if (p == NULL) return NULL;
    Py_INCREF(self);
    p->loop = self;
    p->conn = ev->conn;
    p->buf = ev->payload;
    p->len = (Py_ssize_t)ev->length;
    p->job = ev->job;
    p->job_len = ev->job_len;
    p->with_job = ev->with_job;
    p->exports = 0;
    ev->payload = ev->job = NULL;
    ev->conn = NULL;
    return (PyObject *)p;
}

/* take() -> [(kind, id, ...)]: the events queued by now, in order:
 *   (EV_FRAME, id, payload)  (EV_END, id, code, message)
 *   (EV_NO_ROOM, id, length, job)  (EV_HALF_CLOSE, id)  (EV_CLOSED, id)
 * and the replies done with are released. */
static PyObject *Loop_take(Loop *self, PyObject *unused) {
    (void)unused;
    drain(self->py_efd);  /* before the swap: a wake after it is not lost */
    pthread_mutex_lock(&self->out_lock);
    event_t *events = self->events;
    size_t n = self->n_events;
    reply_t *released = self->released;
    self->events = NULL;
    self->n_events = self->cap_events = 0;
    self->released = NULL;
    self->n_released = 0;
    self->py_signaled = 0;
    pthread_mutex_unlock(&self->out_lock);
    release_replies(self, released);
    PyObject *result = PyList_New(0);
    for (size_t i = 0; i < n; i++) {
        event_t *ev = &events[i];
        PyObject *item = NULL;
        if (result != NULL) {
            switch (ev->kind) {
            case EV_FRAME: {
                PyObject *payload = make_payload(self, ev);
                if (payload != NULL)
                    item = Py_BuildValue("iLN", ev->kind, (long long)ev->id, payload);
                break;
            }
            case EV_END:
                item = Py_BuildValue("iLis", ev->kind, (long long)ev->id, ev->code,
                                     ev->message);
                break;
            case EV_NO_ROOM:
                item = ev->with_job && ev->job != NULL
                           ? Py_BuildValue("iLLs#", ev->kind, (long long)ev->id,
                                           (long long)ev->length, ev->job, ev->job_len)
                           : Py_BuildValue("iLLO", ev->kind, (long long)ev->id,
                                           (long long)ev->length, Py_None);
                break;
            default:
                item = Py_BuildValue("iL", ev->kind, (long long)ev->id);
            }
            if (item == NULL || PyList_Append(result, item) < 0) Py_CLEAR(result);
            Py_XDECREF(item);
        }
        if (ev->kind == EV_FRAME && ev->payload != NULL) {
            /* not handed over (an error above): give back what it held */
            event_t *e = ev;
            job_ref job = {e->with_job ? e->job : NULL, e->job_len};
            budget_c->give_transport(self->budget, e->length, job);
            __atomic_sub_fetch(&self->slots_taken, 1, __ATOMIC_SEQ_CST);
            if (e->conn != NULL) {
                __atomic_sub_fetch(&e->conn->promised_bytes, e->length, __ATOMIC_SEQ_CST);
                conn_unref(e->conn);
            }
            free(e->payload);
        }
        free(ev->job);
        free(ev->message);
    }
    free(events);
    return result;
}

static PyObject *Loop_fileno(Loop *self, PyObject *unused) {
    (void)unused;
    return PyLong_FromLong(self->py_efd);
}

/* Stop the thread (it forgets every connection; their sockets are Python's). */
static PyObject *Loop_stop(Loop *self, PyObject *unused) {
    (void)unused;
    if (!self->started || self->stop) Py_RETURN_NONE;
    pthread_mutex_lock(&self->cmd_lock);
    self->stop = 1;
    pthread_mutex_unlock(&self->cmd_lock);
    wake(self->cmd_efd);
    Py_BEGIN_ALLOW_THREADS
    pthread_join(self->thread, NULL);
    Py_END_ALLOW_THREADS
    for (conn_t *c = self->conns; c != NULL; c = c->next_all) c->state = ST_DONE;
    for (conn_t *c = self->conns; c != NULL;) {
        conn_t *next = c->next_all;
        while (c->replies != NULL) {
            reply_t *r = c->replies;
            c->replies = r->next;
            r->next = NULL;
            release_replies(self, r);
        }
        free(c->payload);
        if (c->reserved) {
            job_ref job = {c->with_job ? c->job : NULL, c->job_len};
            budget_c->give_transport(self->budget, c->length, job);
        }
        if (c->slot) __atomic_sub_fetch(&self->slots_taken, 1, __ATOMIC_SEQ_CST);
        c->payload = NULL;
        c->reserved = c->slot = 0;
        conn_unref(c);
        c = next;
    }
    self->conns = NULL;
    Py_RETURN_NONE;
}

static void Loop_dealloc(Loop *self) {
    PyObject *r = Loop_stop(self, NULL);
    Py_XDECREF(r);
    PyObject *rest = self->budget != NULL ? Loop_take(self, NULL) : NULL;
    Py_XDECREF(rest);
    PyErr_Clear();
    free(self->by_fd);
    while (self->cmds != NULL) {
        cmd_t *next = self->cmds->next;
        if (self->cmds->reply != NULL) release_replies(self, self->cmds->reply);
        free(self->cmds->job);
        free(self->cmds);
        self->cmds = next;
    }
    if (self->epfd > 0) close(self->epfd);
    if (self->cmd_efd > 0) close(self->cmd_efd);
    if (self->py_efd > 0) close(self->py_efd);
    if (self->budget != NULL) {
        pthread_mutex_destroy(&self->cmd_lock);
        pthread_mutex_destroy(&self->out_lock);
    }
    Py_XDECREF(self->budget);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Loop_get_slots(Loop *self, void *c) {
    (void)c;
    return PyLong_FromLongLong(__atomic_load_n(&self->slots_taken, __ATOMIC_SEQ_CST));
}

static PyMethodDef Loop_methods[] = {
    {"start", (PyCFunction)Loop_start, METH_NOARGS, "start the loop thread"},
    {"add", (PyCFunction)Loop_add, METH_VARARGS,
     "add(id, fd, job): read a connection's frames from here on"},
    {"set_job", (PyCFunction)Loop_set_job, METH_VARARGS,
     "set_job(id, fd, job): the job its frames count against (once)"},
    {"send", (PyCFunction)Loop_send, METH_VARARGS,
     "send(id, fd, frame, priority, job, counted): queue a reply frame"},
    {"end", (PyCFunction)Loop_end, METH_VARARGS,
     "end(id, fd, status_frame): the last frame, then half-close and linger"},
    {"take", (PyCFunction)Loop_take, METH_NOARGS, "the events queued by now"},
    {"fileno", (PyCFunction)Loop_fileno, METH_NOARGS, "readable when events wait"},
    {"stop", (PyCFunction)Loop_stop, METH_NOARGS, "stop the loop thread"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Loop_getset[] = {
    {"payloads", (getter)Loop_get_slots, NULL, "payloads alive (payload slots taken)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyTypeObject LoopType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "reducerd.dataplane._cplane.Loop",
    .tp_basicsize = sizeof(Loop),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The C data loop (its thread, its connections).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Loop_init,
    .tp_dealloc = (destructor)Loop_dealloc,
    .tp_methods = Loop_methods,
    .tp_getset = Loop_getset,
};

/* ---- Payload: a received frame's buffer ---- */

static int Payload_getbuffer(Payload *self, Py_buffer *view, int flags) {
    if (self->buf == NULL) {
        PyErr_SetString(PyExc_BufferError, "a released payload");
        return -1;
    }
    self->exports++;
    return PyBuffer_FillInfo(view, (PyObject *)self, self->buf, self->len, 0, flags);
}

static void Payload_releasebuffer(Payload *self, Py_buffer *view) {
    (void)view;
    self->exports--;
}

static PyBufferProcs Payload_as_buffer = {
    (getbufferproc)Payload_getbuffer, (releasebufferproc)Payload_releasebuffer,
};

static void Payload_dealloc(Payload *self) {
    Loop *l = self->loop;
    free(self->buf);
    job_ref job = {self->with_job ? self->job : NULL, self->job_len};
    budget_c->give_transport(l->budget, self->len, job);
    free(self->job);
    __atomic_sub_fetch(&l->slots_taken, 1, __ATOMIC_SEQ_CST);
    if (self->conn != NULL) {
        __atomic_sub_fetch(&self->conn->promised_bytes, self->len, __ATOMIC_SEQ_CST);
        conn_unref(self->conn);
    }
    if (__atomic_load_n(&l->slot_waiters, __ATOMIC_SEQ_CST) && l->started && !l->stop)
        loop_wake_self(l);
    Py_DECREF(l);
    PyObject_Free(self);
}

static Py_ssize_t Payload_len(Payload *self) { return self->len; }

static PySequenceMethods Payload_as_sequence = {.sq_length = (lenfunc)Payload_len};

PyTypeObject PayloadType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "reducerd.dataplane._cplane.Payload",
    .tp_basicsize = sizeof(Payload),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A received frame's payload; freeing it gives back its memory.",
    .tp_dealloc = (destructor)Payload_dealloc,
    .tp_as_buffer = &Payload_as_buffer,
    .tp_as_sequence = &Payload_as_sequence,
};
