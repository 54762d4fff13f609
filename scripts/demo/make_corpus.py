"""Build the demo model's training corpus from CPython standard-library docstrings.

Everything comes from the running interpreter's own standard library (``inspect`` over a fixed
list of modules), so the corpus needs no download and inherits the PSF licence of CPython's
docstrings. The output is deterministic for a given CPython version and ``--seed``.

Documents (one JSON object per line):

* chat: ``{"messages": [...]}`` in OpenAI/Qwen form (``role``/``content``; an assistant turn may
  carry ``reasoning_content``, rendered by the chat template as a ``<think>`` block), e.g.
  "What does `json.dumps` do?" -> first paragraph of the docstring; "Which module provides
  `dumps`?"; "What is the signature of ...?"; "What does the `json` module do?"; ...
* text: ``{"text": "..."}``: plain docstring text ("json.dumps(obj, *, ...)\\n\\n<docstring>").

Split: a fixed fraction of the documented objects (chosen by a seeded hash of the qualified
name) is held out entirely: every document about them goes to ``test.jsonl`` and nothing about
them is in ``train.jsonl``. Module-level documents are always in train.

    python scripts/demo/make_corpus.py --out build/demo/corpus --seed 0
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import inspect
import io
import json
import random
import re
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

# Top-level modules first, then public submodules. Deprecated / platform-only / side-effect
# modules (antigravity, this, tkinter, turtle, idlelib, lib2to3, distutils, msvcrt, ...) are out.
MODULES = [
    "builtins", "abc", "argparse", "array", "ast", "asyncio", "atexit", "base64", "bdb",
    "binascii", "bisect", "bz2", "calendar", "cmath", "cmd", "code", "codecs", "codeop",
    "collections", "colorsys", "compileall", "configparser", "contextlib", "contextvars", "copy",
    "copyreg", "csv", "ctypes", "dataclasses", "datetime", "dbm", "decimal", "difflib", "dis",
    "doctest", "enum", "errno", "faulthandler", "filecmp", "fileinput", "fnmatch", "fractions",
    "ftplib", "functools", "gc", "getopt", "getpass", "gettext", "glob", "graphlib", "gzip",
    "hashlib", "heapq", "hmac", "html", "imaplib", "importlib", "inspect", "io", "ipaddress",
    "itertools", "json", "keyword", "linecache", "locale", "logging", "lzma", "mailbox",
    "marshal", "math", "mimetypes", "mmap", "modulefinder", "netrc", "numbers", "operator",
    "optparse", "os", "pathlib", "pdb", "pickle", "pickletools", "pkgutil", "platform",
    "plistlib", "poplib", "pprint", "profile", "pstats", "py_compile", "pyclbr", "pydoc",
    "queue", "quopri", "random", "re", "reprlib", "rlcompleter", "runpy", "sched", "secrets",
    "select", "selectors", "shelve", "shlex", "shutil", "signal", "smtplib", "socket",
    "socketserver", "sqlite3", "ssl", "stat", "statistics", "string", "stringprep", "struct",
    "subprocess", "symtable", "sys", "sysconfig", "tabnanny", "tarfile", "tempfile",
    "textwrap", "threading", "time", "timeit", "token", "tokenize", "tomllib", "trace",
    "traceback", "tracemalloc", "types", "typing", "unicodedata", "unittest", "uuid", "warnings",
    "wave", "weakref", "webbrowser", "zipapp", "zipfile", "zipimport", "zlib", "zoneinfo",
    # submodules
    "os.path", "collections.abc", "concurrent.futures", "email.message", "email.utils",
    "email.parser", "email.header", "html.parser", "http.client", "http.server",
    "http.cookies", "http.cookiejar", "importlib.metadata", "importlib.resources",
    "importlib.util", "importlib.abc", "json.decoder", "json.encoder", "logging.handlers",
    "logging.config", "multiprocessing", "multiprocessing.pool", "unittest.mock",
    "urllib.parse", "urllib.request", "urllib.error", "urllib.robotparser",
    "xml.etree.ElementTree", "xml.dom.minidom", "xml.sax", "xml.sax.saxutils",
    "xmlrpc.client", "xmlrpc.server", "wsgiref.simple_server", "wsgiref.util", "ctypes.util",
    "email.mime.text", "sqlite3.dbapi2",
]

MAX_ANSWER_CHARS = 700
MAX_TEXT_CHARS = 1800
MAX_DUP_DOC = 3  # docstrings shared by more objects than this are generic: dropped
_SIG_LINE = re.compile(r"^[A-Za-z_][\w.]*\(.*\)(\s*->\s*.*)?$")


@dataclass
class Item:
    """One documented object."""

    module: str          # public module it is taken from ("builtins" for built-ins)
    name: str            # short name ("dumps", "split")
    display: str         # how questions spell it ("json.dumps", "str.split", "len")
    kind: str            # "function", "class", "method", "exception"
    owner: str | None    # class display name for methods
    signature: str | None
    doc: str             # cleaned docstring (signature line removed)
    first: str           # first paragraph, trimmed


def _clean(doc: str, name: str) -> tuple[str, str | None]:
    """-> (docstring without a leading C-style signature paragraph, that signature or None)."""
    doc = inspect.cleandoc(doc).strip()
    paras = doc.split("\n\n")
    sig = None
    head = [ln.strip() for ln in paras[0].strip().splitlines()]
    if (len(paras) > 1 and all(_SIG_LINE.match(ln) for ln in head)
            and name in head[0].split("(")[0]):
        sig = head[0]  # "int([x]) -> integer\nint(x, base=10) -> integer": keep the first form
        doc = "\n\n".join(paras[1:]).strip()
    elif "\n--\n" in doc:  # argument-clinic leftovers
        doc = doc.split("\n--\n", 1)[1].strip()
    return doc, sig


def _first_paragraph(doc: str) -> str:
    para = doc.split("\n\n")[0].strip()
    para = re.sub(r"\s*\n\s*", " ", para)
    if len(para) > MAX_ANSWER_CHARS:
        cut = para[:MAX_ANSWER_CHARS]
        dot = cut.rfind(". ")
        para = cut[: dot + 1] if dot > MAX_ANSWER_CHARS // 3 else cut.rstrip() + " ..."
    return para


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _first_sentence(text: str) -> str:
    s = re.split(r"(?<=[.!?])\s+(?=[A-Z`(])", text, maxsplit=1)[0]
    return s if s.endswith((".", "!", "?")) else s + "."


def _signature(obj, fallback: str | None) -> str | None:
    try:
        # default values whose repr holds a memory address would make the corpus vary per run
        return _ADDRESS.sub("", str(inspect.signature(obj)))
    except (TypeError, ValueError):
        pass
    if fallback and "(" in fallback:
        return "(" + fallback.split("(", 1)[1]
    return None


def _kind(obj) -> str:
    if inspect.isclass(obj):
        return "exception" if issubclass(obj, BaseException) else "class"
    return "function"


def _import(name: str):
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        try:
            return importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a module missing from this build is simply skipped
            return None


def _public_names(mod, modname: str) -> list[str]:
    if modname == "builtins":
        return sorted(n for n in dir(mod) if not n.startswith("_"))
    names = getattr(mod, "__all__", None)
    if names is not None:
        return sorted({n for n in names if isinstance(n, str) and not n.startswith("_")})
    out = []
    for n in sorted(dir(mod)):
        if n.startswith("_"):
            continue
        obj = getattr(mod, n, None)
        owner = getattr(obj, "__module__", None)
        if owner == modname or (
            owner and modname == "os.path" and owner in ("posixpath", "genericpath")
        ):
            out.append(n)
    return out


def collect() -> tuple[list[Item], dict[str, str], dict[str, list[str]]]:
    """-> (items, module docstring first paragraphs, public names per module)."""
    items: list[Item] = []
    module_docs: dict[str, str] = {}
    module_names: dict[str, list[str]] = {}
    seen: set[int] = set()
    for modname in MODULES:
        mod = _import(modname)
        if mod is None:
            continue
        if modname != "builtins" and mod.__doc__:
            d, _ = _clean(mod.__doc__, modname)
            if len(d) > 30:
                module_docs[modname] = _first_paragraph(d)
        listed = []
        for n in _public_names(mod, modname):
            obj = getattr(mod, n, None)
            if obj is None or not (inspect.isclass(obj) or callable(obj)) or inspect.ismodule(obj):
                continue
            if id(obj) in seen:
                continue
            doc = getattr(obj, "__doc__", None)
            if not isinstance(doc, str) or len(doc.strip()) < 20:
                continue
            seen.add(id(obj))
            listed.append(n)
            display = n if modname == "builtins" else f"{modname}.{n}"
            d, sig_line = _clean(doc, n)
            if len(d) < 20:
                continue
            items.append(Item(modname, n, display, _kind(obj), None,
                              _signature(obj, sig_line), d, _first_paragraph(d)))
            if inspect.isclass(obj):
                for mname, member in obj.__dict__.items():
                    if mname.startswith("_"):
                        continue
                    if isinstance(member, (staticmethod, classmethod)):
                        member = member.__func__
                    if not callable(member) or inspect.isclass(member):
                        continue
                    mdoc = getattr(member, "__doc__", None)
                    if not isinstance(mdoc, str) or len(mdoc.strip()) < 20 or id(member) in seen:
                        continue
                    seen.add(id(member))
                    md, msig = _clean(mdoc, mname)
                    if len(md) < 20:
                        continue
                    items.append(Item(modname, mname, f"{display}.{mname}", "method", display,
                                      _signature(member, msig), md, _first_paragraph(md)))
        module_names[modname] = listed
    # generic docstrings ("Return repr(self).", inherited boilerplate) carry no information
    count: dict[str, int] = {}
    for it in items:
        count[it.first] = count.get(it.first, 0) + 1
    items = [it for it in items if count[it.first] <= MAX_DUP_DOC]
    return items, module_docs, module_names


# --- documents ---------------------------------------------------------------------------------

ASK_WHAT = [
    "What does `{x}` do?", "Explain `{x}`.", "What is `{x}` used for?", "Describe `{x}`.",
    "Can you tell me what `{x}` does?", "What is `{x}`?", "Briefly, what does `{x}` do?",
]
ASK_MODULE = [
    "Which module provides `{n}`?", "Where is `{n}` defined?", "What do I import to use `{n}`?",
    "In which standard library module is `{n}`?",
]
ASK_SIG = [
    "What is the signature of `{x}`?", "How do I call `{x}`?", "What arguments does `{x}` take?",
]
ASK_MOD_DOC = [
    "What does the `{m}` module do?", "What is the `{m}` module for?", "Describe the `{m}` module.",
]
ASK_MOD_LIST = [
    "List some functions and classes in `{m}`.", "What does `{m}` provide?",
    "Name a few things defined in the `{m}` module.",
]
KIND_WORD = {"function": "function", "class": "class", "method": "method",
             "exception": "exception"}


def _where(it: Item) -> str:
    if it.kind == "method":
        return f"a method of `{it.owner}`"
    if it.module == "builtins":
        return f"a built-in {KIND_WORD[it.kind]}"
    return f"a {KIND_WORD[it.kind]} in the `{it.module}` module"


def _call(it: Item) -> str:
    return f"{it.display}{it.signature}" if it.signature else it.display


def _thinking(it: Item, topic: str) -> str:
    return (f"The user asks about `{it.display}`, {_where(it)}. "
            f"I should give {topic} from its documentation.")


def _chat(user: str, answer: str, reasoning: str | None = None, system: str | None = None):
    msgs = []
    if system:
        msgs.append({"role": "system", "content": system})
    msgs.append({"role": "user", "content": user})
    a = {"role": "assistant", "content": answer}
    if reasoning is not None:
        a["reasoning_content"] = reasoning
    msgs.append(a)
    return {"messages": msgs}


SYSTEMS = [
    "You are a helpful assistant that knows the Python standard library.",
    "Answer questions about Python's standard library concisely.",
]


def documents_for(it: Item, unique_names: dict[str, int], rng: random.Random,
                  think_frac: float) -> list[dict]:
    docs = []

    def think(topic):
        return _thinking(it, topic) if rng.random() < think_frac else None

    def system():
        return rng.choice(SYSTEMS) if rng.random() < 0.15 else None

    # what does X do -> first paragraph (the main task)
    what_answer = it.first
    docs.append(_chat(rng.choice(ASK_WHAT).format(x=it.display), what_answer,
                      think("a short summary"), system()))
    # signature
    if it.signature:
        ans = f"`{_call(it)}`\n\n{_first_sentence(it.first)}"
        docs.append(_chat(rng.choice(ASK_SIG).format(x=it.display), ans,
                          think("the call signature"), system()))
    # which module (only for names that are unique across the corpus)
    if it.kind != "method" and unique_names.get(it.name, 0) == 1:
        if it.module == "builtins":
            ans = f"`{it.name}` is a built-in {KIND_WORD[it.kind]}; no import is needed."
        else:
            ans = (f"`{it.name}` is provided by the `{it.module}` module:\n\n"
                   f"```python\nfrom {it.module} import {it.name}\n```")
        docs.append(_chat(rng.choice(ASK_MODULE).format(n=it.name), ans, think("the module"),
                          system()))
    # a two-turn conversation now and then
    if it.signature and rng.random() < 0.2:
        msgs = [
            {"role": "user", "content": rng.choice(ASK_WHAT).format(x=it.display)},
            {"role": "assistant", "content": what_answer},
            {"role": "user", "content": rng.choice(ASK_SIG).format(x=it.display)},
            {"role": "assistant", "content": f"`{_call(it)}`"},
        ]
        docs.append({"messages": msgs})
    # plain docstring text
    text = f"{_call(it)}\n\n{it.doc}"
    if len(text) > MAX_TEXT_CHARS:
        text = text[:MAX_TEXT_CHARS].rsplit("\n", 1)[0]
    docs.append({"text": text})
    return docs


def module_documents(mod: str, first: str | None, names: list[str], rng: random.Random,
                     think_frac: float) -> list[dict]:
    docs = []
    if first:
        r = (f"The user asks about the `{mod}` module. I should summarise its documentation."
             if rng.random() < think_frac else None)
        docs.append(_chat(rng.choice(ASK_MOD_DOC).format(m=mod), first, r))
        docs.append({"text": f"Module {mod}\n\n{first}"})
    if len(names) >= 3:
        pick = sorted(rng.sample(names, min(12, len(names))))
        listed = ", ".join(f"`{n}`" for n in pick)
        ans = f"The `{mod}` module provides, among others: " + listed + "."
        docs.append(_chat(rng.choice(ASK_MOD_LIST).format(m=mod), ans))
    return docs


def is_test(display: str, seed: int, frac: float) -> bool:
    h = hashlib.sha256(f"{seed}:{display}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2**64 < frac


def build(seed: int = 0, test_frac: float = 0.03, think_frac: float = 0.2,
          repeats: int = 2) -> tuple[list[dict], list[dict], dict]:
    """-> (train docs, test docs, metadata). ``repeats``: the templated chats are drawn this many
    times per object with different phrasings (plain text once)."""
    items, module_docs, module_names = collect()
    unique: dict[str, int] = {}
    for it in items:
        if it.kind != "method":
            unique[it.name] = unique.get(it.name, 0) + 1
    rng = random.Random(seed)
    train, test = [], []
    for it in items:
        dest = test if is_test(it.display, seed, test_frac) else train
        for r in range(repeats if dest is train else 1):
            docs = documents_for(it, unique, rng, think_frac)
            if r > 0:
                docs = [d for d in docs if "messages" in d]
            dest.extend(docs)
    for mod in MODULES:
        if mod in module_names or mod in module_docs:
            for _ in range(repeats):
                train.extend(module_documents(mod, module_docs.get(mod), module_names.get(mod, []),
                                              rng, think_frac))
    rng.shuffle(train)
    rng.shuffle(test)
    meta = {
        "source": "CPython standard library docstrings (PSF License Agreement)",
        "python": sys.version.split()[0], "seed": seed, "test_frac": test_frac,
        "think_frac": think_frac, "repeats": repeats,
        "objects": len(items), "modules": len(module_names),
        "test_objects": sum(is_test(it.display, seed, test_frac) for it in items),
        "train_docs": len(train), "test_docs": len(test),
        "train_chars": sum(_chars(d) for d in train), "test_chars": sum(_chars(d) for d in test),
    }
    return train, test, meta


def _chars(d: dict) -> int:
    if "text" in d:
        return len(d["text"])
    return sum(len(m["content"]) + len(m.get("reasoning_content", "")) for m in d["messages"])


def write(out: Path, seed: int = 0, **kw) -> dict:
    train, test, meta = build(seed, **kw)
    out.mkdir(parents=True, exist_ok=True)
    for name, docs in (("train", train), ("test", test)):
        with open(out / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(d, ensure_ascii=False) + "\n" for d in docs)
    (out / "meta.json").write_text(json.dumps(meta, indent=2))
    return meta


def read_jsonl(path: Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("build/demo/corpus"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--test-frac", type=float, default=0.03)
    ap.add_argument("--think-frac", type=float, default=0.2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--show", type=int, default=0, help="print this many sample documents")
    args = ap.parse_args()
    meta = write(args.out, args.seed, test_frac=args.test_frac, think_frac=args.think_frac,
                 repeats=args.repeats)
    print(json.dumps(meta, indent=2))
    if args.show:
        for d in read_jsonl(args.out / "train.jsonl")[: args.show]:
            print("-" * 60)
            print(json.dumps(d, indent=1, ensure_ascii=False))


if __name__ == "__main__":
    main()
