/* The SSE relay's walk over a read's complete events, in C. `sse_scan.py` holds the Python reference
 * of each function here (what the pure build runs) and says what the rules are; tests/unit/gateway/
 * test_sse_scan.py and test_relay.py check this against them (orjson for the JSON) and against oracles.
 *
 * Why C: a stream that arrives in one read (a short answer sent in one write) is walked an event at a
 * time. Compiled by mypyc, an ordinary token event cost ~2k instructions (`bytes.find`'s argument
 * parsing, a byte-by-byte search for a two-byte pattern, slices), and each other event (the role
 * chunk, the first token, the finish chunk) a full orjson parse into dicts and strings that the relay
 * then asked three questions of: is it an error, does it carry usage, did it carry output. Here an
 * ordinary event is a memcmp, a memchr and a memcmp, and another event one pass over its bytes that
 * validates its JSON and answers the three questions without building anything.
 *
 * relay_run(buf, pos, stop, prefix, suffix, client, old, new, max_text, include_usage)
 *     -> (end, piece, tokens, done, learned, usage)
 *   Walks the complete events of buf[pos:stop] (`stop` ends a blank line) and relays those it can,
 *   stopping at the first one it leaves to the caller (`end`; `stop` when none): an error event, or
 *   one whose JSON it is not sure of exactly as orjson would read it. `piece` is buf[pos:end] as the
 *   client gets it (the model renamed, a usage chunk dropped when the client did not ask for it), or
 *   None when that is unchanged; `tokens` the events that carried output; `done` whether `[DONE]` was
 *   passed; `learned` the (prefix, suffix, client) this walk learned from the first single-choice
 *   token event when `prefix` was None, else None; `usage` the last usage read, as (prompt,
 *   completion, cached or None), else None. `client` is `prefix` with the backend's model renamed
 *   (`old` -> `new`: every other event passed has each `old` replaced; None, None: no renaming).
 *
 * event_facts(buf, start, end) -> (error, usage, choices, choices_is_list, len(choices), has_text)
 *   or None: what the relay takes from the JSON object buf[start:end] (`sse_scan.facts_of`), or None
 *   when it is not one this reader is sure of (what `relay_run` leaves to the caller).
 *
 * event_end(buf, pos, stop) -> int: where the next event ends (`sse_scan.reference_end`).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#include "_json_facts.h"

typedef const unsigned char *cp;

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

/* Where `pat` (two bytes or more) first occurs in s[0:n], or -1. A memchr for its second byte: the
 * patterns here open with a quote, which every JSON key and string also does (glibc's memmem costs
 * ~400 instructions a call to set up, more than this spends on a whole event). */
static Py_ssize_t
find(const char *s, Py_ssize_t n, const char *pat, Py_ssize_t m)
{
    if (m < 2) {
        const char *at = m == 0 ? s : memchr(s, pat[0], (size_t)n);
        return at == NULL ? -1 : at - s;
    }
    const char *p = s + 1, *last = s + n - m + 1;  /* where pat[1] may lie */
    while (p <= last) {
        p = memchr(p, pat[1], (size_t)(last - p + 1));
        if (p == NULL)
            return -1;
        if (p[-1] == pat[0] && memcmp(p + 1, pat + 2, (size_t)(m - 2)) == 0)
            return p - 1 - s;
        p++;
    }
    return -1;
}

/* bytes.strip()'s whitespace: the data after `data:` is stripped of it before it is parsed */
static inline int
py_space(unsigned char c)
{
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\x0b' || c == '\x0c';
}

/* -- the walk ----------------------------------------------------------------------------------- */

/* The output, written in place into a bytes object of `hint` bytes (enough but for renaming to a
 * longer name), grown when needed and cut to its length when it is done. */
typedef struct {
    PyObject *bytes;
    Py_ssize_t len, cap, hint;
} Out;

static int
put(Out *o, const char *s, Py_ssize_t n)
{
    if (o->bytes == NULL || o->len + n > o->cap) {  /* (allocated at the first call, even for nothing) */
        Py_ssize_t cap = o->bytes == NULL ? o->hint : o->cap * 2;
        while (cap < o->len + n)
            cap *= 2;
        if (o->bytes == NULL)
            o->bytes = PyBytes_FromStringAndSize(NULL, cap);
        else if (_PyBytes_Resize(&o->bytes, cap) < 0)
            return -1;
        if (o->bytes == NULL)
            return -1;
        o->cap = cap;
    }
    memcpy(PyBytes_AS_STRING(o->bytes) + o->len, s, (size_t)n);
    o->len += n;
    return 0;
}

