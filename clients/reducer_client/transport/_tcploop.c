/* reducer_client.transport._tcploop: the client's TCP data plane per chunk, in C.
 *
 * A Loop owns the plain-TCP sockets of a client's daemon links (connected and
 * greeted by Python, then handed over) and one C thread that drives them with
 * epoll. Python hands it a whole key at once: encode() lays every chunk's
 * frame (frame header, Shard, payload narrowed from the caller's array) out in
 * one Batch; submit() queues the batch on its links. The thread sends the
 * frames under the pacing of transport/order.py (SendOrder's window and
 * per-link credits, LinkQueue's priorities), reads the replies, matches each
 * to its chunk by (key, round, offset), checks its dtype and length, and
 * widens its data straight into the caller's output. Python hears of a key
 * once: when its chunks are answered (or a reply says it failed); and of a
 * link only when it breaks, with the chunks it leaves unanswered, which
 * Python resends on its own path (the rare cases stay there).
 *
 * Each link's connection is also its DaemonLink's stream (loopstream.py),
 * so the daemon sees one connection per client: write() sends one of the
 * link's own frames between the loop's (its caller waits, without the GIL,
 * until it is written), and a reply that is none of the loop's batches goes
 * to Python whole. A connection's generation (attach() counts them) tells a
 * write or an event which connection it is about.
 *
 * Threads: the loop thread and Python's callers share the state under one
 * mutex (`lock`). The loop thread holds it while it reads, writes and
 * decodes, never while it waits in epoll or holds the GIL: events for Python
 * are queued under the lock and dispatched after it is released, so a caller
 * holding the GIL can always take the lock. Nothing is allocated per chunk:
 * a batch (one key's round) holds every per-chunk array; receive buffers
 * grow to the largest frame and are reused.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>
#include <fcntl.h>

#include "../../../protos/python/reducer_wire/_api.h"

/* The wire codecs, by the index Python passes (fastpath.py's _codecs()). */
enum { CODEC_FLOAT32, CODEC_FLOAT16, CODEC_BFLOAT16, CODEC_INT8, CODEC_FP8, CODECS };
static rw_codec codecs[CODECS];
static int have_codec[CODECS];

#define FRAME_SHARD 2
#define FRAME_STATUS 3
#define FRAME_HEADER 5

/* Chunk states (bits). */
#define ST_SENT 1      /* went to the socket (or began to) */
#define ST_HANDED 2    /* wholly written: counts for the window's frontier */
#define ST_ANSWERED 4  /* its reply came and was taken */
#define ST_DETACHED 8  /* its link broke: Python resends it */
#define ST_CREDITED 16 /* holds a credit of its link */

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* ---- codecs ---- */

static int64_t wire_nbytes(int codec, Py_ssize_t param, int64_t numel) {
    switch (codec) {
    case CODEC_FLOAT32: return 4 * numel;
    case CODEC_FLOAT16: case CODEC_BFLOAT16: return 2 * numel;
    case CODEC_INT8: return 4 * ((numel + param - 1) / param) + numel;
    default: return numel;
    }
}

/* Values (float32, or float16 bits when f16_in) to the wire; scratch: numel floats. */
static void narrow(int codec, Py_ssize_t param, const char *src, int f16_in, char *dst,
                   int64_t numel, float *scratch) {
    if (f16_in && codec == CODEC_FLOAT16) { memcpy(dst, src, 2 * numel); return; }
    const float *values = (const float *)src;
    if (f16_in) {
        codecs[CODEC_FLOAT16].widen(src, codec == CODEC_FLOAT32 ? (float *)dst : scratch,
                                    numel, 0);
        if (codec == CODEC_FLOAT32) return;
        values = scratch;
    }
    if (codec == CODEC_FLOAT32) memcpy(dst, values, 4 * numel);
    else codecs[codec].narrow(values, dst, numel, param);
}

/* Wire data into the output (float32, or float16 when f16_out); scratch: numel floats. */
static void widen(int codec, Py_ssize_t param, const char *src, char *dst, int f16_out,
                  int64_t numel, float *scratch) {
    if (f16_out && codec == CODEC_FLOAT16) { memcpy(dst, src, 2 * numel); return; }
    float *target = f16_out ? scratch : (float *)dst;
    if (codec == CODEC_FLOAT32) {
        if (!f16_out) { memcpy(dst, src, 4 * numel); return; }
        memcpy(scratch, src, 4 * numel);
    } else {
        codecs[codec].widen(src, target, numel, param);
    }
    if (f16_out) codecs[CODEC_FLOAT16].narrow(scratch, dst, numel, 0);
}

/* ---- protobuf ---- */

static size_t varint_len(uint64_t v) { size_t n = 1; while (v > 0x7F) { v >>= 7; n++; } return n; }

static uint8_t *put_varint(uint8_t *p, uint64_t v) {
    while (v > 0x7F) { *p++ = (uint8_t)((v & 0x7F) | 0x80); v >>= 7; }
    *p++ = (uint8_t)v;
    return p;
}

static size_t int_field_len(int number, uint64_t v) { return v ? varint_len((uint64_t)number << 3) + varint_len(v) : 0; }
static uint8_t *put_int_field(uint8_t *p, int number, uint64_t v) {
    if (!v) return p;
    return put_varint(put_varint(p, (uint64_t)number << 3), v);
}
static size_t str_field_len(int number, Py_ssize_t n) { return n ? varint_len((uint64_t)number << 3 | 2) + varint_len((uint64_t)n) + (size_t)n : 0; }
static uint8_t *put_str_field(uint8_t *p, int number, const char *s, Py_ssize_t n) {
    if (!n) return p;
    p = put_varint(put_varint(p, (uint64_t)number << 3 | 2), (uint64_t)n);
    memcpy(p, s, (size_t)n);
    return p + n;
}

static int read_varint(const uint8_t *buf, size_t end, size_t *pos, uint64_t *out) {
    uint64_t result = 0;
    for (int shift = 0; shift < 70; shift += 7) {
        if (*pos >= end) return 0;
        uint8_t byte = buf[(*pos)++];
        if (shift < 64) result |= (uint64_t)(byte & 0x7F) << shift;
        if (byte < 0x80) { *out = result; return 1; }
    }
    return 0;
}

typedef struct {
    const uint8_t *key; size_t key_len;
    const uint8_t *data; size_t data_len;
    const uint8_t *error_message; size_t error_len;
    uint64_t round, offset, error_code;
    int32_t dtype;
} reply_t;

/* A reply's fields, as protobuf reads them: unknown fields and known numbers
 * with another wire type skipped, the last occurrence winning. 0: malformed
 * (Python's decoder then words the error). UTF-8 is not checked: only the
 * key is compared, byte for byte, with ours. */
static int parse_reply(const uint8_t *buf, size_t end, reply_t *r) {
    memset(r, 0, sizeof *r);
    size_t pos = 0;
    while (pos < end) {
        uint64_t tag, value;
        if (!read_varint(buf, end, &pos, &tag)) return 0;
        uint64_t number = tag >> 3;
        unsigned wire_type = (unsigned)(tag & 7);
        if (number == 0 || number >= (1u << 29)) return 0;
        if (wire_type == 1 || wire_type == 5) {
            size_t width = wire_type == 1 ? 8 : 4;
            if (width > end - pos) return 0;
            pos += width;
            continue;
        }
        if (wire_type != 0 && wire_type != 2) return 0;
        if (!read_varint(buf, end, &pos, &value)) return 0;
        if (wire_type == 2) {
            if (value > end - pos) return 0;
            const uint8_t *at = buf + pos;
            pos += (size_t)value;
            if (number == 5) { r->key = at; r->key_len = (size_t)value; }
            else if (number == 9) { r->data = at; r->data_len = (size_t)value; }
            else if (number == 11) { r->error_message = at; r->error_len = (size_t)value; }
            continue;
        }
        switch (number) {
        case 4: r->round = value; break;
        case 6: r->offset = value; break;
        case 7: r->dtype = (int32_t)(uint32_t)value; break;
        case 10: r->error_code = value & 0xFFFFFFFFu; break;
        default: break;
        }
    }
    return 1;
}

/* ---- the Batch type: one key's round, every chunk's frame ---- */

struct Loop;

typedef struct {
    int in_queue;
    void *prev, *next; /* Batch * in the link's queue */
    int64_t cursor;    /* the next of this link's chunks to send */
    int64_t unanswered; /* credited chunks sent and not answered */
} batch_link;

