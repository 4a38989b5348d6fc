/* ext_proc._jsonscan: what intake and the estimate cost per element, done in C.
 *
 * Why C: intake must refuse a body with more JSON elements than any request needs *before* orjson builds
 * a Python object per element (issue 28: a 3 MB body of `{}` cost 0.86 s), and read any body within
 * `limits.max_body_bytes` (4 MiB) in about 5 ms of CPU. No JSON library on PyPI says how many values a
 * document holds without building them (simdjson validates, but its bindings expose no counts; orjson,
 * msgspec and yyjson build a Python object per value), and the pure-Python passes cost 9-40 ms on
 * bodies that are legitimate or that the caps let through (4 MiB of JSON-in-JSON text; 16k chat
 * messages of an unusual shape, each walked by the estimate). The Python versions stay, as the
 * fallback of an install without a C compiler, and as the reference the tests hold these to.
 *
 * scan(body, max_elements, max_containers, max_strings, max_depth, max_outside, max_fractions)
 *   -> (containers, elements, strings, depth, over)
 *     One pass over the raw bytes. Outside strings it counts objects and arrays, elements (commas and
 *     containers: about one per value), the nesting depth, non-integer numbers (a '.' or an exponent)
 *     and the bytes outside strings (numbers, literals, structure; whitespace an eighth each); strings
 *     are stepped over (a backslash takes the next byte with it). It stops at the first cap passed;
 *     `over` says which (OVER_* below), else 0. Not a validator: a body that is not JSON is counted as
 *     far as it goes and left to orjson to refuse.
 * all_ints(list) -> bool: every item exactly an int (not a bool, float, str, container or None).
 * walk_tokens(value, ratio, opaque, skipped, media_tokens[, into]) -> int | None
 *     estimate.Estimator._walk with a characters-per-token ratio, or None where it must be left to
 *     Python (a type orjson does not make). With `into` (a list), the strings are appended to it for a
 *     tokenizer and only the media parts' tokens are returned.
 * token_ids(body, key) -> (start, end, lists, total, longest) | None
 *     The top-level member `key` of a body, when its value is a list of integers (lists -1) or a list of
 *     lists of integers, without building a Python int per id (orjson's cost for a 262k-id prompt: ~4.5 ms
 *     of ~5). Strict about the integers (JSON's grammar, at most 18 digits: what orjson reads as an int);
 *     None for anything else, a key written with escapes or given twice, or a body that is not an object:
 *     the caller then parses it all.
 * bad_message(list, chat) -> int
 *     The index of the first chat message / Responses input item the estimate would refuse, or -1.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

enum { OVER_ELEMENTS = 1, OVER_CONTAINERS, OVER_STRINGS, OVER_DEPTH, OVER_OUTSIDE, OVER_FRACTIONS };

/* Whitespace outside strings counts an eighth of a byte against max_outside: a pretty-printed body
 * (json.dumps(indent=2) of a 262k-token prompt, ~5 blank bytes an id) fits, padding does not come free
 * (262k ids padded with spaces to 4 MiB cost orjson 8 ms when it did not count at all). */
#define WHITESPACE_SHARE 8

/* The bytes outside strings at index `at`, as max_outside counts them. */
static inline Py_ssize_t outside(Py_ssize_t at, Py_ssize_t inside, Py_ssize_t blank) {
    return at - inside - blank + blank / WHITESPACE_SHARE;
}

/* What the pass outside strings does with a byte: SKIP it, count it as WHITESPACE, or STOP there */
enum { SKIP = 0, WHITESPACE = 1, STOP = 2 };
static unsigned char CLASS[256];
/* Bytes token_ids steps over outside strings without a look: all but quotes, brackets and commas */
static unsigned char PLAIN[256];

