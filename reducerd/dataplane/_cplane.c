/* reducerd.dataplane._cplane: the daemon's data plane in C.
 *
 * Loop (_cplane_loop.c, _cplane_conn.c): the thread that reads
 * plain-TCP connections' frames and sends their replies. */
#include "_cplane.h"

const budget_api *budget_c;

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_cplane", "The daemon's data plane in C.", -1, NULL, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__cplane(void) {
    PyObject *budget_module = PyImport_ImportModule("reducerd.core._budget");
    if (budget_module == NULL) return NULL;
    Py_DECREF(budget_module);  /* kept alive by sys.modules */
    budget_c = PyCapsule_Import("reducerd.core._budget._C_API", 0);
    if (budget_c == NULL) return NULL;
    if (budget_c->version != BUDGET_API_VERSION) {
        PyErr_Format(PyExc_ImportError, "reducerd.core._budget has version %d, the data "
                     "loop needs %d", budget_c->version, BUDGET_API_VERSION);
        return NULL;
    }
    if (PyType_Ready(&LoopType) < 0 || PyType_Ready(&PayloadType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&LoopType);
    if (PyModule_AddObject(m, "Loop", (PyObject *)&LoopType) < 0) {
        Py_DECREF(&LoopType);
        Py_DECREF(m);
        return NULL;
    }
    static const struct { const char *name; int value; } events[] = {
        {"EV_FRAME", EV_FRAME}, {"EV_END", EV_END}, {"EV_NO_ROOM", EV_NO_ROOM},
        {"EV_HALF_CLOSE", EV_HALF_CLOSE}, {"EV_CLOSED", EV_CLOSED},
    };
    for (size_t i = 0; i < sizeof events / sizeof events[0]; i++)
        if (PyModule_AddIntConstant(m, events[i].name, events[i].value) < 0) {
            Py_DECREF(m);
            return NULL;
        }
    return m;
}