typedef struct Batch {
    PyObject_HEAD
    /* set by encode() */
    int64_t n, nlinks;
    char *block; size_t block_bytes; /* one allocation for everything below */
    uint8_t *frames; int64_t frames_bytes;
    int64_t *frame_at, *frame_len, *payload_at, *offset, *numel;
    int32_t *daemon;
    int64_t *order, *link_start; /* chunk indices grouped by link, and where each link's begin */
    uint8_t *state;
    batch_link *links;
    char *key; Py_ssize_t key_len;
    uint64_t round;
    int32_t wire_dtype;
    int codec; Py_ssize_t param;
    uint32_t priority;
    /* set by submit(), under the loop's lock */
    int active, retired, failed;
    int64_t token, seq;
    Py_buffer out; int out_held, f16_out;
    int64_t window; int paced, released, unpaced; int64_t credits;
    int64_t frontier, expected, answered;
    double progress_s;
} Batch;

static void batch_release_block(Batch *b) {
    PyMem_RawFree(b->block);
    b->block = NULL;
    b->block_bytes = 0;
}

static void Batch_dealloc(Batch *b) {
    if (b->out_held) PyBuffer_Release(&b->out);
    batch_release_block(b);
    Py_TYPE(b)->tp_free((PyObject *)b);
}

static PyObject *Batch_frame(Batch *b, PyObject *arg) {
    Py_ssize_t i = PyLong_AsSsize_t(arg);
    if (i == -1 && PyErr_Occurred()) return NULL;
    if (i < 0 || i >= b->n) {
        PyErr_Format(PyExc_IndexError, "chunk %zd of a batch of %lld", i, (long long)b->n);
        return NULL;
    }
    return PyBytes_FromStringAndSize((const char *)b->frames + b->frame_at[i],
                                     b->frame_len[i]);
}

static PyObject *Batch_get_n(Batch *b, void *c) { (void)c; return PyLong_FromLongLong(b->n); }
static PyObject *Batch_get_active(Batch *b, void *c) { (void)c; return PyBool_FromLong(b->active); }
static PyObject *Batch_get_nbytes(Batch *b, void *c) { (void)c; return PyLong_FromSize_t(b->block_bytes); }
static PyObject *Batch_get_daemons(Batch *b, void *c) {
    (void)c;
    PyObject *t = PyTuple_New(b->n ? b->nlinks : 0);
    for (int64_t l = 0; t && b->n && l < b->nlinks; l++)
        PyTuple_SET_ITEM(t, l, PyBool_FromLong(b->link_start[l + 1] > b->link_start[l]));
    return t;
}

