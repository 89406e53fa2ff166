/* One plain-TCP data-plane connection on the C loop thread: its frames in,
 * its replies out, its end. Everything here runs on the loop thread alone,
 * without the GIL (the connection's state is that thread's).
 *
 * Reading: a frame's 5-byte header (reducer_wire.framing: kind, then the
 * payload's length, little-endian), checked as framing.parse_header checks
 * it; then, before any payload byte is read (reducerd.dataplane.loop_reader has the
 * same bounds in Python):
 * - its job's share of the budget has room (budget_job_has_room);
 * - its length is reserved from the budget, waiting up to reserve_wait_s
 *   (at once where it can never fit), else Python ends the stream with
 *   RESOURCE_EXHAUSTED (EV_NO_ROOM: the message is MemoryBudget.no_room's);
 * - fewer than unsent_frames replies and unsent_bytes (replies unsent plus
 *   frames Python has not taken) wait to be sent;
 * - a payload of at most WHOLE_MAX bytes waits in the kernel until it is
 *   all there (SO_RCVLOWAT: one wake-up; FIONREAD says how much is held), so
 *   a stalled payload holds neither a buffer nor a slot of the daemon's;
 *   woken with less (the kernel capped the mark, the client ended or
 *   broke), or above WHOLE_MAX, it is read in pieces;
 * - a payload slot: at most payload_slots payloads alive plane-wide.
 * Where one is not met the connection stops reading (EPOLLIN off: the frame
 * stays in the kernel and TCP slows the client) and is looked at again at
 * the next tick or give-back. The payload must arrive within
 * frame_timeout_s of its start (else DEADLINE_EXCEEDED), into a malloc'd
 * buffer that goes to Python whole (EV_FRAME).
 *
 * Sending: replies in priority order, non-blocking; what the socket does not
 * take waits for EPOLLOUT; no progress for send_timeout_s ends the
 * connection. After the status frame: half-close, read and drop until the
 * client closes or linger_s passes, then EV_CLOSED. */
#include "_cplane.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <time.h>

#define SKIP_BYTES 65536
#define PIECES_LOWAT_MAX (1 << 20)  /* recvside._PIECES_LOWAT_MAX */
#define FRAMES_PER_WAKE 4
#define KIND_HELLO 1
#define KIND_SHARD 2
#define KIND_STATUS 3
#define CODE_INVALID_ARGUMENT 3
#define CODE_DEADLINE_EXCEEDED 4

double loop_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

void conn_set_lowat(conn_t *c, int nbytes) {
    if (nbytes < 1) nbytes = 1;
    if (nbytes == c->lowat) return;
    if (setsockopt(c->fd, SOL_SOCKET, SO_RCVLOWAT, &nbytes, sizeof nbytes) == 0)
        c->lowat = nbytes;
}

/* Bytes the kernel holds, ready to be received. */
static int64_t queued(conn_t *c) {
    int held = 0;
    if (ioctl(c->fd, FIONREAD, &held) < 0) return 0;
    return held;
}

static job_ref frame_job(conn_t *c) {
    job_ref job = {c->with_job ? c->job : NULL, c->with_job ? c->job_len : 0};
    return job;
}

void conn_update_interest(Loop *l, conn_t *c) {
    if (c->state == ST_DONE) return;
    int want = 0;
    if (c->state != ST_HALF && c->state != ST_ADMIT) want |= EPOLLIN;
    if (c->replies != NULL) want |= EPOLLOUT;
    if (want == c->interest) return;
    struct epoll_event ev = {.events = (uint32_t)want, .data.ptr = c};
    epoll_ctl(l->epfd, EPOLL_CTL_MOD, c->fd, &ev);
    c->interest = want;
}

static void emit_end(Loop *l, conn_t *c, int code, const char *message) {
    event_t ev = {.kind = EV_END, .id = c->id, .code = code, .message = strdup(message)};
    loop_emit(l, &ev);
}

