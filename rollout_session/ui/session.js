// Session view: the session's segments and rollbacks, then one segment (the
// last by default, `?segment=k` otherwise) token by token next to its stored
// messages, with its turn table and a search box; the "diff" tab is in diff.js.

import { api } from './api.js';
import { diffView } from './diff.js';
import {
  ageOf, append, badge, branchText, clear, continuationsText, continuationsTitle, describeReason,
  fmtAge, fmtInt, fmtLatency, h, sessionHref, spansTitle, versionSpans, versionsText,
} from './dom.js';
import { TokenStream, search } from './tokens.js';

function legend() {
  const item = (cls, text) => h('span', { class: `legend-item tok ${cls}`, text });
  return h('div', { class: 'legend' },
    item('prompt', 'prompt'), item('obs', 'observation / appended'),
    item('sampled s0', 'sampled p≥0.9'), item('sampled s1', '≥0.6'),
    item('sampled s2', '≥0.3'), item('sampled s3', '≥0.1'), item('sampled s4', '<0.1'),
    item('special', '<|special|>'),
    h('span', { id: 'legend-version', class: 'legend-item',
      title: 'A weight update during the turn: the tokens from this mark on were sampled by ' +
        'the new policy version (v2), those before it by the old one.' },
    h('span', { class: 'version-mark', text: '→ v2' }), ' policy changed mid-turn'));
}

function messageCard(message, index, branch) {
  const role = message.role || '?';
  const atBranch = branch !== null && index === branch.message;
  const parts = [
    h('div', { class: 'msg-head' },
      h('span', { class: `role ${role}`, text: role }),
      h('span', { class: 'muted', text: `#${index}` }),
      message.name ? h('span', { class: 'muted', text: `name ${message.name}` }) : null,
      message.tool_call_id ? h('span', { class: 'muted', text: `call ${message.tool_call_id}` })
        : null),
    atBranch ? h('div', { class: 'branch-note',
      text: `first message that differs from segment ${branch.segment} (${branch.reason})` })
      : null,
  ];
  if (message.reasoning_content) {
    parts.push(h('details', { class: 'reasoning' },
      h('summary', { text: 'reasoning_content' }),
      h('pre', { text: message.reasoning_content })));
  }
  const content = typeof message.content === 'string' ? message.content
    : message.content === null || message.content === undefined ? ''
      : JSON.stringify(message.content, null, 2);
  if (content) parts.push(h('pre', { class: 'content', text: content }));
  for (const call of message.tool_calls || []) {
    const fn = call.function || {};
    const args = typeof fn.arguments === 'string' ? fn.arguments
      : JSON.stringify(fn.arguments, null, 2);
    parts.push(h('div', { class: 'tool-call' },
      h('span', { class: 'muted', text: `tool call ${call.id || ''} → ` }),
      h('strong', { text: fn.name || '?' }),
      h('pre', { text: args })));
  }
  return h('article', { class: `message ${role}${atBranch ? ' branch-point' : ''}` }, parts);
}

// What replaced turns of a segment, by the index of the turn that replaced
// them: "retry: 1 turn dropped".
function replacedTurns(rollbacks, segment) {
  const at = new Map();
  for (const r of rollbacks) {
    if (r.segment !== segment) continue;
    const text = `${r.reason}: ${r.dropped_turns} turn${r.dropped_turns === 1 ? '' : 's'} dropped`;
    at.set(r.turn, at.has(r.turn) ? `${at.get(r.turn)}; ${text}` : text);
  }
  return at;
}

// The policy version(s) that sampled a turn ("v1 → v2" when a weight update
// interrupted it) and the extra requests it took, each with its spans or
// requests as a tooltip.
function policyCell(t) {
  const spans = versionSpans(t);
  const continuations = t.continuations || [];
  return h('td', { class: 'policy' },
    spans.length
      ? h('span', { class: `badge version${spans.length > 1 ? ' changed' : ''}`,
        title: spansTitle(spans), text: versionsText(spans) })
      : h('span', { class: 'muted', text: '—' }),
    continuations.length
      ? h('span', { class: 'badge continued', title: continuationsTitle(continuations),
        text: continuationsText(continuations) })
      : null);
}

