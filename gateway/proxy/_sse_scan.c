/* The run of ordinary token events in an SSE read, in C: `sse_scan.reference_run` is the reference
 * (the same rules in Python, what the pure build runs) and the documentation; tests/unit/gateway/
 * test_sse_scan.py checks this against it and against an oracle.
 *
 * Why C: in a read holding many events (a short answer sent in one write), the compiled Python walk
 * spent ~2k instructions on each ordinary event, most of it in `bytes.find`'s argument parsing and
 * its search for a two-byte pattern (byte by byte), plus a slice per comparison. Here an event is a
 * memcmp of its prefix, a memchr for its end and a memcmp of its suffix (bench/results/instructions.md).
 *
 * ordinary_run(buf, pos, stop, prefix, suffix, client, max_text) -> (end, count, renamed)
 *   From `pos`, skips blank lines and ordinary events (`prefix`, then 1..max_text bytes of text not
 *   starting with a quote, then `suffix`, which ends the event with its blank line) up to `stop`, the
 *   end of the read's complete events. `end`: where the first other event starts (or `stop`);
 *   `count`: the ordinary events passed; `renamed`: buf[pos:end] with each ordinary event's prefix
 *   replaced by `client`, or None when `client` is None or no event was passed.
 *
 * event_end(buf, pos, stop) -> int: where the next event ends (`sse_scan.reference_end`).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

static int
as_index(PyObject *o, Py_ssize_t *out)
{
    *out = PyLong_AsSsize_t(o);
    return !(*out == -1 && PyErr_Occurred());
}

/* Where the event whose text starts at `body` ends (the first of its blank line's two LFs), looked
 * for in [body, limit) only; -1 if not there. `stop` bounds the second LF. */
static Py_ssize_t
event_end(const char *buf, Py_ssize_t body, Py_ssize_t limit, Py_ssize_t stop)
{
    const char *p = buf + body, *lim = buf + limit;
    while (p < lim) {
        const char *lf = memchr(p, '\n', (size_t)(lim - p));
        if (lf == NULL)
            return -1;
        if (lf + 1 < buf + stop && lf[1] == '\n')
            return lf - buf;
        p = lf + 1;
    }
    return -1;
}

static PyObject *
renamed_run(const char *buf, Py_ssize_t start, Py_ssize_t end, const Py_ssize_t *starts, Py_ssize_t count,
            Py_ssize_t plen, PyObject *client)
{
    const char *cli = PyBytes_AS_STRING(client);
    Py_ssize_t clen = PyBytes_GET_SIZE(client);
    PyObject *out = PyBytes_FromStringAndSize(NULL, (end - start) + count * (clen - plen));
    if (out == NULL)
        return NULL;
    char *w = PyBytes_AS_STRING(out);
    Py_ssize_t from = start;
    for (Py_ssize_t i = 0; i < count; i++) {
        memcpy(w, buf + from, (size_t)(starts[i] - from));
        w += starts[i] - from;
        memcpy(w, cli, (size_t)clen);
        w += clen;
        from = starts[i] + plen;
    }
    memcpy(w, buf + from, (size_t)(end - from));
    return out;
}

