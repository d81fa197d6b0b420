"""The trajectory inspector: ``GET /ui`` and the template re-render diff.

The page (``rollout_session/ui/``: plain HTML, CSS and ES modules, no build
step, nothing from outside the server) reads the ordinary API: ``GET
/sessions``, ``GET /workers``, ``GET /sessions/{id}/trajectory?include=
turns,messages,pieces``, plus one route of its own, ``GET
/sessions/{id}/diff[?segment=K]``: one segment's committed ids next to a
fresh full re-render of its stored messages (with its own tools and template
kwargs), with the first position where they differ.

The page and its assets are public: they carry no data, and a browser must be
able to load them before anyone typed a key. `is_public_path` names them, and
the HTTP edge lets ``GET`` and ``HEAD`` on them through without the API key;
every data request the page makes sends ``Authorization: Bearer <key>`` like
any other client (the key is typed once and kept in the tab's
``sessionStorage``). ``/sessions/{id}/diff`` is data and needs the key.

Assets are served with a strict Content-Security-Policy: scripts and styles
only from this origin, nothing inline, and Trusted Types enforced, so a
string can never reach an HTML sink (the page builds every node with
``textContent``; a tool result holding ``<script>`` renders as text).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from importlib import resources
from typing import Any, Final

from quart import Response, request
from quart_trio import QuartTrio

from ...errors import InvalidRequest, RouteNotFound
from ...prompt.junction import Junction, continuation, shared_prefix
from ...prompt.messages import Message
from ...prompt.tokenizer import ChatTokenizer
from ...session.segments import Segment
from ..context import ServerContext
from .sessions import document_response

__all__ = [
    "CONTENT_SECURITY_POLICY",
    "first_mismatch",
    "is_public_path",
    "load_assets",
    "pick_segment",
    "register_inspector_routes",
    "template_diff",
]

CONTENT_SECURITY_POLICY: Final = "; ".join(
    [
        "default-src 'self'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self' data:",
        "connect-src 'self'",
        "object-src 'none'",
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'none'",
        "require-trusted-types-for 'script'",
        "trusted-types 'none'",
    ]
)
_SECURITY_HEADERS: Final = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    # The page is tiny and changes with the package: always revalidate.
    "Cache-Control": "no-cache",
}
_CONTENT_TYPES: Final = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
}
_INDEX: Final = "index.html"
UI_PREFIX: Final = "/ui"


def load_assets() -> dict[str, tuple[bytes, str]]:
    """Every file of the packaged ``ui/`` folder: name → (bytes, content type)."""
    assets: dict[str, tuple[bytes, str]] = {}
    for entry in resources.files("rollout_session").joinpath("ui").iterdir():
        suffix = "." + entry.name.rsplit(".", 1)[-1] if "." in entry.name else ""
        if entry.is_file() and suffix in _CONTENT_TYPES:
            assets[entry.name] = (entry.read_bytes(), _CONTENT_TYPES[suffix])
    if _INDEX not in assets:
        raise RuntimeError("the inspector's ui/index.html is missing from the package")
    return assets


_PUBLIC: Final = frozenset(
    {UI_PREFIX, UI_PREFIX + "/", *(f"{UI_PREFIX}/{name}" for name in load_assets())}
)


def is_public_path(path: str) -> bool:
    """The page and its assets: served without the API key (they hold no data)."""
    return path in _PUBLIC


def first_mismatch(committed: Sequence[int], rerendered: Sequence[int]) -> int | None:
    """First position < len(committed) where the two differ, or None.

    Only the committed length is compared: past it the re-render goes on with
    the template's end of the last turn, which the trajectory does not hold
    yet (see `template_diff`). A re-render shorter than the committed ids
    mismatches where it ends.
    """
    shared = shared_prefix(committed, rerendered)
    return shared if shared < len(committed) else None


def pick_segment(segments: Sequence[Segment], raw: str | None) -> tuple[int, Segment]:
    """The segment ``?segment=`` names (its index, 0 = the first), the last
    one without it; anything else is 400 ``invalid_request``."""
    if raw is None:
        return len(segments) - 1, segments[-1]
    # Plain ASCII digits only: int() would take " 1", "+1", "1_0" and other
    # scripts' digits, and raise on thousands of digits.
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 9 and int(raw) < len(segments)):
        raise InvalidRequest(
            f"segment must be a segment index from 0 to {len(segments) - 1}", param="segment"
        )
    return int(raw), segments[int(raw)]


def template_diff(
    tokenizer: ChatTokenizer,
    messages: Sequence[Message],
    tools: list[Any] | None,
    kwargs: Mapping[str, Any],
    committed: list[int],
    turns: Sequence[tuple[int, int, int]],
) -> dict[str, Any]:
    """Committed ids vs the template's full rendering of the stored messages.

    `turns` are ``(prompt_start, completion_start, completion_end)``. The
    committed sequence ends with the last sampled token (usually the EOS);
    the re-render renders the final assistant message through the template's
    end of turn (``<|im_end|>\\n`` for ChatML). So positions are compared over
    the committed length only, and the re-render's extra tokens are returned
    as ``tail``; ``tail_expected`` says whether they are exactly the turn end
    the server would append before the next turn (what is missing after the
    sampled ids), i.e. not a mismatch.
    """
    if messages:
        text = tokenizer.render(messages, tools=tools, kwargs=kwargs, add_generation_prompt=False)
        rerendered = tokenizer.encode(text)
    else:
        rerendered = []
    at = first_mismatch(committed, rerendered)
    tail = rerendered[len(committed) :] if at is None else []
    expected_tail: list[int] = []
    if turns and messages and messages[-1].get("role") == "assistant":
        end_ids = tokenizer.last_terminator(messages[-1], tools=tools, kwargs=kwargs)
        _, start, end = turns[-1]
        expected_tail = continuation(
            committed[start:end],
            Junction(end_ids, len(end_ids)),
            stopped=False,
            special_ids=tokenizer.special_ids,
        )
    turn = sampled = None
    if at is not None:
        turn = next((k for k, (_, _, end) in enumerate(turns) if at < end), None)
        sampled = turn is not None and turns[turn][1] <= at
    return {
        "committed_ids": committed,
        "committed_pieces": tokenizer.decode_pieces(committed),
        "rerendered_ids": rerendered,
        "rerendered_pieces": tokenizer.decode_pieces(rerendered),
        "compared": len(committed),
        "first_mismatch": at,
        "first_mismatch_turn": turn,
        "first_mismatch_sampled": sampled,
        "tail": tail,
        "tail_expected": at is None and tail == expected_tail,
    }


def _asset_response(body: bytes, content_type: str) -> Response:
    response = Response(body, content_type=content_type)
    response.headers.update(_SECURITY_HEADERS)
    return response


def register_inspector_routes(app: QuartTrio, ctx: ServerContext) -> None:
    """``GET /ui`` (+ assets, public) and ``GET /sessions/{id}/diff`` (keyed)."""
    assets = load_assets()
    registry = ctx.registry

    def asset(name: str) -> Response | None:
        found = assets.get(name)
        return None if found is None else _asset_response(*found)

    # An unknown asset under /ui is a 404 after the key check: it is not public.
    @app.get(UI_PREFIX)
    @app.get(UI_PREFIX + "/")
    async def ui_index() -> Response:
        response = asset(_INDEX)
        assert response is not None
        return response

    @app.get(UI_PREFIX + "/<name>")
    async def ui_asset(name: str) -> Response:
        response = asset(name)
        if response is None:
            raise RouteNotFound(f"no inspector asset {name!r}")
        return response

    @app.get("/sessions/<session_id>/diff")
    async def session_diff(session_id: str) -> Response:
        session = registry.get(session_id)
        segments = session.segments()
        index, segment = pick_segment(segments, request.args.get("segment"))
        # Each segment has its own messages, tools and template kwargs.
        # Snapshot on the loop (`messages()` decodes fresh dicts).
        committed = segment.trajectory.tokens.ids.tolist()
        turns = [
            (t.prompt_start, t.completion_start, t.completion_end) for t in segment.trajectory.turns
        ]
        doc = await ctx.offload.run(
            len(committed) * 20,
            template_diff,
            ctx.ready_tokenizer,
            segment.conversation.messages(),
            segment.tools,
            segment.template_kwargs or ctx.settings.chat_template_kwargs,
            committed,
            turns,
        )
        doc = {
            "session_id": session.id,
            "segment": index,
            "num_segments": len(segments),
            "branch": segment.branch.as_dict() if segment.branch is not None else None,
            "num_turns": len(turns),
            **doc,
        }
        return await document_response(ctx, doc, len(committed) * 2)