static PyMethodDef Batch_methods[] = {
    {"frame", (PyCFunction)Batch_frame, METH_O,
     "frame(i) -> bytes: chunk i's whole frame (the 5-byte header, then the Shard)."},
    {NULL, NULL, 0, NULL},
};
static PyGetSetDef Batch_getset[] = {
    {"chunks", (getter)Batch_get_n, NULL, "how many chunks", NULL},
    {"active", (getter)Batch_get_active, NULL, "queued on a loop and not yet retired", NULL},
    {"nbytes", (getter)Batch_get_nbytes, NULL, "bytes it holds", NULL},
    {"daemons", (getter)Batch_get_daemons, NULL, "per link, whether it has chunks", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject BatchType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "reducer_client.transport._tcploop.Batch",
    .tp_basicsize = sizeof(Batch),
    .tp_dealloc = (destructor)Batch_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One key's round laid out as frames (encode()); reusable as a spare.",
    .tp_methods = Batch_methods,
    .tp_getset = Batch_getset,
};

static PyObject *s_offset, *s_numel, *s_daemon; /* interned attribute names */

static long long int_attr(PyObject *o, PyObject *name) {
    PyObject *v = PyObject_GetAttr(o, name);
    if (v == NULL) return -1;
    long long r = PyLong_AsLongLong(v);
    Py_DECREF(v);
    return r;
}

/* A chunk's (offset, numel, daemon): a reducer_wire.layout.Chunk, or a tuple. 0 on error. */
static int chunk_fields(PyObject *c, long long *off, long long *cnt, long long *d) {
    if (PyTuple_Check(c) && PyTuple_GET_SIZE(c) >= 3) {
        *off = PyLong_AsLongLong(PyTuple_GET_ITEM(c, 0));
        *cnt = PyLong_AsLongLong(PyTuple_GET_ITEM(c, 1));
        *d = PyLong_AsLongLong(PyTuple_GET_ITEM(c, 2));
    } else {
        *off = int_attr(c, s_offset);
        *cnt = int_attr(c, s_numel);
        *d = int_attr(c, s_daemon);
    }
    if (PyErr_Occurred()) return 0;
    return 1;
}

#define ALIGN8(x) (((x) + 7) & ~(size_t)7)

/* encode(job, key, rank, world_size, round, dtype, op, priority, incarnation,
 *        layouts, chunks, nlinks, codec, param, values, f16_in, base, spare) -> Batch */
static PyObject *encode(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *names[] = {"job", "key", "rank", "world_size", "round", "dtype", "op",
                            "priority", "incarnation", "layouts", "chunks", "codec", "param",
                            "values", "f16_in", "base", "spare", NULL};
    const char *job, *key;
    Py_ssize_t job_len, key_len, param, base;
    unsigned long long rank, world_size, round, priority, incarnation;
    int dtype, op, codec, f16_in;
    PyObject *layouts, *chunks, *values, *spare;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "s#s#KKKiiKKOOinOpnO", names, &job, &job_len,
                                     &key, &key_len, &rank, &world_size, &round, &dtype, &op,
                                     &priority, &incarnation, &layouts, &chunks, &codec,
                                     &param, &values, &f16_in, &base, &spare))
        return NULL;
    if (codec < 0 || codec >= CODECS || (codec != CODEC_FLOAT32 && !have_codec[codec])
            || (f16_in && !have_codec[CODEC_FLOAT16])) {
        PyErr_Format(PyExc_ValueError, "encode: codec %d is not available", codec);
        return NULL;
    }
    if ((codec == CODEC_INT8 && param < 1) || !PyList_Check(chunks) || !PyTuple_Check(layouts)) {
        PyErr_SetString(PyExc_TypeError, "encode: chunks must be a list, layouts a tuple, "
                        "the int8 block >= 1");
        return NULL;
    }
    int64_t n = PyList_GET_SIZE(chunks), nlinks = PyTuple_GET_SIZE(layouts);
    if (n == 0 || nlinks == 0) {
        PyErr_SetString(PyExc_ValueError, "encode: no chunks, or no links");
        return NULL;
    }
    Py_buffer in = {0};
    int have_values = values != Py_None;
    if (have_values && PyObject_GetBuffer(values, &in, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (!have_values && codec != CODEC_FLOAT32) {
        PyErr_SetString(PyExc_ValueError, "encode: only float32 wires send zeros");
        return NULL;
    }
    int64_t in_numel = have_values ? in.len / (f16_in ? 2 : 4) : 0;
    Batch *b = NULL;
    uint64_t *layout_values = NULL;
    int64_t *cell = NULL;
    PyObject *result = NULL;
    layout_values = PyMem_RawMalloc(sizeof(uint64_t) * (size_t)nlinks);
    cell = PyMem_RawCalloc((size_t)nlinks + 1, sizeof(int64_t));
    if (layout_values == NULL || cell == NULL) { PyErr_NoMemory(); goto done; }
    for (int64_t l = 0; l < nlinks; l++) {
        layout_values[l] = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(layouts, l));
        if (PyErr_Occurred()) goto done;
    }
    if (spare != Py_None) {
        if (!PyObject_TypeCheck(spare, &BatchType)) {
            PyErr_SetString(PyExc_TypeError, "encode: spare must be a Batch or None");
            goto done;
        }
        b = (Batch *)spare;
        if (b->active) {
            PyErr_SetString(PyExc_ValueError, "encode: the spare batch is still in flight");
            goto done;
        }
        Py_INCREF(b);
        b->n = 0; /* empty until laid out again */
        if (b->out_held) { PyBuffer_Release(&b->out); b->out_held = 0; }
    } else {
        b = PyObject_New(Batch, &BatchType);
        if (b == NULL) goto done;
        b->block = NULL; b->block_bytes = 0; b->out_held = 0;
    }
    /* Sizes first: each chunk's head differs in its offset and data length. */
    size_t head_fixed = str_field_len(1, job_len) + int_field_len(2, rank)
        + int_field_len(3, world_size) + int_field_len(4, round) + str_field_len(5, key_len)
        + int_field_len(7, (uint64_t)(int64_t)dtype) + int_field_len(8, (uint64_t)(int64_t)op);
    size_t tail_fixed = int_field_len(13, priority) + int_field_len(14, incarnation);
    int64_t frames_bytes = 0;
    int64_t off_prev_end = -1;
    for (int64_t i = 0; i < n; i++) {
        long long off, cnt, d;
        if (!chunk_fields(PyList_GET_ITEM(chunks, i), &off, &cnt, &d)) goto fail;
        if (off < 0 || cnt <= 0 || d < 0 || d >= nlinks || off < off_prev_end
                || (have_values && (off - base < 0 || off - base + cnt > in_numel))) {
            PyErr_Format(PyExc_ValueError, "encode: chunk %lld (offset %lld, %lld elements, "
                         "daemon %lld) is out of order or outside the values", (long long)i,
                         off, cnt, d);
            goto fail;
        }
        off_prev_end = off + cnt;
        int64_t data = wire_nbytes(codec, param, cnt);
        int64_t shard = (int64_t)(head_fixed + int_field_len(6, (uint64_t)off)
            + varint_len(9 << 3 | 2) + varint_len((uint64_t)data) + tail_fixed
            + int_field_len(12, layout_values[d])) + data;
        frames_bytes += FRAME_HEADER + shard;
        cell[d]++;
    }
    size_t need = ALIGN8((size_t)frames_bytes) + ALIGN8(sizeof(int64_t) * n) * 6
        + ALIGN8(sizeof(int32_t) * n) + ALIGN8(sizeof(int64_t) * (nlinks + 1))
        + ALIGN8((size_t)n) + ALIGN8(sizeof(batch_link) * nlinks) + ALIGN8((size_t)key_len + 1);
    if (b->block_bytes < need || b->block_bytes > 2 * need) {
        batch_release_block(b);
        b->block = PyMem_RawMalloc(need);
        if (b->block == NULL) { PyErr_NoMemory(); goto fail; }
        b->block_bytes = need;
    }
    char *p = b->block;
#define TAKE(ptr, type, count) do { ptr = (type *)p; p += ALIGN8(sizeof(type) * (size_t)(count)); } while (0)
    TAKE(b->frames, uint8_t, frames_bytes);
    TAKE(b->frame_at, int64_t, n); TAKE(b->frame_len, int64_t, n);
    TAKE(b->payload_at, int64_t, n); TAKE(b->offset, int64_t, n);
    TAKE(b->numel, int64_t, n); TAKE(b->order, int64_t, n);
    TAKE(b->daemon, int32_t, n); TAKE(b->link_start, int64_t, nlinks + 1);
    TAKE(b->state, uint8_t, n); TAKE(b->links, batch_link, nlinks);
    TAKE(b->key, char, key_len + 1);
#undef TAKE
    b->n = n; b->nlinks = nlinks; b->frames_bytes = frames_bytes;
    memcpy(b->key, key, (size_t)key_len);
    b->key[key_len] = 0;
    b->key_len = key_len; b->round = round; b->wire_dtype = dtype;
    b->codec = codec; b->param = param; b->priority = (uint32_t)priority;
    b->active = b->retired = b->failed = 0;
    b->link_start[0] = 0;
    for (int64_t l = 0; l < nlinks; l++) b->link_start[l + 1] = b->link_start[l] + cell[l];
    for (int64_t l = 0; l < nlinks; l++) cell[l] = b->link_start[l];
    int64_t at = 0, max_numel = 0;
    for (int64_t i = 0; i < n; i++) {
        long long off, cnt, d;
        chunk_fields(PyList_GET_ITEM(chunks, i), &off, &cnt, &d); /* checked above */
        b->offset[i] = off; b->numel[i] = cnt; b->daemon[i] = (int32_t)d;
        b->order[cell[b->daemon[i]]++] = i;
        if (b->numel[i] > max_numel) max_numel = b->numel[i];
        int64_t data = wire_nbytes(codec, param, b->numel[i]);
        uint8_t *start = b->frames + at, *q = start + FRAME_HEADER;
        q = put_str_field(q, 1, job, job_len);
        q = put_int_field(q, 2, rank);
        q = put_int_field(q, 3, world_size);
        q = put_int_field(q, 4, round);
        q = put_str_field(q, 5, key, key_len);
        q = put_int_field(q, 6, (uint64_t)b->offset[i]);
        q = put_int_field(q, 7, (uint64_t)(int64_t)dtype);
        q = put_int_field(q, 8, (uint64_t)(int64_t)op);
        q = put_varint(put_varint(q, 9 << 3 | 2), (uint64_t)data);
        b->payload_at[i] = q - b->frames;
        q += data;
        q = put_int_field(q, 12, layout_values[b->daemon[i]]);
        q = put_int_field(q, 13, priority);
        q = put_int_field(q, 14, incarnation);
        int64_t len = q - start;
        uint32_t shard = (uint32_t)(len - FRAME_HEADER);
        start[0] = FRAME_SHARD;
        start[1] = (uint8_t)shard; start[2] = (uint8_t)(shard >> 8);
        start[3] = (uint8_t)(shard >> 16); start[4] = (uint8_t)(shard >> 24);
        b->frame_at[i] = at; b->frame_len[i] = len;
        at += len;
    }
    /* The payloads, without the GIL: the conversions are the bulk of the work. */
    {
        float *scratch = NULL;
        int ok = 1;
        Py_BEGIN_ALLOW_THREADS
        if (f16_in && codec != CODEC_FLOAT16 && codec != CODEC_FLOAT32) {
            scratch = PyMem_RawMalloc(sizeof(float) * (size_t)max_numel);
            ok = scratch != NULL;
        }
        for (int64_t i = 0; ok && i < n; i++) {
            char *dst = (char *)b->frames + b->payload_at[i];
            if (!have_values) {
                float zero = -0.0f; /* x + -0.0 == x, also for x = -0.0 */
                for (int64_t e = 0; e < b->numel[i]; e++) memcpy(dst + 4 * e, &zero, 4);
            } else {
                const char *src = (const char *)in.buf + (b->offset[i] - base) * (f16_in ? 2 : 4);
                narrow(codec, param, src, f16_in, dst, b->numel[i], scratch);
            }
        }
        PyMem_RawFree(scratch);
        Py_END_ALLOW_THREADS
        if (!ok) { PyErr_NoMemory(); goto fail; }
    }
    result = (PyObject *)b;
    goto done;
fail:
    Py_XDECREF(b);
done:
    if (have_values && in.obj != NULL) PyBuffer_Release(&in);
    PyMem_RawFree(layout_values);
    PyMem_RawFree(cell);
    return result;
}

/* ---- the Loop type ---- */

/* A frame of the Python path (write()): on its caller's stack while it waits. */
typedef struct raw_req {
    struct raw_req *next;
    const uint8_t *buf; int64_t len;
    int result; /* 0 waiting, 1 written, -1 the connection ended first */
} raw_req;

typedef struct {
    int fd, up, replied;
    uint64_t gen; /* counts attaches: which connection a write or an event is about */
    int64_t max_frame;
    /* receiving: the header, then the body */
    uint8_t header[FRAME_HEADER]; int header_got;
    uint8_t *body; int64_t body_cap, body_len, body_got; int in_body;
    /* what one recv brought beyond the part being read: most frames and
     * headers come out of it, so a reply costs about one system call */
    uint8_t *rbuf; int64_t rpos, rlen; int drained;
    /* sending: the frame in progress (of cur, or the copied rest in tail) */
    Batch *cur; int64_t cur_chunk; const uint8_t *send_at; int64_t send_left;
    uint8_t *tail; int64_t tail_cap;
    int out_armed, writable; /* EPOLLOUT wanted; epoll said it may write */
    Batch *head, *last; /* the queue: priority first, then submission order */
    Batch *waiting; int64_t waiting_chunk; double waiting_since;
    float *scratch; int64_t scratch_cap;
    /* the Python path's frames on this connection, in order; raw_cur is being sent */
    raw_req *raw_head, *raw_last, *raw_cur;
} link_t;