static void init_table(void) {
    for (int i = 0; i < 256; i++) {
        PLAIN[i] = 1;
    }
    for (const char *s = "\"[]{},"; *s; s++) {
        PLAIN[(unsigned char)*s] = 0;
    }
    const char *stops = "\",[]{}.eE";
    for (const char *s = stops; *s; s++) {
        CLASS[(unsigned char)*s] = STOP;
    }
    CLASS[(unsigned char)' '] = CLASS[(unsigned char)'\t'] = CLASS[(unsigned char)'\n'] = CLASS[(unsigned char)'\r'] =
        WHITESPACE;
}

/* The closing quote of the string that opened just before p (or end: unterminated). Eight bytes at a time
 * while none is a quote or a backslash (plain text: ~0.1 ns a byte), else a byte at a time, a backslash
 * taking the next byte with it: a string of escaped quotes costs no more than that (a memchr per quote,
 * the first version, cost 8.5 ms on 4 MiB of them). */
#define ONES 0x0101010101010101ULL
#define HIGHS 0x8080808080808080ULL
#define HAS_BYTE(v, b) ((((v) ^ (ONES * (b))) - ONES) & ~((v) ^ (ONES * (b))) & HIGHS)

/* Past the runs of eight spaces at `at` (indentation: 4 MiB of it, a byte at a time, cost 3 ms). */
static inline Py_ssize_t past_spaces(const char *b, Py_ssize_t at, Py_ssize_t size) {
    uint64_t v;
    while (size - at >= 8 && (memcpy(&v, b + at, 8), v == ONES * (uint64_t)' ')) {
        at += 8;
    }
    return at;
}

static const char *skip_string(const char *p, const char *end, Py_ssize_t *escapes, Py_ssize_t *unicode,
                               uint64_t *seen) {
    uint64_t acc = 0; /* every byte OR-ed in: its high bit says whether the string has non-ASCII bytes */
    for (;;) {
        while (end - p >= 8) {
            uint64_t v;
            memcpy(&v, p, 8);
            if (HAS_BYTE(v, (uint64_t)'"') | HAS_BYTE(v, (uint64_t)'\\')) {
                break;
            }
            acc |= v;
            p += 8;
        }
        /* a quote or a backslash within the next eight bytes (or fewer than eight left) */
        const char *stop = end - p > 8 ? p + 8 : end;
        while (p < stop) {
            char c = *p;
            acc |= (unsigned char)c;
            if (c == '"') {
                *seen |= acc;
                return p;
            }
            if (c == '\\') {
                ++*escapes;
                if (end - p < 2) {
                    *seen |= acc;
                    return end;
                }
                *unicode += p[1] == 'u';
                p += 2;
            } else {
                p++;
            }
        }
        if (p >= end) {
            *seen |= acc;
            return end;
        }
    }
}

