/* reducerd.dataplane._cplane: the daemon's data plane in C.
 *
 * Budget (_cplane_budget.c): MemoryBudget's counters, shared by Python and
 * the C threads. */
#include "_cplane.h"

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_cplane", "The daemon's data plane in C.", -1, NULL,
};

PyMODINIT_FUNC PyInit__cplane(void) {
    if (PyType_Ready(&BudgetType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&BudgetType);
    if (PyModule_AddObject(m, "Budget", (PyObject *)&BudgetType) < 0) {
        Py_DECREF(&BudgetType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
