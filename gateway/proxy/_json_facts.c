/* The JSON facts of an SSE chunk: what the SSE relay asks of an event (is it an error, what usage does
 * it report, did it carry output), read in one pass over its bytes without building anything. Its
 * Python reference is `sse_scan.facts_of` over orjson's parse (`sse_scan.reference_facts`);
 * tests/unit/gateway/test_sse_scan.py holds this to it on generated and broken JSON.
 *
 * A strict one-pass JSON reader (RFC 8259, as orjson reads it) that builds nothing. It answers only
 * when sure: anything orjson might read otherwise (an exponent or a long number: infinity, underflow;
 * a \u escape of a surrogate; a nesting deeper than MAX_DEPTH; an escaped key where a key matters) is
 * UNSURE, and the caller parses the event with orjson instead. Duplicate keys: the last one wins, as
 * in orjson's dicts. Truth values are Python's: "" 0 0.0 null false [] {} are false. */

#include <stdint.h>
#include <string.h>

#include "_json_facts.h"

typedef const unsigned char *cp;

#define J_OK 0
#define J_UNSURE 1
#define MAX_DEPTH 64
#define MAX_NUMBER 18 /* characters: any such integer fits 64 bits, any such decimal is finite, non-zero if a digit is */

typedef struct {
    cp p, end;
    int depth;
} J;

typedef int (*member_fn)(J *j, cp key, Py_ssize_t klen, int kesc, void *ctx);

static inline void
ws(J *j)
{
    while (j->p < j->end && (*j->p == ' ' || *j->p == '\n' || *j->p == '\r' || *j->p == '\t'))
        j->p++;
}