static PyObject *scan(PyObject *self, PyObject *args) {
    PyObject *body;
    Py_ssize_t max_elements, max_containers, max_strings, max_depth, max_outside, max_fractions;
    (void)self;
    if (!PyArg_ParseTuple(args, "Snnnnnn:scan", &body, &max_elements, &max_containers, &max_strings, &max_depth,
                          &max_outside, &max_fractions)) {
        return NULL;
    }
    const char *start = PyBytes_AS_STRING(body);
    const Py_ssize_t size = PyBytes_GET_SIZE(body);
    Py_ssize_t at = 0; /* (indexes, not pointers: nothing is formed outside the buffer) */
    Py_ssize_t containers = 0, elements = 0, strings = 0, depth = 0, deepest = 0, fractions = 0;
    Py_ssize_t inside = 0, blank = 0, keys = 0, escapes = 0, unicode = 0, numbers = 0, arrays = 0;
    Py_ssize_t high_escapes = 0, high_key_bytes = 0, high_strings = 0, high_escaped_bytes = 0;
    int over = 0;
    while (at < size) {
        /* numbers, literals and whitespace run to the next stop; the bytes outside strings (whitespace an
           eighth each) are checked at each stop (a number ends at one: a comma, a bracket) and at the end */
        while (at < size) {
            /* a number starts here (a digit or '-' after a stop or whitespace, not the fraction or the
               exponent of one: after a '.' or an 'e'): each costs orjson an object */
            numbers += ((unsigned)(start[at] - '0') <= 9u || start[at] == '-') &&
                       !(at > 0 && (start[at - 1] == '.' || start[at - 1] == 'e' || start[at - 1] == 'E'));
            while (at < size && CLASS[(unsigned char)start[at]] == SKIP) { /* digits, letters: tight */
                at++;
            }
            if (at >= size || CLASS[(unsigned char)start[at]] == STOP) {
                break;
            }
            /* whitespace; indentation eight spaces at a time */
            Py_ssize_t from = at;
            at = past_spaces(start, at, size);
            blank += at - from;
            while (at < size && CLASS[(unsigned char)start[at]] == WHITESPACE) {
                at++;
                blank++;
            }
        }
        if (outside(at, inside, blank) > max_outside) {
            over = OVER_OUTSIDE;
            break;
        }
        if (at >= size) {
            break;
        }
        char c = start[at++];
        switch (c) {
        case '"': {
            if (++strings > max_strings) {
                over = OVER_STRINGS;
                goto done;
            }
            uint64_t seen = 0;
            Py_ssize_t escapes_before = escapes, opened = at;
            const char *q = skip_string(start + at, start + size, &escapes, &unicode, &seen);
            Py_ssize_t close = q - start; /* the closing quote, or size: unterminated */
            int high = (seen & HIGHS) != 0; /* non-ASCII bytes in it: orjson unescapes such text ~3x slower */
            high_escapes += high ? escapes - escapes_before : 0;
            high_strings += high;
            high_escaped_bytes += high && escapes > escapes_before ? close - opened : 0;
            inside += close - at;
            at = close < size ? close + 1 : size;
            /* a key: a colon after it (whitespace between is left for the loop above to count) */
            Py_ssize_t k = at;
            while (k < size && CLASS[(unsigned char)start[k]] == WHITESPACE) {
                k++;
            }
            if (k < size && start[k] == ':') {
                keys++;
                high_key_bytes += high ? close - opened : 0; /* (a non-ASCII key is dearer to make and hash) */
            }
            break;
        }
        case ',':
            if (++elements > max_elements) {
                over = OVER_ELEMENTS;
                goto done;
            }
            break;
        case '[':
        case '{':
            arrays += c == '[';
            if (++containers > max_containers) {
                over = OVER_CONTAINERS;
                goto done;
            }
            if (++elements > max_elements) {
                over = OVER_ELEMENTS;
                goto done;
            }
            if (++depth > deepest) {
                deepest = depth;
                if (deepest > max_depth) {
                    over = OVER_DEPTH;
                    goto done;
                }
            }
            break;
        case ']':
        case '}':
            if (depth > 0) {
                depth--;
            }
            break;
        case '.':
            if (++fractions > max_fractions) {
                over = OVER_FRACTIONS;
                goto done;
            }
            break;
        default: { /* 'e' / 'E': an exponent after a digit (not the e of true or false) ... */
            Py_ssize_t q = at - 2;
            while (q >= 0 && start[q] >= '0' && start[q] <= '9') {
                q--;
            }
            /* ... of a number not already counted at its '.' (each digit walked back over once) */
            if (q < at - 2 && !(q >= 0 && start[q] == '.') && ++fractions > max_fractions) {
                over = OVER_FRACTIONS;
                goto done;
            }
            break;
        }
        }
    }
    if (!over && outside(size, inside, blank) > max_outside) { /* (the bytes after the last stop) */
        over = OVER_OUTSIDE;
    }
done:
    return Py_BuildValue("nnnninnnnnnnnnn", containers, elements, strings, deepest, over, keys, escapes, unicode,
                         fractions, numbers, arrays, high_escapes, high_key_bytes, high_strings, high_escaped_bytes);
}

static PyObject *all_ints(PyObject *self, PyObject *arg) {
    (void)self;
    if (!PyList_CheckExact(arg)) {
        PyErr_SetString(PyExc_TypeError, "all_ints: a list");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(arg);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!PyLong_CheckExact(PyList_GET_ITEM(arg, i))) {
            Py_RETURN_FALSE;
        }
    }
    Py_RETURN_TRUE;
}