enum { EV_DONE, EV_ERROR, EV_BAD, EV_DOWN, EV_RELEASE, EV_REPLY };

typedef struct event {
    struct event *next;
    int kind;
    Batch *batch; /* EV_DONE, EV_ERROR, EV_BAD, EV_RELEASE: the loop's reference */
    int64_t link, chunk, code, got, expected;
    uint64_t gen; /* EV_DOWN, EV_REPLY: the connection's */
    char *text; int64_t text_len; /* a message, a STATUS's, a malformed frame's bytes */
    int status_frame, malformed, replied;
    int64_t *orphans; int64_t orphans_n; /* EV_DOWN: (batch index in refs, chunk) pairs */
    Batch **orphan_batches;
} event_t;

typedef struct Loop {
    PyObject_HEAD
    pthread_mutex_t lock; /* guards everything below but `thread`, taken by the loop
                             thread and by callers (submit, cancel, attach, write, close) */
    pthread_cond_t written; /* a raw_req's result was set (writers wait on it) */
    pthread_t thread; int started;
    int epfd, wakefd, stop;
    int64_t nlinks; link_t *links;
    PyObject *on_event;
    event_t *events, *events_last;
    int64_t seq;
    double max_wait_s, stall_s;
    uint64_t frames_sent, replies_taken;
} Loop;

static void push_event(Loop *L, event_t *e) {
    e->next = NULL;
    if (L->events_last) L->events_last->next = e; else L->events = e;
    L->events_last = e;
}

static event_t *new_event(int kind) {
    event_t *e = calloc(1, sizeof *e);
    if (e) e->kind = kind;
    return e;
}

static void wake(Loop *L) {
    uint64_t one = 1;
    ssize_t r = write(L->wakefd, &one, sizeof one);
    (void)r;
}

static void queue_unlink(link_t *k, Batch *b, int64_t l) {
    batch_link *bl = &b->links[l];
    if (!bl->in_queue) return;
    Batch *prev = bl->prev, *next = bl->next;
    if (prev) prev->links[l].next = next; else k->head = next;
    if (next) next->links[l].prev = prev; else k->last = prev;
    bl->in_queue = 0; bl->prev = bl->next = NULL;
    if (k->waiting == b) k->waiting = NULL;
}

static void queue_insert(link_t *k, Batch *b, int64_t l) {
    batch_link *bl = &b->links[l];
    Batch *after = k->last;
    while (after && after->priority < b->priority) after = after->links[l].prev;
    bl->prev = after;
    bl->next = after ? after->links[l].next : k->head;
    if (bl->next) ((Batch *)bl->next)->links[l].prev = b; else k->last = b;
    if (after) after->links[l].next = b; else k->head = b;
    bl->in_queue = 1;
}

static int ensure_tail(link_t *k, int64_t n) {
    if (k->tail_cap >= n) return 1;
    uint8_t *t = realloc(k->tail, (size_t)n);
    if (!t) return 0;
    k->tail = t; k->tail_cap = n;
    return 1;
}

/* Take the batch off every link (its reply, a failure, a cancel); an event
 * hands its reference back to Python. A frame half-sent goes on from a copy. */
static void retire(Loop *L, Batch *b, event_t *e) {
    if (b->retired) { free(e); return; }
    b->retired = 1;
    for (int64_t l = 0; l < L->nlinks && l < b->nlinks; l++) {
        link_t *k = &L->links[l];
        queue_unlink(k, b, l);
        if (k->cur == b) {
            if (k->send_left && ensure_tail(k, k->send_left)) {
                memcpy(k->tail, k->send_at, (size_t)k->send_left);
                k->send_at = k->tail;
            } else if (k->send_left) {
                k->send_left = 0; /* no memory for the rest: the stream is cut below */
                shutdown(k->fd, SHUT_RDWR);
            }
            k->cur = NULL;
        }
    }
    e->batch = b;
    push_event(L, e);
}

static void retire_kind(Loop *L, Batch *b, int kind) {
    event_t *e = new_event(kind);
    if (e == NULL) { /* out of memory: the reference leaks rather than dangles */
        b->retired = 1;
        for (int64_t l = 0; l < L->nlinks; l++) queue_unlink(&L->links[l], b, l);
        return;
    }
    e->got = b->answered;
    retire(L, b, e);
}

static void take_answer(Batch *b, int64_t i, int64_t l, double now) {
    if (b->state[i] & ST_CREDITED) {
        b->state[i] &= ~ST_CREDITED;
        b->links[l].unanswered--;
    }
    b->progress_s = now;
}

static void link_down(Loop *L, int64_t l, int code, const char *text, int64_t text_len,
                      int status_frame, int malformed);

static int set_text(event_t *e, const char *text, int64_t len) {
    e->text = malloc((size_t)len + 1);
    if (!e->text) return 0;
    memcpy(e->text, text, (size_t)len);
    e->text[len] = 0;
    e->text_len = len;
    return 1;
}

static void link_down_errno(Loop *L, int64_t l, int err) {
    char text[200];
    snprintf(text, sizeof text, "connection broke ([Errno %d] %s)", err, strerror(err));
    link_down(L, l, 14 /* UNAVAILABLE */, text, (int64_t)strlen(text), 0, 0);
}

/* A reply that is no batch's goes to Python: the Python path's chunks on this
 * connection (its other keys, resends), or a late one it drops. */
static void forward_reply(Loop *L, int64_t l, const uint8_t *body, int64_t len) {
    event_t *e = new_event(EV_REPLY);
    if (e == NULL) return;
    e->link = l; e->gen = L->links[l].gen;
    if (!set_text(e, (const char *)body, len)) { free(e); return; }
    push_event(L, e);
}

/* Settle the Python path's frames of link l: the one in progress and the queued. */
static void fail_raw(Loop *L, link_t *k) {
    if (k->raw_cur) { k->raw_cur->result = -1; k->raw_cur = NULL; }
    for (raw_req *r = k->raw_head; r; r = r->next) r->result = -1;
    k->raw_head = k->raw_last = NULL;
    pthread_cond_broadcast(&L->written);
}

/* One whole frame arrived on link l. */
static void on_frame(Loop *L, int64_t l, double now) {
    link_t *k = &L->links[l];
    const uint8_t *body = k->body;
    int64_t len = k->body_len;
    int kind = k->header[0];
    if (kind == FRAME_STATUS) {
        if (len < 4) {
            char text[80];
            snprintf(text, sizeof text, "STATUS frame of %lld bytes", (long long)len);
            link_down(L, l, 13 /* INTERNAL */, text, (int64_t)strlen(text), 0, 0);
            return;
        }
        int code = (int)((uint32_t)body[0] | (uint32_t)body[1] << 8 | (uint32_t)body[2] << 16
                         | (uint32_t)body[3] << 24);
        link_down(L, l, code, (const char *)body + 4, len - 4, 1, 0);
        return;
    }
    reply_t r;
    if (!parse_reply(body, (size_t)len, &r)) {
        link_down(L, l, 13, (const char *)body, len, 0, 1);
        return;
    }
    k->replied = 1;
    Batch *b = k->head;
    for (; b; b = b->links[l].next)
        if (b->round == r.round && (size_t)b->key_len == r.key_len
                && memcmp(b->key, r.key, r.key_len) == 0)
            break;
    if (b == NULL) { forward_reply(L, l, body, len); return; }
    int64_t lo = b->link_start[l], hi = b->link_start[l + 1] - 1, found = -1;
    while (lo <= hi) {
        int64_t mid = (lo + hi) / 2, i = b->order[mid];
        if ((uint64_t)b->offset[i] == r.offset) { found = i; break; }
        if ((uint64_t)b->offset[i] < r.offset) lo = mid + 1; else hi = mid - 1;
    }
    if (found < 0 || !(b->state[found] & ST_SENT) || (b->state[found] & (ST_ANSWERED | ST_DETACHED))) {
        forward_reply(L, l, body, len);
        return;
    }
    int64_t i = found;
    take_answer(b, i, l, now);
    L->replies_taken++;
    if (r.error_code) {
        event_t *e = new_event(EV_ERROR);
        if (e == NULL) return;
        e->chunk = i; e->code = (int64_t)r.error_code; e->link = l;
        set_text(e, (const char *)r.error_message, (int64_t)r.error_len);
        b->failed = 1;
        retire(L, b, e);
        return;
    }
    int64_t expected = wire_nbytes(b->codec, b->param, b->numel[i]);
    if (r.dtype != b->wire_dtype || (int64_t)r.data_len != expected) {
        event_t *e = new_event(EV_BAD);
        if (e == NULL) return;
        e->chunk = i; e->link = l;
        e->code = r.dtype != b->wire_dtype; /* 1: the dtype, 0: the length */
        e->got = r.dtype != b->wire_dtype ? r.dtype : (int64_t)r.data_len;
        e->expected = r.dtype != b->wire_dtype ? b->wire_dtype : expected;
        b->failed = 1;
        retire(L, b, e);
        return;
    }
    int64_t numel = b->numel[i];
    if (b->f16_out && (b->codec != CODEC_FLOAT16) && k->scratch_cap < numel) {
        float *s = realloc(k->scratch, sizeof(float) * (size_t)numel);
        if (s == NULL) { link_down_errno(L, l, ENOMEM); return; }
        k->scratch = s; k->scratch_cap = numel;
    }
    widen(b->codec, b->param, (const char *)r.data,
          (char *)b->out.buf + b->offset[i] * (b->f16_out ? 2 : 4), b->f16_out, numel,
          k->scratch);
    b->state[i] |= ST_ANSWERED;
    b->answered++;
    if (b->answered == b->expected) retire_kind(L, b, EV_DONE);
}

