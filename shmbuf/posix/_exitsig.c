/* Die of a signal after Python has finished: the last step of shmbuf's SIGTERM handling.
 *
 * shmbuf/posix/signals.py turns SIGTERM into SystemExit so that `with` blocks,
 * finally clauses, atexit handlers and finalizers run (an owner unlinks its
 * segments).  A process that exits normally then reports status 143, not
 * "killed by SIGTERM".  arm(sig) registers, with Py_AtExit, a function that
 * runs after the interpreter is finalized (after every atexit handler) and
 * raises `sig` with its default action, so the parent sees the usual death
 * by that signal.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <signal.h>

static volatile sig_atomic_t pending = 0;
static int registered = 0;

static void reraise(void)
{
    int sig = pending;
    if (sig <= 0)
        return;
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, sig);
    signal(sig, SIG_DFL);
    sigprocmask(SIG_UNBLOCK, &set, NULL);
    raise(sig);
}

static PyObject *arm(PyObject *self, PyObject *args)
{
    int sig;
    if (!PyArg_ParseTuple(args, "i", &sig))
        return NULL;
    if (!registered) {
        if (Py_AtExit(reraise) < 0) {
            PyErr_SetString(PyExc_RuntimeError, "Py_AtExit has no room for another function");
            return NULL;
        }
        registered = 1;
    }
    pending = sig;
    Py_RETURN_NONE;
}

static PyObject *disarm(PyObject *self, PyObject *unused)
{
    pending = 0;
    Py_RETURN_NONE;
}

static PyObject *armed(PyObject *self, PyObject *unused)
{
    return PyLong_FromLong(pending);
}

static PyMethodDef methods[] = {
    {"arm", arm, METH_VARARGS, "arm(sig): after Python finalizes, die of signal `sig`."},
    {"disarm", disarm, METH_NOARGS, "Exit normally after all (a forked child, say)."},
    {"armed", armed, METH_NOARGS, "The signal armed, or 0."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_exitsig", "Die of a signal after the interpreter finalized.", -1,
    methods,
};

PyMODINIT_FUNC PyInit__exitsig(void) { return PyModule_Create(&module); }
