// The token stream of one trajectory: one span per token, drawn lazily.
//
// A 32k-token trajectory is 32k spans: drawing them all at once stalls the
// page, so tokens are drawn in chunks of CHUNK as a sentinel below the last
// one scrolls into view (IntersectionObserver), and on demand up to a token
// a search or a turn link jumps to. Hover shows a token's details in one
// shared tooltip element (event delegation: no listener per token).

import {
  continuationsText, fmtVersion, h, isSpecial, quoted, shownPiece, versionSpans, versionsText,
} from './dom.js';

export const CHUNK = 2000;

// Sampled-token shading by probability (exp(logprob)); see style.css .s0–.s4.
const BUCKETS = [0.9, 0.6, 0.3, 0.1];

export function bucket(logprob) {
  const p = Math.exp(logprob);
  const k = BUCKETS.findIndex((b) => p >= b);
  return k === -1 ? BUCKETS.length : k;
}

// `doc` is one segment of the export document (token_ids, loss_mask,
// logprobs, pieces, prompt_length, turns); `replaced` maps a turn index to a
// note on the turns it replaced (a retry, a rollback).
export class TokenStream {
  constructor(container, doc, tip, replaced = new Map()) {
    this.container = container;
    this.doc = doc;
    this.replaced = replaced;
    this.tip = tip;
    this.n = doc.token_ids.length;
    this.nodes = [];
    this.rendered = 0;
    this.hits = new Set();
    this.current = null;
    // What is drawn before a token: a turn's bar at its first prompt token,
    // and a policy-change mark at the first token of each of its version
    // spans after the first (one map lookup per token for both).
    this.marksAt = new Map();
    const mark = (i, draw) => {
      if (this.marksAt.has(i)) this.marksAt.get(i).push(draw); else this.marksAt.set(i, [draw]);
    };
    this.turnByIndex = new Map();
    for (const t of doc.turns) {
      this.turnByIndex.set(t.index, t);
      mark(t.prompt_start, () => this.turnMark(t));
      const spans = versionSpans(t);
      for (let k = 1; k < spans.length; k++) {
        mark(spans[k].start, () => this.versionMark(t, spans, k));
      }
    }
    this.finishAt = new Map(doc.turns.map((t) => [t.completion_end - 1, t]));
    this.turnOf = new Int32Array(this.n);
    for (const t of doc.turns) this.turnOf.fill(t.index, t.prompt_start, t.completion_end);
    this.sentinel = h('div', { class: 'sentinel', 'aria-hidden': 'true' });
    container.replaceChildren(this.sentinel);
    this.observer = new IntersectionObserver((entries) => {
      if (entries.some((e) => e.isIntersecting)) this.renderNext();
    }, { root: container, rootMargin: '600px 0px' });
    container.addEventListener('mouseover', (e) => this.hover(e));
    container.addEventListener('mouseleave', () => { this.tip.hidden = true; });
    this.renderNext();
    if (this.rendered < this.n) this.observer.observe(this.sentinel);
  }

  kind(i) {
    if (this.doc.loss_mask[i]) return 'sampled';
    return i < this.doc.prompt_length ? 'prompt' : 'obs';
  }

  turnMark(t) {
    const sampled = t.completion_end - t.completion_start;
    const spans = versionSpans(t);
    const continuations = t.continuations || [];
    return h('div', { class: 'turn-mark', id: `turn-${t.index}` },
      h('strong', { text: `turn ${t.index}` }),
      ` · prompt ${t.prompt_start}–${t.completion_start} (${t.completion_start - t.prompt_start})`,
      ` · sampled ${t.completion_start}–${t.completion_end} (${sampled})`,
      ` · finish ${t.finish_reason ?? '—'}`,
      ` · cached ${t.cached_tokens ?? '—'}`,
      ` · ${(t.upstream_latency_s * 1000).toFixed(1)} ms`,
      ` · ${t.worker}`,
      spans.length ? ` · weights ${versionsText(spans)}` : '',
      continuations.length ? ` · ${continuationsText(continuations)}` : '',
      this.replaced.has(t.index) ? ` · replaced earlier turns (${this.replaced.get(t.index)})` : '');
  }

  // The mark before the first token of `spans[k]`: a thin rule and "→ v2".
  versionMark(t, spans, k) {
    const span = spans[k];
    const before = spans[k - 1];
    return h('span', {
      class: 'version-mark',
      dataset: { start: String(span.start), turn: String(t.index) },
      title: `turn ${t.index}: tokens #${span.start}–${span.end} (${span.end - span.start}) ` +
        `sampled by ${fmtVersion(span.version)}; #${before.start}–${before.end} ` +
        `(${before.end - before.start}) by ${fmtVersion(before.version)}`,
      text: `→ ${fmtVersion(span.version)}`,
    });
  }

  // The version that sampled token i (a sampled token of turn `turnOf[i]`).
  versionOf(i) {
    const spans = versionSpans(this.turnByIndex.get(this.turnOf[i]) || { weight_versions: [] });
    const k = spans.findIndex((s) => s.start <= i && i < s.end);
    return k === -1 ? null : { version: spans[k].version, k, of: spans.length };
  }

  tokenNode(i) {
    const piece = this.doc.pieces[i];
    const kind = this.kind(i);
    let cls = `tok ${kind}`;
    if (kind === 'sampled') cls += ` s${bucket(this.doc.logprobs[i])}`;
    if (isSpecial(piece)) cls += ' special';
    if (this.hits.has(i)) cls += ' hit';
    const span = document.createElement('span');
    span.className = cls;
    span.dataset.i = String(i);
    span.textContent = shownPiece(piece);
    return span;
  }