#define RBUF_BYTES (64 << 10)

/* Up to `want` bytes for dst: from rbuf, else one recv (into dst itself for a
 * large rest); recv's result otherwise. A recv that came back short drained
 * the socket: the next asks epoll again (EAGAIN) instead of the kernel. */
static ssize_t take(link_t *k, uint8_t *dst, int64_t want) {
    if (k->rpos == k->rlen) {
        if (k->drained) { errno = EAGAIN; return -1; }
        if (want >= RBUF_BYTES) {
            ssize_t got = recv(k->fd, dst, (size_t)want, 0);
            k->drained = got > 0 && got < want;
            return got;
        }
        ssize_t got = recv(k->fd, k->rbuf, RBUF_BYTES, 0);
        if (got <= 0) return got;
        k->rpos = 0; k->rlen = got; k->drained = got < RBUF_BYTES;
    }
    int64_t n = k->rlen - k->rpos < want ? k->rlen - k->rpos : want;
    memcpy(dst, k->rbuf + k->rpos, (size_t)n);
    k->rpos += n;
    return (ssize_t)n;
}

/* Read what link l holds; stop at EAGAIN, after a bounded number of frames, or a break. */
static void pump_recv(Loop *L, int64_t l, double now) {
    link_t *k = &L->links[l];
    k->drained = 0; /* epoll says there is more */
    for (int frames = 0; k->up && frames < 256;) {
        ssize_t got;
        if (!k->in_body) {
            got = take(k, k->header + k->header_got, FRAME_HEADER - k->header_got);
        } else {
            got = take(k, k->body + k->body_got, k->body_len - k->body_got);
        }
        if (got < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK) return;
            if (errno == EINTR) continue;
            link_down_errno(L, l, errno);
            return;
        }
        if (got == 0) {
            char text[160];
            if (!k->in_body && k->header_got == 0) {
                link_down(L, l, 14, "the daemon closed the connection", 32, 0, 0);
            } else {
                snprintf(text, sizeof text, "connection broke (connection ended inside a "
                         "frame (%lld of %lld bytes))",
                         (long long)(k->in_body ? k->body_got : k->header_got),
                         (long long)(k->in_body ? k->body_len : FRAME_HEADER));
                link_down(L, l, 14, text, (int64_t)strlen(text), 0, 0);
            }
            return;
        }
        if (!k->in_body) {
            k->header_got += (int)got;
            if (k->header_got < FRAME_HEADER) continue;
            int kind = k->header[0];
            int64_t len = (int64_t)((uint32_t)k->header[1] | (uint32_t)k->header[2] << 8
                                    | (uint32_t)k->header[3] << 16 | (uint32_t)k->header[4] << 24);
            char text[160];
            if (kind != FRAME_SHARD && kind != FRAME_STATUS) {
                snprintf(text, sizeof text, "unexpected frame kind %d", kind);
                link_down(L, l, 13, text, (int64_t)strlen(text), 0, 0);
                return;
            }
            if (len > k->max_frame) {
                snprintf(text, sizeof text, "frame of %lld bytes is larger than the limit of "
                         "%lld bytes", (long long)len, (long long)k->max_frame);
                link_down(L, l, 13, text, (int64_t)strlen(text), 0, 0);
                return;
            }
            if (k->body_cap < len) {
                uint8_t *body = realloc(k->body, (size_t)len);
                if (body == NULL) { link_down_errno(L, l, ENOMEM); return; }
                k->body = body; k->body_cap = len;
            }
            k->body_len = len; k->body_got = 0; k->in_body = 1;
            if (len) continue;
        } else {
            k->body_got += got;
            if (k->body_got < k->body_len) continue;
        }
        k->in_body = 0; k->header_got = 0;
        frames++;
        on_frame(L, l, now);
    }
}

/* Whether chunk i (the head of link l's queue) may go now; else when to look again. */
static int may_send(Loop *L, link_t *k, Batch *b, int64_t i, int64_t l, double now,
                    double *retry_at) {
    if (!b->paced) return 1;
    if (k->waiting != b || k->waiting_chunk != i) {
        k->waiting = b; k->waiting_chunk = i; k->waiting_since = now;
    }
    if (!(i - b->window < b->frontier || b->released)) {
        if (now - k->waiting_since >= L->max_wait_s) {
            b->released = 1; /* a link is stuck: stop pacing this key (SendOrder.wait) */
        } else {
            double at = k->waiting_since + L->max_wait_s;
            if (at < *retry_at) *retry_at = at;
            return 0;
        }
    }
    if (!b->unpaced && b->links[l].unanswered >= b->credits) {
        if (now - b->progress_s >= L->stall_s) {
            b->unpaced = 1; /* no progress for stall_s: credits give up (take_credit) */
        } else {
            double at = b->progress_s + L->stall_s;
            if (at < *retry_at) *retry_at = at;
            return 0;
        }
    }
    if (!b->unpaced) {
        b->state[i] |= ST_CREDITED;
        b->links[l].unanswered++;
        b->progress_s = now;
    }
    return 1;
}

static void handed(Batch *b, int64_t i) {
    b->state[i] |= ST_HANDED;
    while (b->frontier < b->n && (b->state[b->frontier] & ST_HANDED)) b->frontier++;
}

static void arm_out(Loop *L, link_t *k, int on) {
    if (k->out_armed == on) return;
    struct epoll_event ev = {.events = EPOLLIN | (on ? EPOLLOUT : 0)};
    ev.data.u64 = (uint64_t)(k - L->links);
    epoll_ctl(L->epfd, EPOLL_CTL_MOD, k->fd, &ev);
    k->out_armed = on;
}

/* Send what link l may: the frame in progress, then the queue's head chunks. */
static void pump_send(Loop *L, int64_t l, double now, double *retry_at) {
    link_t *k = &L->links[l];
    while (k->up) {
        if (k->send_left) {
            if (k->out_armed && !k->writable) return; /* still full: epoll says when */
            ssize_t n = send(k->fd, k->send_at, (size_t)k->send_left, MSG_DONTWAIT | MSG_NOSIGNAL);
            if (n < 0) {
                if (errno == EAGAIN || errno == EWOULDBLOCK) {
                    k->writable = 0;
                    arm_out(L, k, 1);
                    return;
                }
                if (errno == EINTR) continue;
                link_down_errno(L, l, errno);
                return;
            }
            k->send_at += n; k->send_left -= n;
            if (k->send_left) continue;
            if (k->raw_cur) {
                k->raw_cur->result = 1;
                k->raw_cur = NULL;
                pthread_cond_broadcast(&L->written);
                continue;
            }
            if (k->cur) handed(k->cur, k->cur_chunk);
            k->cur = NULL;
            L->frames_sent++;
            continue;
        }
        if (k->raw_head) { /* the Python path's frame first: its sender waits for it */
            raw_req *r = k->raw_head;
            k->raw_head = r->next;
            if (k->raw_head == NULL) k->raw_last = NULL;
            k->raw_cur = r; k->cur = NULL;
            k->send_at = r->buf; k->send_left = r->len;
            continue;
        }
        Batch *b = k->head;
        while (b && b->links[l].cursor >= b->link_start[l + 1] - b->link_start[l])
            b = b->links[l].next;
        if (b == NULL) { arm_out(L, k, 0); return; }
        int64_t i = b->order[b->link_start[l] + b->links[l].cursor];
        if (!may_send(L, k, b, i, l, now, retry_at)) { arm_out(L, k, 0); return; }
        k->waiting = NULL;
        b->links[l].cursor++;
        b->state[i] |= ST_SENT;
        k->cur = b; k->cur_chunk = i;
        k->send_at = b->frames + b->frame_at[i];
        k->send_left = b->frame_len[i];
    }
}

