// kv-canary's native launch signer: kv_canary/signature.py's `signature(value)` in one C call.
//
// A cached launch (kv_canary/launch_cache.py) is keyed on a signature of all its arguments: every
// tensor's data pointer, shape, strides, dtype and device, every scalar's class and value, the
// attributes of contexts and plans. Read through torch's Python API that costs about a microsecond
// per tensor; here it is a few tens of nanoseconds, read from the TensorImpl itself.
//
// A signature is a `Signature` object: the words of a tagged walk of the value (tensors and small
// ints inline as 64-bit words) and a tuple of the Python objects the walk met in order (classes,
// strings, big ints, floats, other by-value scalars, results of the Python fallback). Two
// signatures are equal exactly when their words and extras are, so the encoding is injective; the
// hash is computed once, while signing, so a dict lookup does not rehash a kilobyte of words.
//
// `sign_shape(value, pointer_class_bytes)` is the same walk with every tensor's data pointer reduced
// to its class: the address modulo pointer_class_bytes (a power of two) and whether it is null. Launches whose arguments differ
// only in where their tensors live share a shape signature (kv_canary/launch_cache.py reuses their
// validation and rebinds only the pointers).
//
// What this file does not decide: how a class other than the built-in ones is signed. That comes
// from Python (`classify(cls)`, kv_canary/signature.py) once per class:
//   (BY_VALUE, None, False)          the object's class and value (numpy scalars, dtypes, devices)
//   (MEMBER, None, False)            the class and the member's address (enums: members are the
//                                    class's singletons, kept alive with the class by the extras;
//                                    their Python-level __hash__ is never called)
//   (OBJECT, slots, has_dict)        class, then each slot, then __dict__; `slots` holds the member
//                                    descriptor of each slot (read at its offset here) or its name
//   (PYTHON, None, False)            the Python implementation's signature (tensor subclasses,
//                                    other sequences and mappings; raises for the unsignable)
// The TensorImpl is read from the tensor's Python object (KV_CANARY_DIRECT_IMPL, torch >= 2.10) or
// reached through `tensor._cdata` (its address); the loader checks both against torch's own
// accessors before use. A tensor that the TensorImpl's accessors refuse (no storage, custom sizes)
// is signed by the Python implementation instead.
#include <Python.h>
#include <structmember.h>

#include <c10/core/TensorImpl.h>
#include <c10/core/UndefinedTensorImpl.h>
#include <c10/util/intrusive_ptr.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace {

enum Tag : uint64_t {
  kNone = 1, kFalse, kTrue, kInt, kTensor, kTuple, kList, kDict, kObject, kByValue, kPython, kStr, kBigInt,
  kFloat, kKey, kInstanceDict, kMember,
};
enum Kind : long { kKindByValue = 0, kKindObject = 1, kKindPython = 2, kKindMember = 3 };
constexpr int kMaxDepth = 64;

PyObject* g_tensor_type = nullptr;  // torch.Tensor (exactly; subclasses go to the Python fallback)
PyObject* g_classify = nullptr;     // cls -> (kind, getter, has_dict)
PyObject* g_fallback = nullptr;     // value -> the Python implementation's signature
PyObject* g_kinds = nullptr;        // {cls: (kind, getter, has_dict)}, filled by g_classify
PyObject* g_cdata = nullptr;        // interned "_cdata"
PyObject* g_dict = nullptr;         // interned "__dict__"

// The walk's output: words on the stack up to kInline (a launch's arguments fit), extras as new
// references handed to the Signature at the end (or released with the walk on an error).
constexpr size_t kInline = 1024;
struct Walk {
  uint64_t pointer_mask = ~0ULL;  // sign_shape: pointer_class_bytes - 1 (see the file's head)
  uint64_t inline_words[kInline];
  std::vector<uint64_t> spill;
  size_t n = 0;
  std::vector<PyObject*> extras;

