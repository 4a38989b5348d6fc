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
 *     and the bytes outside strings (numbers, literals, whitespace, structure); strings are stepped
 *     over (a backslash takes the next byte with it). It stops at the first cap passed; `over` says
 *     which (OVER_* below), else 0. Not a validator: a body that is not JSON is counted as far as it
 *     goes and left to orjson to refuse.
 * all_ints(list) -> bool: every item exactly an int (not a bool, float, str, container or None).
 * walk_tokens(value, ratio, opaque, skipped, media_tokens) -> int | None
 *     estimate.Estimator._walk with a characters-per-token ratio, or None where it must be left to
 *     Python (a type orjson does not make).
 * bad_message(list, chat) -> int
 *     The index of the first chat message / Responses input item the estimate would refuse, or -1.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>

enum { OVER_ELEMENTS = 1, OVER_CONTAINERS, OVER_STRINGS, OVER_DEPTH, OVER_OUTSIDE, OVER_FRACTIONS };

/* 1: a character the pass outside strings stops at; 0: skipped */
static unsigned char STOP[256];

static void init_table(void) {
    const char *stops = "\",[]{}.eE";
    for (const char *s = stops; *s; s++) {
        STOP[(unsigned char)*s] = 1;
    }
}

/* The closing quote of the string that opened just before p (or end: unterminated). A byte at a time: a
 * string of escaped quotes costs what plain text does (a memchr per quote cost 8.5 ms on 4 MiB of them). */
static const char *skip_string(const char *p, const char *end) {
    while (p < end) {
        char c = *p;
        if (c == '"') {
            return p;
        }
        if (c == '\\') {
            if (end - p < 2) {
                return end;
            }
            p += 2;
        } else {
            p++;
        }
    }
    return end;
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
    const char *p = start;
    const char *end = p + PyBytes_GET_SIZE(body);
    Py_ssize_t containers = 0, elements = 0, strings = 0, depth = 0, deepest = 0, fractions = 0, inside = 0;
    int over = 0;
    while (p < end) {
        /* bytes outside strings still allowed; a run of them (whitespace, digits) stops there */
        Py_ssize_t room = max_outside - ((p - start) - inside);
        if (room < 0) {
            over = OVER_OUTSIDE;
            break;
        }
        const char *lim = (end - p > room) ? p + room + 1 : end;
        while (p < lim && !STOP[(unsigned char)*p]) {
            p++;
        }
        if (p >= end) {
            break;
        }
        if (p == lim) {
            over = OVER_OUTSIDE;
            break;
        }
        char c = *p++;
        switch (c) {
        case '"': {
            if (++strings > max_strings) {
                over = OVER_STRINGS;
                goto done;
            }
            const char *q = skip_string(p, end);
            inside += (q < end ? q : end) - p;
            p = q < end ? q + 1 : end;
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
            const char *q = p - 2;
            while (q >= start && *q >= '0' && *q <= '9') {
                q--;
            }
            /* ... of a number not already counted at its '.' (each digit walked back over once) */
            if (q < p - 2 && !(q >= start && *q == '.') && ++fractions > max_fractions) {
                over = OVER_FRACTIONS;
                goto done;
            }
            break;
        }
        }
    }
    if (!over && (end - start) - inside > max_outside) { /* (the last bytes: read after the last check) */
        over = OVER_OUTSIDE;
    }
done:
    return Py_BuildValue("nnnni", containers, elements, strings, deepest, over);
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

/* One str, dict or list met by the walk: a string counted, a container pushed, anything else ignored. */
static int visit(PyObject *x, double ratio, long long *total, Stack *stack) {
    if (PyUnicode_CheckExact(x)) {
        *total += (long long)ceil((double)PyUnicode_GET_LENGTH(x) / ratio);
        return 0;
    }
    if (PyDict_CheckExact(x) || PyList_CheckExact(x)) {
        return push(stack, x);
    }
    if (PyDict_Check(x) || PyList_Check(x) || PyUnicode_Check(x)) {
        return 1; /* a subclass: orjson makes none; Python decides */
    }
    return 0;
}

static PyObject *walk_tokens(PyObject *self, PyObject *args) {
    PyObject *value, *opaque, *skipped;
    double ratio;
    long long media;
    (void)self;
    if (!PyArg_ParseTuple(args, "OdO!O!L:walk_tokens", &value, &ratio, &PyFrozenSet_Type, &opaque,
                          &PyFrozenSet_Type, &skipped, &media)) {
        return NULL;
    }
    if (!(ratio > 0.0)) {
        PyErr_SetString(PyExc_ValueError, "walk_tokens: ratio must be positive");
        return NULL;
    }
    long long total = 0;
    Stack stack = {NULL, 0, 0};
    int r = visit(value, ratio, &total, &stack);
    while (r == 0 && stack.size > 0) {
        PyObject *v = stack.items[--stack.size];
        if (PyList_CheckExact(v)) {
            Py_ssize_t n = PyList_GET_SIZE(v);
            for (Py_ssize_t i = 0; i < n && r == 0; i++) {
                r = visit(PyList_GET_ITEM(v, i), ratio, &total, &stack);
            }
            continue;
        }
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
                total += media;
                continue;
            }
        }
        Py_ssize_t pos = 0;
        PyObject *k, *x;
        while (r == 0 && PyDict_Next(v, &pos, &k, &x)) {
            if (!PyUnicode_CheckExact(k)) {
                r = 1;
                break;
            }
            int in = PySet_Contains(opaque, k);
            if (in < 0) {
                r = -1;
                break;
            }
            if (in) { /* a media key: counted flat, its payload not walked */
                total += media;
                continue;
            }
            in = PySet_Contains(skipped, k); /* a part's kind, a message's role */
            if (in < 0) {
                r = -1;
                break;
            }
            if (!in) {
                r = visit(x, ratio, &total, &stack);
            }
        }
    }
    PyMem_Free(stack.items);
    if (r < 0) {
        return NULL;
    }
    if (r > 0) {
        Py_RETURN_NONE;
    }
    return PyLong_FromLongLong(total);
}