  renderNext() {
    if (this.rendered >= this.n) return;
    const end = Math.min(this.n, this.rendered + CHUNK);
    const fragment = document.createDocumentFragment();
    for (let i = this.rendered; i < end; i++) {
      const marks = this.marksAt.get(i);
      if (marks) for (const draw of marks) fragment.append(draw());
      const node = this.tokenNode(i);
      this.nodes.push(node);
      fragment.append(node);
      const finished = this.finishAt.get(i);
      if (finished && finished.completion_end > finished.completion_start) {
        fragment.append(h('span', { class: 'finish-mark', text: `end · ${finished.finish_reason}` }));
      }
    }
    this.container.insertBefore(fragment, this.sentinel);
    this.rendered = end;
    if (this.rendered >= this.n) {
      this.observer.disconnect();
      this.sentinel.remove();
    }
  }

  ensure(i) {
    while (this.rendered <= i && this.rendered < this.n) this.renderNext();
  }

  jump(i, { mark = true } = {}) {
    if (i < 0 || i >= this.n) return;
    this.ensure(i);
    if (mark) {
      if (this.current !== null) this.nodes[this.current].classList.remove('current');
      this.current = i;
      this.nodes[i].classList.add('current');
    }
    this.nodes[i].scrollIntoView({ block: 'center' });
  }

  jumpToTurn(t) {
    this.ensure(t.prompt_start);
    const mark = this.container.querySelector(`#turn-${t.index}`);
    if (mark) mark.scrollIntoView({ block: 'start' });
  }

  setHits(hits) {
    for (const i of this.hits) if (i < this.rendered) this.nodes[i].classList.remove('hit');
    this.hits = hits;
    for (const i of hits) if (i < this.rendered) this.nodes[i].classList.add('hit');
  }

  describe(i) {
    const { token_ids: ids, logprobs, pieces } = this.doc;
    const lines = [`#${i} · id ${ids[i]} · turn ${this.turnOf[i]}`];
    const kind = this.kind(i);
    if (kind === 'sampled') {
      const lp = logprobs[i];
      lines.push(`sampled · logprob ${lp.toFixed(4)} · p ${Math.exp(lp).toFixed(3)}`);
      const policy = this.versionOf(i);
      if (policy) {
        lines.push(`policy ${fmtVersion(policy.version)}` +
          (policy.of > 1 ? ` (span ${policy.k + 1} of ${policy.of})` : ''));
      }
    } else {
      lines.push(kind === 'prompt' ? 'prompt (mask 0)' : 'observation / appended (mask 0)');
    }
    lines.push(`piece ${quoted(pieces[i])}`);
    return lines.join('\n');
  }

  hover(event) {
    const node = event.target.closest ? event.target.closest('.tok') : null;
    if (!node) return;
    const i = Number(node.dataset.i);
    this.tip.textContent = this.describe(i);
    this.tip.hidden = false;
    const box = node.getBoundingClientRect();
    const width = this.tip.offsetWidth;
    const left = Math.min(box.left, window.innerWidth - width - 8);
    const below = box.bottom + 6 + this.tip.offsetHeight < window.innerHeight;
    this.tip.style.left = `${Math.max(4, left) + window.scrollX}px`;
    this.tip.style.top = `${(below ? box.bottom + 6 : box.top - this.tip.offsetHeight - 6)
      + window.scrollY}px`;
  }
}

// Search: `#N` is a position, a plain number a token id, anything else text
// (matched across token boundaries in the concatenated pieces).
export function search(doc, query, cache) {
  const q = query.trim();
  if (!q) return { starts: [], tokens: new Set(), what: '' };
  const position = /^#(\d+)$/.exec(q);
  if (position) {
    const i = Number(position[1]);
    const ok = i < doc.token_ids.length;
    return { starts: ok ? [i] : [], tokens: new Set(ok ? [i] : []), what: 'position' };
  }
  if (/^\d+$/.test(q)) {
    const id = Number(q);
    const starts = [];
    doc.token_ids.forEach((t, i) => { if (t === id) starts.push(i); });
    return { starts, tokens: new Set(starts), what: 'token id' };
  }
  if (!cache.text) {
    cache.offsets = new Int32Array(doc.pieces.length + 1);
    let at = 0;
    doc.pieces.forEach((p, i) => { cache.offsets[i] = at; at += p.length; });
    cache.offsets[doc.pieces.length] = at;
    cache.text = doc.pieces.join('');
  }
  const tokenAt = (offset) => {
    let lo = 0;
    let hi = doc.pieces.length - 1;
    while (lo < hi) {
      const mid = (lo + hi + 1) >> 1;
      if (cache.offsets[mid] <= offset) lo = mid; else hi = mid - 1;
    }
    return lo;
  };
  const starts = [];
  const tokens = new Set();
  for (let at = cache.text.indexOf(q); at !== -1 && starts.length < 10000;
    at = cache.text.indexOf(q, at + 1)) {
    const first = tokenAt(at);
    const last = tokenAt(at + q.length - 1);
    if (starts[starts.length - 1] !== first) starts.push(first);
    for (let i = first; i <= last; i++) tokens.add(i);
  }
  return { starts, tokens, what: 'text' };
}