  ~Walk() {
    for (PyObject* obj : extras) Py_DECREF(obj);
  }
  const uint64_t* data() const { return n <= kInline ? inline_words : spill.data(); }
  inline void word(uint64_t w) {
    if (__builtin_expect(n < kInline, 1)) {
      inline_words[n++] = w;
      return;
    }
    spill_word(w);
  }
  __attribute__((noinline)) void spill_word(uint64_t w) {
    if (n == kInline) spill.assign(inline_words, inline_words + kInline);
    spill.push_back(w);
    ++n;
  }
  void truncate(size_t size) {  // only ever back to a point in the current storage
    if (n > kInline && size <= kInline) std::memcpy(inline_words, spill.data(), size * sizeof(uint64_t));
    if (size > kInline) spill.resize(size);
    n = size;
  }
  bool extra(PyObject* obj) {
    Py_INCREF(obj);
    extras.push_back(obj);
    return true;
  }
};

bool sign(Walk& w, PyObject* value, int depth);

bool sign_python(Walk& w, PyObject* value) {
  PyObject* sig = PyObject_CallOneArg(g_fallback, value);
  if (sig == nullptr) return false;
  w.word(kPython);
  bool ok = w.extra(sig);
  Py_DECREF(sig);
  return ok;
}

#if KV_CANARY_DIRECT_IMPL
// Since torch 2.10 a tensor's Python object is {PyObject_HEAD; at::Tensor cdata; ...} and an
// at::Tensor is one intrusive_ptr<TensorImpl>: the TensorImpl's address follows the object header.
static_assert(sizeof(c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>) == sizeof(void*));
c10::TensorImpl* impl_of(PyObject* value) {
  return *reinterpret_cast<c10::TensorImpl**>(reinterpret_cast<char*>(value) + sizeof(PyObject));
}
#else
c10::TensorImpl* impl_of(PyObject* value) {  // nullptr with an exception set, or with none for 0
  PyObject* address = PyObject_GetAttr(value, g_cdata);
  if (address == nullptr) return nullptr;
  auto* impl = static_cast<c10::TensorImpl*>(PyLong_AsVoidPtr(address));
  Py_DECREF(address);
  return impl;
}
#endif

// The TensorImpl's fields, or false (no exception set) when its accessors refuse.
bool sign_tensor(Walk& w, PyObject* value) {
  c10::TensorImpl* impl = impl_of(value);
  if (impl == nullptr) {
    PyErr_Clear();
    return false;
  }
  const size_t start = w.n;
  try {
    const int64_t dim = impl->dim();
    const c10::Device device = impl->device();
    const auto dtype = static_cast<uint64_t>(static_cast<int8_t>(impl->dtype().toScalarType())) & 0xff;
    const auto type = static_cast<uint64_t>(static_cast<int8_t>(device.type())) & 0xff;
    const auto index = static_cast<uint64_t>(static_cast<int64_t>(device.index()) + 1) & 0xffff;
    w.word(kTensor | dtype << 8 | type << 16 | index << 24 | static_cast<uint64_t>(dim) << 40);
    const auto address = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(impl->mutable_data()));
    w.word(w.pointer_mask == ~0ULL ? address : (address & w.pointer_mask) | (address == 0 ? 1ULL << 63 : 0));
    for (int64_t s : impl->sizes()) w.word(static_cast<uint64_t>(s));
    for (int64_t s : impl->strides()) w.word(static_cast<uint64_t>(s));
    return true;
  } catch (...) {  // a c10::Error (no storage, custom sizes or strides): the Python implementation decides
    w.truncate(start);
    return false;
  }
}

bool sign_items(Walk& w, PyObject* items, int depth) {  // items: a tuple
  const Py_ssize_t n = PyTuple_GET_SIZE(items);
  w.word(static_cast<uint64_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (!sign(w, PyTuple_GET_ITEM(items, i), depth + 1)) return false;
  }
  return true;
}