static PyObject *TYPE_KEY, *ROLE_KEY, *CONTENT_KEY;

/* Whether every key of a dict is exactly a str. Only then is a lookup by a str key, or a key's membership
 * in a frozenset of strs, free of Python code (a key of another type whose hash matches would have its
 * __eq__ called, which could change what this walk holds borrowed). orjson makes no other key. */
static int str_keys(PyObject *d) {
    Py_ssize_t pos = 0;
    PyObject *k, *v;
    while (PyDict_Next(d, &pos, &k, &v)) {
        if (!PyUnicode_CheckExact(k)) {
            return 0;
        }
    }
    return 1;
}

typedef struct {
    PyObject **items; /* borrowed: the value walked holds them, and nothing here runs Python code */
    Py_ssize_t size, cap;
} Stack;

static int push(Stack *s, PyObject *o) {
    if (s->size == s->cap) {
        Py_ssize_t cap = s->cap ? 2 * s->cap : 64;
        PyObject **items = PyMem_Realloc(s->items, (size_t)cap * sizeof(PyObject *));
        if (items == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        s->items = items;
        s->cap = cap;
    }
    s->items[s->size++] = o;
    return 0;
}

#define TOKENS_MAX 1e15 /* past it (an absurd chars_per_token), a double is no longer exact: Python decides */

/* One value met by the walk: a str counted, an exact dict or list pushed, anything else ignored; 1 for
 * what Python must decide (a subclass: orjson makes none; a count past TOKENS_MAX). */
static int visit(PyObject *x, double ratio, double *total, Stack *stack, PyObject *into) {
    if (PyUnicode_CheckExact(x)) {
        if (into != NULL) { /* gathered for a tokenizer */
            return PyList_Append(into, x);
        }
        *total += ceil((double)PyUnicode_GET_LENGTH(x) / ratio);
        return *total > TOKENS_MAX ? 1 : 0;
    }
    if (PyDict_CheckExact(x)) {
        return str_keys(x) ? push(stack, x) : 1;
    }
    if (PyList_CheckExact(x)) {
        return push(stack, x);
    }
    if (PyDict_Check(x) || PyList_Check(x) || PyUnicode_Check(x)) {
        return 1;
    }
    return 0;
}

static PyObject *walk_tokens(PyObject *self, PyObject *args) {
    PyObject *value, *opaque, *skipped, *into = NULL;
    double ratio;
    long long media;
    (void)self;
    if (!PyArg_ParseTuple(args, "OdO!O!L|O!:walk_tokens", &value, &ratio, &PyFrozenSet_Type, &opaque,
                          &PyFrozenSet_Type, &skipped, &media, &PyList_Type, &into)) {
        return NULL;
    }
    if (!(ratio > 0.0) || media < 0) {
        PyErr_SetString(PyExc_ValueError, "walk_tokens: a positive ratio and media tokens >= 0");
        return NULL;
    }
    /* every count a whole number below TOKENS_MAX: exact in a double */
    double total = 0.0;
    Stack stack = {NULL, 0, 0};
    int r = visit(value, ratio, &total, &stack, into);
    while (r == 0 && stack.size > 0) {
        PyObject *v = stack.items[--stack.size];
        if (PyList_CheckExact(v)) {
            Py_ssize_t n = PyList_GET_SIZE(v);
            for (Py_ssize_t i = 0; i < n && r == 0; i++) {
                r = visit(PyList_GET_ITEM(v, i), ratio, &total, &stack, into);
            }
            continue;
        }
        /* an exact dict whose keys are all exact strs (visit checked) */
        if (PyDict_GET_SIZE(v) == 0) {
            continue;
        }
        /* a media part ({"type": "image_url", ...}) counts flat, whatever it holds */
        PyObject *kind = PyDict_GetItemWithError(v, TYPE_KEY);
        if (kind == NULL && PyErr_Occurred()) {
            r = -1;
            break;
        }
        if (kind != NULL && PyUnicode_CheckExact(kind)) {
            int in = PySet_Contains(opaque, kind);
            if (in < 0) {
                r = -1;
                break;
            }
            if (in) {
                total += (double)media;
                if (total > TOKENS_MAX) {
                    r = 1;
                }
                continue;
            }
        }
        Py_ssize_t pos = 0;
        PyObject *k, *x;
        while (r == 0 && PyDict_Next(v, &pos, &k, &x)) {
            int in = PySet_Contains(opaque, k);
            if (in < 0) {
                r = -1;
                break;
            }
            if (in) { /* a media key: counted flat, its payload not walked */
                total += (double)media;
                continue;
            }
            in = PySet_Contains(skipped, k); /* a part's kind, a message's role */
            if (in < 0) {
                r = -1;
                break;
            }
            if (!in) {
                r = visit(x, ratio, &total, &stack, into);
            }
        }
        if (total > TOKENS_MAX && r == 0) {
            r = 1;
        }
    }
    PyMem_Free(stack.items);
    if (r < 0) {
        return NULL;
    }
    if (r > 0) {
        Py_RETURN_NONE;
    }
    return PyLong_FromLongLong((long long)total);
}

/* Whether a message's content is one the estimate accepts: null, a string, or a list of objects each
 * with a string "type" (0 also for what Python must decide: a part with a key that is not a str). */
static int content_ok(PyObject *content) {
    if (content == Py_None || PyUnicode_Check(content)) {
        return 1;
    }
    if (!PyList_Check(content)) {
        return 0;
    }
    for (Py_ssize_t j = 0; j < PyList_GET_SIZE(content); j++) {
        PyObject *part = PyList_GET_ITEM(content, j);
        if (!PyDict_CheckExact(part) || !str_keys(part)) {
            return 0;
        }
        PyObject *kind = PyDict_GetItemWithError(part, TYPE_KEY);
        if (kind == NULL) {
            return PyErr_Occurred() ? -1 : 0;
        }
        if (!PyUnicode_Check(kind)) {
            return 0;
        }
    }
    return 1;
}

static PyObject *bad_message(PyObject *self, PyObject *args) {
    PyObject *messages;
    int chat;
    (void)self;
    if (!PyArg_ParseTuple(args, "O!p:bad_message", &PyList_Type, &messages, &chat)) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(messages); i++) {
        PyObject *m = PyList_GET_ITEM(messages, i);
        if (!PyDict_CheckExact(m) || !str_keys(m)) {
            return PyLong_FromSsize_t(i); /* (a dict subclass, a key not a str: Python's own checks decide) */
        }
        PyObject *role = PyDict_GetItemWithError(m, ROLE_KEY);
        if (role == NULL && PyErr_Occurred()) {
            return NULL;
        }
        /* chat: a string role; Responses input items: a string role or none (null) */
        int role_ok = role != NULL && PyUnicode_Check(role);
        if (!role_ok && (chat || (role != NULL && role != Py_None))) {
            return PyLong_FromSsize_t(i);
        }
        PyObject *content = PyDict_GetItemWithError(m, CONTENT_KEY);
        if (content == NULL && PyErr_Occurred()) {
            return NULL;
        }
        if (content != NULL) {
            int ok = content_ok(content);
            if (ok < 0) {
                return NULL;
            }
            if (!ok) {
                return PyLong_FromSsize_t(i);
            }
        }
    }
    return PyLong_FromLong(-1);
}


