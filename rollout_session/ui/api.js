// The server's JSON API, with the API key when the server wants one.
//
// The key is asked for the first time a request answers 401, kept in this
// tab's sessionStorage (gone when the tab closes, never sent anywhere but
// this origin) and sent as `Authorization: Bearer <key>`. Requests that meet
// a 401 while the dialog is open all wait for the same answer, then retry.

const KEY = 'rollout-session.api-key';
let pending = null;

export class ApiError extends Error {
  constructor(status, message, code) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

export function forgetKey() {
  sessionStorage.removeItem(KEY);
}

// Resolves once a key was typed, or (optional asks only) the dialog was
// dismissed with Escape; a request that then meets 401 again asks again.
export function askKey(message, { optional = false } = {}) {
  const dialog = document.getElementById('auth');
  if (pending) {
    if (!optional) dialog.dataset.optional = '';
    return pending;
  }
  const form = document.getElementById('auth-form');
  const input = document.getElementById('auth-key');
  document.getElementById('auth-message').textContent = message;
  dialog.dataset.optional = optional ? '1' : '';
  input.value = '';
  pending = new Promise((resolve) => {
    const done = () => {
      form.removeEventListener('submit', submit);
      dialog.removeEventListener('cancel', cancel);
      dialog.close();
      pending = null;
      resolve();
    };
    const submit = (event) => {
      event.preventDefault();
      if (!input.value) return;
      sessionStorage.setItem(KEY, input.value);
      done();
    };
    const cancel = (event) => {
      event.preventDefault();
      if (dialog.dataset.optional) done();
    };
    form.addEventListener('submit', submit);
    dialog.addEventListener('cancel', cancel);
  });
  dialog.showModal();
  input.focus();
  return pending;
}

export async function api(path) {
  for (;;) {
    const key = sessionStorage.getItem(KEY);
    const headers = { Accept: 'application/json' };
    if (key !== null) headers.Authorization = `Bearer ${key}`;
    const response = await fetch(path, { headers, cache: 'no-store', credentials: 'omit' });
    if (response.status === 401) {
      await askKey(key === null
        ? 'This server needs its API key (--api-key).'
        : 'The server refused that key. Try again.');
      continue;
    }
    let body = null;
    try {
      body = await response.json();
    } catch {
      body = null;
    }
    if (!response.ok) {
      const error = body && body.error ? body.error : {};
      throw new ApiError(response.status, error.message || response.statusText, error.code);
    }
    return body;
  }
}

export function setupKeyButtons(onChange) {
  document.getElementById('key-button').addEventListener('click', async () => {
    await askKey('Type the API key of this server (Escape to keep the current one).',
      { optional: true });
    onChange();
  });
  document.getElementById('forget-key').addEventListener('click', () => {
    forgetKey();
    onChange();
  });
}