function turnTable(doc, stream, replaced) {
  const rows = doc.turns.map((t) => h('tr', { class: 'turn-row', onclick: () => stream.jumpToTurn(t) },
    h('td', { class: 'num' }, String(t.index)),
    h('td', { class: 'num' }, `${t.prompt_start}–${t.completion_start}`),
    h('td', { class: 'num' }, `${t.completion_start}–${t.completion_end}`),
    h('td', {}, badge(t.finish_reason ?? '—', 'finish')),
    h('td', { class: 'num' }, fmtInt(t.cached_tokens)),
    h('td', { class: 'num' }, fmtLatency(t.upstream_latency_s)),
    h('td', { class: 'url', title: t.worker }, t.worker),
    policyCell(t),
    h('td', { class: 'replaced' }, replaced.has(t.index) ? badge(replaced.get(t.index), 'rollback')
      : '')));
  return h('table', { id: 'turns', class: 'grid compact' },
    h('thead', {}, h('tr', {}, ['turn', 'prompt', 'sampled', 'finish', 'cached', 'latency',
      'worker', 'policy', 'replaced'].map((t) => h('th', { text: t })))),
    h('tbody', {}, rows));
}

function searchBox(doc, stream) {
  const input = h('input', { id: 'search', type: 'search', placeholder: 'token id, #position or text',
    autocomplete: 'off', spellcheck: 'false' });
  const status = h('span', { id: 'search-status', class: 'muted' });
  const cache = {};
  let result = { starts: [] };
  let at = -1;
  let last = null;
  const show = () => {
    if (!result.starts.length) {
      status.textContent = last ? `no ${result.what || 'match'} found` : '';
      return;
    }
    status.textContent = `${at + 1} / ${result.starts.length} (${result.what})`;
    stream.jump(result.starts[at]);
  };
  const step = (delta) => {
    if (input.value !== last) {
      last = input.value;
      result = search(doc, last, cache);
      stream.setHits(result.tokens);
      at = delta > 0 ? 0 : result.starts.length - 1;
    } else if (result.starts.length) {
      at = (at + delta + result.starts.length) % result.starts.length;
    }
    show();
  };
  input.addEventListener('keydown', (e) => {
    if (e.key === 'Enter') {
      e.preventDefault();
      step(e.shiftKey ? -1 : 1);
    }
  });
  return h('div', { class: 'search' }, input,
    h('button', { type: 'button', text: '‹', title: 'previous match', onclick: () => step(-1) }),
    h('button', { type: 'button', text: '›', title: 'next match', onclick: () => step(1) }),
    status);
}

const sum = (values) => values.reduce((a, b) => a + b, 0);

// Every segment (a link to each) and every rollback of the session. A session
// that never branched and never replaced a turn gets one line instead.
function segmentsPanel(doc, id, selected) {
  const segments = doc.segments;
  if (segments.length === 1 && !doc.rollbacks.length) {
    return h('p', { id: 'segments', class: 'muted small',
      text: 'One segment (the agent never rewrote its history) · no rollbacks.' });
  }
  const rows = segments.map((s) => h('tr', {
    class: `segment-row${s.index === selected ? ' selected' : ''}`,
    dataset: { segment: String(s.index) },
  },
  h('td', {}, h('a', { href: sessionHref(id, 'tokens', s.index), text: `segment ${s.index}` })),
  h('td', {}, branchText(s.branch)),
  h('td', {}, s.branch ? badge(s.branch.reason, 'reason') : '—'),
  h('td', { class: 'num' }, fmtInt(s.turns.length)),
  h('td', { class: 'num' }, fmtInt(s.token_ids.length)),
  h('td', { class: 'num' }, fmtInt(sum(s.loss_mask))),
  h('td', { class: 'num' }, fmtInt(s.prompt_length))));
  const rollbacks = doc.rollbacks.map((r) => h('tr', { class: 'rollback-row' },
    h('td', {}, badge(r.reason, 'reason')),
    h('td', {}, h('a', { href: sessionHref(id, 'tokens', r.segment), text: `segment ${r.segment}` })),
    h('td', {}, `turn ${r.turn}`),
    h('td', { class: 'num' }, fmtInt(r.dropped_turns)),
    h('td', {}, `#${r.message}`),
    h('td', { class: 'num' }, fmtAge(ageOf(r.created_at)))));
  const head = (titles) => h('thead', {}, h('tr', {}, titles.map((t) => h('th', { text: t }))));
  return h('section', { id: 'segments', class: 'panel' },
    h('h3', { text: `Segments (${segments.length})` }),
    h('table', { id: 'segments-table', class: 'grid compact' },
      head(['segment', 'branched from', 'reason', 'turns', 'tokens', 'sampled', 'first prompt']),
      h('tbody', {}, rows)),
    h('h3', { class: 'gap', text: `Rollbacks: turns replaced in place (${rollbacks.length})` }),
    rollbacks.length
      ? h('table', { id: 'rollbacks', class: 'grid compact' },
        head(['reason', 'segment', 'replaced at', 'turns dropped', 'first differing message',
          'ago']),
        h('tbody', {}, rollbacks))
      : h('p', { id: 'rollbacks', class: 'muted small', text: 'None: no turn was replaced.' }));
}

