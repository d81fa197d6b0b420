// DOM helpers. Every node of the page is built here or with these: data only
// ever becomes text (textContent) or an attribute value, never markup. The
// server's Content-Security-Policy enforces Trusted Types, so an accidental
// innerHTML with a string would throw instead of running.

export function h(tag, props = {}, ...children) {
  const el = document.createElement(tag);
  for (const [key, value] of Object.entries(props)) {
    if (value === null || value === undefined || value === false) continue;
    if (key === 'class') el.className = value;
    else if (key === 'text') el.textContent = String(value);
    else if (key === 'dataset') Object.assign(el.dataset, value);
    else if (key.startsWith('on')) el.addEventListener(key.slice(2), value);
    else el.setAttribute(key, value === true ? '' : String(value));
  }
  append(el, children);
  return el;
}

export function append(el, children) {
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return el;
}

export function clear(el) {
  el.replaceChildren();
  return el;
}

export function fmtInt(n) {
  return n === null || n === undefined ? '—' : Number(n).toLocaleString('en-US');
}

export function fmtAge(seconds) {
  if (seconds === null || seconds === undefined || !Number.isFinite(seconds)) return '—';
  const s = Math.max(0, seconds);
  if (s < 60) return `${s.toFixed(0)} s`;
  if (s < 3600) return `${Math.floor(s / 60)} min ${Math.floor(s % 60)} s`;
  if (s < 86400) return `${Math.floor(s / 3600)} h ${Math.floor((s % 3600) / 60)} min`;
  return `${Math.floor(s / 86400)} d ${Math.floor((s % 86400) / 3600)} h`;
}

export function ageOf(unixSeconds) {
  return unixSeconds ? Date.now() / 1000 - unixSeconds : null;
}

export function fmtLatency(seconds) {
  if (seconds === null || seconds === undefined) return '—';
  return seconds < 1 ? `${(seconds * 1000).toFixed(1)} ms` : `${seconds.toFixed(2)} s`;
}

// A piece as a JS string literal: shows whitespace and control characters.
export function quoted(piece) {
  return JSON.stringify(piece);
}

// How a token piece is drawn in the stream: line breaks stay line breaks but
// get a visible mark, tabs an arrow, an empty piece a placeholder.
export function shownPiece(piece) {
  if (piece === '') return '∅';
  return piece.replaceAll('\t', '→\t').replaceAll('\r', '␍').replaceAll('\n', '↵\n');
}

export function isSpecial(piece) {
  return /^<[|｜][^\s]*[|｜]>$/.test(piece) || /^<\/?(think|tool_call|tool_response)>$/.test(piece);
}

export function badge(text, kind) {
  return h('span', { class: `badge ${kind || text}`, text });
}

// `segment` null: the session's last segment (what the page shows by default).
export function sessionHref(id, tab, segment = null) {
  const query = segment === null ? '' : `?segment=${encodeURIComponent(segment)}`;
  return `#/s/${encodeURIComponent(id)}${tab === 'diff' ? '/diff' : ''}${query}`;
}

// Why a segment started or turns were replaced (the server's reason codes,
// segments.py Divergence); an unknown code is shown as it is.
const REASONS = {
  retry: 'the previous request again: its answer never reached the agent',
  tools_changed: 'the request has other tools than the segment',
  answer_dropped: 'the request leaves out one of the model\'s answers',
  answer_edited: 'the request has another assistant message in place of the model\'s answer',
  history_edited: 'the request differs at an earlier message (edited, compacted, summarised)',
  appended_role: 'an appended message has a role the template does not render in place',
  rendered_differently: 'the template renders the history differently from the segment\'s ids',
};

export function describeReason(reason) {
  return REASONS[reason] || reason;
}

// Where a segment came from, in words.
export function branchText(branch) {
  return branch === null ? 'start of the session'
    : `segment ${branch.segment} at message #${branch.message}`;
}

// The policy that sampled a turn's tokens (export `weight_versions`: spans
// in segment positions tiling its sampled tokens, several when a weight
// update interrupted the turn) and the extra requests it took
// (`continuations`). A span's version is null when nobody named one.
export function fmtVersion(version) {
  return version === null || version === undefined ? 'unnamed' : version;
}

export function versionSpans(turn) {
  const spans = turn.weight_versions || [];
  // No spans (nothing sampled, an old journal): the turn's own version, if any.
  return spans.length || !turn.weight_version ? spans
    : [{ start: turn.completion_start, end: turn.completion_end, version: turn.weight_version }];
}

// "v1 → v2": each span's version in order (equal neighbours once).
export function versionsText(spans) {
  const names = spans.map((s) => fmtVersion(s.version))
    .filter((v, k, all) => k === 0 || v !== all[k - 1]);
  return names.join(' → ');
}

export function spansTitle(spans) {
  return spans.map((s) => `#${s.start}–${s.end} (${s.end - s.start} tokens): ` +
    `${fmtVersion(s.version)}`).join('\n');
}

export function continuationsText(continuations) {
  const n = continuations.length;
  return `${n} continuation${n === 1 ? '' : 's'}`;
}

export function continuationsTitle(continuations) {
  return continuations.map((c, k) => {
    const reprefilled = c.cached_tokens === null || c.cached_tokens === undefined
      ? `${c.prompt_tokens} prompt tokens, cache unknown`
      : `${c.prompt_tokens - c.cached_tokens} re-prefilled (${c.prompt_tokens} prompt − ` +
        `${c.cached_tokens} cached)`;
    return `continuation ${k + 1} from #${c.start} · ${c.worker || 'worker unknown'} · ` +
      `${reprefilled} · ${c.discarded_tokens} discarded`;
  }).join('\n');
}

let bannerTimer = null;

export function showBanner(message) {
  const banner = document.getElementById('banner');
  banner.textContent = message;
  banner.hidden = false;
  clearTimeout(bannerTimer);
  bannerTimer = setTimeout(() => { banner.hidden = true; }, 8000);
}
