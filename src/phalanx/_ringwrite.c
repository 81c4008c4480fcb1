/* phalanx._ringwrite: the interval recorder's write path (phalanx.intervals), in C.
 *
 * Why C: the recorder runs several times a training step, and on a sub-millisecond CPU step what a record
 * costs is not the few word stores it makes but the Python it runs to make them. Right after a torch op has
 * evicted the caches, every Python frame, bound method and dict the path touches is a cache miss: the pure
 * Python writer's `with collective(...)` block cost many times there what it costs in a tight loop (see
 * docs/benchmarks.md). Here a block is one call to a type (vectorcall: no argument tuple), two special-method
 * calls, and the stores; the step boundary one C call.
 *
 * The ring's format and protocol are phalanx.api.intervals' (its docstring says them; RingWriter is the
 * reference implementation, and tests/agent/test_ring_writers.py checks that both write the same words):
 * record n's slot is (n + 1) & mask, its seq word is -(n + 1) while it is written and n + 1 once it is whole;
 * an interval's end is one word, stored only if the slot still holds the interval. A token is the record's
 * seq. Every function here runs with the GIL held and never releases it: the GIL orders the claims of the
 * threads that write (the training thread, the CUDA-event watcher, a collective's completion callback).
 * The release fences order the stores for the agent, which reads the ring from another process.
 *
 * No pickle and no Python object crosses the process boundary: only the ring's 8-byte words. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <time.h>

/* ---- counters and channels: a group's sequence numbers, and an (op, group)'s meta word ----------------- */

typedef struct {
    PyObject_HEAD
    int64_t next; /* the group's next collective's sequence number, from 1 */
} Counter;

static PyTypeObject CounterType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "phalanx._ringwrite.Counter",
    .tp_basicsize = sizeof(Counter),
    .tp_flags = Py_TPFLAGS_DEFAULT,
};

typedef struct {
    PyObject_HEAD
    int64_t meta;     /* the records' meta word (kind, device flag, text indices) */
    Counter *counter; /* the group's, shared by every op of the group */
} Channel;

static void Channel_dealloc(Channel *c) {
    Py_XDECREF(c->counter);
    PyObject_Free(c);
}

static PyTypeObject ChannelType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "phalanx._ringwrite.Channel",
    .tp_basicsize = sizeof(Channel),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_dealloc = (destructor)Channel_dealloc,
};

/* ---- Writer -------------------------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    Py_buffer view; /* the ring's mapping, held (the mmap cannot close) until release() */
    int64_t *seqs, *metas, *numbers, *stamps, *ends; /* NULL once released: every write is then a no-op */
    int64_t mask;
    int64_t next_seq;
    int64_t mark_meta;
    PyObject *channels; /* group -> {op -> Channel} */
    PyObject *counters; /* group -> Counter */
    PyObject *encode;   /* encode(op, group) -> meta, for an (op, group) seen the first time */
    PyObject *last_op, *last_group; /* the (op, group) objects of the last lookup, and its channel: a loop */
    PyObject *last;                 /* records the same collective again and again, with the same objects */
} Writer;

static inline int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts); /* time.time_ns()'s clock; a vDSO call, no system call */
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static inline int64_t put(Writer *w, int64_t meta, int64_t number, int64_t stamp) {
    if (w->seqs == NULL) return 0;
    int64_t seq = w->next_seq++;
    int64_t i = seq & w->mask;
    w->seqs[i] = -seq; /* being written */
    __atomic_thread_fence(__ATOMIC_RELEASE);
    w->metas[i] = meta;
    w->numbers[i] = number;
    w->stamps[i] = stamp;
    w->ends[i] = 0; /* open */
    __atomic_store_n(&w->seqs[i], seq, __ATOMIC_RELEASE); /* whole */
    return seq;
}

static inline void finish(Writer *w, int64_t seq, int64_t stamp) {
    if (w->seqs == NULL || seq <= 0) return;
    int64_t i = seq & w->mask;
    if (__atomic_load_n(&w->seqs[i], __ATOMIC_RELAXED) == seq) /* not lapped meanwhile */
        __atomic_store_n(&w->ends[i], stamp, __ATOMIC_RELEASE);
}

