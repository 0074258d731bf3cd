"""The web agent's page side: scripts run in the page and the text view's element lines.

- `SCREENSHOT_STYLE`: applied only while a screenshot is taken (no focus rings), so the same page
  state gives the same pixels.
- `INIT_SCRIPT`: keeps every page in one tab (targets stripped, `window.open` navigates in place).
- `OBSERVE_JS`: the text view's data: title, scroll position, the text in the viewport, the
  numbered interactive elements (marked `data-agentwin-id` for the actions).
- `describe_element`: one element line, `[3] link 'Next page' -> /b.html`.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

# Applied only while the screenshot is taken: the same page always gives the same pixels.
SCREENSHOT_STYLE = "*:focus, *:focus-visible { outline: none !important; }"
# Keep every page in one tab: links and forms with a target, and window.open, navigate in place.
INIT_SCRIPT = """
(() => {
  const strip = (e) => {
    const el = e.target && e.target.closest ? e.target.closest('a[target], form[target], area[target]') : null;
    if (el) el.removeAttribute('target');
  };
  document.addEventListener('click', strip, true);
  document.addEventListener('submit', strip, true);
  window.open = (url) => { if (url) location.href = url; return null; };
})();
"""
# The text view: title, scroll position, the text in the viewport, the numbered elements.
OBSERVE_JS = """
([maxChars, maxElements]) => {
  const vh = window.innerHeight;
  const root = document.body || document.documentElement;
  const shown = (el) => {
    if (!el || !el.getBoundingClientRect) return false;
    if (el.checkVisibility && !el.checkVisibility({opacityProperty: true, visibilityProperty: true})) return false;
    const r = el.getBoundingClientRect();
    return r.width > 0 && r.height > 0;
  };
  const inView = (r) => r.bottom > 0 && r.top < vh;
  const clean = (s, n) => { s = (s || '').replace(/\\s+/g, ' ').trim(); return s.length > n ? s.slice(0, n - 1) + '…' : s; };
  let text = '', lastBottom = null;
  if (root) {
    const walker = document.createTreeWalker(root, NodeFilter.SHOW_TEXT);
    const range = document.createRange();
    let node;
    while ((node = walker.nextNode()) && text.length <= maxChars) {
      const s = node.nodeValue.replace(/\\s+/g, ' ').trim();
      const parent = node.parentElement;
      if (!s || !parent || ['SCRIPT', 'STYLE', 'NOSCRIPT', 'TEMPLATE', 'OPTION'].includes(parent.tagName)) continue;
      if (!shown(parent)) continue;
      range.selectNodeContents(node);
      const r = range.getBoundingClientRect();
      if (r.width === 0 || !inView(r)) continue;
      text += (lastBottom === null ? '' : (r.top >= lastBottom - 2 ? '\\n' : ' ')) + s;
      lastBottom = r.bottom;
    }
  }
  if (text.length > maxChars) text = text.slice(0, maxChars - 1) + '…';
  document.querySelectorAll('[data-agentwin-id]').forEach((e) => e.removeAttribute('data-agentwin-id'));
  const selector = 'a[href], button, input:not([type=hidden]), select, textarea, summary, ' +
    '[role=button], [role=link], [role=textbox], [contenteditable=""], [contenteditable=true]';
  let els = Array.from(document.querySelectorAll(selector)).filter(shown);
  const total = els.length;
  if (els.length > maxElements) {
    const visible = els.filter((e) => inView(e.getBoundingClientRect()));
    const keep = new Set(visible.slice(0, maxElements));
    for (const e of els) { if (keep.size >= maxElements) break; keep.add(e); }
    els = els.filter((e) => keep.has(e));
  }
  const nameOf = (e) => {
    const by = e.getAttribute('aria-labelledby');
    const labelled = by ? by.split(/\\s+/).map((id) => (document.getElementById(id) || {}).innerText || '').join(' ') : '';
    const img = e.querySelector ? e.querySelector('img[alt]') : null;
    const label = e.labels && e.labels.length ? e.labels[0].innerText : '';
    const isButtonInput = e.tagName === 'INPUT' && ['submit', 'button', 'reset'].includes(e.type);
    return clean(e.getAttribute('aria-label') || labelled || label ||
      (['INPUT', 'SELECT', 'TEXTAREA'].includes(e.tagName) ? '' : e.innerText) ||
      (isButtonInput ? e.value || e.type : '') || e.getAttribute('placeholder') || e.getAttribute('title') ||
      (img ? img.alt : '') || e.getAttribute('name') || '', 80);
  };
  const kindOf = (e) => {
    const t = e.tagName, role = e.getAttribute('role');
    if (t === 'A' || role === 'link') return 'link';
    if (t === 'BUTTON' || t === 'SUMMARY' || role === 'button') return 'button';
    if (t === 'INPUT') return ['submit', 'button', 'reset', 'image'].includes(e.type) ? 'button' : 'input';
    if (t === 'SELECT') return 'select';
    if (t === 'TEXTAREA') return 'textarea';
    return 'textbox';
  };
  const elements = els.map((e, i) => {
    const id = i + 1;
    e.setAttribute('data-agentwin-id', String(id));
    const kind = kindOf(e);
    const info = {id, kind, name: nameOf(e), tag: e.tagName.toLowerCase(), type: e.type || '',
                  href: e.tagName === 'A' ? e.href : '', disabled: !!e.disabled, value: '', options: [],
                  checked: null};
    if (e.tagName === 'INPUT' && ['checkbox', 'radio'].includes(e.type)) info.checked = e.checked;
    else if (e.tagName === 'INPUT' && e.type !== 'password' && kind === 'input') info.value = clean(e.value, 60);
    else if (e.tagName === 'TEXTAREA') info.value = clean(e.value, 60);
    else if (e.tagName === 'SELECT') {
      info.value = e.selectedIndex >= 0 ? clean(e.options[e.selectedIndex].text, 40) : '';
      info.options = Array.from(e.options).slice(0, 12).map((o) => clean(o.text, 30));
    }
    return info;
  });
  const doc = document.scrollingElement || document.documentElement;
  return {title: document.title || '', text, elements, total,
          scrollY: Math.round(window.scrollY), height: Math.round(doc ? doc.scrollHeight : vh), vh};
}
"""


def describe_element(e: dict[str, Any], base: Any) -> str:
    """One element line of the text view: `[N] kind 'name'` and its target, value or state."""
    name = e["name"].replace("'", "’")
    out = f"[{e['id']}] {e['kind']} '{name}'"
    if e["kind"] == "link" and e["href"]:
        target = urlsplit(e["href"])
        if (target.scheme, target.netloc) == (base.scheme, base.netloc):
            shown = target.path + (f"?{target.query}" if target.query else "") + (f"#{target.fragment}" if target.fragment else "")
        else:
            shown = e["href"]
        out += f" -> {shown}"
    elif e["kind"] == "input":
        out += f" ({e['type'] or 'text'})"
        if e["checked"] is not None:
            out += " checked" if e["checked"] else " unchecked"
        elif e["value"]:
            out += f" = '{e['value']}'"
    elif e["kind"] in ("textarea", "textbox") and e["value"]:
        out += f" = '{e['value']}'"
    elif e["kind"] == "select":
        out += f" = '{e['value']}' (options: {', '.join(e['options'])})"
    if e["disabled"]:
        out += " (disabled)"
    return out
