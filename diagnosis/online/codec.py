"""A data-only form of the engine's dynamic state: what a checkpoint holds, with no pickle anywhere.

A checkpoint is read back from a Kafka topic, so whoever can write that topic
chooses its bytes. Pickle runs code named by those bytes; this codec only ever
builds plain data and instances of an explicit list of faultlens classes, and
it never imports a module or calls anything a document names.

``encode(value) -> builtins`` (maps, arrays, strings, numbers: what MessagePack
and JSON hold) and ``decode(doc) -> value`` are exact inverses over what the
engine's dynamic parts hold (tests/test_diag_state.py round-trips a busy engine).
The checkpoint writes the builtins as MessagePack (msgspec), which keeps NaN and
Infinity (a NaN loss is state the NaN-loss diagnosis needs):

=====================  =====================================================
value                  form
=====================  =====================================================
None, bool, str, int   as they are (an int beyond 64 bits: ``{"$i": "123"}``)
float                  as it is (NaN and Infinity included)
list / tuple           ``{"$l": [...]}`` / ``{"$t": [...]}``
set / frozenset        ``{"$s": [...]}`` / ``{"$fs": [...]}``
deque                  ``{"$q": [...], "max": maxlen}``
dict / defaultdict     ``{"$m": [[key, value], ...]}`` / ``{"$dd": ..., "f": "list"}``
bytes                  ``{"$b": base64}``
numpy array            ``{"$nd": base64, "dtype": "<f8", "shape": [..]}`` (dtypes allowed below)
numpy Generator        ``{"$rng": bit generator state}`` (PCG64 only)
a faultlens object     ``{"$o": "module:Class", "f": {attribute: value}}`` (classes in ``MODULES``)
a record (msgspec)     ``{"$st": "module:Class", "v": its fields as builtins}`` (read back by msgspec,
                       typed and checked)
=====================  =====================================================

Every mutable value carries ``"#": n`` the first time it appears and is
``{"$ref": n}`` after, so shared objects stay shared (an incident that the book
holds by id and by key is one object after a restore, as before the checkpoint).
A document this codec did not write fails with ``CodecError``: the caller starts
that job afresh.
"""

from __future__ import annotations

import base64
import collections
import dataclasses
import itertools
import math
import sys
from typing import Any

import msgspec
import numpy as np

from faultlens.errors import FaultlensError

# The modules whose classes a checkpoint may hold. Only these (and only when already imported:
# the codec imports nothing a document names) are ever instantiated on decode. A new part of
# the engine's dynamic state in another module adds its module here; the round-trip test fails
# until it does.
MODULES = frozenset({
    "faultlens.config", "faultlens.records", "faultlens.collectors.signatures", "faultlens.vocabulary",
    "faultlens.decode", "faultlens.gpu_wire", "faultlens.schema", "faultlens.stream.topology",
    "faultlens.diagnosis.decision",
    "faultlens.diagnosis.bursts", "faultlens.diagnosis.engine", "faultlens.diagnosis.exceptions",
    "faultlens.diagnosis.guard", "faultlens.diagnosis.incidents", "faultlens.diagnosis.inhibit",
    "faultlens.diagnosis.jobwide", "faultlens.diagnosis.modes", "faultlens.diagnosis.nanloss",
    "faultlens.diagnosis.notes", "faultlens.diagnosis.policy", "faultlens.diagnosis.progress",
    "faultlens.diagnosis.remedy", "faultlens.diagnosis.rules", "faultlens.diagnosis.stacks",
    "faultlens.diagnosis.topology", "faultlens.diagnosis.classify",
    "faultlens.models.failslow", "faultlens.models.peer", "faultlens.models.predictor",
    "faultlens.models.params",
})
# Classes that moved to another module since a checkpoint may have been written: an old
# "module" or "module:Class" -> where it is now, so a new build restores its predecessor's jobs.
MOVED = {
    "faultlens.stream.schema": "faultlens.schema",
    "faultlens.stream.decode": "faultlens.gpu_wire",
    "faultlens.signatures": "faultlens.collectors.signatures",
    "faultlens.diagnosis.policy:Decision": "faultlens.diagnosis.decision:Decision",
    "faultlens.diagnosis.policy:Hold": "faultlens.diagnosis.decision:Hold",
}
DTYPES = frozenset({"<f8", "<f4", "<i8", "<i4", "|b1", "|u1", "<u8", "<u4"})
FACTORIES: dict[str, Any] = {"list": list, "set": set, "dict": dict, "int": int, "float": float}
_INT64 = 1 << 63
_PLAIN = frozenset({str, int, float, bool, type(None)})


