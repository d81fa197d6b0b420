// Session view: the trajectory token by token next to the stored messages,
// the turn table, and a search box; the "diff" tab is in diff.js.

import { api } from './api.js';
import { diffView } from './diff.js';
import { badge, clear, fmtInt, fmtLatency, h, sessionHref } from './dom.js';
import { TokenStream, search } from './tokens.js';

function legend() {
  const item = (cls, text) => h('span', { class: `legend-item tok ${cls}`, text });
  return h('div', { class: 'legend' },
    item('prompt', 'prompt'), item('obs', 'observation / appended'),
    item('sampled s0', 'sampled p≥0.9'), item('sampled s1', '≥0.6'),
    item('sampled s2', '≥0.3'), item('sampled s3', '≥0.1'), item('sampled s4', '<0.1'),
    item('special', '<|special|>'));
}

function messageCard(message, index) {
  const role = message.role || '?';
  const parts = [
    h('div', { class: 'msg-head' },
      h('span', { class: `role ${role}`, text: role }),
      h('span', { class: 'muted', text: `#${index}` }),
      message.name ? h('span', { class: 'muted', text: `name ${message.name}` }) : null,
      message.tool_call_id ? h('span', { class: 'muted', text: `call ${message.tool_call_id}` })
        : null),
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
  return h('article', { class: `message ${role}` }, parts);
}

function turnTable(doc, stream) {
  const rows = doc.turns.map((t) => h('tr', { class: 'turn-row', onclick: () => stream.jumpToTurn(t) },
    h('td', { class: 'num' }, String(t.index)),
    h('td', { class: 'num' }, `${t.prompt_start}–${t.completion_start}`),
    h('td', { class: 'num' }, `${t.completion_start}–${t.completion_end}`),
    h('td', {}, badge(t.finish_reason ?? '—', 'finish')),
    h('td', { class: 'num' }, fmtInt(t.cached_tokens)),
    h('td', { class: 'num' }, fmtLatency(t.upstream_latency_s)),
    h('td', { class: 'url', title: t.worker }, t.worker)));
  return h('table', { id: 'turns', class: 'grid compact' },
    h('thead', {}, h('tr', {}, ['turn', 'prompt', 'sampled', 'finish', 'cached', 'latency',
      'worker'].map((t) => h('th', { text: t })))),
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

async function tokensTab(body, id, isAlive) {
  const doc = await api(`/sessions/${encodeURIComponent(id)}/trajectory?include=turns,messages,pieces`);
  if (!isAlive()) return;
  const sampled = doc.loss_mask.reduce((a, b) => a + b, 0);
  const streamBox = h('div', { id: 'tokens', class: 'tokens' });
  const stream = new TokenStream(streamBox, doc, document.getElementById('tip'));
  clear(body).append(
    h('p', { id: 'session-summary', class: 'muted' },
      `${doc.status} · model ${doc.model ?? '—'} · ${fmtInt(doc.token_ids.length)} tokens ` +
      `(${fmtInt(doc.prompt_length)} first prompt, ${fmtInt(sampled)} sampled) · ` +
      `${doc.turns.length} turns · ${doc.messages.length} messages`),
    h('div', { class: 'split' },
      h('section', { class: 'panel left' },
        h('div', { class: 'toolbar' }, searchBox(doc, stream), legend()),
        turnTable(doc, stream),
        streamBox),
      h('section', { class: 'panel right' },
        h('h3', { text: 'Messages' }),
        h('div', { id: 'messages', class: 'messages' }, doc.messages.map(messageCard)))));
}

export function sessionView(root, id, tab) {
  let alive = true;
  const isAlive = () => alive;
  const tabLink = (name, label) => h('a', {
    class: `tab${tab === name ? ' active' : ''}`, id: `tab-${name}`,
    href: sessionHref(id, name), text: label,
  });
  const body = h('div', { id: 'session-body' }, h('p', { class: 'muted', text: 'loading…' }));
  clear(root).append(
    h('div', { class: 'toolbar session-head' },
      h('a', { href: '#/', text: '‹ sessions' }),
      h('h2', { id: 'session-id', text: id }),
      tabLink('tokens', 'tokens'), tabLink('diff', 'diff vs re-render')),
    body);
  const load = tab === 'diff' ? diffView(body, id, isAlive) : tokensTab(body, id, isAlive);
  load.catch((error) => {
    if (alive) clear(body).append(h('p', { class: 'error', id: 'load-error', text: error.message }));
  });
  return () => {
    alive = false;
    document.getElementById('tip').hidden = true;
  };
}
