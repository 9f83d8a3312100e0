/* COCO polygon text straight to its stored form, for the build's workers.
 *
 * packed_polygons(text) -> bytes or None. For the common polygon text -- a JSON list of
 * non-empty lists of plain numbers (no exponent; an integer part of at most 18 digits; at
 * most 19 digits in all; a value that a double holds exactly by Clinger's fast path) --
 * the msgpack bytes of ``json.loads(text)``, exactly what ``msgpack.packb`` gives for it.
 * Anything else gives None and the caller parses the text in Python, which accepts it or
 * says what is wrong: this only ever skips work, it never decides what is valid JSON.
 *
 * Why: parsing polygons into Python floats and packing them again was the largest part of
 * what COCO annotations add to a build (docs/benchmarks.md). Here each number costs a few
 * nanoseconds and no Python object.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <float.h>
#include <stdint.h>
#include <string.h>

#define MAX_TEXT (1 << 24) /* longer texts go the Python way (bounded scratch memory) */
#define EXACT (UINT64_C(1) << 53)

static const double POW10[23] = {1e0,  1e1,  1e2,  1e3,  1e4,  1e5,  1e6,  1e7,
                                 1e8,  1e9,  1e10, 1e11, 1e12, 1e13, 1e14, 1e15,
                                 1e16, 1e17, 1e18, 1e19, 1e20, 1e21, 1e22};

typedef struct {
    unsigned char *p; /* write position */
} Out;

static inline const char *skip_ws(const char *s, const char *e) {
    while (s < e && (*s == ' ' || *s == '\t' || *s == '\n' || *s == '\r'))
        s++;
    return s;
}

static inline void put_be(Out *o, uint64_t v, int bytes) {
    for (int k = bytes - 1; k >= 0; k--)
        *o->p++ = (unsigned char)(v >> (8 * k));
}

/* msgpack-python's choice of encoding for an integer (smallest form; uint for positives). */
static void put_int(Out *o, int64_t v) {
    if (v < -(1 << 5)) {
        if (v < -(INT64_C(1) << 31)) {
            *o->p++ = 0xd3;
            put_be(o, (uint64_t)v, 8);
        } else if (v < -(1 << 15)) {
            *o->p++ = 0xd2;
            put_be(o, (uint64_t)(uint32_t)(int32_t)v, 4);
        } else if (v < -(1 << 7)) {
            *o->p++ = 0xd1;
            put_be(o, (uint64_t)(uint16_t)(int16_t)v, 2);
        } else {
            *o->p++ = 0xd0;
            *o->p++ = (unsigned char)(int8_t)v;
        }
    } else if (v < (1 << 7)) {
        *o->p++ = (unsigned char)(int8_t)v; /* fixint, positive or negative */
    } else if (v < (1 << 8)) {
        *o->p++ = 0xcc;
        *o->p++ = (unsigned char)v;
    } else if (v < (1 << 16)) {
        *o->p++ = 0xcd;
        put_be(o, (uint64_t)v, 2);
    } else if (v < (INT64_C(1) << 32)) {
        *o->p++ = 0xce;
        put_be(o, (uint64_t)v, 4);
    } else {
        *o->p++ = 0xcf;
        put_be(o, (uint64_t)v, 8);
    }
}

static void put_float(Out *o, double d) {
    uint64_t bits;
    memcpy(&bits, &d, 8);
    *o->p++ = 0xcb;
    put_be(o, bits, 8);
}

static void put_array_head(Out *o, Py_ssize_t n) {
    if (n < 16) {
        *o->p++ = (unsigned char)(0x90 | n);
    } else if (n < 65536) {
        *o->p++ = 0xdc;
        put_be(o, (uint64_t)n, 2);
    } else {
        *o->p++ = 0xdd;
        put_be(o, (uint64_t)n, 4);
    }
}

static inline int is_digit(char c) { return c >= '0' && c <= '9'; }

/* One JSON number at s, packed into o; the text after it, or NULL where it is not a
 * number of the simple kind (or not a number at all). */