// Strong references to a list's items or a dict's keys and values, taken before any of them is
// signed: Python code run for one of them (a getter, the fallback) cannot resize what is walked or
// free what is being read. Without a Python allocation (it runs for every launch).
class Snapshot {
 public:
  ~Snapshot() {
    for (size_t i = 0; i < n_; ++i) Py_DECREF(at(i));
  }
  void take(PyObject* obj) {
    Py_INCREF(obj);
    if (n_ < kInlineRefs) {
      inline_[n_++] = obj;
      return;
    }
    if (n_ == kInlineRefs) spill_.assign(inline_, inline_ + kInlineRefs);
    spill_.push_back(obj);
    ++n_;
  }
  size_t size() const { return n_; }
  PyObject* at(size_t i) const { return n_ <= kInlineRefs ? inline_[i] : spill_[i]; }

 private:
  static constexpr size_t kInlineRefs = 32;
  PyObject* inline_[kInlineRefs];
  std::vector<PyObject*> spill_;
  size_t n_ = 0;
};

bool sign_sequence(Walk& w, PyObject* list, Tag tag, int depth) {  // list: exactly a list
  Snapshot items;
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(list); ++i) items.take(PyList_GET_ITEM(list, i));
  w.word(tag);
  w.word(static_cast<uint64_t>(items.size()));
  for (size_t i = 0; i < items.size(); ++i) {
    if (!sign(w, items.at(i), depth + 1)) return false;
  }
  return true;
}

// A dict's items, each key a string (kept as an extra) or its (class, value).
bool sign_mapping(Walk& w, PyObject* dict, Tag tag, int depth) {
  Snapshot items;  // key, value, key, value, ...
  Py_ssize_t pos = 0;
  PyObject *key, *value;
  while (PyDict_Next(dict, &pos, &key, &value)) {
    items.take(key);
    items.take(value);
  }
  w.word(tag);
  w.word(static_cast<uint64_t>(items.size() / 2));
  for (size_t i = 0; i < items.size(); i += 2) {
    PyObject* k = items.at(i);
    if (PyUnicode_CheckExact(k)) {
      w.word(kStr);
      w.extra(k);
    } else {
      PyObject* pair = PyTuple_Pack(2, reinterpret_cast<PyObject*>(Py_TYPE(k)), k);
      if (pair == nullptr) return false;
      w.word(kKey);
      w.extra(pair);
      Py_DECREF(pair);
    }
    if (!sign(w, items.at(i + 1), depth + 1)) return false;
  }
  return true;
}

// classify's (kind, slots, has_dict) with each slot that is a plain object member turned into its
// offset (an int, read directly); any other slot stays a name, read with getattr.
PyObject* compile_slots(PyObject* made) {
  PyObject* slots = PyTuple_GET_ITEM(made, 1);
  if (slots == Py_None) {
    Py_INCREF(made);
    return made;
  }
  const Py_ssize_t n = PyTuple_GET_SIZE(slots);
  PyObject* how = PyTuple_New(n);
  if (how == nullptr) return nullptr;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* slot = PyTuple_GET_ITEM(slots, i);  // (name, the descriptor attribute access finds)
    if (!PyTuple_Check(slot) || PyTuple_GET_SIZE(slot) != 2 || !PyUnicode_Check(PyTuple_GET_ITEM(slot, 0))) {
      Py_DECREF(how);
      PyErr_SetString(PyExc_TypeError, "kv-canary: classify's slots must be (name, descriptor) pairs");
      return nullptr;
    }
    PyObject* descriptor = PyTuple_GET_ITEM(slot, 1);
    PyObject* item;
    if (Py_TYPE(descriptor) == &PyMemberDescr_Type &&
        reinterpret_cast<PyMemberDescrObject*>(descriptor)->d_member->type == T_OBJECT_EX) {
      item = PyLong_FromSsize_t(reinterpret_cast<PyMemberDescrObject*>(descriptor)->d_member->offset);
    } else {
      item = PyTuple_GET_ITEM(slot, 0);
      Py_INCREF(item);
    }
    if (item == nullptr) {
      Py_DECREF(how);
      return nullptr;
    }
    PyTuple_SET_ITEM(how, i, item);
  }
  PyObject* spec = PyTuple_Pack(3, PyTuple_GET_ITEM(made, 0), how, PyTuple_GET_ITEM(made, 2));
  Py_DECREF(how);
  return spec;
}