static inline int
hexval(unsigned char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

/* Bytes a JSON string holds as they are: printable ASCII but the quote and the backslash. */
static unsigned char plain[256];

void
json_facts_init(void)
{
    for (int c = 0x20; c < 0x80; c++)
        plain[c] = c != '"' && c != '\\';
}

/* Whether the 8 bytes at p are all plain (no quote, backslash, control byte or non-ASCII byte; the
 * usual "has a zero byte" bit tricks, which only err towards "no" next to a byte that is not plain). */
static inline int
plain8(cp p)
{
    const uint64_t ones = 0x0101010101010101ULL, highs = 0x8080808080808080ULL;
    uint64_t w, q, b;
    memcpy(&w, p, 8);
    q = w ^ (ones * '"');
    b = w ^ (ones * '\\');
    return (((q - ones) & ~q) | ((b - ones) & ~b) | (w - ones * 0x20) | w) & highs ? 0 : 1;
}

/* The string at j->p (its opening quote): [*s, *s + *n) its bytes as sent, *esc whether it holds an
 * escape. Control characters, invalid UTF-8 and surrogate escapes are UNSURE (orjson refuses them). */
static int
jstring(J *j, cp *s, Py_ssize_t *n, int *esc)
{
    cp p = j->p + 1, end = j->end;
    *s = p;
    *esc = 0;
    for (;;) {
        while (end - p >= 8 && plain8(p))
            p += 8;
        while (p < end && plain[*p])
            p++;
        if (p >= end)
            return J_UNSURE;
        unsigned char c = *p;
        if (c == '"') {
            *n = p - *s;
            j->p = p + 1;
            return J_OK;
        }
        if (c == '\\') {
            *esc = 1;
            if (end - p < 2)
                return J_UNSURE;
            unsigned char e = p[1];
            if (e == 'u') {
                if (end - p < 6)
                    return J_UNSURE;
                int v = 0;
                for (int k = 2; k < 6; k++) {
                    int h = hexval(p[k]);
                    if (h < 0)
                        return J_UNSURE;
                    v = v * 16 + h;
                }
                if (v >= 0xD800 && v <= 0xDFFF)
                    return J_UNSURE;
                p += 6;
            } else if (e == '"' || e == '\\' || e == '/' || e == 'b' || e == 'f' || e == 'n' || e == 'r'
                       || e == 't') {
                p += 2;
            } else {
                return J_UNSURE;
            }
        } else if (c < 0x20) {
            return J_UNSURE;
        } else {  /* UTF-8: no overlong forms, no surrogates, nothing above U+10FFFF */
            int need;
            unsigned char lo = 0x80, hi = 0xBF;
            if (c >= 0xC2 && c <= 0xDF)
                need = 1;
            else if (c == 0xE0)
                need = 2, lo = 0xA0;
            else if ((c >= 0xE1 && c <= 0xEC) || c == 0xEE || c == 0xEF)
                need = 2;
            else if (c == 0xED)
                need = 2, hi = 0x9F;
            else if (c == 0xF0)
                need = 3, lo = 0x90;
            else if (c >= 0xF1 && c <= 0xF3)
                need = 3;
            else if (c == 0xF4)
                need = 3, hi = 0x8F;
            else
                return J_UNSURE;
            if (end - p <= need || p[1] < lo || p[1] > hi)
                return J_UNSURE;
            for (int k = 2; k <= need; k++)
                if ((p[k] & 0xC0) != 0x80)
                    return J_UNSURE;
            p += need + 1;
        }
    }
}

/* A number: its truth, and whether it is an integer (orjson: an int) with its value. */
static int
jnumber(J *j, int *truthy, int *is_int, long long *value)
{
    cp p = j->p, end = j->end;
    int nonzero = 0, negative = 0;
    long long v = 0;
    if (p < end && *p == '-')
        p++, negative = 1;
    if (p >= end)
        return J_UNSURE;
    if (*p == '0') {
        p++;
    } else if (*p >= '1' && *p <= '9') {
        nonzero = 1;
        while (p < end && *p >= '0' && *p <= '9')
            v = v * 10 + (*p++ - '0');  /* at most MAX_NUMBER digits: no overflow */
    } else {
        return J_UNSURE;
    }
    *is_int = 1;
    if (p < end && *p == '.') {
        cp digits = ++p;
        while (p < end && *p >= '0' && *p <= '9') {
            nonzero |= *p != '0';
            p++;
        }
        if (p == digits)
            return J_UNSURE;
        *is_int = 0;
    }
    if ((p < end && (*p == 'e' || *p == 'E')) || p - j->p > MAX_NUMBER)
        return J_UNSURE;
    *truthy = nonzero;
    *value = negative ? -v : v;
    j->p = p;
    return J_OK;
}

static int jvalue(J *j, int *truthy);

/* After a member or element: 1 at a ',' (skipped, j->p at the next one), 0 at `close` (skipped,
   the container ends), -1 at anything else. */
static inline int
separator(J *j, char close)
{
    ws(j);
    if (j->p >= j->end)
        return -1;
    if (*j->p == ',') {
        j->p++;
        ws(j);
        return 1;
    }
    if (*j->p == close) {
        j->p++;
        j->depth--;
        return 0;
    }
    return -1;
}

/* The object at j->p: `member` reads each member's value (j->p at it) given its key. */
static int
jobject(J *j, member_fn member, void *ctx, int *nonempty)
{
    if (++j->depth > MAX_DEPTH)
        return J_UNSURE;
    j->p++;
    ws(j);
    *nonempty = 0;
    if (j->p < j->end && *j->p == '}') {
        j->p++;
        j->depth--;
        return J_OK;
    }
    for (;;) {
        cp key;
        Py_ssize_t klen;
        int kesc;
        if (j->p >= j->end || *j->p != '"' || jstring(j, &key, &klen, &kesc))
            return J_UNSURE;
        ws(j);
        if (j->p >= j->end || *j->p != ':')
            return J_UNSURE;
        j->p++;
        ws(j);
        if (member(j, key, klen, kesc, ctx))
            return J_UNSURE;
        *nonempty = 1;
        int more = separator(j, '}');
        if (more <= 0)
            return more < 0 ? J_UNSURE : J_OK;
    }
}

static int
any_member(J *j, cp key, Py_ssize_t klen, int kesc, void *ctx)
{
    (void)key, (void)klen, (void)kesc, (void)ctx;
    int t;
    return jvalue(j, &t);
}

/* The array at j->p: `element` reads each element (j->p at it); NULL: any value. */
static int
jarray(J *j, int (*element)(J *j, void *ctx), void *ctx, Py_ssize_t *count)
{
    if (++j->depth > MAX_DEPTH)
        return J_UNSURE;
    j->p++;
    ws(j);
    *count = 0;
    if (j->p < j->end && *j->p == ']') {
        j->p++;
        j->depth--;
        return J_OK;
    }
    for (;;) {
        int t;
        if (element != NULL ? element(j, ctx) : jvalue(j, &t))
            return J_UNSURE;
        (*count)++;
        int more = separator(j, ']');
        if (more <= 0)
            return more < 0 ? J_UNSURE : J_OK;
    }
}

static int
literal(J *j, const char *word, Py_ssize_t n)
{
    if (j->end - j->p < n || memcmp(j->p, word, (size_t)n) != 0)
        return J_UNSURE;
    j->p += n;
    return J_OK;
}

static int
jvalue(J *j, int *truthy)
{
    if (j->p >= j->end)
        return J_UNSURE;
    switch (*j->p) {
    case '"': {
        cp s;
        Py_ssize_t n;
        int esc;
        if (jstring(j, &s, &n, &esc))
            return J_UNSURE;
        *truthy = n > 0;
        return J_OK;
    }
    case '{':
        return jobject(j, any_member, NULL, truthy);
    case '[': {
        Py_ssize_t count;
        if (jarray(j, NULL, NULL, &count))
            return J_UNSURE;
        *truthy = count > 0;
        return J_OK;
    }
    case 't':
        *truthy = 1;
        return literal(j, "true", 4);
    case 'f':
        *truthy = 0;
        return literal(j, "false", 5);
    case 'n':
        *truthy = 0;
        return literal(j, "null", 4);
    default: {
        int is_int;
        long long v;
        return jnumber(j, truthy, &is_int, &v);
    }
    }
}

#define KEY(word) (klen == (Py_ssize_t)sizeof(word) - 1 && memcmp(key, word, sizeof(word) - 1) == 0)

/* A streamed choice carries output (`sse._has_text`): its `delta`, when that is an object, has a true
 * `content`, `reasoning_content`, `reasoning` or `tool_calls`; else its `text` is true. */
typedef struct {
    int delta_is_object, delta_text, text;
} Choice;

static int
delta_member(J *j, cp key, Py_ssize_t klen, int kesc, void *ctx)
{
    int *text = ctx, t;
    if (kesc || jvalue(j, &t))
        return J_UNSURE;
    if (KEY("content"))
        text[0] = t;
    else if (KEY("reasoning_content"))
        text[1] = t;
    else if (KEY("reasoning"))
        text[2] = t;
    else if (KEY("tool_calls"))
        text[3] = t;
    return J_OK;
}

static int
choice_member(J *j, cp key, Py_ssize_t klen, int kesc, void *ctx)
{
    Choice *c = ctx;
    int t;
    if (kesc)
        return J_UNSURE;
    if (KEY("delta")) {
        if (j->p < j->end && *j->p == '{') {
            int text[4] = {0, 0, 0, 0};
            if (jobject(j, delta_member, text, &t))
                return J_UNSURE;
            c->delta_is_object = 1;
            c->delta_text = text[0] || text[1] || text[2] || text[3];
            return J_OK;
        }
        c->delta_is_object = 0;
        return jvalue(j, &t);
    }
    if (jvalue(j, &t))
        return J_UNSURE;
    if (KEY("text"))
        c->text = t;
    return J_OK;
}

/* An integer field, as `openai_compat._int` reads it (a bool is not one). */
typedef struct {
    int is_int;
    long long value;
} Int;

static int
jint(J *j, Int *out)
{
    int t;
    out->is_int = 0;
    if (j->p < j->end && (*j->p == '-' || (*j->p >= '0' && *j->p <= '9')))
        return jnumber(j, &t, &out->is_int, &out->value);
    return jvalue(j, &t);
}

static int
details_member(J *j, cp key, Py_ssize_t klen, int kesc, void *ctx)
{
    int t;
    if (kesc)
        return J_UNSURE;
    return KEY("cached_tokens") ? jint(j, ctx) : jvalue(j, &t);
}

/* `usage`'s fields (`openai_compat.parse_usage`): chat's and the Responses API's */
typedef struct {
    Int prompt, completion, total, input, output;
    Int prompt_cached, input_cached;
} UsageFields;

/* `prompt_tokens_details` and `input_tokens_details`: their `cached_tokens` when they are objects */
static int
details(J *j, Int *cached)
{
    int t;
    cached->is_int = 0;
    return j->p < j->end && *j->p == '{' ? jobject(j, details_member, cached, &t) : jvalue(j, &t);
}

static int
usage_member(J *j, cp key, Py_ssize_t klen, int kesc, void *ctx)
{
    UsageFields *u = ctx;
    int t;
    if (kesc)
        return J_UNSURE;
    if (KEY("prompt_tokens"))
        return jint(j, &u->prompt);
    if (KEY("completion_tokens"))
        return jint(j, &u->completion);
    if (KEY("total_tokens"))
        return jint(j, &u->total);
    if (KEY("input_tokens"))
        return jint(j, &u->input);
    if (KEY("output_tokens"))
        return jint(j, &u->output);
    if (KEY("prompt_tokens_details"))
        return details(j, &u->prompt_cached);
    if (KEY("input_tokens_details"))
        return details(j, &u->input_cached);
    return jvalue(j, &t);
}


/* `parse_usage` of the value at j->p */
static int
jusage(J *j, Usage *out)
{
    int t;
    memset(out, 0, sizeof *out);
    if (j->p >= j->end || *j->p != '{')
        return jvalue(j, &t);
    UsageFields u;
    memset(&u, 0, sizeof u);
    if (jobject(j, usage_member, &u, &t))
        return J_UNSURE;
    Int cached = {0, 0};
    if (u.prompt.is_int) {
        out->prompt = u.prompt.value;
        if (u.completion.is_int) {
            out->completion = u.completion.value;
            out->valid = 1;
        } else if (u.total.is_int && u.total.value >= u.prompt.value) {  /* embeddings: no completion */
            out->completion = u.total.value - u.prompt.value;
            out->valid = 1;
        }
        cached = u.prompt_cached;
    } else if (u.input.is_int && u.output.is_int) {  /* the Responses API's names */
        out->prompt = u.input.value;
        out->completion = u.output.value;
        out->valid = 1;
        cached = u.input_cached;
    }
    out->has_cached = cached.is_int;
    out->cached = cached.value;
    return J_OK;
}


static int
choice_element(J *j, void *ctx)
{
    Facts *f = ctx;
    if (j->p < j->end && *j->p == '{') {
        Choice c = {0, 0, 0};
        int nonempty;
        if (jobject(j, choice_member, &c, &nonempty))
            return J_UNSURE;
        f->has_text |= c.delta_is_object ? c.delta_text : c.text;
        return J_OK;
    }
    int t;
    return jvalue(j, &t);
}

static int
top_member(J *j, cp key, Py_ssize_t klen, int kesc, void *ctx)
{
    Facts *f = ctx;
    int t;
    if (kesc)
        return J_UNSURE;
    if (KEY("choices")) {
        f->has_text = 0;
        f->choices_len = 0;
        f->choices_is_list = j->p < j->end && *j->p == '[';
        if (!f->choices_is_list)
            return jvalue(j, &f->choices);
        if (jarray(j, choice_element, f, &f->choices_len))
            return J_UNSURE;
        f->choices = f->choices_len > 0;
        return J_OK;
    }
    if (KEY("object")) {
        f->object_error = 0;
        if (j->p < j->end && *j->p == '"') {
            cp s;
            Py_ssize_t n;
            int esc;
            if (jstring(j, &s, &n, &esc) || esc)
                return J_UNSURE;
            f->object_error = n == 5 && memcmp(s, "error", 5) == 0;
            return J_OK;
        }
        return jvalue(j, &t);
    }
    if (KEY("usage"))
        return jusage(j, &f->usage);
    if (KEY("error"))
        f->error = 1;
    return jvalue(j, &t);
}

int
event_facts(cp s, cp e, Facts *f)
{
    J j = {s, e, 0};
    int nonempty;
    memset(f, 0, sizeof *f);
    if (s >= e || *s != '{' || jobject(&j, top_member, f, &nonempty))
        return 0;
    ws(&j);
    return j.p == e;
}