/* Link l broke (or its daemon ended the stream): close it, take its chunks
 * back from every batch (Python resends them) and tell Python. */
static void link_down(Loop *L, int64_t l, int code, const char *text, int64_t text_len,
                      int status_frame, int malformed) {
    link_t *k = &L->links[l];
    if (!k->up) return;
    event_t *e = new_event(EV_DOWN);
    int64_t count = 0, at = 0;
    for (Batch *b = k->head; b; b = b->links[l].next)
        count += (b->link_start[l + 1] - b->link_start[l]);
    if (e) {
        e->link = l; e->code = code; e->status_frame = status_frame;
        e->malformed = malformed; e->replied = k->replied; e->gen = k->gen;
        set_text(e, text, text_len);
        e->orphans = malloc(sizeof(int64_t) * (size_t)(count ? count : 1));
        e->orphan_batches = malloc(sizeof(Batch *) * (size_t)(count ? count : 1));
        if (!e->orphans || !e->orphan_batches) {
            free(e->orphans); free(e->orphan_batches); free(e->text); free(e);
            e = NULL;
        }
    }
    epoll_ctl(L->epfd, EPOLL_CTL_DEL, k->fd, NULL);
    close(k->fd);
    k->fd = -1; k->up = 0; k->cur = NULL; k->send_left = 0; k->out_armed = 0;
    k->in_body = 0; k->header_got = 0; k->waiting = NULL;
    fail_raw(L, k);
    Batch *b = k->head;
    /* The down event goes first: the batches it names are alive until theirs. */
    if (e) push_event(L, e);
    while (b) {
        Batch *next = b->links[l].next;
        for (int64_t j = b->link_start[l]; j < b->link_start[l + 1]; j++) {
            int64_t i = b->order[j];
            if (b->state[i] & (ST_ANSWERED | ST_DETACHED)) continue;
            b->state[i] |= ST_DETACHED | ST_HANDED;
            b->expected--;
            if (e) { e->orphans[at] = i; e->orphan_batches[at] = b; at++; }
        }
        b->links[l].unanswered = 0;
        b->released = b->unpaced = 1; /* a resend goes without order (order.py) */
        while (b->frontier < b->n && (b->state[b->frontier] & ST_HANDED)) b->frontier++;
        queue_unlink(k, b, l);
        if (!b->retired && b->answered == b->expected) retire_kind(L, b, EV_DONE);
        b = next;
    }
    if (e) e->orphans_n = at;
}

static void dispatch(Loop *L, event_t *events);

static void *loop_main(void *arg) {
    Loop *L = arg;
    struct epoll_event ready[64];
    int timeout_ms = 0;
    for (;;) {
        int n = epoll_wait(L->epfd, ready, 64, timeout_ms);
        pthread_mutex_lock(&L->lock);
        if (L->stop) { pthread_mutex_unlock(&L->lock); break; }
        double now = now_s();
        for (int j = 0; j < n; j++) {
            uint64_t id = ready[j].data.u64;
            if (id == UINT64_MAX) {
                uint64_t count;
                ssize_t r = read(L->wakefd, &count, sizeof count);
                (void)r;
                continue;
            }
            if (id < (uint64_t)L->nlinks && L->links[id].up && (ready[j].events & EPOLLOUT))
                L->links[id].writable = 1;
            if (id < (uint64_t)L->nlinks && L->links[id].up
                    && (ready[j].events & (EPOLLIN | EPOLLERR | EPOLLHUP)))
                pump_recv(L, (int64_t)id, now);
        }
        double retry_at = now + 3600.0;
        for (int64_t l = 0; l < L->nlinks; l++)
            if (L->links[l].up) pump_send(L, l, now, &retry_at);
        event_t *events = L->events;
        L->events = L->events_last = NULL;
        pthread_mutex_unlock(&L->lock);
        double wait_s = retry_at - now_s();
        timeout_ms = wait_s <= 0 ? 0 : wait_s > 1.0 ? 1000 : (int)(wait_s * 1e3) + 1;
        if (events) {
            PyGILState_STATE g = PyGILState_Ensure();
            dispatch(L, events);
            PyGILState_Release(g);
        }
    }
    return NULL;
}

/* Hand the events to Python (GIL held, lock not held) and free them. */
static void dispatch(Loop *L, event_t *events) {
    while (events) {
        event_t *e = events;
        events = e->next;
        PyObject *args = NULL;
        switch (e->kind) {
        case EV_DONE:
            args = Py_BuildValue("(sLL)", "done", (long long)e->batch->token, (long long)e->got);
            break;
        case EV_ERROR:
            args = Py_BuildValue("(sLLLy#)", "error", (long long)e->batch->token,
                                 (long long)e->chunk, (long long)e->code,
                                 e->text ? e->text : "", (Py_ssize_t)e->text_len);
            break;
        case EV_BAD:
            args = Py_BuildValue("(sLLsLL)", "bad", (long long)e->batch->token,
                                 (long long)e->chunk, e->code ? "dtype" : "length",
                                 (long long)e->got, (long long)e->expected);
            break;
        case EV_REPLY:
            args = Py_BuildValue("(sLKy#)", "reply", (long long)e->link,
                                 (unsigned long long)e->gen, e->text, (Py_ssize_t)e->text_len);
            break;
        case EV_DOWN: {
            PyObject *orphans = PyList_New(e->orphans_n);
            for (int64_t j = 0; orphans && j < e->orphans_n; j++)
                PyList_SET_ITEM(orphans, j, Py_BuildValue("(LL)",
                                (long long)e->orphan_batches[j]->token, (long long)e->orphans[j]));
            if (orphans && !PyErr_Occurred())
                args = Py_BuildValue("(sLKiy#iiiN)", "down", (long long)e->link,
                                     (unsigned long long)e->gen, (int)e->code,
                                     e->text ? e->text : "", (Py_ssize_t)e->text_len,
                                     e->status_frame, e->malformed, e->replied, orphans);
            else
                Py_XDECREF(orphans);
            break;
        }
        default: /* EV_RELEASE: a cancelled batch's reference comes back; no news */
            break;
        }
        if (args) {
            PyObject *r = PyObject_CallObject(L->on_event, args);
            if (r == NULL) PyErr_WriteUnraisable(L->on_event);
            Py_XDECREF(r);
            Py_DECREF(args);
        } else if (PyErr_Occurred()) {
            PyErr_WriteUnraisable(L->on_event);
        }
        if (e->batch) {
            Batch *b = e->batch;
            pthread_mutex_lock(&L->lock);
            b->active = 0;
            int hold = b->out_held;
            b->out_held = 0;
            pthread_mutex_unlock(&L->lock);
            if (hold) PyBuffer_Release(&b->out);
            Py_DECREF(b);
        }
        free(e->text); free(e->orphans); free(e->orphan_batches); free(e);
    }
}

