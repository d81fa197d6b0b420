"""What the trainer gets: the export document, its views, bulk export.

Owns: the document (schema version 3; v1's with ``?schema=1``) and its
sample and steps views (`document`), each segment's rescores with their
drift against the rollout (`rescores`), and bulk export of a server's sessions
to JSON Lines or Parquet (`bulk`, the `rollout-session export` command;
Parquet is the ``parquet`` extra).

May import: `session`, `errors`, `tokens`. `bulk` is a client of the
server's HTTP API and imports nothing of the server."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_attributes

if TYPE_CHECKING:
    from .document import SCHEMA_VERSION, export_document

__all__ = ["SCHEMA_VERSION", "export_document"]

_HOME = {
    "SCHEMA_VERSION": ".document",
    "export_document": ".document",
}

__getattr__, __dir__ = lazy_attributes(__name__, _HOME, __all__)