/* `event` with each `old` replaced by `new` (non-overlapping, left to right) onto `o`. */
static int
put_renamed(Out *o, const char *event, Py_ssize_t n, const char *old, Py_ssize_t olen, const char *new,
            Py_ssize_t nlen)
{
    Py_ssize_t from = 0;
    for (;;) {
        Py_ssize_t at = find(event + from, n - from, old, olen);
        if (at < 0)
            break;
        if (put(o, event + from, at) || put(o, new, nlen))
            return -1;
        from += at + olen;
    }
    return put(o, event + from, n - from);
}

/* `sse._string_end`: where the JSON string that starts at `start` (past its opening quote) closes. */
static Py_ssize_t
string_end(const char *ev, Py_ssize_t n, Py_ssize_t start)
{
    Py_ssize_t i = start;
    for (;;) {
        const char *q = memchr(ev + i, '"', (size_t)(n - i));
        if (q == NULL)
            return -1;
        i = q - ev;
        Py_ssize_t backslashes = 0;
        while (i - 1 - backslashes >= 0 && ev[i - 1 - backslashes] == '\\')
            backslashes++;
        if (backslashes % 2 == 0)
            return i;
        i++;
    }
}

/* `sse.SseRelay._learn`: the prefix, suffix and client prefix of a token event; 0 when it teaches
 * nothing, -1 on an error (set). */
static int
learn(const char *ev, Py_ssize_t n, const char *old, Py_ssize_t olen, const char *new, Py_ssize_t nlen,
      PyObject **prefix, PyObject **suffix, PyObject **client)
{
    static const char *keys[2] = {"\"content\":\"", "\"text\":\""};
    for (int k = 0; k < 2; k++) {
        Py_ssize_t klen = (Py_ssize_t)strlen(keys[k]), at = find(ev, n, keys[k], klen);
        if (at <= 0)
            continue;
        Py_ssize_t start = at + klen, end = string_end(ev, n, start);
        if (end < 0)
            return 0;
        *prefix = PyBytes_FromStringAndSize(ev, start);
        *suffix = PyBytes_FromStringAndSize(NULL, n - end + 2);
        *client = NULL;
        if (*prefix == NULL || *suffix == NULL)
            goto fail;
        memcpy(PyBytes_AS_STRING(*suffix), ev + end, (size_t)(n - end));
        memcpy(PyBytes_AS_STRING(*suffix) + (n - end), "\n\n", 2);
        if (old != NULL) {  /* the model must lie in the prefix, and only there */
            Py_ssize_t at_old = find(ev, start, old, olen);
            if (at_old < 0 || find(PyBytes_AS_STRING(*suffix), n - end + 2, old, olen) >= 0) {
                Py_CLEAR(*prefix);
                Py_CLEAR(*suffix);
                return 0;
            }
            *client = PyBytes_FromStringAndSize(NULL, start - olen + nlen);
            if (*client == NULL)
                goto fail;
            char *w = PyBytes_AS_STRING(*client);
            memcpy(w, ev, (size_t)at_old);
            memcpy(w + at_old, new, (size_t)nlen);
            memcpy(w + at_old + nlen, ev + at_old + olen, (size_t)(start - at_old - olen));
        }
        return 1;
    fail:
        Py_CLEAR(*prefix);
        Py_CLEAR(*suffix);
        return -1;
    }
    return 0;
}

/* (prompt, completion, cached or None), or None when not valid */
static PyObject *
usage_tuple(const Usage *u)
{
    if (!u->valid)
        Py_RETURN_NONE;
    if (u->has_cached)
        return Py_BuildValue("(LLL)", u->prompt, u->completion, u->cached);
    return Py_BuildValue("(LLO)", u->prompt, u->completion, Py_None);
}

static int
optional_bytes(PyObject *o, const char **s, Py_ssize_t *n)
{
    if (o == Py_None) {
        *s = NULL;
        *n = 0;
        return 1;
    }
    if (!PyBytes_Check(o))
        return 0;
    *s = PyBytes_AS_STRING(o);
    *n = PyBytes_GET_SIZE(o);
    return 1;
}

