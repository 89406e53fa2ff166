/* reducer_wire._codec: the Shard header parse of reducer_wire.codec.decode_shard, in C.
 *
 * The daemon decodes every received frame: in Python that is ~15 us a shard
 * (17 varints), here well under 1 us. Only the plain case is handled: known
 * fields with their own wire type, varints of at most 64 bits, valid UTF-8.
 * Anything else (a truncated or overlong varint, an unknown field, a wire
 * type that does not match, bad UTF-8) returns None and the Python decoder
 * decides, so results and error messages are the Python decoder's exactly.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

enum kind { K_NONE, K_STR, K_BYTES, K_U32, K_U64, K_ENUM };

/* Field number -> kind and slot in the result tuple: ShardView's order, with
 * data as two slots, 8 (start) and 9 (length), so error_code is slot 10. */
static const struct { enum kind kind; int slot; } fields[15] = {
    {K_NONE, -1},
    {K_STR, 0},     /* 1 job */
    {K_U32, 1},     /* 2 rank */
    {K_U32, 2},     /* 3 world_size */
    {K_U64, 3},     /* 4 round */
    {K_STR, 4},     /* 5 key */
    {K_U64, 5},     /* 6 offset */
    {K_ENUM, 6},    /* 7 dtype */
    {K_ENUM, 7},    /* 8 op */
    {K_BYTES, 8},   /* 9 data: slots 8 (start) and 9 (length) */
    {K_U32, 10},    /* 10 error_code */
    {K_STR, 11},    /* 11 error_message */
    {K_U64, 12},    /* 12 layout */
    {K_U32, 13},    /* 13 priority */
    {K_U64, 14},    /* 14 incarnation */
};
#define SLOTS 15

/* A varint of at most 64 bits; 0 when truncated or longer (Python decides). */
static int read_varint(const uint8_t *buf, Py_ssize_t end, Py_ssize_t *pos, uint64_t *out) {
    uint64_t result = 0;
    for (int shift = 0; shift < 64; shift += 7) {
        if (*pos >= end) return 0;
        uint8_t byte = buf[(*pos)++];
        if (shift == 63 && byte > 1) return 0; /* bits beyond 64 */
        result |= (uint64_t)(byte & 0x7F) << shift;
        if (byte < 0x80) { *out = result; return 1; }
    }
    return 0;
}

static PyObject *decode_fields(PyObject *self, PyObject *arg) {
    (void)self;
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) return NULL;
    const uint8_t *buf = (const uint8_t *)view.buf;
    Py_ssize_t pos = 0, end = view.len;
    uint64_t ints[SLOTS] = {0};
    Py_ssize_t str_start[SLOTS] = {0}, str_len[SLOTS] = {0};
    int64_t data_start = -1, data_len = 0;
    unsigned str_seen = 0;
    PyObject *result = Py_None;
    while (pos < end) {
        uint64_t tag, value;
        if (!read_varint(buf, end, &pos, &tag)) goto defer;
        uint64_t number = tag >> 3;
        unsigned wire_type = (unsigned)(tag & 7);
        if (number == 0 || number > 14) goto defer;
        enum kind kind = fields[number].kind;
        int slot = fields[number].slot;
        if ((kind == K_STR || kind == K_BYTES) != (wire_type == 2) ||
            (wire_type != 0 && wire_type != 2))
            goto defer;
        if (!read_varint(buf, end, &pos, &value)) goto defer;
        if (wire_type == 2) {
            if (value > (uint64_t)(end - pos)) goto defer;
            if (kind == K_BYTES) {
                data_start = pos;
                data_len = (int64_t)value;
            } else {
                /* Python checks every occurrence's UTF-8, the last one wins: defer */
                if (str_seen & (1u << slot)) goto defer;
                str_seen |= 1u << slot;
                str_start[slot] = pos;
                str_len[slot] = (Py_ssize_t)value;
            }
            pos += (Py_ssize_t)value;
        } else if (kind == K_U32) {
            ints[slot] = value & 0xFFFFFFFFu;
        } else {
            ints[slot] = value; /* u64; enums are sign-extended below */
        }
    }
    result = PyTuple_New(SLOTS);
    if (result == NULL) goto done;
    for (int number = 1; number <= 14; number++) {
        int slot = fields[number].slot;
        PyObject *item;
        switch (fields[number].kind) {
        case K_STR:
            item = PyUnicode_DecodeUTF8((const char *)buf + str_start[slot], str_len[slot],
                                        "strict");
            if (item == NULL) { /* not UTF-8: the Python decoder words the error */
                PyErr_Clear();
                Py_DECREF(result);
                goto defer;
            }
            break;
        case K_BYTES:
            PyTuple_SET_ITEM(result, slot + 1, PyLong_FromLongLong(data_len)); /* slot 9 */
            item = PyLong_FromLongLong(data_start);
            break;
        case K_ENUM: {
            uint32_t low = (uint32_t)ints[slot];
            item = PyLong_FromLong(low >= 0x80000000u ? (long)((int64_t)low - 0x100000000LL)
                                                        : (long)low);
            break;
        }
        default:
            item = PyLong_FromUnsignedLongLong(ints[slot]);
        }
        PyTuple_SET_ITEM(result, slot, item);
    }
    if (PyErr_Occurred()) Py_CLEAR(result);
    goto done;
defer:
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&view);
    return result;
}

static PyMethodDef methods[] = {
    {"decode_fields", decode_fields, METH_O,
     "decode_fields(buffer) -> tuple | None: a Shard's fields in ShardView order, data "
     "as (start, length) with start -1 when absent; None: let the Python decoder decide."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_codec", "The Shard header parse of reducer_wire.codec, in C.",
    -1, methods,
};

PyMODINIT_FUNC PyInit__codec(void) { return PyModule_Create(&module); }