PyObject* kind_of(PyObject* cls) {  // borrowed
  PyObject* kind = PyDict_GetItemWithError(g_kinds, cls);
  if (kind != nullptr || PyErr_Occurred()) return kind;
  PyObject* made = PyObject_CallOneArg(g_classify, cls);
  if (made == nullptr) return nullptr;
  if (!PyTuple_Check(made) || PyTuple_GET_SIZE(made) != 3 || !PyLong_Check(PyTuple_GET_ITEM(made, 0)) ||
      !(PyTuple_GET_ITEM(made, 1) == Py_None || PyTuple_Check(PyTuple_GET_ITEM(made, 1)))) {
    Py_DECREF(made);
    PyErr_SetString(PyExc_TypeError, "kv-canary: classify(cls) must return (kind, slots or None, has_dict)");
    return nullptr;
  }
  PyObject* spec = compile_slots(made);
  Py_DECREF(made);
  if (spec == nullptr) return nullptr;
  int stored = PyDict_SetItem(g_kinds, cls, spec);
  Py_DECREF(spec);
  return stored == 0 ? PyDict_GetItemWithError(g_kinds, cls) : nullptr;
}

bool sign_object(Walk& w, PyObject* value, PyObject* kind, int depth) {
  PyObject* cls = reinterpret_cast<PyObject*>(Py_TYPE(value));
  const long how = PyLong_AsLong(PyTuple_GET_ITEM(kind, 0));
  if (how == kKindPython) return sign_python(w, value);
  if (how == kKindMember) return w.word(kMember), w.word(reinterpret_cast<uintptr_t>(value)), w.extra(cls);
  w.word(how == kKindByValue ? kByValue : kObject);
  if (!w.extra(cls)) return false;
  if (how == kKindByValue) return w.extra(value);
  PyObject* slots = PyTuple_GET_ITEM(kind, 1);
  if (slots != Py_None) {
    const Py_ssize_t n = PyTuple_GET_SIZE(slots);
    w.word(static_cast<uint64_t>(n));
    for (Py_ssize_t i = 0; i < n; ++i) {
      PyObject* how = PyTuple_GET_ITEM(slots, i);
      PyObject* item;
      if (PyLong_CheckExact(how)) {  // a member's offset within this exact class's instances
        item = *reinterpret_cast<PyObject**>(reinterpret_cast<char*>(value) + PyLong_AsSsize_t(how));
        if (item == nullptr) {  // unset slot: the launch runs uncached and the validator names it
          PyErr_Format(PyExc_AttributeError, "kv-canary: a slot of this %s is not set", Py_TYPE(value)->tp_name);
          return false;
        }
        Py_INCREF(item);  // held while Python code run for nested values could rebind the slot
      } else {
        item = PyObject_GetAttr(value, how);
        if (item == nullptr) return false;
      }
      bool ok = sign(w, item, depth + 1);
      Py_DECREF(item);
      if (!ok) return false;
    }
  }
  if (PyObject_IsTrue(PyTuple_GET_ITEM(kind, 2))) {
    PyObject* attrs = PyObject_GetAttr(value, g_dict);
    if (attrs == nullptr) return false;
    bool ok = PyDict_Check(attrs) && sign_mapping(w, attrs, kInstanceDict, depth);
    if (!PyDict_Check(attrs)) PyErr_SetString(PyExc_TypeError, "kv-canary: __dict__ is not a dict");
    Py_DECREF(attrs);
    return ok;
  }
  return true;
}