static PyObject *
relay_run(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 10) {
        PyErr_Format(PyExc_TypeError, "relay_run takes 10 arguments (%zd given)", nargs);
        return NULL;
    }
    const char *pre, *suf, *cli, *old, *new;
    Py_ssize_t plen, slen, clen, olen, nlen, pos, stop, max_text;
    if (!PyBytes_Check(args[0]) || !optional_bytes(args[3], &pre, &plen) || !optional_bytes(args[4], &suf, &slen)
            || !optional_bytes(args[5], &cli, &clen) || !optional_bytes(args[6], &old, &olen)
            || !optional_bytes(args[7], &new, &nlen)) {
        PyErr_SetString(PyExc_TypeError, "relay_run: buf must be bytes, prefix, suffix, client, old and new bytes or None");
        return NULL;
    }
    if (!as_index(args[1], &pos) || !as_index(args[2], &stop) || !as_index(args[8], &max_text))
        return NULL;
    int include_usage = PyObject_IsTrue(args[9]);
    if (include_usage < 0)
        return NULL;
    const char *buf = PyBytes_AS_STRING(args[0]);
    Py_ssize_t n = PyBytes_GET_SIZE(args[0]);
    if (stop > n)
        stop = n;
    if (pos < 0 || pos > stop || (pre != NULL && (plen == 0 || slen < 2)) || (old == NULL) != (new == NULL)
            || (old != NULL && olen == 0)) {
        PyErr_SetString(PyExc_ValueError,
                        "relay_run: need 0 <= pos <= stop, a prefix with a suffix, and old with new");
        return NULL;
    }
    if (pre == NULL)
        cli = NULL;  /* the client's prefix goes with a prefix */
    PyObject *lp = NULL, *ls = NULL, *lc = NULL;  /* what this walk learned */
    Out out = {NULL, 0, 0, (stop - pos) + (nlen > olen ? stop - pos : 0) + 16};
    int changed = 0, done = 0;
    Usage usage = {0, 0, 0, 0, 0};  /* the last one read */
    Py_ssize_t copied = pos, tokens = 0;
    for (;;) {
        while (pos < stop && buf[pos] == '\n')
            pos++;
        if (pos >= stop)
            break;
        if (pre != NULL) {  /* an ordinary token event? */
            Py_ssize_t body = pos + plen;
            if (body < stop && buf[body] != '"' && memcmp(buf + pos, pre, (size_t)plen) == 0) {
                Py_ssize_t limit = body + max_text + slen;
                Py_ssize_t nxt = event_end(buf, body, limit < stop ? limit : stop, stop);
                Py_ssize_t tail = nxt + 2 - slen;  /* where an ordinary event's suffix starts */
                if (nxt >= 0 && tail > body && tail <= body + max_text && memcmp(buf + tail, suf, (size_t)slen) == 0) {
                    tokens++;
                    if (cli != NULL) {
                        if (put(&out, buf + copied, pos - copied) || put(&out, cli, clen))
                            goto fail;
                        changed = 1;
                        copied = pos + plen;
                    }
                    pos = nxt + 2;
                    continue;
                }
            }
        }
        Py_ssize_t nxt = event_end(buf, pos, stop, stop);
        if (nxt < 0)
            break;
        const char *ev = buf + pos;
        Py_ssize_t elen = nxt - pos;
        if (elen >= 5 && memcmp(ev, "data:", 5) == 0) {
            cp s = (cp)ev + 5, e = (cp)buf + nxt;
            while (s < e && py_space(*s))
                s++;
            while (e > s && py_space(e[-1]))
                e--;
            if (e - s == 6 && memcmp(s, "[DONE]", 6) == 0) {
                done = 1;
                if (elen != 12 || memcmp(ev, "data: [DONE]", 12) != 0) {  /* `data:[DONE]`, ...: as it should be */
                    if (put(&out, buf + copied, pos - copied) || put(&out, "data: [DONE]", 12))
                        goto fail;
                    changed = 1;
                    copied = nxt;
                }
                pos = nxt + 2;
                continue;
            }
            Facts f;
            if (!event_facts(s, e, &f) || f.error || f.object_error)
                break;  /* the caller's */
            if (f.usage.valid)
                usage = f.usage;
            if (!f.choices) {  /* a usage chunk is not output: the client gets it only if it asked */
                if (!include_usage && f.usage.valid) {
                    if (put(&out, buf + copied, pos - copied))
                        goto fail;
                    changed = 1;
                    copied = pos = nxt + 2;
                    continue;
                }
            } else if (f.choices_is_list && f.has_text) {
                tokens++;
                if (pre == NULL && lp == NULL && f.choices_len == 1) {
                    int got = learn(ev, elen, old, olen, new, nlen, &lp, &ls, &lc);
                    if (got < 0)
                        goto fail;
                    if (got) {
                        pre = PyBytes_AS_STRING(lp), plen = PyBytes_GET_SIZE(lp);
                        suf = PyBytes_AS_STRING(ls), slen = PyBytes_GET_SIZE(ls);
                        if (lc != NULL)
                            cli = PyBytes_AS_STRING(lc), clen = PyBytes_GET_SIZE(lc);
                    }
                }
            }
        }
        /* relayed as it is, the model renamed (an SSE comment, a field we do not interpret, a chunk) */
        if (old != NULL && find(ev, elen, old, olen) >= 0) {
            if (put(&out, buf + copied, pos - copied) || put_renamed(&out, ev, elen, old, olen, new, nlen))
                goto fail;
            changed = 1;
            copied = nxt;
        }
        pos = nxt + 2;
    }
    PyObject *piece = NULL, *learned = NULL;
    if (changed) {
        if (put(&out, buf + copied, pos - copied))
            goto fail;
        if (_PyBytes_Resize(&out.bytes, out.len) < 0)
            goto fail;
        piece = out.bytes;
    } else {
        piece = Py_NewRef(Py_None);
    }
    if (lp != NULL) {
        learned = PyTuple_Pack(3, lp, ls, lc != NULL ? lc : Py_None);
        Py_CLEAR(lp);
        Py_CLEAR(ls);
        Py_CLEAR(lc);
        if (learned == NULL) {
            Py_DECREF(piece);
            return NULL;
        }
    } else {
        learned = Py_NewRef(Py_None);
    }
    PyObject *read = usage_tuple(&usage);
    if (read == NULL) {
        Py_DECREF(piece);
        Py_DECREF(learned);
        return NULL;
    }
    return Py_BuildValue("(nNnONN)", pos, piece, tokens, done ? Py_True : Py_False, learned, read);