// The segment `?segment=` names, the last one without it.
function pickSegment(segments, segment) {
  if (segment === null) return segments.length - 1;
  const k = /^\d+$/.test(segment) ? Number(segment) : NaN;
  if (!(k < segments.length)) {
    throw new Error(`There is no segment ${segment}: the session has ${segments.length} ` +
      `(0 to ${segments.length - 1}).`);
  }
  return k;
}

async function tokensTab(body, id, segment, isAlive) {
  const whole = await api(`/sessions/${encodeURIComponent(id)}/trajectory?include=turns,messages,pieces`);
  if (!isAlive()) return;
  const k = pickSegment(whole.segments, segment);
  const doc = whole.segments[k];
  const n = whole.segments.length;
  const replaced = replacedTurns(whole.rollbacks, k);
  const sampled = sum(doc.loss_mask);
  const streamBox = h('div', { id: 'tokens', class: 'tokens' });
  const stream = new TokenStream(streamBox, doc, document.getElementById('tip'), replaced);
  // dom.js append: the branch line is null for a session of one segment.
  append(clear(body), [
    segmentsPanel(whole, id, k),
    h('p', { id: 'session-summary', class: 'muted' },
      `segment ${k} of ${n} · ${whole.status} · model ${whole.model ?? '—'} · ` +
      `${fmtInt(doc.token_ids.length)} tokens ` +
      `(${fmtInt(doc.prompt_length)} first prompt, ${fmtInt(sampled)} sampled) · ` +
      `${doc.turns.length} turns · ${doc.messages.length} messages`),
    n > 1 ? h('p', { id: 'branch', class: 'branch' }, doc.branch === null
      ? `Segment ${k}: the start of the session.`
      : [`Segment ${k} branched from ${branchText(doc.branch)}: `,
        badge(doc.branch.reason, 'reason'),
        `: ${describeReason(doc.branch.reason)}. Its first prompt is the render of that request; ` +
        `messages before #${doc.branch.message} are those of segment ${doc.branch.segment}.`])
      : null,
    h('div', { class: 'split' },
      h('section', { class: 'panel left' },
        h('div', { class: 'toolbar' }, searchBox(doc, stream), legend()),
        turnTable(doc, stream, replaced),
        streamBox),
      h('section', { class: 'panel right' },
        h('h3', { text: 'Messages' }),
        h('div', { id: 'messages', class: 'messages' },
          doc.messages.map((m, i) => messageCard(m, i, doc.branch)))))]);
}

export function sessionView(root, id, tab, segment = null) {
  let alive = true;
  const isAlive = () => alive;
  const tabLink = (name, label) => h('a', {
    class: `tab${tab === name ? ' active' : ''}`, id: `tab-${name}`,
    href: sessionHref(id, name, segment), text: label,
  });
  const body = h('div', { id: 'session-body' }, h('p', { class: 'muted', text: 'loading…' }));
  clear(root).append(
    h('div', { class: 'toolbar session-head' },
      h('a', { href: '#/', text: '‹ sessions' }),
      h('h2', { id: 'session-id', text: id }),
      tabLink('tokens', 'tokens'), tabLink('diff', 'diff vs re-render')),
    body);
  const load = tab === 'diff' ? diffView(body, id, segment, isAlive)
    : tokensTab(body, id, segment, isAlive);
  load.catch((error) => {
    if (alive) clear(body).append(h('p', { class: 'error', id: 'load-error', text: error.message }));
  });
  return () => {
    alive = false;
    document.getElementById('tip').hidden = true;
  };
}