/* ---- token_ids: a top-level token-id prompt read without building a Python int per id ---------------- */

#define MAX_ID_DIGITS 18 /* every id fits an int64, as orjson reads it: a longer one is left to orjson */

static inline Py_ssize_t skip_ws(const char *b, Py_ssize_t at, Py_ssize_t size) {
    while (at < size && CLASS[(unsigned char)b[at]] == WHITESPACE) {
        at++;
    }
    return at;
}

/* One JSON integer at `at` (strictly: -?(0|[1-9][0-9]*), at most MAX_ID_DIGITS digits, not followed by a
 * fraction or an exponent): the index after it, or -1. */
static Py_ssize_t json_int(const char *b, Py_ssize_t at, Py_ssize_t size) {
    if (at < size && b[at] == '-') {
        at++;
    }
    Py_ssize_t first = at;
    if (at < size && b[at] == '0') {
        at++;
    } else {
        while (at < size && b[at] >= '0' && b[at] <= '9') {
            at++;
        }
    }
    if (at == first || at - first > MAX_ID_DIGITS) {
        return -1;
    }
    if (at < size && (b[at] == '.' || b[at] == 'e' || b[at] == 'E' || (b[at] >= '0' && b[at] <= '9'))) {
        return -1;
    }
    return at;
}