static int Writer_init(Writer *w, PyObject *args, PyObject *kwargs) {
    static char *kw[] = {"buffer", "fields", "capacity", "next_seq", "mark_meta", "encode", NULL};
    PyObject *buffer, *fields, *encode;
    long long capacity, next_seq, mark_meta;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO!LLLO:Writer", kw, &buffer, &PyTuple_Type, &fields,
                                     &capacity, &next_seq, &mark_meta, &encode))
        return -1;
    if (w->view.obj != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "a Writer is initialised once");
        return -1;
    }
    if (capacity <= 0 || (capacity & (capacity - 1)) || PyTuple_GET_SIZE(fields) != 5 || next_seq <= 0) {
        PyErr_SetString(PyExc_ValueError, "a ring has five field arrays of a power-of-two capacity");
        return -1;
    }
    if (PyObject_GetBuffer(buffer, &w->view, PyBUF_WRITABLE) < 0) return -1;
    int64_t *starts[5];
    Py_ssize_t words = w->view.len / 8;
    for (int k = 0; k < 5; k++) {
        long long offset = PyLong_AsLongLong(PyTuple_GET_ITEM(fields, k));
        if (offset == -1 && PyErr_Occurred()) goto fail;
        if (offset < 0 || offset + capacity > words || ((uintptr_t)w->view.buf & 7)) {
            PyErr_SetString(PyExc_ValueError, "a field array lies outside the ring");
            goto fail;
        }
        starts[k] = (int64_t *)w->view.buf + offset;
    }
    w->channels = PyDict_New();
    w->counters = PyDict_New();
    if (w->channels == NULL || w->counters == NULL) goto fail;
    w->seqs = starts[0], w->metas = starts[1], w->numbers = starts[2], w->stamps = starts[3], w->ends = starts[4];
    w->mask = capacity - 1;
    w->next_seq = next_seq;
    w->mark_meta = mark_meta;
    Py_INCREF(encode);
    w->encode = encode;
    return 0;
fail:
    PyBuffer_Release(&w->view);
    return -1;
}

static void Writer_dealloc(Writer *w) {
    if (w->view.obj != NULL) PyBuffer_Release(&w->view);
    Py_XDECREF(w->channels);
    Py_XDECREF(w->counters);
    Py_XDECREF(w->encode);
    Py_XDECREF(w->last_op);
    Py_XDECREF(w->last_group);
    Py_XDECREF(w->last);
    Py_TYPE(w)->tp_free((PyObject *)w);
}

static Channel *encode_channel(Writer *w, PyObject *op, PyObject *group, PyObject *by_op);

/* The (op, group) channel, encoded on first use (the only path that calls back into Python). Borrowed. */
static Channel *channel(Writer *w, PyObject *op, PyObject *group) {
    if (op == w->last_op && group == w->last_group) return (Channel *)w->last;
    PyObject *by_op = PyDict_GetItemWithError(w->channels, group);
    PyObject *c = by_op != NULL ? PyDict_GetItemWithError(by_op, op) : NULL;
    if (c == NULL) {
        if (PyErr_Occurred()) return NULL;
        c = (PyObject *)encode_channel(w, op, group, by_op);
        if (c == NULL) return NULL;
    }
    Py_XSETREF(w->last_op, Py_NewRef(op));
    Py_XSETREF(w->last_group, Py_NewRef(group));
    Py_XSETREF(w->last, Py_NewRef(c));
    return (Channel *)c;
}

static Channel *encode_channel(Writer *w, PyObject *op, PyObject *group, PyObject *by_op) {
    if (!PyUnicode_Check(op) || !PyUnicode_Check(group)) {
        PyErr_Format(PyExc_TypeError, "a collective's op and group are str, not %.50s and %.50s",
                     Py_TYPE(op)->tp_name, Py_TYPE(group)->tp_name);
        return NULL;
    }
    PyObject *meta_obj = PyObject_CallFunctionObjArgs(w->encode, op, group, NULL);
    if (meta_obj == NULL) return NULL;
    long long meta = PyLong_AsLongLong(meta_obj);
    Py_DECREF(meta_obj);
    if (meta == -1 && PyErr_Occurred()) return NULL;
    Counter *counter = (Counter *)PyDict_GetItemWithError(w->counters, group);
    if (counter == NULL) {
        if (PyErr_Occurred()) return NULL;
        counter = PyObject_New(Counter, &CounterType);
        if (counter == NULL) return NULL;
        counter->next = 1;
        int failed = PyDict_SetItem(w->counters, group, (PyObject *)counter);
        Py_DECREF(counter); /* the dict holds it */
        if (failed) return NULL;
    }
    Channel *c = PyObject_New(Channel, &ChannelType);
    if (c == NULL) return NULL;
    c->meta = meta;
    Py_INCREF(counter);
    c->counter = counter;
    if (by_op == NULL) {
        by_op = PyDict_New();
        if (by_op == NULL || PyDict_SetItem(w->channels, group, by_op) < 0) {
            Py_XDECREF(by_op);
            Py_DECREF(c);
            return NULL;
        }
        Py_DECREF(by_op); /* w->channels holds it */
    }
    int failed = PyDict_SetItem(by_op, op, (PyObject *)c);
    Py_DECREF(c);
    return failed ? NULL : c;
}

static int64_t begin(Writer *w, PyObject *op, PyObject *group) {
    if (w->seqs == NULL) return 0; /* released (or never initialised): nothing to encode or write */
    Channel *c = channel(w, op, group);
    if (c == NULL) return -1;
    return put(w, c->meta, c->counter->next++, now_ns());
}

