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


def _function_prompt(name: str, fn) -> str | None:
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
    return f"{INSTRUCTION}def {name}{sig}:\n{body}\n"


def module_prompts(modules=DEFAULT_MODULES, limit: int | None = None, seed: int = 0) -> list[tuple[str, list[str]]]:
    """(id, [prompt]) pairs, one per documented public Python function of `modules`, shuffled
    deterministically; ids are "doc-<module>.<function>"."""
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
    random.Random(seed).shuffle(out)
    return out[:limit] if limit is not None else out