/* Give back what a frame cut short held. */
static void give_back(Loop *l, conn_t *c) {
    free(c->payload);
    c->payload = NULL;
    if (c->reserved) {
        budget_c->give_transport(l->budget, c->length, frame_job(c));
        c->reserved = 0;
    }
    if (c->slot) {
        __atomic_sub_fetch(&l->slots_taken, 1, __ATOMIC_SEQ_CST);
        c->slot = 0;
    }
    conn_set_lowat(c, 1);
}

/* Read and drop until the client closes (or linger_s from now, if > 0). */
static void start_drop(conn_t *c, double linger_s) {
    c->state = ST_DROP;
    if (linger_s > 0) c->drop_deadline = loop_now() + linger_s;
}

/* The stream cannot go on: Python ends it with (code, message); drop the rest. */
static void fail(Loop *l, conn_t *c, int code, const char *message, double linger_s) {
    give_back(l, c);
    emit_end(l, c, code, message);
    start_drop(c, linger_s);
}

/* A receive without waiting: > 0 bytes, 0 at the end, -1 none yet, -2 broken. */
static ssize_t receive(conn_t *c, void *buf, size_t n) {
    ssize_t got = recv(c->fd, buf, n, MSG_DONTWAIT);
    if (got >= 0) return got;
    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return -1;
    return -2;
}

/* The connection broke: read and send no more, tell Python once. */
void conn_close(Loop *l, conn_t *c) {
    if (c->state == ST_DONE) return;
    give_back(l, c);
    epoll_ctl(l->epfd, EPOLL_CTL_DEL, c->fd, NULL);
    c->state = ST_DONE;
    while (c->replies != NULL) {
        reply_t *r = c->replies;
        c->replies = r->next;
        loop_release(l, r);
    }
    c->queued_frames = c->unsent_bytes = 0;
    event_t ev = {.kind = EV_CLOSED, .id = c->id};
    loop_emit(l, &ev);
}

/* ---- reading ---- */

static int admit(Loop *l, conn_t *c);

/* A whole header is in: check it (framing.parse_header's messages). 1: go on. */
static int on_header(Loop *l, conn_t *c) {
    int kind = c->header[0];
    uint32_t length = (uint32_t)c->header[1] | (uint32_t)c->header[2] << 8 |
                      (uint32_t)c->header[3] << 16 | (uint32_t)c->header[4] << 24;
    char message[160];
    c->header_got = 0;
    if (kind != KIND_HELLO && kind != KIND_SHARD && kind != KIND_STATUS) {
        snprintf(message, sizeof message, "unknown frame kind %d", kind);
        fail(l, c, CODE_INVALID_ARGUMENT, message, 0);
        return 0;
    }
    if ((int64_t)length > l->max_message_bytes) {
        snprintf(message, sizeof message,
                 "frame of %u bytes is larger than the limit of %lld bytes", length,
                 (long long)l->max_message_bytes);
        fail(l, c, CODE_INVALID_ARGUMENT, message, 0);
        return 0;
    }
    c->length = length;
    if (c->ending) {  /* so the client sees our status, not a reset */
        c->left = length;
        c->state = length ? ST_SKIP : ST_HEADER;
        return 1;
    }
    if (kind != KIND_SHARD) {
        snprintf(message, sizeof message, "unexpected frame kind %d after HELLO", kind);
        emit_end(l, c, CODE_INVALID_ARGUMENT, message);
        c->ending = 1;
        c->left = length;
        c->state = length ? ST_SKIP : ST_HEADER;
        return 1;
    }
    c->with_job = c->job != NULL;  /* fixed from here on: what is counted goes back */
    c->reserve_deadline = 0;
    c->frame_deadline = 0;
    c->pressure_noted = 0;
    c->in_pieces = c->length > WHOLE_MAX;
    c->waited_whole = 0;
    c->state = ST_ADMIT;
    return admit(l, c);
}

static void note_pressure(Loop *l, conn_t *c) {
    if (!c->pressure_noted) {
        c->pressure_noted = 1;
        budget_c->note_pressure(l->budget);
    }
}

