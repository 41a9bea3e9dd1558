"""Code prompts made from the signatures and docstrings of installed Python modules.

For code models, answers to "complete this function" prompts are the kind of text the heads must learn
to draft, and any machine has thousands of documented functions to make such prompts from, with no
download and no licence question beyond that of the installed modules. Each prompt is the function's
signature and docstring, in the style of HumanEval: the model writes the body.
"""
from __future__ import annotations

import importlib
import inspect
import random
import sys
import textwrap

DEFAULT_MODULES = (
    "json", "csv", "string", "textwrap", "difflib", "heapq", "bisect", "statistics", "fractions", "itertools",
    "functools", "collections", "pathlib", "shutil", "glob", "fnmatch", "calendar", "datetime", "random",
    "base64", "binascii", "hashlib", "hmac", "zlib", "gzip", "tarfile", "zipfile", "configparser", "argparse",
    "shlex", "html", "urllib.parse", "ipaddress", "email.utils", "uuid", "copy", "pprint", "operator", "re",
    "tokenize", "ast", "inspect", "dis", "timeit", "platform", "locale", "gettext", "colorsys", "wave",
    "sched", "queue", "graphlib", "dataclasses", "enum", "typing", "contextlib", "abc", "numbers", "decimal",
    "math", "cmath", "secrets", "tempfile", "filecmp", "linecache", "traceback", "warnings", "logging",
)

INSTRUCTION = "Complete the code I provided.\n\n"


def _function_prompt(name: str, fn, owner: str | None = None) -> str | None:
    """A function's signature and docstring; for a method, inside its class header."""
    doc = inspect.getdoc(fn)
    if not doc or len(doc) < 40 or len(doc) > 1500:
        return None
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    if name.startswith("_"):
        return None
    body = textwrap.indent('"""' + doc.strip() + '\n"""', "    ")
    code = f"def {name}{sig}:\n{body}\n"
    if owner is not None:
        code = f"class {owner}:\n    ...\n\n" + textwrap.indent(code, "    ")
    return INSTRUCTION + code


# never imported: they open windows or browsers, print on import, or are test suites and tooling
_SKIP = {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "test", "lib2to3", "ensurepip",
         "venv", "pydoc_data", "__main__", "__phello__", "xxsubtype", "msilib", "winreg", "winsound", "_msi"}


def more_modules() -> list[str]:
    """The rest of the standard library (and its public submodules' parents), for more prompts than
    DEFAULT_MODULES give, in a fixed order."""
    names = getattr(sys, "stdlib_module_names", ())
    return [n for n in sorted(names) if not n.startswith("_") and n not in _SKIP and n not in DEFAULT_MODULES]


def module_prompts(modules=None, limit: int | None = None, seed: int = 0,
                   methods: bool = False) -> list[tuple[str, list[str]]]:
    """(id, [prompt]) pairs, one per documented public Python function of `modules`, shuffled
    deterministically; ids are "doc-<module>.<function>". By default DEFAULT_MODULES come first, and
    when `limit` asks for more prompts than they give, the rest of the standard library follows (the
    first prompts stay the same whatever the limit), then methods of their classes. methods=True also
    makes prompts from the documented public methods of the modules' public classes."""
    if modules is None:
        first = module_prompts(DEFAULT_MODULES, seed=seed)
        if limit is not None and limit <= len(first):
            return first[:limit]
        have = {q for q, _ in first}
        rest = [x for x in module_prompts(more_modules(), seed=seed) if x[0] not in have]
        have |= {q for q, _ in rest}
        rest += [x for x in module_prompts(DEFAULT_MODULES + tuple(more_modules()), seed=seed, methods=True)
                 if x[0] not in have]
        out = first + rest
        return out[:limit] if limit is not None else out
    out: list[tuple[str, list[str]]] = []
    seen: set[str] = set()
    for mod_name in modules:
        try:
            mod = importlib.import_module(mod_name)
        except Exception:  # a module missing on this Python is simply skipped
            continue
        for name, obj in sorted(vars(mod).items()):
            if not inspect.isfunction(obj) or getattr(obj, "__module__", None) != mod.__name__:
                continue
            prompt = _function_prompt(name, obj)
            qid = f"doc-{mod_name}.{name}"
            if prompt and qid not in seen:
                seen.add(qid)
                out.append((qid, [prompt]))
        if methods:  # documented public methods of the module's public classes
            for cname, cls in sorted(vars(mod).items()):
                if not inspect.isclass(cls) or cname.startswith("_") or getattr(cls, "__module__", None) != mod.__name__:
                    continue
                for name, obj in sorted(vars(cls).items()):
                    if inspect.isfunction(obj):
                        prompt = _function_prompt(name, obj, owner=cname)
                        qid = f"doc-{mod_name}.{cname}.{name}"
                        if prompt and qid not in seen:
                            seen.add(qid)
                            out.append((qid, [prompt]))
    random.Random(seed).shuffle(out)
    return out[:limit] if limit is not None else out