bool sign(Walk& w, PyObject* value, int depth) {
  if (depth > kMaxDepth) {
    PyErr_SetString(PyExc_RecursionError, "kv-canary: a launch argument nests too deep to sign");
    return false;
  }
  PyTypeObject* type = Py_TYPE(value);
  if (reinterpret_cast<PyObject*>(type) == g_tensor_type) {
    return sign_tensor(w, value) || (!PyErr_Occurred() && sign_python(w, value));
  }
  if (value == Py_None) return w.word(kNone), true;
  if (value == Py_True) return w.word(kTrue), true;
  if (value == Py_False) return w.word(kFalse), true;
  if (type == &PyLong_Type) {
    int overflow = 0;
    const long long v = PyLong_AsLongLongAndOverflow(value, &overflow);
    if (v == -1 && PyErr_Occurred()) return false;
    if (overflow == 0) return w.word(kInt), w.word(static_cast<uint64_t>(v)), true;
    return w.word(kBigInt), w.extra(value);
  }
  if (type == &PyUnicode_Type) return w.word(kStr), w.extra(value);
  if (type == &PyFloat_Type) return w.word(kFloat), w.extra(value);
  if (type == &PyTuple_Type) return w.word(kTuple), sign_items(w, value, depth);
  if (type == &PyList_Type) return sign_sequence(w, value, kList, depth);
  if (type == &PyDict_Type) return sign_mapping(w, value, kDict, depth);
  PyObject* kind = kind_of(reinterpret_cast<PyObject*>(type));
  return kind != nullptr && sign_object(w, value, kind, depth);
}

// -- the Signature type ----------------------------------------------------------------------------
struct Signature {
  PyObject_VAR_HEAD
  Py_hash_t hash;
  PyObject* extras;  // a tuple
  uint64_t words[1];
};

void signature_dealloc(PyObject* self) {
  Py_XDECREF(reinterpret_cast<Signature*>(self)->extras);
  Py_TYPE(self)->tp_free(self);
}

Py_hash_t signature_hash(PyObject* self) { return reinterpret_cast<Signature*>(self)->hash; }

PyObject* signature_richcompare(PyObject* a, PyObject* b, int op);

PyObject* signature_repr(PyObject* self) {
  auto* sig = reinterpret_cast<Signature*>(self);
  return PyUnicode_FromFormat("<kv-canary signature: %zd words, %zd extras>", Py_SIZE(self),
                              PyTuple_GET_SIZE(sig->extras));
}

PyTypeObject SignatureType = {PyVarObject_HEAD_INIT(nullptr, 0)};

PyObject* signature_richcompare(PyObject* a, PyObject* b, int op) {
  if ((op != Py_EQ && op != Py_NE) || Py_TYPE(b) != &SignatureType) Py_RETURN_NOTIMPLEMENTED;
  auto* x = reinterpret_cast<Signature*>(a);
  auto* y = reinterpret_cast<Signature*>(b);
  int equal = x->hash == y->hash && Py_SIZE(a) == Py_SIZE(b) &&
              std::memcmp(x->words, y->words, static_cast<size_t>(Py_SIZE(a)) * sizeof(uint64_t)) == 0;
  if (equal) {
    equal = PyObject_RichCompareBool(x->extras, y->extras, Py_EQ);
    if (equal < 0) return nullptr;
  }
  return PyBool_FromLong(op == Py_EQ ? equal : !equal);
}

// A 64-bit hash of the words: four independent lanes of xxHash64's round (so the multiplies overlap),
// folded and finished with splitmix64's mixer, then combined with the extras' hash.
constexpr uint64_t kP1 = 0x9E3779B185EBCA87ULL, kP2 = 0xC2B2AE3D27D4EB4FULL;
inline uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
inline uint64_t round64(uint64_t lane, uint64_t word) { return rotl(lane + word * kP2, 31) * kP1; }

