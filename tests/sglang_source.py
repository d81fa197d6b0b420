"""SGLang's own code in tests, without its GPU stack.

SGLang is installed with ``--no-deps`` (scripts/test): its package
``__init__`` imports torch, so the pieces the tests compare against are
loaded from their files: the OpenAI protocol models (``protocol.py``, with
empty parent packages so no ``__init__`` runs; every module added to
``sys.modules`` is taken out again), the ``/generate`` contract gate
(``api/v1/api_types.py``, msgspec only) and ``get_json_schema_constraint``
(compiled from ``function_call/utils.py``). A test that needs them is
skipped with the reason when they cannot be loaded, and fails instead under
``ROLLOUT_SESSION_REQUIRE_SGLANG=1`` (CI).
"""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.metadata
import importlib.util
import os
import sys
import types
import typing
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest

__all__ = [
    "SGLang",
    "load_api_types",
    "load_detokenizer",
    "load_protocol",
    "load_sglang",
    "or_skip",
    "sglang_root",
]

T = TypeVar("T")

_PROTOCOL = "sglang.srt.entrypoints.openai.protocol"
_PACKAGES = ("sglang", "sglang.srt", "sglang.srt.entrypoints", "sglang.srt.entrypoints.openai")


@dataclass(frozen=True)
class SGLang:
    """The pieces of the installed SGLang that run without its GPU stack."""

    root: Path
    protocol: types.ModuleType  # ChatCompletionRequest, ChatCompletionResponse, ...
    json_schema_constraint: Callable[..., Any]  # function_call/utils.get_json_schema_constraint
    api_types: types.ModuleType  # the /generate contract gate


def sglang_root() -> Path:
    # Not importlib.util.find_spec: another test may have left a stand-in
    # `sglang` package (without __spec__) in sys.modules.
    return Path(str(importlib.metadata.distribution("sglang").locate_file("sglang")))


def load_protocol(root: Path | None = None) -> types.ModuleType:
    """protocol.py without running sglang/__init__.py (torch); every module
    this adds to sys.modules is taken out again."""
    if _PROTOCOL in sys.modules:
        return sys.modules[_PROTOCOL]
    root = root or sglang_root()
    before = set(sys.modules)
    added: dict[str, types.ModuleType] = {}
    for name in _PACKAGES:
        package = types.ModuleType(name)
        package.__path__ = [str(root.joinpath(*name.split(".")[1:]))]
        added[name] = package
    if importlib.util.find_spec("IPython") is None:  # sglang.utils imports its display helpers
        display = types.ModuleType("IPython.display")
        display.HTML = display.display = None  # type: ignore[attr-defined]
        added.update({"IPython": types.ModuleType("IPython"), "IPython.display": display})
    sys.modules.update(added)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return importlib.import_module(_PROTOCOL)
    finally:
        for name in set(sys.modules) - before:
            if name in added or name.startswith("sglang."):
                del sys.modules[name]


def _load_json_schema_constraint(root: Path, protocol: types.ModuleType) -> Callable[..., Any]:
    """get_json_schema_constraint and its helpers, compiled from SGLang's file
    (the module itself imports partial_json_parser and more)."""
    path = root / "srt" / "function_call" / "utils.py"
    wanted = {"get_json_schema_constraint", "_get_tool_schema", "_get_tool_schema_defs"}
    tree = ast.parse(path.read_text("utf-8"))
    functions = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in wanted]
    assert {f.name for f in functions} == wanted
    namespace: dict[str, Any] = {"Tool": protocol.Tool, "ToolChoice": protocol.ToolChoice}
    for name in ("Any", "Dict", "List", "Literal", "Optional", "Union"):
        namespace[name] = getattr(typing, name)
    exec(compile(ast.Module(body=list(functions), type_ignores=[]), str(path), "exec"), namespace)
    function: Callable[..., Any] = namespace["get_json_schema_constraint"]
    return function