static int as_int64(PyObject *obj, int64_t *out) {
    long long v = PyLong_AsLongLong(obj);
    if (v == -1 && PyErr_Occurred()) return -1;
    *out = v;
    return 0;
}

static PyObject *Writer_write(Writer *w, PyObject *const *args, Py_ssize_t nargs) {
    int64_t meta, number, stamp;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "write(meta, number, stamp)");
        return NULL;
    }
    if (as_int64(args[0], &meta) || as_int64(args[1], &number) || as_int64(args[2], &stamp)) return NULL;
    return PyLong_FromLongLong(put(w, meta, number, stamp));
}

static PyObject *Writer_end(Writer *w, PyObject *const *args, Py_ssize_t nargs) {
    int64_t seq, stamp;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "end(token, stamp)");
        return NULL;
    }
    if (as_int64(args[0], &seq) || as_int64(args[1], &stamp)) return NULL;
    finish(w, seq, stamp);
    Py_RETURN_NONE;
}

static PyObject *Writer_step(Writer *w, PyObject *number) {
    int64_t n;
    if (as_int64(number, &n)) return NULL;
    put(w, w->mark_meta, n, now_ns());
    Py_RETURN_NONE;
}

static PyObject *Writer_begin(Writer *w, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "begin(op, group)");
        return NULL;
    }
    int64_t seq = begin(w, args[0], args[1]);
    return seq < 0 ? NULL : PyLong_FromLongLong(seq);
}

static PyObject *Writer_end_now(Writer *w, PyObject *token) {
    int64_t seq;
    if (as_int64(token, &seq)) return NULL;
    finish(w, seq, now_ns());
    Py_RETURN_NONE;
}

static PyObject *Writer_release(Writer *w, PyObject *unused) {
    w->seqs = w->metas = w->numbers = w->stamps = w->ends = NULL;
    if (w->view.obj != NULL) PyBuffer_Release(&w->view);
    /* A Writer is not tracked by the garbage collector, and ``encode`` refers back to the recorder that holds
     * it: let go of it here, or the two would never be freed. */
    Py_CLEAR(w->encode);
    Py_CLEAR(w->last_op);
    Py_CLEAR(w->last_group);
    Py_CLEAR(w->last);
    if (w->channels != NULL) PyDict_Clear(w->channels);
    Py_RETURN_NONE;
}

static PyMethodDef Writer_methods[] = {
    {"write", (PyCFunction)(void (*)(void))Writer_write, METH_FASTCALL,
     "write(meta, number, stamp) -> token: one record, as RingWriter.write."},
    {"end", (PyCFunction)(void (*)(void))Writer_end, METH_FASTCALL,
     "end(token, stamp): ends the interval token names, as RingWriter.end."},
    {"step", (PyCFunction)Writer_step, METH_O, "step(number): a step boundary (MARK), stamped now."},
    {"begin", (PyCFunction)(void (*)(void))Writer_begin, METH_FASTCALL,
     "begin(op, group) -> token: a collective starts now; its number is the group's next."},
    {"end_now", (PyCFunction)Writer_end_now, METH_O, "end_now(token): the interval ends now."},
    {"release", (PyCFunction)Writer_release, METH_NOARGS,
     "Lets go of the ring's mapping (so that it can close); every write after is a no-op."},
    {NULL},
};

static PyTypeObject WriterType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "phalanx._ringwrite.Writer",
    .tp_doc = "Writer(buffer, fields, capacity, next_seq, mark_meta, encode): writes records into a ring.",
    .tp_basicsize = sizeof(Writer),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Writer_init,
    .tp_dealloc = (destructor)Writer_dealloc,
    .tp_methods = Writer_methods,
};

/* ---- the recorder this process turned on: what collective(...) writes to ------------------------------- */

static Writer *active = NULL;      /* NULL: collective(...) is a no-op */
static PyObject *on_end = NULL;    /* NULL: an interval ends on the host, now; else on_end(token) (CUDA) */
static PyObject *group_of = NULL;  /* group_of(process_group, label) -> group string */

static PyObject *activate(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "activate(writer or None, on_end or None, group_of)");
        return NULL;
    }
    if (args[0] != Py_None && !PyObject_TypeCheck(args[0], &WriterType)) {
        PyErr_SetString(PyExc_TypeError, "activate: a Writer or None");
        return NULL;
    }
    Py_XSETREF(active, args[0] == Py_None ? NULL : (Writer *)Py_NewRef(args[0]));
    Py_XSETREF(on_end, args[1] == Py_None ? NULL : Py_NewRef(args[1]));
    Py_XSETREF(group_of, Py_NewRef(args[2]));
    Py_RETURN_NONE;
}