def _plain(seq: Any) -> bool:
    """Only strings, 64-bit integers, floats, booleans and None: written as they are, in one go."""
    for x in seq:
        t = type(x)
        if t not in _PLAIN or (t is int and not -_INT64 <= x < _INT64):
            return False
    return True


def _records_by_plain_tuple(o: dict[Any, Any]) -> bool:
    """A non-empty map of plain tuples to frozen records of one of our classes, all of one class."""
    if not o:
        return False
    cls = type(next(iter(o.values())))
    return (issubclass(cls, msgspec.Struct) and cls.__struct_config__.frozen and cls.__module__ in MODULES
            and all(type(v) is cls for v in o.values()) and all(type(k) is tuple and _plain(k) for k in o))


class CodecError(FaultlensError):
    """A value the codec cannot write, or a document it did not write."""


def _name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _lookup(name: Any) -> type:
    """The class a document names, if it is one of ours; never imports anything."""
    if not isinstance(name, str) or ":" not in name:
        raise CodecError(f"not a class name: {name!r}")
    module, _, qualname = name.partition(":")
    if name in MOVED:
        module, _, qualname = MOVED[name].partition(":")
    elif module in MOVED:
        module = MOVED[module]
    if module not in MODULES:
        raise CodecError(f"class {name!r} is not one a checkpoint may hold")
    mod = sys.modules.get(module)
    if mod is None:
        raise CodecError(f"class {name!r}: its module is not loaded here")
    obj: Any = mod
    for part in qualname.split("."):
        if not part.isidentifier() or part.startswith("__"):
            raise CodecError(f"not a class name: {name!r}")
        obj = getattr(obj, part, None)
    if not isinstance(obj, type) or obj.__module__ != module:
        raise CodecError(f"{name!r} is not a class of {module}")
    return obj


_SLOTS: dict[type, list[str]] = {}


def _slots(cls: type) -> list[str]:
    known = _SLOTS.get(cls)
    if known is not None:
        return known
    out: list[str] = []
    for c in cls.__mro__:
        s = c.__dict__.get("__slots__", ())
        out.extend([s] if isinstance(s, str) else s)
    known = _SLOTS[cls] = [s for s in out if s not in ("__dict__", "__weakref__")]
    return known


class _Encoder:
    def __init__(self) -> None:
        self.memo: dict[int, int] = {}
        self.keep: list[Any] = []  # the objects numbered, alive until the end (ids stay unique)

    def number(self, o: Any) -> int:
        n = self.memo[id(o)] = len(self.memo)
        self.keep.append(o)
        return n

    def enc(self, o: Any, path: str) -> Any:  # noqa: C901 - one branch per form, see the table
        if o is None or o is True or o is False:
            return o
        t = type(o)
        if t is str:
            return o
        if t is int:
            return o if -_INT64 <= o < _INT64 else {"$i": str(o)}
        if t is float:
            return o
        if isinstance(o, str):  # a StrEnum: its value, as a plain str
            return str.__str__(o)
        if isinstance(o, (np.generic,)):
            return self.enc(o.item(), path)
        if isinstance(o, (int, float)):  # IntEnum and the like
            return self.enc(int(o) if isinstance(o, int) else float(o), path)
        # Immutable values (tuples, frozensets, records) are written where they stand: sharing
        # one is invisible. Mutable ones are numbered, so that two holders still share after a restore.
        if t is tuple:
            return {"$t": list(o) if _plain(o) else [self.enc(x, f"{path}[]") for x in o]}
        if t is frozenset:
            return {"$fs": list(o) if _plain(o) else [self.enc(x, f"{path}[]") for x in o]}
        if t is bytes:
            return {"$b": base64.b64encode(o).decode()}
        if isinstance(o, msgspec.Struct) and t.__struct_config__.frozen:
            if t.__module__ not in MODULES:
                raise CodecError(f"{path}: a {_name(t)} cannot be checkpointed")
            return {"$st": _name(t), "v": msgspec.to_builtins(o)}
        ref = self.memo.get(id(o))
        if ref is not None:
            return {"$ref": ref}
        n = self.number(o)
        if t is list or t is set or t is collections.deque:
            tag = "$l" if t is list else "$s" if t is set else "$q"
            out: dict[str, Any] = {tag: None, "#": n}
            if t is collections.deque:
                out["max"] = o.maxlen
            if _plain(o):
                out[tag] = list(o)
            elif all(type(x) is tuple and _plain(x) for x in o):  # rows: (ts, value) histories
                out[tag], out["rows"] = [list(x) for x in o], True
            else:
                out[tag] = [self.enc(x, f"{path}[]") for x in o]
            return out
        if t is dict or t is collections.defaultdict:
            if _plain(o) and _plain(o.values()):  # plain keys and values: as they are, in one go
                items = [[k, v] for k, v in o.items()]
            elif _records_by_plain_tuple(o):  # (node, GPU) -> the GPU's last entry: the same form, in one go
                name = _name(type(next(iter(o.values()))))
                items = [[{"$t": list(k)}, {"$st": name, "v": msgspec.to_builtins(v)}] for k, v in o.items()]
            else:
                items = [[self.enc(k, f"{path}{{}}"), self.enc(v, f"{path}{{}}")] for k, v in o.items()]
            if t is dict:
                return {"$m": items, "#": n}
            factory = next((k for k, f in FACTORIES.items() if f is o.default_factory), None)
            if factory is None:
                raise CodecError(f"{path}: a defaultdict of {o.default_factory!r} cannot be checkpointed")
            return {"$dd": items, "f": factory, "#": n}
        if isinstance(o, np.ndarray):
            arr = np.ascontiguousarray(o)
            if arr.dtype.str not in DTYPES:
                raise CodecError(f"{path}: an array of {arr.dtype} cannot be checkpointed")
            return {"$nd": base64.b64encode(arr.tobytes()).decode(), "dtype": arr.dtype.str, "shape": list(arr.shape),
                    "#": n}
        if isinstance(o, np.random.Generator):
            state = o.bit_generator.state
            if state.get("bit_generator") != "PCG64":
                raise CodecError(f"{path}: a {state.get('bit_generator')} generator cannot be checkpointed")
            return {"$rng": self.enc(state, path), "#": n}
        if t.__module__ not in MODULES:
            raise CodecError(f"{path}: a {_name(t)} cannot be checkpointed (add its module to codec.MODULES "
                             "if it is plain data)")
        if isinstance(o, msgspec.Struct):  # a mutable record
            return {"$st": _name(t), "v": msgspec.to_builtins(o), "#": n}
        fields = dict(vars(o)) if hasattr(o, "__dict__") else {}
        for s in _slots(t):
            if hasattr(o, s):
                fields[s] = getattr(o, s)
        return {"$o": _name(t), "f": {k: self.enc(v, f"{path}.{k}") for k, v in fields.items()}, "#": n}