static PyObject *Loop_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    static char *names[] = {"links", "on_event", "max_wait_s", "stall_s", NULL};
    Py_ssize_t nlinks;
    PyObject *on_event;
    double max_wait_s, stall_s;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "nOdd", names, &nlinks, &on_event,
                                     &max_wait_s, &stall_s))
        return NULL;
    if (nlinks < 1 || !PyCallable_Check(on_event) || !(max_wait_s > 0) || !(stall_s > 0)) {
        PyErr_SetString(PyExc_ValueError, "Loop: links >= 1, a callable on_event, "
                        "max_wait_s > 0 and stall_s > 0");
        return NULL;
    }
    Loop *L = (Loop *)type->tp_alloc(type, 0);
    if (L == NULL) return NULL;
    L->epfd = L->wakefd = -1;
    L->links = calloc((size_t)nlinks, sizeof(link_t));
    if (L->links == NULL) { Py_DECREF(L); return PyErr_NoMemory(); }
    L->nlinks = nlinks;
    for (Py_ssize_t l = 0; l < nlinks; l++) L->links[l].fd = -1;
    pthread_mutex_init(&L->lock, NULL);
    pthread_cond_init(&L->written, NULL);
    Py_INCREF(on_event);
    L->on_event = on_event;
    L->max_wait_s = max_wait_s;
    L->stall_s = stall_s;
    L->epfd = epoll_create1(EPOLL_CLOEXEC);
    L->wakefd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (L->epfd < 0 || L->wakefd < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        Py_DECREF(L);
        return NULL;
    }
    struct epoll_event ev = {.events = EPOLLIN};
    ev.data.u64 = UINT64_MAX;
    epoll_ctl(L->epfd, EPOLL_CTL_ADD, L->wakefd, &ev);
    if (pthread_create(&L->thread, NULL, loop_main, L) != 0) {
        PyErr_SetString(PyExc_RuntimeError, "Loop: cannot start its thread");
        Py_DECREF(L);
        return NULL;
    }
    L->started = 1;
    return (PyObject *)L;
}

/* Stop the thread, retire every batch and hand the references back (GIL held). */
static void loop_shutdown(Loop *L) {
    if (L->started) {
        pthread_mutex_lock(&L->lock);
        L->stop = 1;
        pthread_mutex_unlock(&L->lock);
        wake(L);
        Py_BEGIN_ALLOW_THREADS
        pthread_join(L->thread, NULL);
        Py_END_ALLOW_THREADS
        L->started = 0;
    }
    pthread_mutex_lock(&L->lock);
    for (int64_t l = 0; l < L->nlinks; l++) {
        link_t *k = &L->links[l];
        while (k->head) retire_kind(L, k->head, EV_RELEASE);
        if (k->fd >= 0) { shutdown(k->fd, SHUT_RDWR); close(k->fd); }
        k->fd = -1; k->up = 0; k->cur = NULL; k->send_left = 0;
        fail_raw(L, k);
    }
    event_t *events = L->events;
    L->events = L->events_last = NULL;
    pthread_mutex_unlock(&L->lock);
    /* Only the references come back now: the client fails what was open. */
    for (event_t *e = events; e; e = e->next)
        if (e->kind != EV_DOWN) e->kind = EV_RELEASE;
        else e->orphans_n = 0;
    dispatch(L, events);
}

static void Loop_dealloc(Loop *L) {
    if (L->links) loop_shutdown(L);
    for (int64_t l = 0; L->links && l < L->nlinks; l++) {
        free(L->links[l].body); free(L->links[l].tail); free(L->links[l].scratch);
        free(L->links[l].rbuf);
    }
    free(L->links);
    if (L->epfd >= 0) close(L->epfd);
    if (L->wakefd >= 0) close(L->wakefd);
    Py_XDECREF(L->on_event);
    pthread_cond_destroy(&L->written);
    pthread_mutex_destroy(&L->lock);
    Py_TYPE(L)->tp_free((PyObject *)L);
}

static PyObject *Loop_close(Loop *L, PyObject *unused) {
    (void)unused;
    loop_shutdown(L);
    Py_RETURN_NONE;
}

static int check_link(Loop *L, Py_ssize_t l) {
    if (l < 0 || l >= L->nlinks) {
        PyErr_Format(PyExc_IndexError, "link %zd of %lld", l, (long long)L->nlinks);
        return 0;
    }
    return 1;
}

