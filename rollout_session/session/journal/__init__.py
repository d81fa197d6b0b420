"""The durable journal (``--journal DIR``): session events on disk, replay.

Owns: segment files and record framing (`format`), reading a segment back
(`reader`), encoding and replaying session records (`records`), opening a
directory (`recovery`), compaction (`compaction`) and the writer task
(`writer.Journal`). The session store is its one caller.

May import: the rest of `session`, `errors`, `tokens`.
"""