Py_hash_t hash_of(const uint64_t* words, size_t n, Py_hash_t extras_hash) {
  uint64_t lane[4] = {kP1 + kP2, kP2, 0, 0 - kP1};
  size_t i = 0;
  for (; i + 4 <= n; i += 4) {
    for (int k = 0; k < 4; ++k) lane[k] = round64(lane[k], words[i + k]);
  }
  for (; i < n; ++i) lane[i % 4] = round64(lane[i % 4], words[i]);
  uint64_t h = rotl(lane[0], 1) + rotl(lane[1], 7) + rotl(lane[2], 12) + rotl(lane[3], 18);
  h ^= n + static_cast<uint64_t>(extras_hash) * kP1;
  h = (h ^ (h >> 30)) * 0xbf58476d1ce4e5b9ULL;
  h = (h ^ (h >> 27)) * 0x94d049bb133111ebULL;
  h ^= h >> 31;
  auto out = static_cast<Py_hash_t>(h);
  return out == -1 ? -2 : out;  // -1 means an error to CPython
}

PyObject* signature_of(PyObject* value, uint64_t pointer_mask) {
  if (g_tensor_type == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "kv-canary: the native signer is not configured");
    return nullptr;
  }
  Walk w;
  w.pointer_mask = pointer_mask;
  w.extras.reserve(32);
  if (!sign(w, value, 0)) return nullptr;
  PyObject* extras = PyTuple_New(static_cast<Py_ssize_t>(w.extras.size()));
  if (extras == nullptr) return nullptr;
  for (size_t i = 0; i < w.extras.size(); ++i) PyTuple_SET_ITEM(extras, static_cast<Py_ssize_t>(i), w.extras[i]);
  w.extras.clear();  // the tuple owns them now
  const Py_hash_t extras_hash = PyObject_Hash(extras);  // an unhashable extra: the launch runs uncached
  if (extras_hash == -1) {
    Py_DECREF(extras);
    return nullptr;
  }
  auto* sig = PyObject_NewVar(Signature, &SignatureType, static_cast<Py_ssize_t>(w.n));
  if (sig == nullptr) {
    Py_DECREF(extras);
    return nullptr;
  }
  std::memcpy(sig->words, w.data(), w.n * sizeof(uint64_t));
  sig->extras = extras;
  sig->hash = hash_of(sig->words, w.n, extras_hash);
  return reinterpret_cast<PyObject*>(sig);
}

PyObject* py_sign(PyObject*, PyObject* value) { return signature_of(value, ~0ULL); }

PyObject* py_sign_shape(PyObject*, PyObject* args) {
  PyObject* value;
  unsigned long long pointer_class_bytes;
  if (!PyArg_ParseTuple(args, "OK", &value, &pointer_class_bytes)) return nullptr;
  if (pointer_class_bytes == 0 || (pointer_class_bytes & (pointer_class_bytes - 1)) != 0) {
    PyErr_Format(PyExc_ValueError, "kv-canary: pointer_class_bytes must be a power of two, got %llu",
                 pointer_class_bytes);
    return nullptr;
  }
  return signature_of(value, pointer_class_bytes - 1);
}

// (data pointer, device type, device index, sizes, strides) as this module reads them, for the
// loader's self-check against torch's Python accessors.
PyObject* py_tensor_fields(PyObject*, PyObject* value) {
  if (g_tensor_type == nullptr || reinterpret_cast<PyObject*>(Py_TYPE(value)) != g_tensor_type) {
    PyErr_SetString(PyExc_TypeError, "kv-canary: tensor_fields takes a torch.Tensor (after configure)");
    return nullptr;
  }
  Walk w;
  if (!sign_tensor(w, value)) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "kv-canary: the tensor's accessors refused");
    return nullptr;
  }
  const uint64_t* words = w.data();
  const int64_t dim = static_cast<int64_t>(words[0] >> 40);
  PyObject* sizes = PyTuple_New(dim);
  PyObject* strides = PyTuple_New(dim);
  if (sizes == nullptr || strides == nullptr) {
    Py_XDECREF(sizes);
    Py_XDECREF(strides);
    return nullptr;
  }
  for (int64_t i = 0; i < dim; ++i) {
    PyTuple_SET_ITEM(sizes, i, PyLong_FromLongLong(static_cast<int64_t>(words[2 + i])));
    PyTuple_SET_ITEM(strides, i, PyLong_FromLongLong(static_cast<int64_t>(words[2 + dim + i])));
  }
  return Py_BuildValue("(KiiNN)", static_cast<unsigned long long>(words[1]), static_cast<int>((words[0] >> 16) & 0xff),
                       static_cast<int>((words[0] >> 24) & 0xffff) - 1, sizes, strides);
}