static PyObject *Loop_attach(Loop *L, PyObject *args) {
    Py_ssize_t l, max_frame;
    int fd;
    if (!PyArg_ParseTuple(args, "nin", &l, &fd, &max_frame) || !check_link(L, l)) return NULL;
    int flags = fcntl(fd, F_GETFL);
    if (flags < 0 || fcntl(fd, F_SETFL, flags | O_NONBLOCK) < 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    pthread_mutex_lock(&L->lock);
    link_t *k = &L->links[l];
    if (k->rbuf == NULL && (k->rbuf = malloc(RBUF_BYTES)) == NULL) {
        pthread_mutex_unlock(&L->lock);
        return PyErr_NoMemory();
    }
    if (k->up || !L->started || L->stop) {
        pthread_mutex_unlock(&L->lock);
        PyErr_Format(PyExc_ValueError, "link %zd is attached already, or the loop is closed", l);
        return NULL;
    }
    struct epoll_event ev = {.events = EPOLLIN};
    ev.data.u64 = (uint64_t)l;
    if (epoll_ctl(L->epfd, EPOLL_CTL_ADD, fd, &ev) < 0) {
        pthread_mutex_unlock(&L->lock);
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    k->fd = fd; k->up = 1; k->replied = 0; k->max_frame = max_frame;
    k->rpos = k->rlen = 0; k->drained = 0;
    k->header_got = 0; k->in_body = 0; k->cur = NULL; k->send_left = 0; k->out_armed = 0;
    k->waiting = NULL;
    uint64_t gen = ++k->gen;
    pthread_mutex_unlock(&L->lock);
    return PyLong_FromUnsignedLongLong(gen);
}

/* shutdown(link, gen): end connection `gen` of the link now, as a break (the
 * Python side stopped reading it); the down event follows. Nothing if it ended. */
static PyObject *Loop_shutdown(Loop *L, PyObject *args) {
    Py_ssize_t l;
    unsigned long long gen;
    if (!PyArg_ParseTuple(args, "nK", &l, &gen) || !check_link(L, l)) return NULL;
    pthread_mutex_lock(&L->lock);
    link_t *k = &L->links[l];
    int live = k->up && k->gen == gen;
    if (live) {
        shutdown(k->fd, SHUT_RDWR);
        link_down(L, l, 14 /* UNAVAILABLE */, "the client ended the connection", 31, 0, 0);
    }
    pthread_mutex_unlock(&L->lock);
    if (live) wake(L);
    Py_RETURN_NONE;
}

/* write(link, gen, frame): send one whole frame of the Python path on connection
 * `gen` of the link, between the loop's frames; blocks (without the GIL) until
 * it is written. False: that connection is down (or the loop closed) first. */
static PyObject *Loop_write(Loop *L, PyObject *args) {
    Py_ssize_t l;
    unsigned long long gen;
    Py_buffer frame;
    if (!PyArg_ParseTuple(args, "nKy*", &l, &gen, &frame)) return NULL;
    if (!check_link(L, l)) { PyBuffer_Release(&frame); return NULL; }
    raw_req r = {.buf = frame.buf, .len = frame.len};
    pthread_mutex_lock(&L->lock);
    link_t *k = &L->links[l];
    int ok = k->up && k->gen == gen && L->started && !L->stop && frame.len > 0;
    if (!ok) {
        pthread_mutex_unlock(&L->lock);
        PyBuffer_Release(&frame);
        Py_RETURN_FALSE;
    }
    if (k->raw_last) k->raw_last->next = &r; else k->raw_head = &r;
    k->raw_last = &r;
    wake(L);
    /* The GIL goes before the wait and comes back after the lock is let go:
     * a caller holding the GIL may be waiting for the lock. */
    Py_BEGIN_ALLOW_THREADS
    while (r.result == 0) pthread_cond_wait(&L->written, &L->lock);
    ok = r.result == 1;
    pthread_mutex_unlock(&L->lock);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&frame);
    return PyBool_FromLong(ok);
}

static PyObject *Loop_link_up(Loop *L, PyObject *arg) {
    Py_ssize_t l = PyLong_AsSsize_t(arg);
    if ((l == -1 && PyErr_Occurred()) || !check_link(L, l)) return NULL;
    pthread_mutex_lock(&L->lock);
    int up = L->links[l].up;
    pthread_mutex_unlock(&L->lock);
    return PyBool_FromLong(up);
}

/* submit(batch, token, out, f16_out, window, credits): queue every chunk of the
 * batch on its links; the replies are widened into `out` (float32 or float16,
 * indexed by the chunks' offsets). ValueError when a link it needs is down. */
static PyObject *Loop_submit(Loop *L, PyObject *args) {
    Batch *b;
    long long token, window, credits;
    PyObject *out;
    int f16_out;
    if (!PyArg_ParseTuple(args, "O!LOpLL", &BatchType, &b, &token, &out, &f16_out, &window,
                          &credits))
        return NULL;
    if (b->active || b->block == NULL || b->n == 0 || b->nlinks != L->nlinks) {
        PyErr_SetString(PyExc_ValueError, "submit: the batch is in flight, empty, or laid "
                        "out for another number of links");
        return NULL;
    }
    if (f16_out && b->codec != CODEC_FLOAT16 && !have_codec[CODEC_FLOAT16]) {
        PyErr_SetString(PyExc_ValueError, "submit: float16 outputs need reducer_wire._kernels");
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(out, &view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return NULL;
    int64_t need = 0;
    for (int64_t i = 0; i < b->n; i++)
        if (b->offset[i] + b->numel[i] > need) need = b->offset[i] + b->numel[i];
    if (view.len < need * (f16_out ? 2 : 4)) {
        PyBuffer_Release(&view);
        PyErr_Format(PyExc_ValueError, "submit: the output holds %zd bytes, the chunks need %lld",
                     view.len, (long long)(need * (f16_out ? 2 : 4)));
        return NULL;
    }
    pthread_mutex_lock(&L->lock);
    int ok = L->started && !L->stop;
    for (int64_t l = 0; ok && l < L->nlinks; l++)
        if (b->link_start[l + 1] > b->link_start[l] && !L->links[l].up) ok = 0;
    if (!ok) {
        pthread_mutex_unlock(&L->lock);
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "submit: a link of the batch is down");
        return NULL;
    }
    b->out = view; b->out_held = 1; b->f16_out = f16_out;
    b->token = token; b->seq = L->seq++;
    b->window = window; b->credits = credits; b->paced = b->n > window;
    b->released = 0; b->unpaced = credits == 0;
    b->frontier = 0; b->expected = b->n; b->answered = 0;
    b->progress_s = now_s();
    b->active = 1; b->retired = 0; b->failed = 0;
    memset(b->state, 0, (size_t)b->n);
    Py_INCREF(b); /* the loop's, handed back with the batch's last event */
    for (int64_t l = 0; l < L->nlinks; l++) {
        batch_link *bl = &b->links[l];
        bl->in_queue = 0; bl->prev = bl->next = NULL; bl->cursor = 0; bl->unanswered = 0;
        if (b->link_start[l + 1] > b->link_start[l]) queue_insert(&L->links[l], b, l);
    }
    pthread_mutex_unlock(&L->lock);
    wake(L);
    Py_RETURN_NONE;
}

/* cancel(batch): send no more of it and leave its output alone from now on. */
static PyObject *Loop_cancel(Loop *L, PyObject *arg) {
    if (!PyObject_TypeCheck(arg, &BatchType)) {
        PyErr_SetString(PyExc_TypeError, "cancel: a Batch");
        return NULL;
    }
    Batch *b = (Batch *)arg;
    pthread_mutex_lock(&L->lock);
    int live = b->active && !b->retired;
    if (live) retire_kind(L, b, EV_RELEASE);
    pthread_mutex_unlock(&L->lock);
    if (live) wake(L);
    Py_RETURN_NONE;
}

static PyObject *Loop_counters(Loop *L, PyObject *unused) {
    (void)unused;
    pthread_mutex_lock(&L->lock);
    unsigned long long sent = L->frames_sent, taken = L->replies_taken;
    pthread_mutex_unlock(&L->lock);
    return Py_BuildValue("(KK)", sent, taken);
}

static PyMethodDef Loop_methods[] = {
    {"attach", (PyCFunction)Loop_attach, METH_VARARGS,
     "attach(link, fd, max_frame_bytes) -> gen: the loop owns this connected, greeted "
     "socket, the link's connection `gen`."},
    {"shutdown", (PyCFunction)Loop_shutdown, METH_VARARGS,
     "shutdown(link, gen): end that connection now (its down event follows)."},
    {"write", (PyCFunction)Loop_write, METH_VARARGS,
     "write(link, gen, frame) -> bool: send one frame on that connection, waiting until "
     "it is written; False: the connection ended first."},
    {"link_up", (PyCFunction)Loop_link_up, METH_O, "link_up(link) -> bool"},
    {"submit", (PyCFunction)Loop_submit, METH_VARARGS,
     "submit(batch, token, out, f16_out, window, credits): send a key's chunks."},
    {"cancel", (PyCFunction)Loop_cancel, METH_O,
     "cancel(batch): stop sending it and writing its output."},
    {"counters", (PyCFunction)Loop_counters, METH_NOARGS,
     "counters() -> (frames sent, replies taken)"},
    {"close", (PyCFunction)Loop_close, METH_NOARGS,
     "close(): stop the thread, close the sockets; idempotent."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject LoopType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "reducer_client.transport._tcploop.Loop",
    .tp_basicsize = sizeof(Loop),
    .tp_dealloc = (destructor)Loop_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Loop(links, on_event, max_wait_s, stall_s): the epoll thread of a client's "
              "plain-TCP links.",
    .tp_methods = Loop_methods,
    .tp_new = Loop_new,
};

/* ---- module ---- */

static int import_api(const char *module, const char *capsule, const void **api) {
    *api = NULL;
    PyObject *m = PyImport_ImportModule(module);
    if (m == NULL) { PyErr_Clear(); return 0; }
    Py_DECREF(m);
    *api = PyCapsule_Import(capsule, 0);
    if (*api == NULL) return -1;
    if (*(const int *)*api != RW_API_VERSION) {
        PyErr_Format(PyExc_ImportError, "%s has version %d, the client loop needs %d",
                     capsule, *(const int *)*api, RW_API_VERSION);
        return -1;
    }
    return 0;
}

static PyObject *available(PyObject *self, PyObject *arg) {
    (void)self;
    long codec = PyLong_AsLong(arg);
    if (codec == -1 && PyErr_Occurred()) return NULL;
    return PyBool_FromLong(codec == CODEC_FLOAT32 ||
                           (codec > 0 && codec < CODECS && have_codec[codec]));
}

static PyMethodDef module_methods[] = {
    {"encode", (PyCFunction)(void (*)(void))encode, METH_VARARGS | METH_KEYWORDS,
     "encode(...) -> Batch: a key's chunks laid out as frames, payloads narrowed."},
    {"available", available, METH_O, "available(codec) -> bool: its kernels were built."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_tcploop", "The client's TCP data plane per chunk, in C.", -1,
    module_methods,
};

PyMODINIT_FUNC PyInit__tcploop(void) {
    const void *kernels, *quant;
    if (import_api("reducer_wire._kernels", "reducer_wire._kernels._C_API", &kernels) < 0 ||
            import_api("reducer_wire._quant", "reducer_wire._quant._C_API", &quant) < 0)
        return NULL;
    if (kernels) {
        const rw_kernels_api *k = kernels;
        codecs[CODEC_FLOAT16] = k->float16; codecs[CODEC_BFLOAT16] = k->bfloat16;
        have_codec[CODEC_FLOAT16] = have_codec[CODEC_BFLOAT16] = 1;
    }
    if (quant) {
        const rw_quant_api *q = quant;
        codecs[CODEC_INT8] = q->int8; codecs[CODEC_FP8] = q->fp8;
        have_codec[CODEC_INT8] = have_codec[CODEC_FP8] = 1;
    }
    s_offset = PyUnicode_InternFromString("offset");
    s_numel = PyUnicode_InternFromString("numel");
    s_daemon = PyUnicode_InternFromString("daemon");
    if (!s_offset || !s_numel || !s_daemon) return NULL;
    if (PyType_Ready(&BatchType) < 0 || PyType_Ready(&LoopType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&BatchType);
    Py_INCREF(&LoopType);
    if (PyModule_AddObject(m, "Batch", (PyObject *)&BatchType) < 0 ||
            PyModule_AddObject(m, "Loop", (PyObject *)&LoopType) < 0 ||
            PyModule_AddIntConstant(m, "FLOAT32", CODEC_FLOAT32) < 0 ||
            PyModule_AddIntConstant(m, "FLOAT16", CODEC_FLOAT16) < 0 ||
            PyModule_AddIntConstant(m, "BFLOAT16", CODEC_BFLOAT16) < 0 ||
            PyModule_AddIntConstant(m, "INT8", CODEC_INT8) < 0 ||
            PyModule_AddIntConstant(m, "FP8", CODEC_FP8) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