/* The frame's bounds (the file's comment); 1: the payload may be read. */
static int admit(Loop *l, conn_t *c) {
    if (c->ending) {
        give_back(l, c);
        c->left = c->length;
        c->state = c->length ? ST_SKIP : ST_HEADER;
        return 1;
    }
    if (!budget_c->job_has_room(l->budget, frame_job(c))) {
        note_pressure(l, c);
        return 0;
    }
    if (!c->reserved) {
        if (!budget_c->try_reserve(l->budget, c->length, frame_job(c))) {
            note_pressure(l, c);
            double now = loop_now();
            if (c->reserve_deadline == 0) c->reserve_deadline = now + l->reserve_wait_s;
            if (c->length > l->budget->limit_bytes || now >= c->reserve_deadline) {
                event_t ev = {.kind = EV_NO_ROOM, .id = c->id, .length = c->length,
                              .with_job = c->with_job};
                if (c->with_job) {
                    ev.job = malloc((size_t)c->job_len + 1);
                    if (ev.job != NULL) memcpy(ev.job, c->job, (size_t)c->job_len);
                    ev.job_len = c->job_len;
                }
                loop_emit(l, &ev);
                start_drop(c, l->linger_s);
            }
            return 0;
        }
        c->reserved = 1;
    }
    if (!(c->queued_frames < l->unsent_frames &&
          c->unsent_bytes + __atomic_load_n(&c->promised_bytes, __ATOMIC_SEQ_CST) <
              l->unsent_bytes)) {
        __atomic_store_n(&l->slot_waiters, 1, __ATOMIC_SEQ_CST);  /* a Payload's free wakes it */
        return 0;
    }
    if (c->frame_deadline == 0)  /* the payload starts: its deadline runs from here */
        c->frame_deadline = loop_now() + l->frame_timeout_s;
    if (!c->in_pieces && queued(c) < c->length) {
        if (!c->waited_whole) {  /* the first look: wait for the rest in the kernel */
            c->waited_whole = 1;
            conn_set_lowat(c, (int)c->length);
            c->state = ST_WHOLE;
            return 0;
        }
        c->in_pieces = 1;  /* woken with less: the mark was capped, or the client ended */
    }
    if (!c->slot) {
        if (__atomic_add_fetch(&l->slots_taken, 1, __ATOMIC_SEQ_CST) > l->payload_slots) {
            __atomic_sub_fetch(&l->slots_taken, 1, __ATOMIC_SEQ_CST);
            __atomic_store_n(&l->slot_waiters, 1, __ATOMIC_SEQ_CST);
            return 0;
        }
        c->slot = 1;
    }
    c->payload = malloc(c->length ? (size_t)c->length : 1);
    if (c->payload == NULL) {
        fail(l, c, 13 /* INTERNAL */, "reducerd fault: out of memory for a frame", 0);
        return 0;
    }
    c->got = 0;
    c->state = ST_PAYLOAD;
    return 1;
}

/* The payload is whole: it goes to Python, with its reservation and slot. */
static void hand_over(Loop *l, conn_t *c) {
    event_t ev = {.kind = EV_FRAME, .id = c->id, .length = c->length, .payload = c->payload,
                  .conn = c, .with_job = c->with_job};
    if (c->with_job) {
        ev.job = malloc((size_t)c->job_len + 1);
        if (ev.job == NULL) {  /* cannot name it for the give-back: fail the stream */
            fail(l, c, 13, "reducerd fault: out of memory for a frame", 0);
            return;
        }
        memcpy(ev.job, c->job, (size_t)c->job_len);
        ev.job_len = c->job_len;
    }
    c->payload = NULL;
    c->reserved = c->slot = 0;  /* the Payload object gives both back */
    conn_set_lowat(c, 1);
    __atomic_add_fetch(&c->promised_bytes, c->length, __ATOMIC_SEQ_CST);
    __atomic_add_fetch(&c->refs, 1, __ATOMIC_SEQ_CST);  /* the Payload's */
    c->state = ST_HEADER;
    loop_emit(l, &ev);
}

/* A payload read in pieces: readable once its rest is there, or PIECES_LOWAT_MAX
 * of it (recvside.ReceiveSide.wake_for_rest). Never more than what is missing:
 * a mark the rest cannot reach would leave it to the deadline. */