/* Whether a message's content is one the estimate accepts: null, a string, or a list of objects each
 * with a string "type". */
static int content_ok(PyObject *content) {
    if (content == Py_None || PyUnicode_Check(content)) {
        return 1;
    }
    if (!PyList_Check(content)) {
        return 0;
    }
    Py_ssize_t n = PyList_GET_SIZE(content);
    for (Py_ssize_t j = 0; j < n; j++) {
        PyObject *part = PyList_GET_ITEM(content, j);
        if (!PyDict_Check(part)) {
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
    Py_ssize_t n = PyList_GET_SIZE(messages);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *m = PyList_GET_ITEM(messages, i);
        if (!PyDict_CheckExact(m)) {
            return PyLong_FromSsize_t(i); /* (a dict subclass too: Python's own checks decide) */
        }
        PyObject *role = PyDict_GetItemWithError(m, ROLE_KEY);
        if (role == NULL && PyErr_Occurred()) {
            return NULL;
        }
        if ((chat || role != NULL) && (role == NULL || !PyUnicode_Check(role))) {
            if (!(role == Py_None && !chat)) {
                return PyLong_FromSsize_t(i);
            }
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

static PyMethodDef METHODS[] = {
    {"scan", scan, METH_VARARGS,
     "scan(body, max_elements, max_containers, max_strings, max_depth, max_outside, max_fractions)"
     " -> (containers, elements, strings, depth, over)"},
    {"all_ints", all_ints, METH_O, "all_ints(list) -> bool: every item exactly an int"},
    {"walk_tokens", walk_tokens, METH_VARARGS,
     "walk_tokens(value, ratio, opaque, skipped, media_tokens) -> int | None"},
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