/* An array of integers at `at` ('['): the index after its ']', or -1 if it is anything else; *count gets
 * its length. */
static Py_ssize_t int_array(const char *b, Py_ssize_t at, Py_ssize_t size, Py_ssize_t *count) {
    Py_ssize_t n = 0;
    at = skip_ws(b, at + 1, size);
    if (at < size && b[at] == ']') {
        *count = 0;
        return at + 1;
    }
    for (;;) {
        at = json_int(b, at, size);
        if (at < 0) {
            return -1;
        }
        n++;
        at = skip_ws(b, at, size);
        if (at >= size) {
            return -1;
        }
        if (b[at] == ']') {
            *count = n;
            return at + 1;
        }
        if (b[at] != ',') {
            return -1;
        }
        at = skip_ws(b, at + 1, size);
    }
}

/* Past one JSON value at `at` (not validated: orjson reads it later), or -1 where the body ends first. */
static Py_ssize_t skip_value(const char *b, Py_ssize_t at, Py_ssize_t size) {
    Py_ssize_t escapes = 0, unicode = 0, depth = 0;
    uint64_t seen = 0;
    while (at < size) {
        /* numbers, literals, whitespace, colons: tight (spaces eight at a time, as the scan does) */
        at = past_spaces(b, at, size);
        while (at < size && PLAIN[(unsigned char)b[at]]) {
            at++;
        }
        if (at >= size) {
            break;
        }
        char c = b[at];
        if (c == '"') {
            Py_ssize_t close = skip_string(b + at + 1, b + size, &escapes, &unicode, &seen) - b;
            if (close >= size) {
                return -1;
            }
            at = close + 1;
            if (depth == 0) {
                return at;
            }
        } else if (c == '[' || c == '{') {
            depth++;
            at++;
        } else if (c == ']' || c == '}') {
            if (depth == 0) {
                return at; /* the end of the enclosing object: a scalar ended here */
            }
            at++;
            if (--depth == 0) {
                return at;
            }
        } else { /* ',' */
            if (depth == 0) {
                return at;
            }
            at++;
        }
    }
    return depth == 0 ? at : -1;
}

/* A list of integers, or a list of lists of integers, at `at`: the index after it, or -1. */
static Py_ssize_t ids_value(const char *b, Py_ssize_t at, Py_ssize_t size, Py_ssize_t *lists, Py_ssize_t *total,
                            Py_ssize_t *longest) {
    *lists = -1;
    *total = *longest = 0;
    if (at >= size || b[at] != '[') {
        return -1;
    }
    Py_ssize_t n = 0, in = skip_ws(b, at + 1, size);
    if (!(in < size && b[in] == '[')) {
        in = int_array(b, at, size, total);
        *longest = *total;
        return in;
    }
    *lists = 0;
    for (;;) {
        in = int_array(b, in, size, &n);
        if (in < 0) {
            return -1;
        }
        ++*lists;
        *total += n;
        *longest = n > *longest ? n : *longest;
        in = skip_ws(b, in, size);
        if (in < size && b[in] == ']') {
            return in + 1;
        }
        if (in >= size || b[in] != ',') {
            return -1;
        }
        in = skip_ws(b, in + 1, size);
        if (in >= size || b[in] != '[') {
            return -1;
        }
    }
}