def load_api_types(root: Path | None = None) -> types.ModuleType:
    path = (root or sglang_root()) / "api" / "v1" / "api_types.py"
    spec = importlib.util.spec_from_file_location("_sglang_api_types", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# SGLANG_FORCE_STREAM_INTERVAL's default (srt/environ.py): a non-streamed
# request's ids go to the detokenizer every this many output tokens
# (scheduler_components/output_streamer.py OutputStreamer.accept).
FORCE_STREAM_INTERVAL = 50


def _functions(
    path: Path, names: set[str], classes: frozenset[str] | set[str] = frozenset()
) -> list[ast.stmt]:
    """The top-level functions, the methods and the classes named, from `path`
    (a method becomes a function taking `self`; decorators are dropped)."""
    tree = ast.parse(path.read_text("utf-8"))
    found: list[ast.stmt] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name in names:
            node.decorator_list = []
            found.append(node)
        elif isinstance(node, ast.ClassDef) and node.name in classes:
            found.append(node)
    assert {getattr(n, "name", None) for n in found} == names | classes, path
    return found


@functools.cache
def load_detokenizer() -> Callable[..., str]:
    """SGLang 0.5.23's detokenizer as it decodes a non-streamed ``/generate``
    answer: `text(tokenizer, prompt, output, finish, skip, spaces)` runs the
    detokenizer's own `_decode_batch_token_id_output` (and `trim_matched_stop`,
    `DecodeStatus`, `find_printable_text`, compiled from the wheel's files)
    over the hand-offs the scheduler makes (`Req.init_incremental_detokenize`:
    the last 5 prompt ids as context; every `FORCE_STREAM_INTERVAL` output
    ids, and once finished), and joins its outputs as the tokenizer manager
    does (`ReqState.append_text`)."""
    root = sglang_root()
    manager = _functions(
        root / "srt" / "managers" / "detokenizer_manager.py",
        {
            "trim_matched_stop",
            "_clamp_decode_ids",
            "_grouped_batch_decode",
            "_decode_batch_token_id_output",
        },
        {"DecodeStatus"},
    )
    printable = _functions(root / "utils.py", {"find_printable_text", "_is_chinese_char"})
    patch = _functions(root / "srt" / "utils" / "patch_tokenizer.py", {"decode_without_hf_kwargs"})
    namespace: dict[str, Any] = {
        "dataclasses": importlib.import_module("dataclasses"),
        "defaultdict": importlib.import_module("collections").defaultdict,
        "DETOKENIZER_MAX_STATES": 1 << 16,
    }
    for name in ("Dict", "List", "Optional", "Tuple", "Union"):
        namespace[name] = getattr(typing, name)
    body = [*printable, *patch, *manager]
    exec(compile(ast.Module(body=body, type_ignores=[]), "sglang_detokenizer", "exec"), namespace)

    def text(
        tokenizer: Any,
        prompt: list[int],
        output: list[int],
        finish: dict[str, Any],
        skip_special_tokens: bool,
        spaces_between_special_tokens: bool,
    ) -> str:
        manager_self = types.SimpleNamespace(
            tokenizer=tokenizer,
            vocab_size=len(tokenizer),
            decode_status={},
            disable_tokenizer_batch_decode=False,
            is_tool_call_parser_gpt_oss=False,
            tool_close_token_ids=frozenset(),
        )
        for method in ("trim_matched_stop", "_grouped_batch_decode"):
            setattr(manager_self, method, functools.partial(namespace[method], manager_self))
        manager_self._clamp_decode_ids = namespace["_clamp_decode_ids"]
        context = prompt[-5:]
        ids = context + output
        sends = [*range(FORCE_STREAM_INTERVAL, len(output), FORCE_STREAM_INTERVAL), len(output)]
        sent, joined = 0, ""
        for upto in sends:
            now = ids[: len(context) + upto]
            received = types.SimpleNamespace(
                rids=["r"],
                decoded_texts=[""],
                decode_ids=[now[sent:]],
                read_offsets=[len(context)],
                finished_reasons=[finish if upto == len(output) else None],
                no_stop_trim=[False],
                skip_special_tokens=[skip_special_tokens],
                spaces_between_special_tokens=[spaces_between_special_tokens],
            )
            sent = len(now)
            (piece,) = namespace["_decode_batch_token_id_output"](manager_self, received)
            joined += piece
        return joined

    return text


@functools.cache
def load_sglang() -> SGLang:
    root = sglang_root()
    protocol = load_protocol(root)
    return SGLang(
        root, protocol, _load_json_schema_constraint(root, protocol), load_api_types(root)
    )


def or_skip(load: Callable[[], T]) -> T:
    """`load()`; a test is skipped with the reason when it fails (failed
    instead with ROLLOUT_SESSION_REQUIRE_SGLANG=1)."""
    try:
        return load()
    except Exception as exc:
        reason = f"cannot load SGLang's own code: {type(exc).__name__}: {exc}"
        if os.environ.get("ROLLOUT_SESSION_REQUIRE_SGLANG"):
            pytest.fail(reason)
        pytest.skip(reason)