// The TensorImpl address this module reads from a tensor (the loader compares it with `_cdata`).
PyObject* py_impl_address(PyObject*, PyObject* value) {
  if (g_tensor_type == nullptr || reinterpret_cast<PyObject*>(Py_TYPE(value)) != g_tensor_type) {
    PyErr_SetString(PyExc_TypeError, "kv-canary: impl_address takes a torch.Tensor (after configure)");
    return nullptr;
  }
  c10::TensorImpl* impl = impl_of(value);
  return impl == nullptr && PyErr_Occurred() ? nullptr : PyLong_FromVoidPtr(impl);
}

PyObject* py_configure(PyObject*, PyObject* args) {
  PyObject *tensor_type, *classify, *fallback;
  if (!PyArg_ParseTuple(args, "OOO", &tensor_type, &classify, &fallback)) return nullptr;
  if (!PyType_Check(tensor_type) || !PyCallable_Check(classify) || !PyCallable_Check(fallback)) {
    PyErr_SetString(PyExc_TypeError, "kv-canary: configure(tensor_type, classify, fallback)");
    return nullptr;
  }
  PyObject* kinds = PyDict_New();
  if (kinds == nullptr) return nullptr;
  Py_INCREF(tensor_type);
  Py_INCREF(classify);
  Py_INCREF(fallback);
  Py_XSETREF(g_tensor_type, tensor_type);
  Py_XSETREF(g_classify, classify);
  Py_XSETREF(g_fallback, fallback);
  Py_XSETREF(g_kinds, kinds);
  Py_RETURN_NONE;
}

PyMethodDef kMethods[] = {
    {"sign", py_sign, METH_O, "The signature of a value (kv_canary/signature.py)."},
    {"sign_shape", py_sign_shape, METH_VARARGS,
     "sign_shape(value, pointer_class_bytes): the signature with data pointers by class (see signing.cpp)."},
    {"tensor_fields", py_tensor_fields, METH_O, "(data_ptr, device type, device index, sizes, strides) as read here."},
    {"impl_address", py_impl_address, METH_O, "The TensorImpl address read from a tensor."},
    {"configure", py_configure, METH_VARARGS, "configure(torch.Tensor, classify, fallback)"},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_signing", "kv-canary's native launch signer.", -1, kMethods};

}  // namespace

PyMODINIT_FUNC PyInit__signing() {
  g_cdata = PyUnicode_InternFromString("_cdata");
  g_dict = PyUnicode_InternFromString("__dict__");
  if (g_cdata == nullptr || g_dict == nullptr) return nullptr;
  SignatureType.tp_name = "kv_canary._signing.Signature";
  SignatureType.tp_doc = "A launch argument's signature (kv_canary/signature.py); compare and hash only.";
  SignatureType.tp_basicsize = offsetof(Signature, words);
  SignatureType.tp_itemsize = sizeof(uint64_t);
  SignatureType.tp_flags = Py_TPFLAGS_DEFAULT;
  SignatureType.tp_dealloc = signature_dealloc;
  SignatureType.tp_hash = signature_hash;
  SignatureType.tp_richcompare = signature_richcompare;
  SignatureType.tp_repr = signature_repr;
  if (PyType_Ready(&SignatureType) < 0) return nullptr;
  PyObject* module = PyModule_Create(&kModule);
  if (module == nullptr) return nullptr;
  Py_INCREF(&SignatureType);
  if (PyModule_AddObject(module, "Signature", reinterpret_cast<PyObject*>(&SignatureType)) < 0) {
    Py_DECREF(&SignatureType);
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}