def encode(value: Any, path: str = "state") -> Any:
    """``value`` as JSON-ready builtins (see the module docstring); CodecError names what cannot be."""
    return _Encoder().enc(value, path)


class _Decoder:
    def __init__(self) -> None:
        self.memo: dict[int, Any] = {}

    def put(self, doc: dict[str, Any], value: Any) -> Any:
        n = doc.get("#")
        if n is not None:
            if type(n) is not int or n in self.memo:
                raise CodecError(f"bad object number {n!r}")
            self.memo[n] = value
        return value

    def seq(self, doc: dict[str, Any], tag: str) -> list[Any]:
        items = doc[tag]
        if not isinstance(items, list):
            raise CodecError(f"{tag} holds no list")
        if doc.get("rows"):  # plain tuples, written as lists
            if not all(isinstance(x, list) for x in items):
                raise CodecError(f"{tag}: rows that are not lists")
            return [{"$t": x} for x in items]
        return items

    def items(self, doc: dict[str, Any], tag: str) -> list[Any]:
        """A sequence's values. Plain values and plain rows (most of a job's state: (ts, value)
        histories) are taken as they are, without a call per value: a restore moving a partition's
        jobs spent ~85% of its time here (14 ms for one 8-node job)."""
        items = doc[tag]
        if not isinstance(items, list):
            raise CodecError(f"{tag} holds no list")
        if doc.get("rows"):  # plain tuples, written as lists
            if items and set(map(type, items)) != {list}:
                raise CodecError(f"{tag}: rows that are not lists")
            if set(map(type, itertools.chain.from_iterable(items))) <= _PLAIN:
                return list(map(tuple, items))
            return [tuple(self.dec(v) for v in x) for x in items]
        if set(map(type, items)) <= _PLAIN:
            return items
        return [self.dec(x) for x in items]

    def dec(self, d: Any) -> Any:  # noqa: C901 - one branch per form, see the table
        if d is None or isinstance(d, (bool, str, int, float)):
            return d
        if isinstance(d, list):
            raise CodecError("a bare list is not in this codec's form")
        if not isinstance(d, dict):
            raise CodecError(f"unexpected {type(d).__name__}")
        if "$ref" in d:
            try:
                return self.memo[d["$ref"]]
            except (KeyError, TypeError):
                raise CodecError(f"reference to an unknown object {d['$ref']!r}") from None
        if "$i" in d:
            return int(str(d["$i"]))
        if "$F" in d:
            if d["$F"] not in ("nan", "inf", "-inf"):
                raise CodecError(f"not a float: {d['$F']!r}")
            return float(d["$F"])
        if "$b" in d:
            return base64.b64decode(str(d["$b"]), validate=True)
        if "$l" in d:
            out: list[Any] = self.put(d, [])
            out.extend(self.items(d, "$l"))
            return out
        if "$t" in d:
            return self.put(d, tuple(self.dec(x) for x in self.seq(d, "$t")))
        if "$s" in d:
            s: set[Any] = self.put(d, set())
            s.update(self.items(d, "$s"))
            return s
        if "$fs" in d:
            return self.put(d, frozenset(self.dec(x) for x in self.seq(d, "$fs")))
        if "$q" in d:
            maxlen = d.get("max")
            if maxlen is not None and (type(maxlen) is not int or maxlen < 0):
                raise CodecError(f"bad deque length {maxlen!r}")
            q: collections.deque[Any] = self.put(d, collections.deque(maxlen=maxlen))
            q.extend(self.items(d, "$q"))
            return q
        if "$m" in d or "$dd" in d:
            tag = "$m" if "$m" in d else "$dd"
            if tag == "$dd":
                factory = FACTORIES.get(d.get("f"))  # type: ignore[arg-type]
                if factory is None:
                    raise CodecError(f"not a defaultdict factory: {d.get('f')!r}")
                m: dict[Any, Any] = self.put(d, collections.defaultdict(factory))
            else:
                m = self.put(d, {})
            for pair in self.seq(d, tag):
                if not isinstance(pair, list) or len(pair) != 2:
                    raise CodecError("a map item is no [key, value] pair")
                key = self.dec(pair[0])  # the key first, as written (``m[k] = v`` evaluates v first)
                m[key] = self.dec(pair[1])
            return m
        if "$nd" in d:
            dtype, shape = d.get("dtype"), d.get("shape")
            if dtype not in DTYPES or not isinstance(shape, list) or not all(type(x) is int and x >= 0 for x in shape):
                raise CodecError(f"bad array dtype {dtype!r} or shape {shape!r}")
            raw = base64.b64decode(str(d["$nd"]), validate=True)
            arr = np.frombuffer(raw, dtype=np.dtype(dtype))
            if arr.size != math.prod(shape):
                raise CodecError(f"array of {arr.size} values is not of shape {shape}")
            return self.put(d, arr.reshape(shape).copy())
        if "$rng" in d:
            state = self.dec(d["$rng"])
            if not isinstance(state, dict) or state.get("bit_generator") != "PCG64":
                raise CodecError("only a PCG64 generator can be restored")
            gen = np.random.Generator(np.random.PCG64())
            try:
                gen.bit_generator.state = state
            except (TypeError, ValueError, KeyError) as exc:
                raise CodecError(f"bad generator state: {exc}") from None
            return self.put(d, gen)
        if "$st" in d:
            cls = _lookup(d["$st"])
            if not issubclass(cls, msgspec.Struct):
                raise CodecError(f"{d['$st']} is not a record")
            try:
                return self.put(d, msgspec.convert(d.get("v"), cls))
            except (TypeError, ValueError, msgspec.ValidationError) as exc:
                raise CodecError(f"{d['$st']}: {exc}") from None
        if "$o" in d:
            cls = _lookup(d["$o"])
            if issubclass(cls, (msgspec.Struct, BaseException)):
                raise CodecError(f"{d['$o']} is not a plain object")
            obj = self.put(d, cls.__new__(cls))
            slots = set(_slots(cls))
            for k, v in self.fields(d).items():
                if not k.isidentifier() or k.startswith("__"):
                    raise CodecError(f"{d['$o']}: bad attribute name {k!r}")
                if k in slots or dataclasses.is_dataclass(cls):
                    object.__setattr__(obj, k, v)  # frozen dataclasses and slots alike
                elif hasattr(obj, "__dict__"):
                    obj.__dict__[k] = v
                else:
                    raise CodecError(f"{d['$o']} has no attribute {k!r}")
            return obj
        raise CodecError(f"unknown form with keys {sorted(d)[:5]}")

    def fields(self, d: dict[str, Any]) -> dict[str, Any]:
        f = d.get("f")
        if not isinstance(f, dict):
            raise CodecError("an object without fields")
        return {str(k): self.dec(v) for k, v in f.items()}


def decode(doc: Any) -> Any:
    """The value a document from ``encode`` stands for; CodecError when it is not one."""
    try:
        return _Decoder().dec(doc)
    except CodecError:
        raise
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError, OverflowError) as exc:
        raise CodecError(f"unreadable state: {exc!r}") from None
