// The inspector's entry point: a hash router over three views.
//   #/               overview (sessions + workers)
//   #/s/<id>         one session, token by token
//   #/s/<id>/diff    committed ids vs a fresh re-render of the messages
// Both session views take `?segment=<k>` (default: the last segment).

import { api, setupKeyButtons } from './api.js';
import { fmtInt } from './dom.js';
import { overview } from './overview.js';
import { sessionView } from './session.js';

const root = document.getElementById('view');
let leave = null;

function route() {
  if (leave) leave();
  leave = null;
  const path = location.hash.slice(1) || '/';
  const match = /^\/s\/([^/?]+)(\/diff)?(?:\?(.*))?$/.exec(path);
  if (match) {
    const segment = new URLSearchParams(match[3] || '').get('segment');
    leave = sessionView(root, decodeURIComponent(match[1]), match[2] ? 'diff' : 'tokens', segment);
  } else {
    leave = overview(root);
  }
}

// The header line; the overview keeps it fresh (GET /health needs no key).
api('/health').then((health) => {
  document.getElementById('server-info').textContent =
    `${fmtInt(health.sessions)} sessions · workers ${health.workers.healthy}/` +
    `${health.workers.total} healthy · instance ${health.instance_id.slice(0, 8)}`;
}).catch(() => {});

setupKeyButtons(route);
window.addEventListener('hashchange', route);
route();
