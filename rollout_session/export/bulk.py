"""Bulk export: every matching session of a server to JSON Lines or Parquet.

``rollout-session export --server URL --out DIR [--format jsonl|parquet]
[--state open|closed|all] [--close] [--schema 1|3] [--rescore TARGET:LABEL]``.
Sessions are listed first (paging by cursor), then fetched one by one — or
collected with DELETE when ``--close`` is given — and streamed to
``DIR/trajectories.{jsonl,parquet}``, so memory holds one Parquet row group
at most. With ``--rescore`` each session is rescored first
(``POST /sessions/{id}/rescore``, ``--rescore-concurrency`` at a time), so
its document carries the rescore; a rescore that fails stops the export
with the server's error (a session gone meanwhile is skipped). ``--state
closed`` means sessions the server closed by itself (state ``expired``):
DELETE'd sessions are already in their collector's hands.

A fleet's shard exports the whole fleet: its ``GET /health?fleet=1`` names
every shard, and each shard's own sessions are listed and read on that
shard (no redirects, so ``--api-key`` reaches each). A shard that does not
answer stops the export before anything is written, rather than leaving
its sessions silently out.

JSON Lines hold one export document (schema 3: all segments) per line, or
with ``--schema 1`` v1's document (the last segment's fields at the top
level). Parquet holds one row per segment (each a linear sample; ``segment`` and ``num_segments``
say which): token ids ``list<int32>``, loss mask ``list<int8>``, logprobs
``list<float32>``; ``metadata``, ``branch``, ``rollbacks``, ``turns``,
``messages`` and ``routed_experts`` as JSON strings (they are nested and
heterogeneous).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import httpx
import orjson
from tqdm import tqdm

__all__ = ["Rescore", "add_arguments", "export_sessions", "parquet_schema", "run"]

_STATES: Final = {"open": "open", "closed": "expired", "all": None}
# The documents' `?schema=` (docs/training.md#the-export-document-schema_version-3).
_SCHEMAS: Final = (1, 3)
# A fleet shard's status in `GET /health?fleet=1` when it did not answer.
_DOWN: Final = ("unreachable", "error")
_JSON_COLUMNS: Final = (
    "metadata",
    "branch",
    "rollbacks",
    "turns",
    "messages",
    "routed_experts",
    "rescores",
)


def parquet_schema() -> Any:
    """The Parquet schema (pyarrow, the optional ``parquet`` extra, is
    imported only when Parquet is written)."""
    try:
        import pyarrow as pa
    except ImportError:
        raise SystemExit(
            "Parquet export needs pyarrow: pip install 'rollout-session[parquet]'"
        ) from None
    return pa.schema(
        [
            ("session_id", pa.string()),
            ("status", pa.string()),
            ("schema_version", pa.int32()),
            ("created_at", pa.float64()),
            ("closed_at", pa.float64()),
            ("model", pa.string()),
            ("segment", pa.int32()),
            ("num_segments", pa.int32()),
            ("prompt_length", pa.int64()),
            ("token_ids", pa.list_(pa.int32())),
            ("loss_mask", pa.list_(pa.int8())),
            ("logprobs", pa.list_(pa.float32())),
            *((name, pa.string()) for name in _JSON_COLUMNS),
        ]
    )


_ROW_GROUP: Final = 256


def _list_ids(client: httpx.Client, state: str | None) -> list[str]:
    ids: list[str] = []
    after: str | None = None
    while True:
        params = {"limit": "1000", **({"state": state} if state else {})}
        if after:
            params["after"] = after
        page = _ok(client.get("/sessions", params=params))
        ids += [s["session_id"] for s in page["sessions"]]
        if not page.get("has_more") or not page["sessions"]:
            return ids
        after = ids[-1]


def _shards(client: httpx.Client) -> list[str] | None:
    """The fleet's shard URLs in fleet order when `client`'s server is a
    fleet's shard (its ``GET /health?fleet=1`` lists them); None for a lone
    server, which ignores the parameter."""
    shards = _ok(client.get("/health", params={"fleet": "1"})).get("shards")
    if shards is None:
        return None
    down = [f"{s['url']} ({s.get('error')})" for s in shards if s["status"] in _DOWN]
    if down:
        raise SystemExit(
            f"fleet shards not answering: {', '.join(down)}; their sessions cannot be "
            "exported, so nothing was: start them again (docs/deploy.md#a-fleet)"
        )
    return [str(s["url"]) for s in shards]


def _ok(response: httpx.Response) -> Any:
    if response.status_code != 200:
        raise SystemExit(f"{response.request.method} {response.url}: {response.text}")
    return orjson.loads(response.content)


@dataclass(frozen=True, slots=True)
class Rescore:
    """``--rescore TARGET:LABEL``: the rescore every session gets before export."""

    target: str  # pinned, teacher or a worker's URL (which has colons of its own)
    label: str
    concurrency: int = 8

    @classmethod
    def parse(cls, raw: str, concurrency: int = 8) -> Rescore:
        target, sep, label = raw.rpartition(":")
        if not sep or not target or not label:
            raise ValueError(f"--rescore takes TARGET:LABEL (e.g. teacher:distill), not {raw!r}")
        return cls(target, label, concurrency)


def _rescored(client: httpx.Client, ids: list[str], rescore: Rescore | None) -> Iterator[str]:
    """The ids in order, each once its rescore (if any) is done; rescores
    run `rescore.concurrency` at a time, ahead of the export."""
    if rescore is None:
        yield from ids
        return
    body = {"target": rescore.target, "label": rescore.label}

    def one(session_id: str) -> str | None:
        """Why the rescore failed, or None; its answer (the scores, which the
        export reads again) is not kept: the rescores run ahead."""
        response = client.post(f"/sessions/{session_id}/rescore", json=body)
        if response.status_code in (200, 404):  # a session gone meanwhile is skipped below
            return None
        return f"POST {response.url}: {response.text}"

    pool = ThreadPoolExecutor(rescore.concurrency)
    try:
        for session_id, failure in zip(ids, pool.map(one, ids), strict=True):
            if failure is not None:
                raise SystemExit(failure)
            yield session_id
    finally:
        # After a failure (or an export stopped early) the rescores not yet
        # started are not started: only those running are waited for.
        pool.shutdown(wait=True, cancel_futures=True)


def _documents(
    client: httpx.Client, ids: list[str], close: bool, schema: int, rescore: Rescore | None
) -> Iterator[dict[str, Any]]:
    params = {"schema": str(schema)}
    for session_id in _rescored(client, ids, rescore):
        if close:
            response = client.delete(f"/sessions/{session_id}", params=params)
        else:
            response = client.get(f"/sessions/{session_id}/trajectory", params=params)
        if response.status_code == 404:
            continue  # collected or closed by someone else meanwhile
        yield _ok(response)


def _rows(doc: dict[str, Any], names: list[str]) -> Iterator[dict[str, Any]]:
    """One row per segment (of a schema 3 document): the session's fields,
    then the segment's own."""
    for segment in doc["segments"]:
        fields = {**doc, **segment, "segment": segment["index"]}
        row = {name: fields.get(name) for name in names}
        for name in _JSON_COLUMNS:
            value = fields.get(name)
            row[name] = None if value is None else orjson.dumps(value).decode()
        yield row