static PyObject *
ordinary_run(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 7) {
        PyErr_Format(PyExc_TypeError, "ordinary_run takes 7 arguments (%zd given)", nargs);
        return NULL;
    }
    PyObject *bufo = args[0], *prefo = args[3], *sufo = args[4], *client = args[5];
    if (!PyBytes_Check(bufo) || !PyBytes_Check(prefo) || !PyBytes_Check(sufo)
            || (client != Py_None && !PyBytes_Check(client))) {
        PyErr_SetString(PyExc_TypeError, "ordinary_run: buf, prefix, suffix (and client) must be bytes");
        return NULL;
    }
    Py_ssize_t pos, stop, max_text;
    if (!as_index(args[1], &pos) || !as_index(args[2], &stop) || !as_index(args[6], &max_text))
        return NULL;
    const char *buf = PyBytes_AS_STRING(bufo), *pre = PyBytes_AS_STRING(prefo), *suf = PyBytes_AS_STRING(sufo);
    Py_ssize_t n = PyBytes_GET_SIZE(bufo), plen = PyBytes_GET_SIZE(prefo), slen = PyBytes_GET_SIZE(sufo);
    if (stop > n)
        stop = n;
    if (pos < 0 || pos > stop || plen == 0 || slen < 2) {
        PyErr_SetString(PyExc_ValueError, "ordinary_run: need 0 <= pos <= stop, a prefix and a suffix");
        return NULL;
    }
    Py_ssize_t start = pos, count = 0, cap = 0;
    Py_ssize_t small[32], *starts = small;  /* where the renamed events start (only with a client) */
    if (client != Py_None)
        cap = 32;
    for (;;) {
        while (pos < stop && buf[pos] == '\n')
            pos++;
        Py_ssize_t body = pos + plen;
        if (body >= stop || buf[body] == '"' || memcmp(buf + pos, pre, (size_t)plen) != 0)
            break;
        Py_ssize_t limit = body + max_text + slen;
        Py_ssize_t nxt = event_end(buf, body, limit < stop ? limit : stop, stop);
        if (nxt < 0)
            break;
        Py_ssize_t tail = nxt + 2 - slen;  /* where an ordinary event's suffix starts */
        if (tail <= body || tail > body + max_text || memcmp(buf + tail, suf, (size_t)slen) != 0)
            break;
        if (cap) {
            if (count == cap) {
                Py_ssize_t *grown = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)cap * 2);
                if (grown == NULL) {
                    if (starts != small)
                        PyMem_Free(starts);
                    return PyErr_NoMemory();
                }
                memcpy(grown, starts, sizeof(Py_ssize_t) * (size_t)count);
                if (starts != small)
                    PyMem_Free(starts);
                starts = grown;
                cap *= 2;
            }
            starts[count] = pos;
        }
        count++;
        pos = nxt + 2;
    }
    PyObject *renamed;
    if (cap && count) {
        renamed = renamed_run(buf, start, pos, starts, count, plen, client);
        if (starts != small)
            PyMem_Free(starts);
        if (renamed == NULL)
            return NULL;
    } else {
        renamed = Py_NewRef(Py_None);
    }
    PyObject *result = PyTuple_New(3);
    PyObject *a = PyLong_FromSsize_t(pos), *b = PyLong_FromSsize_t(count);
    if (result == NULL || a == NULL || b == NULL) {
        Py_XDECREF(result);
        Py_XDECREF(a);
        Py_XDECREF(b);
        Py_DECREF(renamed);
        return NULL;
    }
    PyTuple_SET_ITEM(result, 0, a);
    PyTuple_SET_ITEM(result, 1, b);
    PyTuple_SET_ITEM(result, 2, renamed);
    return result;
}

/* event_end(buf, pos, stop) -> where the first blank line at or after `pos` starts (its first LF;
 * both LFs before `stop`), or -1: `buf.find(b"\n\n", pos, stop)` with memchr instead of CPython's
 * byte-by-byte search for a two-byte pattern. */
static PyObject *
event_end_py(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "event_end takes 3 arguments (%zd given)", nargs);
        return NULL;
    }
    if (!PyBytes_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "event_end: buf must be bytes");
        return NULL;
    }
    Py_ssize_t pos, stop, n = PyBytes_GET_SIZE(args[0]);
    if (!as_index(args[1], &pos) || !as_index(args[2], &stop))
        return NULL;
    if (stop > n)
        stop = n;
    if (pos < 0 || pos > stop) {
        PyErr_SetString(PyExc_ValueError, "event_end: need 0 <= pos <= stop");
        return NULL;
    }
    return PyLong_FromSsize_t(event_end(PyBytes_AS_STRING(args[0]), pos, stop, stop));
}

static PyMethodDef methods[] = {
    {"event_end", (PyCFunction)(void (*)(void))event_end_py, METH_FASTCALL,
     "event_end(buf, pos, stop) -> the first blank line's start at or after pos, or -1"},
    {"ordinary_run", (PyCFunction)(void (*)(void))ordinary_run, METH_FASTCALL,
     "ordinary_run(buf, pos, stop, prefix, suffix, client, max_text) -> (end, count, renamed)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_sse_scan", "The run of ordinary token events in an SSE read (see sse_scan.py).",
    0, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__sse_scan(void)
{
    return PyModuleDef_Init(&module);
}
