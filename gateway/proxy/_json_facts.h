/* The JSON facts of an SSE chunk (`_json_facts.c`), for the SSE relay's walk (`_sse_scan.c`). */
#ifndef GATEWAY_JSON_FACTS_H
#define GATEWAY_JSON_FACTS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* A `usage` object as `openai_compat.parse_usage` reads it */
typedef struct {
    int valid;  /* parse_usage would read these (else it gives None) */
    long long prompt, completion;
    int has_cached;
    long long cached;
} Usage;

/* What the relay asks of a chunk (`sse_scan.facts_of`) */
typedef struct {
    int error, object_error;  /* an `error` key; the last `object` is "error" */
    Usage usage;  /* the last `usage`, as parse_usage reads it */
    int choices, choices_is_list, has_text;  /* the last `choices`: true, a list, one of its choices carries output */
    Py_ssize_t choices_len;  /* its length (0 when not a list) */
} Facts;

/* The facts of the JSON object [s, e) (the data of an event, whitespace stripped); 0 when it is not an
 * object, or not one this reader is sure of exactly as orjson would read it. */
int event_facts(const unsigned char *s, const unsigned char *e, Facts *f);

/* Once, before event_facts is called (the module's init). */
void json_facts_init(void);

#endif