static int await_rest(conn_t *c) {
    int64_t missing = c->length - c->got;
    conn_set_lowat(c, (int)(missing < PIECES_LOWAT_MAX ? missing : PIECES_LOWAT_MAX));
    return 0;
}

/* One step as far as the socket allows: 1 when a frame was handled (another
 * may follow), 0 when it must wait. */
static int step(Loop *l, conn_t *c) {
    ssize_t n;
    char scratch[SKIP_BYTES];
    switch (c->state) {
    case ST_HEADER:
        n = receive(c, c->header + c->header_got, 5 - (size_t)c->header_got);
        if (n == -1) return 0;
        if (n == -2) { conn_close(l, c); return 0; }
        if (n == 0) {
            if (c->header_got) {
                char message[128];
                snprintf(message, sizeof message,
                         "connection ended inside a frame header (%d of 5 bytes)",
                         c->header_got);
                fail(l, c, CODE_INVALID_ARGUMENT, message, 0);
                return 0;
            }
            event_t ev = {.kind = EV_HALF_CLOSE, .id = c->id};
            loop_emit(l, &ev);
            c->state = ST_HALF;
            return 0;
        }
        c->header_got += (int)n;
        if (c->header_got < 5) return 0;
        return on_header(l, c);
    case ST_ADMIT:
        return admit(l, c);
    case ST_WHOLE:  /* woken: all there, or it is read in pieces */
        c->state = ST_ADMIT;
        return admit(l, c);
    case ST_PAYLOAD:
        if (c->got < c->length) {
            n = receive(c, c->payload + c->got, (size_t)(c->length - c->got));
            if (n == -1) return await_rest(c);
            if (n == -2) { conn_close(l, c); return 0; }
            if (n == 0) {
                char message[128];
                snprintf(message, sizeof message,
                         "connection ended inside a frame (%lld of %lld bytes)",
                         (long long)c->got, (long long)c->length);
                fail(l, c, CODE_INVALID_ARGUMENT, message, 0);
                return 0;
            }
            c->got += n;
            if (c->got < c->length) return await_rest(c);
        }
        hand_over(l, c);
        return 1;
    case ST_SKIP:
    case ST_DROP:
        n = receive(c, scratch, c->state == ST_SKIP && c->left < SKIP_BYTES
                                    ? (size_t)c->left : sizeof scratch);
        if (n == -1) return 0;
        if (n == -2) { conn_close(l, c); return 0; }
        if (n == 0) {
            if (c->state == ST_SKIP && !c->ending) {  /* as at a frame's end */
                event_t ev = {.kind = EV_HALF_CLOSE, .id = c->id};
                loop_emit(l, &ev);
            }
            c->state = ST_HALF;  /* the client closed: our status goes, then the close */
            if (c->wr_shut) conn_close(l, c);
            return 0;
        }
        if (c->state == ST_SKIP) {
            c->left -= n;
            if (!c->left) {
                c->state = ST_HEADER;
                return 1;
            }
        }
        return 1;
    default:
        return 0;
    }
}

/* ---- sending ---- */

/* Send what the socket takes; 0 on a broken connection (closed by now). */
static int send_some(Loop *l, conn_t *c) {
    while (c->replies != NULL) {
        reply_t *r = c->replies;
        ssize_t n = send(c->fd, (char *)r->view.buf + r->sent, (size_t)(r->view.len - r->sent),
                         MSG_DONTWAIT | MSG_NOSIGNAL);
        if (n < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) {
                if (c->send_stalled_since == 0) c->send_stalled_since = loop_now();
                return 1;
            }
            conn_close(l, c);
            return 0;
        }
        c->send_stalled_since = 0;
        r->sent += n;
        if (r->sent < r->view.len) continue;
        c->replies = r->next;
        if (!r->last) {
            c->queued_frames--;
            c->unsent_bytes -= r->view.len;
        }
        int last = r->last;
        loop_release(l, r);
        if (last) {
            shutdown(c->fd, SHUT_WR);
            c->wr_shut = 1;
            if (c->state == ST_HALF) {  /* the client has closed its side already */
                conn_close(l, c);
                return 0;
            }
            start_drop(c, l->linger_s);
        }
    }
    return 1;
}

