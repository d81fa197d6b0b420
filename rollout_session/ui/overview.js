// Overview: the sessions (filter by state, paged with the server's cursor)
// and the worker pool, refreshed every few seconds without reloading.

import { api, ApiError } from './api.js';
import { ageOf, badge, clear, fmtAge, fmtInt, h, sessionHref } from './dom.js';

const REFRESH_MS = 3000;
const STATES = ['', 'open', 'closing', 'expired', 'closed'];
const LIMITS = [25, 50, 100, 250];

// Kept across visits of the overview (going back from a session keeps the page).
const view = { state: '', limit: 25, cursors: [null] };

function sessionRow(s) {
  const href = sessionHref(s.session_id);
  const meta = Object.keys(s.metadata || {}).length ? JSON.stringify(s.metadata) : '';
  return h('tr', { class: 'session-row', dataset: { id: s.session_id } },
    h('td', { class: 'id' }, h('a', { href, title: s.session_id, text: s.session_id })),
    h('td', {}, badge(s.state)),
    h('td', { class: 'num' }, fmtInt(s.num_turns)),
    h('td', { class: 'num' }, fmtInt(s.num_tokens)),
    // More than one segment, or any rollback: the agent rewrote its history.
    h('td', { class: `num segments${s.num_segments > 1 ? ' flag' : ''}` }, fmtInt(s.num_segments)),
    h('td', { class: `num rollbacks${s.num_rollbacks > 0 ? ' flag' : ''}` },
      fmtInt(s.num_rollbacks)),
    h('td', { class: 'url', title: s.worker || '' }, s.worker || '—'),
    h('td', { class: 'num' }, fmtAge(ageOf(s.created_at))),
    h('td', { class: 'num' }, fmtAge(ageOf(s.last_active_at))),
    h('td', { class: 'meta', title: meta }, meta),
    h('td', {}, h('a', { href: sessionHref(s.session_id, 'diff'), text: 'diff' })));
}

// The pool is the operator's: with the trainer's key (and --admin-api-key
// set) it is 403, and the rest of the overview still shows.
function operatorOnly(error) {
  if (error instanceof ApiError && error.status === 403) return null;
  throw error;
}

function workerRow(w) {
  // Joining: not admitted yet; fenced: failed turns opened its circuit.
  const health = w.draining ? 'draining' : w.healthy ? 'healthy'
    : w.state === 'joining' ? 'joining'
    : w.state === 'healthy' && w.circuit !== 'closed' ? 'fenced' : 'unhealthy';
  return h('tr', { class: 'worker-row' },
    h('td', { class: 'url' }, w.url),
    h('td', {}, badge(health)),
    h('td', { class: 'num' }, fmtInt(w.active_sessions)),
    h('td', { class: 'num' }, fmtInt(w.inflight)),
    h('td', { class: 'num' }, fmtInt(w.consecutive_failures)),
    h('td', { class: 'num' }, fmtAge(ageOf(w.last_checked_at))));
}

function table(id, headings, tbody) {
  return h('table', { id, class: 'grid' },
    h('thead', {}, h('tr', {}, headings.map((t) => h('th', { text: t })))),
    tbody);
}

function select(id, values, current, label, onChange) {
  const el = h('select', { id, onchange: (e) => onChange(e.target.value) },
    values.map((v) => h('option', { value: v, selected: String(v) === String(current) },
      label(v))));
  return el;
}

export function overview(root) {
  let alive = true;
  let timer = null;
  const sessionsBody = h('tbody', { id: 'sessions-body' });
  const workersBody = h('tbody', { id: 'workers-body' });
  const pageLabel = h('span', { class: 'muted' });
  const updated = h('span', { id: 'updated', class: 'muted' });
  const prev = h('button', { id: 'prev-page', type: 'button', text: '‹ prev' });
  const next = h('button', { id: 'next-page', type: 'button', text: 'next ›' });
  const empty = h('p', { class: 'muted', hidden: true, text: 'No sessions.' });

  const restart = () => {
    clearTimeout(timer);
    refresh();
  };
  prev.addEventListener('click', () => {
    if (view.cursors.length > 1) view.cursors.pop();
    restart();
  });
  next.addEventListener('click', () => {
    const rows = sessionsBody.querySelectorAll('tr.session-row');
    if (rows.length) view.cursors.push(rows[rows.length - 1].dataset.id);
    restart();
  });

  clear(root).append(
    h('section', { class: 'panel' },
      h('div', { class: 'toolbar' },
        h('h2', { text: 'Sessions' }),
        h('label', {}, 'state ', select('state-filter', STATES, view.state,
          (v) => v || 'all', (v) => { view.state = v; view.cursors = [null]; restart(); })),
        h('label', {}, 'per page ', select('page-size', LIMITS, view.limit, String,
          (v) => { view.limit = Number(v); view.cursors = [null]; restart(); })),
        prev, pageLabel, next,
        h('span', { class: 'spacer' }), updated),
      table('sessions', ['session', 'state', 'turns', 'tokens', 'segments', 'rollbacks',
        'worker', 'age', 'idle', 'metadata', ''], sessionsBody),
      empty),
    h('section', { class: 'panel' },
      h('div', { class: 'toolbar' }, h('h2', { text: 'Workers' })),
      table('workers', ['worker', 'health', 'active sessions', 'in flight', 'failures',
        'last check'], workersBody)));

  async function refresh() {
    const params = new URLSearchParams({ limit: String(view.limit) });
    if (view.state) params.set('state', view.state);
    const cursor = view.cursors[view.cursors.length - 1];
    if (cursor) params.set('after', cursor);
    try {
      const [sessions, workers, health] = await Promise.all([
        api(`/sessions?${params}`), api('/workers').catch(operatorOnly), api('/health')]);
      if (!alive) return;
      sessionsBody.replaceChildren(...sessions.sessions.map(sessionRow));
      workersBody.replaceChildren(...(workers === null
        ? [h('tr', {}, h('td', { colspan: '6', class: 'muted',
          text: 'The worker pool needs the operator key (--admin-api-key).' }))]
        : workers.workers.map(workerRow)));
      empty.hidden = sessions.sessions.length > 0;
      prev.disabled = view.cursors.length <= 1;
      next.disabled = !sessions.has_more;
      pageLabel.textContent = `page ${view.cursors.length}`;
      document.getElementById('server-info').textContent =
        `${fmtInt(health.sessions)} sessions · workers ${health.workers.healthy}/` +
        `${health.workers.total} healthy · instance ${health.instance_id.slice(0, 8)}`;
      updated.textContent = `updated ${new Date().toLocaleTimeString()}`;
      updated.classList.remove('error');
    } catch (error) {
      if (!alive) return;
      if (error instanceof ApiError && error.status === 400 && cursor) {
        // The page's cursor session was collected meanwhile: start over.
        view.cursors = [null];
      }
      updated.textContent = `refresh failed: ${error.message}`;
      updated.classList.add('error');
    } finally {
      if (alive) timer = setTimeout(refresh, REFRESH_MS);
    }
  }

  refresh();
  return () => {
    alive = false;
    clearTimeout(timer);
  };
}