static const char *number(const char *s, const char *e, Out *o) {
    int neg = 0;
    if (s < e && *s == '-') {
        neg = 1;
        s++;
    }
    if (s >= e || !is_digit(*s))
        return NULL;
    uint64_t m = 0;
    int digits = 0;
    if (*s == '0') { /* JSON: a leading zero stands alone */
        s++;
        digits = 1;
        if (s < e && is_digit(*s))
            return NULL;
    } else {
        while (s < e && is_digit(*s)) {
            if (++digits > 18)
                return NULL;
            m = m * 10 + (uint64_t)(*s++ - '0');
        }
    }
    if (s < e && *s == '.') {
        s++;
        int frac = 0;
        if (s >= e || !is_digit(*s))
            return NULL;
        while (s < e && is_digit(*s)) {
            if (++digits > 19 || ++frac > 22)
                return NULL;
            m = m * 10 + (uint64_t)(*s++ - '0');
        }
        if (s < e && (*s == 'e' || *s == 'E'))
            return NULL;
        if (m > EXACT) /* beyond Clinger's fast path: Python rounds it */
            return NULL;
#if !defined(FLT_EVAL_METHOD) || FLT_EVAL_METHOD != 0
        return NULL; /* x87 arithmetic could round the division twice: Python does floats */
#endif
        double d = (double)m / POW10[frac]; /* both exact: one correctly rounded division */
        put_float(o, neg ? -d : d);
        return s;
    }
    if (s < e && (*s == 'e' || *s == 'E'))
        return NULL;
    put_int(o, neg ? -(int64_t)m : (int64_t)m);
    return s;
}

/* After an array item: the text past its "," (*closed = 0) or past the array's "]"
 * (*closed = 1); NULL for anything else. */
static const char *after_item(const char *s, const char *e, int *closed) {
    s = skip_ws(s, e);
    if (s >= e || (*s != ']' && *s != ','))
        return NULL;
    *closed = *s == ']';
    return s + 1;
}

/* An array of n items packed at head + 5 .. end: its header written at head and the items
 * moved up to it (the header's size is known only once the items are counted); the new end. */
static unsigned char *close_array(unsigned char *head, unsigned char *end, Py_ssize_t n) {
    Out h = {head};
    put_array_head(&h, n);
    memmove(h.p, head + 5, (size_t)(end - (head + 5)));
    return h.p + (end - (head + 5));
}

/* Polygons from text [s, e) into buf (10 bytes per text byte); 0 if not simple. */
static int polygons(const char *s, const char *e, unsigned char *buf, Py_ssize_t *size) {
    Out o = {buf + 5}; /* room for the outer header */
    Py_ssize_t count = 0;
    int closed = 0;
    s = skip_ws(s, e);
    if (s >= e || *s++ != '[')
        return 0;
    while (!closed) {
        s = skip_ws(s, e);
        if (s >= e || *s++ != '[')
            return 0;
        unsigned char *head = o.p;
        o.p += 5; /* room for the polygon's header */
        Py_ssize_t n = 0;
        int last = 0;
        while (!last) {
            s = number(skip_ws(s, e), e, &o);
            if (s == NULL || (s = after_item(s, e, &last)) == NULL)
                return 0;
            n++;
        }
        o.p = close_array(head, o.p, n);
        count++;
        if ((s = after_item(s, e, &closed)) == NULL)
            return 0;
    }
    if (skip_ws(s, e) != e)
        return 0;
    *size = close_array(buf, o.p, count) - buf;
    return 1;
}

static PyObject *packed_polygons(PyObject *self, PyObject *arg) {
    (void)self;
    if (!PyUnicode_Check(arg)) {
        PyErr_SetString(PyExc_TypeError, "packed_polygons takes the polygons' JSON text (str)");
        return NULL;
    }
    if (!PyUnicode_IS_ASCII(arg) || PyUnicode_GET_LENGTH(arg) > MAX_TEXT)
        Py_RETURN_NONE;
    Py_ssize_t n = PyUnicode_GET_LENGTH(arg);
    const char *s = (const char *)PyUnicode_DATA(arg); /* ASCII: one byte per character */
    /* at most ~3 bytes per text byte ("[[0.0]]": 19 bytes, headers reserved at 5 each
     * before they are compacted); 10 per byte leaves room to spare */
    unsigned char *buf = PyMem_Malloc((size_t)n * 10 + 16);
    if (buf == NULL)
        return PyErr_NoMemory();
    Py_ssize_t size = 0;
    PyObject *out;
    if (polygons(s, s + n, buf, &size)) {
        out = PyBytes_FromStringAndSize((const char *)buf, size);
    } else {
        Py_INCREF(Py_None);
        out = Py_None;
    }
    PyMem_Free(buf);
    return out;
}

static PyMethodDef methods[] = {
    {"packed_polygons", packed_polygons, METH_O,
     "packed_polygons(text) -> bytes | None: msgpack of json.loads(text) for simple COCO "
     "polygon text, else None (parse it in Python)."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, .m_name = "_polygons",
                                    .m_doc = "COCO polygon text to msgpack in one pass.",
                                    .m_size = -1, .m_methods = methods};

PyMODINIT_FUNC PyInit__polygons(void) { return PyModule_Create(&module); }