fail:
    Py_XDECREF(out.bytes);
    Py_XDECREF(lp);
    Py_XDECREF(ls);
    Py_XDECREF(lc);
    return NULL;
}

static PyObject *
event_facts_py(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 3 || !PyBytes_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "event_facts(buf: bytes, start, end)");
        return NULL;
    }
    Py_ssize_t start, end, n = PyBytes_GET_SIZE(args[0]);
    if (!as_index(args[1], &start) || !as_index(args[2], &end))
        return NULL;
    if (start < 0 || start > end || end > n) {
        PyErr_SetString(PyExc_ValueError, "event_facts: need 0 <= start <= end <= len(buf)");
        return NULL;
    }
    cp buf = (cp)PyBytes_AS_STRING(args[0]);
    Facts f;
    if (!event_facts(buf + start, buf + end, &f))
        Py_RETURN_NONE;
    PyObject *usage = usage_tuple(&f.usage);
    if (usage == NULL)
        return NULL;
    return Py_BuildValue("(ONOOnO)", f.error || f.object_error ? Py_True : Py_False, usage,
                         f.choices ? Py_True : Py_False, f.choices_is_list ? Py_True : Py_False, f.choices_len,
                         f.has_text ? Py_True : Py_False);
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
    {"event_facts", (PyCFunction)(void (*)(void))event_facts_py, METH_FASTCALL,
     "event_facts(buf, start, end) -> (error, usage, choices, choices_is_list, len(choices), has_text) or None"},
    {"relay_run", (PyCFunction)(void (*)(void))relay_run, METH_FASTCALL,
     "relay_run(buf, pos, stop, prefix, suffix, client, old, new, max_text, include_usage)"
     " -> (end, piece, tokens, done, learned, usage)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_sse_scan", "The SSE relay's walk over a read's complete events (see sse_scan.py).",
    0, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__sse_scan(void)
{
    json_facts_init();
    return PyModuleDef_Init(&module);
}