def export_sessions(
    server: str,
    out_dir: Path,
    *,
    fmt: str = "jsonl",
    state: str = "all",
    close: bool = False,
    api_key: str | None = None,
    progress: bool = True,
    schema: int = 3,
    rescore: Rescore | None = None,
) -> tuple[Path, int]:
    """Write every matching session; return (file, number of sessions written).
    `schema`: of the JSON Lines documents (Parquet rows are per segment)."""
    if schema not in _SCHEMAS:
        raise ValueError(f"schema must be one of {_SCHEMAS}")
    if fmt == "parquet" and schema != 3:
        raise ValueError("Parquet rows are one per segment: --schema 1 is for --format jsonl")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"trajectories.{fmt}"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    written = 0
    # Room for the rescores' threads on top of the export's own connection.
    limits = httpx.Limits(max_connections=1 + (rescore.concurrency if rescore else 0))
    with ExitStack() as clients:

        def client_for(url: str) -> httpx.Client:
            client = httpx.Client(
                base_url=url.rstrip("/"), headers=headers, timeout=600, limits=limits
            )
            return clients.enter_context(client)

        entry = client_for(server)
        shards = _shards(entry)
        sources = [entry] if shards is None else [client_for(url) for url in shards]
        listed = [(client, _list_ids(client, _STATES[state])) for client in sources]
        docs = tqdm(
            (
                doc
                for client, ids in listed
                for doc in _documents(client, ids, close, schema, rescore)
            ),
            total=sum(len(ids) for _, ids in listed),
            unit="session",
            disable=not progress,
        )
        if fmt == "jsonl":
            with path.open("wb") as out:
                for doc in docs:
                    out.write(orjson.dumps(doc) + b"\n")
                    written += 1
        else:
            columns = parquet_schema()
            import pyarrow as pa
            import pyarrow.parquet as pq

            with pq.ParquetWriter(path, columns) as writer:
                batch: list[dict[str, Any]] = []
                for doc in docs:
                    batch += _rows(doc, columns.names)
                    written += 1
                    if len(batch) >= _ROW_GROUP:
                        writer.write_table(pa.Table.from_pylist(batch, columns))
                        batch = []
                if batch or not written:
                    writer.write_table(pa.Table.from_pylist(batch, columns))
    return path, written


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--server",
        required=True,
        help="session server base URL (a fleet's shard: the whole fleet is exported)",
    )
    parser.add_argument("--out", required=True, type=Path, help="output directory")
    parser.add_argument("--format", choices=("jsonl", "parquet"), default="jsonl")
    parser.add_argument(
        "--state",
        choices=tuple(_STATES),
        default="all",
        help="closed = sessions the server closed itself (expired)",
    )
    parser.add_argument("--close", action="store_true", help="collect (DELETE) each session")
    parser.add_argument("--api-key", default=None, help="Bearer token if the server has one")
    parser.add_argument(
        "--schema",
        type=int,
        choices=_SCHEMAS,
        default=3,
        help="JSON Lines: 3 = every segment once; 1 = v1's document (the last segment's "
        "fields at the top level)",
    )
    parser.add_argument(
        "--rescore",
        metavar="TARGET:LABEL",
        default=None,
        help="rescore each session first (target pinned, teacher or a worker URL), so its "
        "document carries rescores[LABEL] (docs/training.md#rescoring)",
    )
    parser.add_argument(
        "--rescore-concurrency",
        type=int,
        default=8,
        help="rescores in flight at once (default 8)",
    )


def run(args: argparse.Namespace) -> None:
    if args.format == "parquet" and args.schema != 3:
        raise SystemExit("--schema 1 is for --format jsonl: Parquet rows are one per segment")
    if args.rescore_concurrency < 1:
        raise SystemExit("--rescore-concurrency must be at least 1")
    try:
        rescore = Rescore.parse(args.rescore, args.rescore_concurrency) if args.rescore else None
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    path, written = export_sessions(
        args.server,
        args.out,
        fmt=args.format,
        state=args.state,
        close=args.close,
        api_key=args.api_key,
        schema=args.schema,
        rescore=rescore,
    )
    print(f"wrote {written} sessions to {path}")
