// Diff view: one segment's committed ids against a fresh full re-render of
// its stored messages (GET /sessions/{id}/diff?segment=k, the last segment
// without k), first mismatch highlighted.
//
// Only the committed length is compared: the committed ids end with the last
// sampled token, the re-render goes on with the template's end of that turn
// (the "tail"), which is expected and not a mismatch.

import { api } from './api.js';
import { badge, branchText, clear, fmtInt, h, quoted, sessionHref } from './dom.js';

const RADII = [10, 40, 200];

function summary(d) {
  if (d.first_mismatch === null) {
    const tail = d.tail.length
      ? ` The re-render goes on with ${d.tail.length} more token(s) ` +
        `${d.tail.map((_, k) => quoted(d.rerendered_pieces[d.compared + k])).join(' ')}: ` +
        (d.tail_expected
          ? 'the template\'s end of the last turn, appended when the next turn comes.'
          : 'NOT the turn end the server would append; look at the template.')
      : '';
    return h('div', { id: 'diff-summary', class: d.tail_expected || !d.tail.length ? 'ok' : 'warn' },
      h('strong', { text: 'No mismatch.' }),
      ` All ${fmtInt(d.compared)} committed tokens equal the template's re-render of the ` +
      `stored messages.${tail}`);
  }
  const m = d.first_mismatch;
  const kind = d.first_mismatch_sampled ? ', a sampled token' : ', a prompt token';
  const side = (ids, pieces) => (m < ids.length ? `${ids[m]} ${quoted(pieces[m])}` : 'nothing (ends)');
  return h('div', { id: 'diff-summary', class: 'bad' },
    h('strong', { text: `First mismatch at token #${m}` }),
    `${d.first_mismatch_turn === null ? '' : ` (turn ${d.first_mismatch_turn})`}${kind}: `,
    'committed ', h('code', { text: side(d.committed_ids, d.committed_pieces) }),
    ' vs re-render ', h('code', { text: side(d.rerendered_ids, d.rerendered_pieces) }),
    '. The template renders the stored conversation differently from what the model saw ' +
    '(e.g. it strips earlier <think> blocks); positions after this one are shifted.');
}

function rows(d, radius) {
  const m = d.first_mismatch;
  const centre = m === null ? d.compared : m;
  const from = Math.max(0, centre - radius);
  const to = Math.min(Math.max(d.committed_ids.length, d.rerendered_ids.length), centre + radius);
  const out = [];
  for (let i = from; i < to; i++) {
    const a = i < d.committed_ids.length;
    const b = i < d.rerendered_ids.length;
    let cls = 'same';
    if (i === m) cls = 'mismatch';
    else if (m !== null && i > m) cls = 'after';
    else if (!a) cls = 'tail';
    out.push(h('tr', { class: `diff-row ${cls}`, dataset: { i: String(i) } },
      h('td', { class: 'num', text: `#${i}` }),
      h('td', { class: 'num', text: a ? String(d.committed_ids[i]) : '' }),
      h('td', { class: 'piece', text: a ? quoted(d.committed_pieces[i]) : '' }),
      h('td', { class: 'eq', text: a && b ? (d.committed_ids[i] === d.rerendered_ids[i] ? '=' : '≠') : '' }),
      h('td', { class: 'num', text: b ? String(d.rerendered_ids[i]) : '' }),
      h('td', { class: 'piece', text: b ? quoted(d.rerendered_pieces[i]) : '' })));
  }
  return out;
}

// Which segment this is, and links to the others' diffs.
function segmentLine(d) {
  const links = [];
  for (let k = 0; d.num_segments > 1 && k < d.num_segments; k++) {
    links.push(h('a', { class: `tab${k === d.segment ? ' active' : ''}`, dataset: { segment: String(k) },
      href: sessionHref(d.session_id, 'diff', k), text: `segment ${k}` }));
  }
  return h('div', { class: 'toolbar' },
    h('span', { id: 'diff-segment' }, `segment ${d.segment} of ${d.num_segments} · `,
      d.branch === null ? 'start of the session'
        : [`branched from ${branchText(d.branch)} `, badge(d.branch.reason, 'reason')]),
    links.length ? h('nav', { id: 'diff-segments', class: 'toolbar' }, links) : null);
}

export async function diffView(body, id, segment, isAlive) {
  const query = segment === null ? '' : `?segment=${encodeURIComponent(segment)}`;
  const d = await api(`/sessions/${encodeURIComponent(id)}/diff${query}`);
  if (!isAlive()) return;
  const tbody = h('tbody', { id: 'diff-body' });
  let radius = RADII[0];
  const draw = () => tbody.replaceChildren(...rows(d, radius));
  const picker = h('select', { id: 'diff-radius',
    onchange: (e) => { radius = Number(e.target.value); draw(); } },
  RADII.map((r) => h('option', { value: r, text: `±${r} tokens` })));
  draw();
  clear(body).append(
    segmentLine(d),
    summary(d),
    h('p', { class: 'muted' },
      `${fmtInt(d.committed_ids.length)} committed tokens over ${d.num_turns} turns · ` +
      `${fmtInt(d.rerendered_ids.length)} re-rendered tokens · showing `, picker,
      d.first_mismatch === null ? ' around the end' : ' around the first mismatch'),
    h('section', { class: 'panel' },
      h('table', { id: 'diff', class: 'grid diff' },
        h('thead', {}, h('tr', {}, ['pos', 'committed id', 'committed piece', '',
          're-render id', 're-render piece'].map((t) => h('th', { text: t })))),
        tbody)));
  const target = tbody.querySelector('tr.mismatch');
  if (target) target.scrollIntoView({ block: 'center' });
}