static PyObject *token_ids(PyObject *self, PyObject *args) {
    PyObject *body;
    const char *key;
    Py_ssize_t key_len;
    (void)self;
    if (!PyArg_ParseTuple(args, "Sy#:token_ids", &body, &key, &key_len)) {
        return NULL;
    }
    const char *b = PyBytes_AS_STRING(body);
    const Py_ssize_t size = PyBytes_GET_SIZE(body);
    Py_ssize_t at = skip_ws(b, 0, size), found = -1, found_end = -1, lists = -1, total = 0, longest = 0;
    if (at >= size || b[at] != '{') {
        Py_RETURN_NONE;
    }
    at = skip_ws(b, at + 1, size);
    if (at < size && b[at] == '}') {
        Py_RETURN_NONE;
    }
    for (;;) { /* the members of the top-level object */
        if (at >= size || b[at] != '"') {
            Py_RETURN_NONE;
        }
        Py_ssize_t escapes = 0, unicode = 0;
        uint64_t seen = 0;
        Py_ssize_t close = skip_string(b + at + 1, b + size, &escapes, &unicode, &seen) - b;
        if (close >= size || escapes) { /* (a key written with escapes: left to orjson) */
            Py_RETURN_NONE;
        }
        int match = close - at - 1 == key_len && memcmp(b + at + 1, key, (size_t)key_len) == 0;
        at = skip_ws(b, close + 1, size);
        if (at >= size || b[at] != ':') {
            Py_RETURN_NONE;
        }
        at = skip_ws(b, at + 1, size);
        if (match) {
            if (found >= 0) { /* the key twice: which one a parser keeps is its own choice */
                Py_RETURN_NONE;
            }
            /* read as ids straight away (skipping it first, then reading it, took two passes) */
            found_end = ids_value(b, at, size, &lists, &total, &longest);
            if (found_end < 0) {
                Py_RETURN_NONE;
            }
            found = at;
        }
        Py_ssize_t end = match ? found_end : skip_value(b, at, size);
        if (end < 0) {
            Py_RETURN_NONE;
        }
        at = skip_ws(b, end, size);
        if (at < size && b[at] == ',') {
            at = skip_ws(b, at + 1, size);
            continue;
        }
        if (at < size && b[at] == '}') {
            break;
        }
        Py_RETURN_NONE;
    }
    if (found < 0) {
        Py_RETURN_NONE;
    }
    return Py_BuildValue("nnnnn", found, found_end, lists, total, longest);
}

static PyMethodDef METHODS[] = {
    {"scan", scan, METH_VARARGS,
     "scan(body, max_elements, max_containers, max_strings, max_depth, max_outside, max_fractions)"
     " -> (containers, elements, strings, depth, over, keys, escapes, unicode_escapes, fractions, numbers, arrays,"
     " high_escapes, high_key_bytes, high_strings, high_escaped_bytes)"},
    {"all_ints", all_ints, METH_O, "all_ints(list) -> bool: every item exactly an int"},
    {"walk_tokens", walk_tokens, METH_VARARGS,
     "walk_tokens(value, ratio, opaque, skipped, media_tokens[, into]) -> int | None"},
    {"token_ids", token_ids, METH_VARARGS,
     "token_ids(body, key) -> (start, end, lists, total, longest) | None: the top-level member `key` when it"
     " is a list of integers (lists -1) or a list of lists of integers"},
    {"bad_message", bad_message, METH_VARARGS, "bad_message(messages, chat) -> int: the first refused, or -1"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef MODULE = {
    PyModuleDef_HEAD_INIT, "_jsonscan", "What intake and the estimate cost per element, done in C.", -1, METHODS,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__jsonscan(void) {
    init_table();
    TYPE_KEY = PyUnicode_InternFromString("type");
    ROLE_KEY = PyUnicode_InternFromString("role");
    CONTENT_KEY = PyUnicode_InternFromString("content");
    if (TYPE_KEY == NULL || ROLE_KEY == NULL || CONTENT_KEY == NULL) {
        return NULL;
    }
    return PyModule_Create(&MODULE);
}