/* Put a reply in priority order: positive priorities first, highest first,
 * put order among equals, then priority 0 in put order, the status last;
 * a part-sent head stays first. */
void conn_queue_reply(Loop *l, conn_t *c, reply_t *r) {
    if (c->state == ST_DONE || c->status_queued) {
        loop_release(l, r);
        return;
    }
    if (!r->last) {
        c->queued_frames++;
        c->unsent_bytes += r->view.len;
    }
    reply_t **at = &c->replies;
    if (*at != NULL && (*at)->sent) at = &(*at)->next;
    while (*at != NULL && !(*at)->last && (*at)->priority >= r->priority &&
           !(r->priority > 0 && (*at)->priority < r->priority))
        at = &(*at)->next;
    if (r->last) while (*at != NULL) at = &(*at)->next;
    r->next = *at;
    *at = r;
    if (send_some(l, c)) conn_update_interest(l, c);
}

/* Python ends the stream: its status after the replies queued, then the
 * half-close and linger. */
void conn_begin_end(Loop *l, conn_t *c, reply_t *status) {
    if (c->state == ST_DONE || c->status_queued) {
        loop_release(l, status);
        return;
    }
    c->ending = 1;
    status->last = 1;
    conn_queue_reply(l, c, status);
    c->status_queued = 1;
}

/* ---- events and ticks ---- */

void conn_on_ready(Loop *l, conn_t *c, uint32_t events) {
    if ((events & EPOLLOUT) && !send_some(l, c)) return;
    /* A reset shows as EPOLLERR / EPOLLHUP: the next receive reports it. A
     * frame waiting for room may go on once replies went out. */
    if ((events & (EPOLLIN | EPOLLERR | EPOLLHUP)) || c->state == ST_ADMIT)
        for (int i = 0; i < FRAMES_PER_WAKE && c->state != ST_DONE && c->state != ST_HALF; i++)
            if (!step(l, c)) break;
    /* Not reading, a reset or hang-up would wake the loop for ever: the
     * connection is gone (a status could not reach the client now). */
    if ((events & (EPOLLERR | EPOLLHUP)) && (c->state == ST_HALF || c->state == ST_ADMIT)) {
        conn_close(l, c);
        return;
    }
    conn_update_interest(l, c);
}

void conn_unref(conn_t *c) {
    if (__atomic_sub_fetch(&c->refs, 1, __ATOMIC_SEQ_CST) == 0) {
        free(c->job);
        free(c);
    }
}

void conn_check(Loop *l, conn_t *c, double now) {
    if (c->state == ST_DONE) return;
    if (c->replies != NULL && c->send_stalled_since &&
        now - c->send_stalled_since > l->send_timeout_s) {
        conn_close(l, c);  /* no progress for the send timeout */
        return;
    }
    if ((c->state == ST_PAYLOAD || c->state == ST_WHOLE) && now > c->frame_deadline) {
        char message[256];
        int64_t arrived = c->state == ST_PAYLOAD ? c->got : queued(c);
        if (arrived > c->length) arrived = c->length;
        snprintf(message, sizeof message,
                 "a frame of %lld bytes did not arrive within %g s of its header "
                 "(%lld of %lld bytes arrived by the deadline)",
                 (long long)c->length, l->frame_timeout_s, (long long)arrived,
                 (long long)c->length);
        fail(l, c, CODE_DEADLINE_EXCEEDED, message, l->linger_s);
    } else if (c->state == ST_DROP && c->drop_deadline && now > c->drop_deadline) {
        if (c->wr_shut) {  /* the linger after our status is over */
            conn_close(l, c);
            return;
        }
        c->state = ST_HALF;  /* read no more; our status goes, then the close */
    } else if (c->state == ST_ADMIT && admit(l, c)) {
        for (int i = 0; i < FRAMES_PER_WAKE && c->state != ST_DONE; i++)
            if (!step(l, c)) break;
    }
    conn_update_interest(l, c);
}