/* ---- collective(op, *, group=None, label="pg"): one blocking collective, as a with block ---------------- */

typedef struct {
    PyObject_HEAD
    Writer *writer;   /* NULL: the recorder was off when the block began */
    PyObject *on_end; /* the recorder's, when the block began */
    int64_t token;
} Span;

static PyTypeObject SpanType;
static PyObject *str_group, *str_label, *str_pg; /* "group", "label", "pg", interned at import */

static PyObject *Span_vectorcall(PyObject *type, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs != 1) {
        PyErr_Format(PyExc_TypeError, "collective() takes the op, then group= and label=, not %zd positional",
                     nargs);
        return NULL;
    }
    PyObject *op = args[0], *group = Py_None, *label = NULL;
    Py_ssize_t nkw = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    for (Py_ssize_t k = 0; k < nkw; k++) {
        PyObject *key = PyTuple_GET_ITEM(kwnames, k); /* interned, as a call's keywords are: one compare */
        if (key == str_group || PyUnicode_Compare(key, str_group) == 0) {
            group = args[1 + k];
        } else if (key == str_label || PyUnicode_Compare(key, str_label) == 0) {
            label = args[1 + k];
        } else {
            PyErr_Format(PyExc_TypeError, "collective() got an unexpected keyword argument '%U'", key);
            return NULL;
        }
    }
    Span *s = PyObject_New(Span, &SpanType);
    if (s == NULL) return NULL;
    s->writer = NULL;
    s->on_end = NULL;
    s->token = 0;
    Writer *w = active;
    if (w == NULL) return (PyObject *)s;
    PyObject *name = NULL;
    if (!PyUnicode_CheckExact(group)) { /* a torch process group (None: the default one) */
        name = PyObject_CallFunctionObjArgs(group_of, group, label != NULL ? label : str_pg, NULL);
        if (name == NULL) goto fail;
        group = name;
    }
    int64_t token = begin(w, op, group);
    Py_XDECREF(name);
    if (token < 0) goto fail;
    s->writer = (Writer *)Py_NewRef(w);
    s->on_end = Py_XNewRef(on_end);
    s->token = token;
    return (PyObject *)s;
fail:
    Py_DECREF(s);
    return NULL;
}

static void Span_dealloc(Span *s) {
    Py_XDECREF(s->writer);
    Py_XDECREF(s->on_end);
    PyObject_Free(s);
}

static PyObject *Span_enter(Span *s, PyObject *unused) {
    if (s->writer == NULL) Py_RETURN_NONE;
    return PyLong_FromLongLong(s->token);
}

static PyObject *Span_exit(Span *s, PyObject *const *args, Py_ssize_t nargs) {
    if (s->writer == NULL) Py_RETURN_NONE;
    if (s->on_end == NULL) {
        finish(s->writer, s->token, now_ns());
        Py_RETURN_NONE;
    }
    PyObject *token = PyLong_FromLongLong(s->token);
    if (token == NULL) return NULL;
    PyObject *r = PyObject_CallOneArg(s->on_end, token);
    Py_DECREF(token);
    if (r == NULL) return NULL;
    Py_DECREF(r);
    Py_RETURN_NONE; /* never swallows the block's exception */
}

static PyMethodDef Span_methods[] = {
    {"__enter__", (PyCFunction)Span_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)(void (*)(void))Span_exit, METH_FASTCALL, NULL},
    {NULL},
};

static PyTypeObject SpanType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "phalanx._ringwrite.collective",
    .tp_doc = "with collective(op, group=pg): records one blocking collective; a no-op when the recorder is off.",
    .tp_basicsize = sizeof(Span),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_dealloc = (destructor)Span_dealloc,
    .tp_methods = Span_methods,
    .tp_vectorcall = Span_vectorcall,
};

/* ---- the module ---------------------------------------------------------------------------------------- */

static PyMethodDef module_methods[] = {
    {"activate", (PyCFunction)(void (*)(void))activate, METH_FASTCALL,
     "activate(writer or None, on_end or None, group_of): what collective(...) records into."},
    {NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "phalanx._ringwrite", "The interval recorder's write path, in C.", -1, module_methods,
};

PyMODINIT_FUNC PyInit__ringwrite(void) {
    if (PyType_Ready(&CounterType) < 0 || PyType_Ready(&ChannelType) < 0 || PyType_Ready(&WriterType) < 0 ||
        PyType_Ready(&SpanType) < 0)
        return NULL;
    str_group = PyUnicode_InternFromString("group");
    str_label = PyUnicode_InternFromString("label");
    str_pg = PyUnicode_InternFromString("pg");
    if (str_group == NULL || str_label == NULL || str_pg == NULL) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddObjectRef(m, "Writer", (PyObject *)&WriterType) < 0 ||
        PyModule_AddObjectRef(m, "collective", (PyObject *)&SpanType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
